"""The goodput autoscaler: replicas and per-replica admission limits from goodput.

``policy`` is the pure decision (stdlib only); the I/O loop, scraping and CLI live beside it;
``simulate`` replays traces through the same ``decide`` against the usual baseline policies.
"""
