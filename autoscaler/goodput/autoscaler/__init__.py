"""The goodput autoscaler: replicas and per-replica admission limits from goodput.

``policy`` is the pure decision (stdlib only); the I/O loop, scraping and CLI live beside it.
The simulator that replays traces through the same ``decide`` against the usual baseline policies
is benchmark code: ``goodput.bench.simulate`` (this package imports neither it nor goodput.bench).
"""
