"""Event-based affinity (the router's ``--kv-events on``) against the request-history index, in the
simulator, on the shared-prefix trace (``goodput.bench.routing.shared_prefix_trace``)::

    python -m goodput.bench.kv_events_sim [--replicas 3] [--duration 600] [--rate 4] [--tenants 64]
    python -m goodput.bench.kv_events_sim --trace chat [--rate 2]   # rate: sessions/s

Fixed fleets (every replica ready at 0), the h200 step model, the real ``Scheduler`` +
``BlockManager`` with prefix caching; routings ``round-robin``, ``goodput`` (the request-history
index) and ``goodput-kv`` (the exact index from the replicas' KV events). Prints one row per
routing: good requests/s (both SLOs met), SLO attainment, prefix-cache hit rate, decisions.
"""
from __future__ import annotations

import argparse

from goodput.bench.routing import chat_trace, shared_prefix_trace
from goodput.bench.simulate import HARDWARE, StaticPeak, simulate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m goodput.bench.kv_events_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--tenants", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routings", default="round-robin,goodput,goodput-kv")
    ap.add_argument("--trace", default="shared-prefix", choices=("shared-prefix", "chat"))
    a = ap.parse_args(argv)
    if a.trace == "chat":  # the routing results' chat trace (bench/results/routing): rate = sessions/s
        trace = chat_trace(a.seed, session_rate=a.rate, duration=a.duration)
    else:
        trace = shared_prefix_trace(a.seed, tenants=a.tenants, prefix_tokens=a.prefix_tokens, rate=a.rate,
                                    duration=a.duration)
    hw = HARDWARE["h200"]()
    print(f"{trace.name}: {len(trace)} requests; {trace.note}; {a.replicas} replicas of {hw.name} "
          f"({hw.num_blocks * hw.block_size} KV tokens each)")
    print("| routing | good req/s | attainment | prefix hit rate | decisions |")
    print("|---|---|---|---|---|")
    for routing in a.routings.split(","):
        r = simulate(trace, StaticPeak(a.replicas), hw, load_time_s=0.0, routing=routing, route_seed=a.seed)
        good = r.slo_met / trace.duration
        att = r.slo_met / max(1, len(trace))
        hit = f"{r.prefix_hit_rate:.3f}" if r.prefix_hit_rate is not None else "-"
        print(f"| {routing} | {good:.3f} | {att:.3f} | {hit} | {dict(sorted(r.decisions.items()))} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
