"""Request routing in the simulator, and the multi-turn chat trace it is measured on.

``SimRouter`` is what ``simulate(..., routing=...)`` (``python -m goodput.bench.simulate
--routing ...``) sends each arrival through. Seven routings:

- ``round-robin``: the ready pods in turn (kube-proxy's IPVS ``rr``; what the simulator did before);
- ``random``: a seeded uniform choice (kube-proxy's iptables mode);
- ``least-loaded``: the fewest in-flight requests (ties in turn);
- ``affinity``: the router's picker (``goodput.router.picker.pick``) with prefix affinity and
  rendezvous hashing only: no load bound, admission limits ignored (``PickConfig(eps=None,
  respect_limits=False, cost=False)``);
- ``goodput``: the router's full pipeline with its defaults (``PickConfig`` defaults, chunks of 64
  token ids ~ the router's 256 characters): the admission-limit filter, then cost picking, prefix
  affinity weighed against the work held on each pod, a pod's work being, as in the router, the
  picks' costs of its open (running or waiting) requests;
- ``goodput-count``: the same with ``PickConfig(cost=False)`` (the router's ``--no-picker-cost``):
  prefix affinity, rendezvous and bounded loads over in-flight counts. The simulator has no router queue: when every pod is at its limits (reason
  ``full``) the request goes to the pod with the fewest in flight and that pod's admission
  decides (the real router queues it first, up to ``routerMaxQueued``). Without a load bound,
  ``affinity`` sends every new conversation to the pod that first served the shared system
  prompt (its match is the longest): the hot spot that bounded loads exist to prevent.

- ``goodput-kv``: ``goodput`` with the router's ``--kv-events on``: each replica's block manager
  feeds a ``KvEventLog`` (the worker's), each request's chunk keys are tied to its prompt's KV
  blocks when it is routed (token ids: exact, as the worker does), and before each pick the
  router's ``ExactIndex`` applies every event since the last pick (no delay: an upper bound on
  what the real stream, a few ms behind, gives). Traces with token ids only (others: as
  ``goodput``).

The last three call the router's own code, not a copy. In-flight = the pod's running + waiting
requests (with one router, exactly the router's count); the scraped fields (waiting, KV usage)
are read at the arrival instant (the real router's are up to one scrape period old).

Requests of a trace with token ids (``Trace.tokens``: the chat trace) are keyed by
``chunk_hashes`` of their ids, with the conversation's anchor (its system prompt and first user
message, as the router computes for chat); requests of the other traces share no prefix: each is
keyed by its own number repeated to its prompt's length (as many chunks as the router would cut
from a prompt that long, none shared).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys
from collections import Counter
from typing import TYPE_CHECKING, Sequence

from goodput.api.kv_events import KvEvent
from goodput.api.prefix import chunk_ends
from goodput.router.kv_index import OK, ExactIndex
from goodput.router.picker import Endpoint, PickConfig, PrefixIndex, RouteKey, chunk_hashes, pick
from goodput.worker.engine.kv_events import KvEventLog, block_ties

if TYPE_CHECKING:  # simulate imports this module: no import cycle at run time
    from goodput.bench.simulate import Replica, Trace

ROUTINGS = ("round-robin", "random", "least-loaded", "affinity", "goodput", "goodput-kv", "goodput-count")
SIM_CHUNK_TOKENS = 64


def pick_config(routing: str) -> PickConfig | None:
    """The picker's configuration for ``affinity`` and ``goodput`` (None for the others)."""
    if routing in ("goodput", "goodput-kv"):
        return PickConfig(chunk_size=SIM_CHUNK_TOKENS)
    if routing == "goodput-count":
        return PickConfig(chunk_size=SIM_CHUNK_TOKENS, cost=False)
    if routing == "affinity":
        return PickConfig(chunk_size=SIM_CHUNK_TOKENS, eps=None, respect_limits=False, cost=False)
    if routing in ROUTINGS:
        return None
    raise ValueError(f"unknown routing {routing!r}; one of {', '.join(ROUTINGS)}")


class SimRouter:
    """One router in front of the simulated fleet: ``route(trace, k, pods)`` -> the replica for
    request ``k`` or None (refused); deterministic for a given seed."""

    def __init__(self, routing: str = "round-robin", seed: int = 0, cfg: PickConfig | None = None) -> None:
        self.routing = routing
        self.cfg = cfg if cfg is not None else pick_config(routing)
        self.index = PrefixIndex(self.cfg.index_capacity) if self.cfg is not None else None
        self.rng = random.Random(seed)
        self.turn = itertools.count()
        self.decisions: Counter[str] = Counter()
        self.cost: dict[str, tuple[int, int]] = {}   # request id -> its Pick (cost, prefill)
        self.logs: dict[str, tuple[KvEventLog, int]] = {}  # goodput-kv: pod -> (its log, last seq applied)
        if routing == "goodput-kv" and self.index is not None:
            self.index.exact = ExactIndex()

    def _sync(self, pods: Sequence["Replica"]) -> None:
        """goodput-kv: every event of every pod since the last pick, into the exact index."""
        ix = self.index.exact
        for p in pods:
            got = self.logs.get(p.name)
            if got is None:
                log = KvEventLog()
                p.sched.block_manager.attach_kv_events(log)
                ix.reset(p.name, "sim", 0, ())
                got = self.logs[p.name] = (log, 0)
            log, last = got
            evs = log.since(last)
            if evs is None:   # the ring overtook us: resync from the snapshot
                seq, keys = log.snapshot()
                ix.reset(p.name, "sim", seq, keys)
            else:
                for seq, kind, keys in evs:
                    assert ix.apply(p.name, KvEvent("sim", seq, kind, keys)) == OK
                seq = evs[-1][0] if evs else last
            self.logs[p.name] = (log, seq)

    def _tie(self, key: RouteKey, ids: Sequence[int], pod: "Replica") -> None:
        """goodput-kv: the worker's ties of the request's chunk keys to its prompt's blocks."""
        log = self.logs[pod.name][0]
        bm = pod.sched.block_manager
        ends = chunk_ends(token_ids=ids, chunk_size=self.cfg.chunk_size)
        log.annotate(block_ties(key.chunks, ends, bm.prompt_block_hashes(ids, None), bm.block_size))

    def key(self, trace: "Trace", k: int) -> RouteKey:
        """Request ``k``'s route key (see the module doc)."""
        size = self.cfg.chunk_size if self.cfg is not None else SIM_CHUNK_TOKENS
        if trace.tokens is None:   # k's own ids, its prompt's length: a chain no other request shares
            ids = (k % 2**32,) * max(1, trace.prompt[k])
            return RouteKey("sim", "r", None, chunk_hashes("sim", "r", None, token_ids=ids, chunk_size=size))
        ids = trace.tokens[k]
        n_anchor = trace.anchor_tokens[k] if trace.anchor_tokens is not None else 0
        anchor = chunk_hashes("sim", "r", None, token_ids=ids[:n_anchor], chunk_size=size)[-1] if n_anchor else None
        return RouteKey("sim", "r", None, chunk_hashes("sim", "r", None, token_ids=ids, chunk_size=size), anchor)

    def route(self, trace: "Trace", k: int, pods: Sequence["Replica"]) -> "Replica | None":
        if not pods:
            return None
        if self.routing == "round-robin":
            return pods[next(self.turn) % len(pods)]
        if self.routing == "random":
            return pods[self.rng.randrange(len(pods))]
        if self.routing == "least-loaded":
            start = next(self.turn) % len(pods)
            order = pods[start:] + pods[:start]
            return min(order, key=lambda p: len(p.sched.running) + len(p.sched.waiting))
        key = self.key(trace, k)
        kv = self.index.exact is not None and trace.tokens is not None
        if kv:
            self._sync(pods)
        by_name = {p.name: p for p in pods}
        eps = [Endpoint(p.name, f"sim://{p.name}", len(p.sched.running) + len(p.sched.waiting),
                        p.sched.max_num_seqs, p.sched.max_waiting, len(p.sched.running),
                        len(p.sched.waiting), p.sched.block_manager.usage, self.work(p)) for p in pods]
        got = pick(key, eps, self.index, self.cfg)
        self.decisions[got.reason] += 1
        pod = got.pod
        if pod is None:   # no router queue here: the least-loaded pod's own admission decides
            pod = min(eps, key=lambda e: e.in_flight).name
        self.index.record(key, pod)
        if kv:
            self._tie(key, trace.tokens[k], by_name[pod])
        if got.cost:
            self.cost[f"q{k}"] = (got.cost, got.prefill)
        return by_name[pod]

    def work(self, pod: "Replica") -> int:
        """The router's ``Pod.work`` of ``pod`` (streamed answers): the picks' costs of its open
        requests (running or waiting; a finished or refused one no longer counts), less the
        prefill of those that have their first token."""
        get, none = self.cost.get, (0, 0)
        total = 0
        for r in (*pod.sched.running, *pod.sched.waiting):
            cost, prefill = get(r.request_id, none)
            total += cost if r.first_token_time is None else cost - prefill
        return total


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def chat_trace(seed: int = 0, session_rate: float = 1.0, duration: float = 600.0,
               system_tokens: int = 1024, turns: tuple[int, int] = (3, 8), user_median: int = 96,
               output_median: int = 192, think_median_s: float = 15.0, tpot_estimate_s: float = 0.06,
               slo: tuple[float, float] = (1.0, 0.15), max_replicas: int = 10, initial_replicas: int = 2,
               max_model_len: int = 8192, vocab: int = 32000) -> "Trace":
    """Seeded multi-turn chat: sessions arrive as a Poisson process (``session_rate`` per second)
    over ``duration`` seconds; every session starts with the same ``system_tokens``-token system
    prompt and runs a uniform number of turns in ``turns`` (inclusive). Turn j's prompt is the
    system prompt, then every earlier user message and reply, then the new user message (lognormal
    median ``user_median`` tokens, sigma 0.6, 8..1024); its output is lognormal median
    ``output_median`` (sigma 0.6, 8..1024). Replies are ids ``1`` (what the simulated model emits:
    the sampled token is always 1), so the engine's prefix cache holds exactly the next turn's
    history. The next turn arrives after the reply's estimated generation time (``output *
    tpot_estimate_s``) plus a think time (lognormal median ``think_median_s``, sigma 0.5):
    open loop, the same arrivals under every routing. A session ends early when its next turn
    would not fit ``max_model_len``; turns after ``duration`` are dropped. Token ids of system and
    user text are uniform in [2, vocab).
    """
    from goodput.bench.simulate import Trace

    rng = random.Random(seed)
    system = tuple(rng.randrange(2, vocab) for _ in range(system_tokens))
    reqs: list[tuple[float, tuple[int, ...], int, int]] = []   # (t, ids, output, anchor tokens)
    t = 0.0
    sessions = 0
    while True:
        t += rng.expovariate(session_rate)
        if t >= duration:
            break
        sessions += 1
        n_turns = rng.randint(turns[0], turns[1])
        history = system
        at = t
        anchor = 0
        for j in range(n_turns):
            user = tuple(rng.randrange(2, vocab) for _ in range(_lognormal_int(rng, user_median, 0.6, 8, 1024)))
            out = _lognormal_int(rng, output_median, 0.6, 8, 1024)
            prompt = history + user
            if len(prompt) + out > max_model_len or at >= duration:
                break
            if j == 0:
                anchor = len(prompt)
            reqs.append((at, prompt, out, anchor))
            history = prompt + (1,) * out
            at += out * tpot_estimate_s + rng.lognormvariate(math.log(think_median_s), 0.5)
    reqs.sort(key=lambda r: r[0])
    tr = Trace("chat", [r[0] for r in reqs], [len(r[1]) for r in reqs], [r[2] for r in reqs],
               [0] * len(reqs), [slo], duration, max_replicas, initial_replicas,
               note=f"seed {seed}, {sessions} sessions at {session_rate}/s, {turns[0]}-{turns[1]} turns, "
                    f"system prompt {system_tokens}, user median {user_median}, reply median "
                    f"{output_median}, think median {think_median_s:.0f} s, prefix caching on, SLO TTFT "
                    f"{slo[0]} s / TPOT {slo[1] * 1000:.0f} ms")
    tr.tokens = [r[1] for r in reqs]
    tr.anchor_tokens = [r[3] for r in reqs]
    tr.prefix_caching = True
    return tr


def shared_prefix_trace(seed: int = 0, tenants: int = 64, prefix_tokens: int = 6000, rate: float = 4.0,
                        duration: float = 600.0, question_median: int = 64, output_median: int = 64,
                        slo: tuple[float, float] = (2.0, 0.15), max_replicas: int = 10, initial_replicas: int = 3,
                        vocab: int = 32000) -> "Trace":
    """Seeded shared-prefix load: ``tenants`` tenants, each with a long prefix of its own
    (``prefix_tokens`` ids uniform in [2, vocab): a document or a long system prompt); requests
    arrive as a Poisson process of ``rate`` per second over ``duration`` seconds, each from a
    tenant drawn uniformly, its prompt the tenant's prefix then a question of its own (lognormal
    median ``question_median``, sigma 0.6, 8..512), its output lognormal median ``output_median``
    (sigma 0.6, 8..512). With the defaults the prefixes take 384k tokens: 75 % of three h200
    replicas' KV pools (171k tokens each), so the caches must evict prefixes that were sent."""
    from goodput.bench.simulate import Trace

    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(2, vocab) for _ in range(prefix_tokens)) for _ in range(tenants)]
    t, reqs = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        who = rng.randrange(tenants)
        q = tuple(rng.randrange(2, vocab) for _ in range(_lognormal_int(rng, question_median, 0.6, 8, 512)))
        reqs.append((t, prefixes[who] + q, _lognormal_int(rng, output_median, 0.6, 8, 512)))
    tr = Trace("shared-prefix", [r[0] for r in reqs], [len(r[1]) for r in reqs], [r[2] for r in reqs],
               [0] * len(reqs), [slo], duration, max_replicas, initial_replicas,
               note=f"seed {seed}, {tenants} tenants x {prefix_tokens}-token prefix, {rate} req/s, question "
                    f"median {question_median}, output median {output_median}, prefix caching on, SLO TTFT "
                    f"{slo[0]} s / TPOT {slo[1] * 1000:.0f} ms")
    tr.tokens = [r[1] for r in reqs]
    tr.prefix_caching = True
    return tr


# ------------------------------------------------------------------------------ the results
CHAT_POLICIES = ("goodput", "hpa-queue")
OTHER_TRACES = ("steady", "bursty", "diurnal", "long-prompt", "two-class", "azure-code")
# the round-robin hindsight static fleet of each (bench/results/autoscaler/<trace>-h200.json)
OTHER_FIXED = "steady=2,diurnal=2,bursty=6,long-prompt=7,two-class=8"


def _job_id(job: tuple) -> str:
    return json.dumps(job)


def _run(job: tuple) -> dict:
    """One simulation (in a worker process): (trace, seed, hardware, duration, rate, policy or
    ["static", n], routing) -> its summary."""
    from goodput.bench import baselines
    from goodput.bench import simulate as sim

    tname, seed, hardware, duration, rate, policy, routing = job
    trace = sim.make_trace(tname, seed, hardware, duration, rate)
    fixed = not isinstance(policy, str)
    pol = baselines.StaticPeak(policy[1]) if fixed else sim.make_policy(policy, trace)
    r = sim.simulate(trace, pol, sim.HARDWARE[hardware](), routing=routing, route_seed=seed)
    print(f"{tname} {policy} {routing}: {r.summary()}", file=sys.stderr, flush=True)
    return {"trace": tname, "policy": f"fixed-{policy[1]}" if fixed else policy, "routing": routing,
            "requests": len(trace), "note": trace.note, "decisions": r.decisions, **r.summary()}


class Runs:
    """Simulations by job, cached in a JSON-lines file (a rerun does only what is missing)."""

    def __init__(self, path: str | None, procs: int) -> None:
        self.path, self.procs = path, procs
        self.done: dict[str, dict] = {}
        if path and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    self.done[rec["job"]] = rec["result"]

    def __call__(self, jobs: list[tuple]) -> list[dict]:
        jobs = [json.loads(_job_id(j)) for j in jobs]     # tuples -> lists, as stored
        todo = [j for j in jobs if _job_id(j) not in self.done]
        if todo:
            if self.procs <= 1 or len(todo) == 1:
                results = map(_run, todo)
            else:
                import multiprocessing
                pool = multiprocessing.get_context("spawn").Pool(min(self.procs, len(todo)))
                results = pool.imap(_run, todo)
            for j, res in zip(todo, results):
                self.done[_job_id(j)] = res
                if self.path:
                    with open(self.path, "a") as f:
                        f.write(json.dumps({"job": _job_id(j), "result": res}) + "\n")
            if not isinstance(results, map):
                pool.close()
                pool.join()
        return [self.done[_job_id(j)] for j in jobs]


def smallest_fleets(runs: Runs, base: tuple, routings: Sequence[str], target: float, start: int,
                    hi: int) -> dict[str, dict[int, dict]]:
    """For each routing, fixed fleets from ``start`` down while they reach ``target`` attainment
    and up until one does (at most ``hi``, and not past a replica that added no goodput):
    {routing: {n: summary}}; each routing's smallest passing n has n - 1 failing (or is 1)."""
    fleets: dict[str, dict[int, dict]] = {r: {} for r in routings}

    def next_n(r: str) -> int | None:
        got = fleets[r]
        if not got:
            return start
        ok = sorted(n for n, s in got.items() if s["attainment"] >= target)
        bad = sorted(n for n, s in got.items() if s["attainment"] < target)
        if ok and (ok[0] == 1 or (bad and bad[-1] == ok[0] - 1)):
            return None
        if ok:
            return ok[0] - 1
        if len(bad) >= 2 and got[bad[-1]]["goodput_rps"] <= got[bad[-2]]["goodput_rps"]:
            return None   # one more replica gained nothing: this routing leaves replicas idle
        return bad[-1] + 1 if bad[-1] < hi else None

    while True:
        todo = [(r, n) for r in routings if (n := next_n(r)) is not None]
        if not todo:
            return fleets
        for (r, n), s in zip(todo, runs([base + (("static", n), r) for r, n in todo])):
            fleets[r][n] = s


def _row(s: dict, first: str) -> str:
    hit = s.get("prefix_hit_rate")
    dec = ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items())) or "-"
    return (f"| {first} | {s['goodput_rps']:.2f} | {s['attainment']:.3f} | {s['rejection_rate']:.3f} | "
            f"{s['replica_hours']:.3f} | {s['direction_changes']} | "
            f"{'-' if hit is None else f'{hit:.3f}'} | {dec} |")


HEAD = ("goodput (req/s) | attainment | rejection rate | replica-hours | direction changes | "
        "prefix-cache hit rate | picker decisions |")


def main(argv: list[str] | None = None) -> int:
    """``python -m goodput.bench.routing [--out-dir bench/results/routing] [--procs 2]``: the
    routing results (chat trace: smallest fixed fleet per routing, routing x autoscaling policy,
    the targets; the other traces: goodput vs round-robin routing under our autoscaler)."""
    import argparse
    import time

    from goodput.bench.simulate import default_goodput_spec, make_trace

    ap = argparse.ArgumentParser(prog="python -m goodput.bench.routing", description=main.__doc__)
    ap.add_argument("--out-dir", default=None, help="write routing-<hardware>.md / .jsonl here")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--chat-duration", type=float, default=600.0)
    ap.add_argument("--chat-rate", type=float, default=2.0, help="chat sessions per second")
    ap.add_argument("--policies", default=",".join(CHAT_POLICIES), help="autoscaling policies on chat")
    ap.add_argument("--other-traces", default=",".join(OTHER_TRACES), help="'' to skip")
    ap.add_argument("--fleet-start", type=int, default=3)
    ap.add_argument("--other-fixed", default=OTHER_FIXED,
                    help="TRACE=N,...: fixed fleets of N on the other traces, round-robin vs goodput")
    args = ap.parse_args(argv)
    t0 = time.time()
    cache = os.path.join(args.out_dir, f"routing-{args.hardware}.jsonl") if args.out_dir else None
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    runs = Runs(cache, args.procs)
    chat = make_trace("chat", args.seed, args.hardware, args.chat_duration, args.chat_rate)
    target = default_goodput_spec(chat).attainment_target
    base = ("chat", args.seed, args.hardware, args.chat_duration, args.chat_rate)
    fleets = smallest_fleets(runs, base, ROUTINGS, target, args.fleet_start, chat.max_replicas)
    policies = [p for p in args.policies.split(",") if p]
    table = runs([base + (p, r) for r in ROUTINGS for p in policies])
    others = [t for t in args.other_traces.split(",") if t]
    other = runs([(t, args.seed, args.hardware, None, None, "goodput", r)
                  for t in others for r in ("round-robin", "goodput")])
    fixed_other = [(t, int(n)) for t, n in (x.split("=") for x in args.other_fixed.split(",") if x)]
    other_fixed = runs([(t, args.seed, args.hardware, None, None, ("static", n), r)
                        for t, n in fixed_other for r in ("round-robin", "goodput")])

    out = [f"# Routing in the simulator ({args.hardware})", "",
           f"Chat trace: {len(chat)} requests over {chat.duration:.0f} s; {chat.note}. Replicas: the "
           f"engine's real Scheduler + BlockManager; SLO target (the autoscaler spec's attainment "
           f"target): {target}.", "",
           "## Smallest fixed fleet reaching the target, per routing (chat)", "",
           "| routing | replicas | " + HEAD, "|---|---:|" + "---:|" * 6 + "---|"]
    smallest: dict[str, int | None] = {}
    for r in ROUTINGS:
        ok = sorted(n for n, s in fleets[r].items() if s["attainment"] >= target)
        smallest[r] = ok[0] if ok else None
        for n in sorted(fleets[r]):
            mark = " (smallest)" if n == smallest[r] else ""
            out.append(_row(fleets[r][n], f"{r} | {n}{mark}"))
    out += ["", "## Routing x autoscaling policy (chat)", "",
            "| routing | policy | " + HEAD, "|---|---|" + "---:|" * 6 + "---|"]
    cell = {(s["routing"], s["policy"]): s for s in table}
    for r in ROUTINGS:
        for p in policies:
            out.append(_row(cell[(r, p)], f"{r} | {p}"))
    checks = []
    ours, rr = smallest["goodput"], smallest["round-robin"]
    if ours and rr:
        checks.append(f"smallest fleet: goodput routing {ours} vs round-robin {rr} replicas "
                      f"({1 - ours / rr:.0%} smaller; target >= 25%) -> "
                      f"{'met' if ours <= 0.75 * rr else 'NOT met'}")
        g_ours = fleets["goodput"][ours]["goodput_rps"]
        rr_at = fleets["round-robin"].get(ours) or runs([base + (("static", ours), "round-robin")])[0]
        checks.append(f"at {ours} replicas: round-robin goodput {rr_at['goodput_rps']:.2f} vs ours "
                      f"{g_ours:.2f} req/s ({rr_at['goodput_rps'] / g_ours:.2f}x; target < 0.5x) -> "
                      f"{'met' if rr_at['goodput_rps'] < 0.5 * g_ours else 'NOT met'}")
    if ("goodput", "goodput") in cell:
        a, b = cell[("goodput", "goodput")], cell[("round-robin", "goodput")]
        ok = a["attainment"] >= b["attainment"] and a["replica_hours"] <= 0.75 * b["replica_hours"]
        checks.append(f"goodput autoscaler: attainment {a['attainment']:.3f} with goodput routing vs "
                      f"{b['attainment']:.3f} with round-robin, at {a['replica_hours'] / b['replica_hours']:.2f}x "
                      f"its replica-hours (target: >= at <= 0.75x) -> {'met' if ok else 'NOT met'}")
    if other:
        out += ["", "## The other traces: our autoscaler, round-robin vs goodput routing", "",
                "| trace | routing | " + HEAD, "|---|---|" + "---:|" * 6 + "---|"]
        for s in other:
            out.append(_row(s, f"{s['trace']} | {s['routing']}"))
        byt = {(s["trace"], s["routing"]): s for s in other}
        worse = [t for t in others
                 if byt[(t, "goodput")]["goodput_rps"] < byt[(t, "round-robin")]["goodput_rps"] - 1e-9]
        checks.append("other traces: goodput routing's goodput >= round-robin's on "
                      f"{len(others) - len(worse)} of {len(others)}"
                      + (f" (below on {', '.join(worse)})" if worse else "") + " -> "
                      + ("met" if not worse else "NOT met"))
    if other_fixed:
        out += ["", "## The other traces: fixed fleets (the hindsight static fleet of round-robin), "
                    "round-robin vs goodput routing", "",
                "| trace | replicas | routing | " + HEAD, "|---|---:|---|" + "---:|" * 6 + "---|"]
        for s in other_fixed:
            out.append(_row(s, f"{s['trace']} | {s['policy'].split('-')[1]} | {s['routing']}"))
        byf = {(s["trace"], s["routing"]): s for s in other_fixed}
        worse = [t for t, _ in fixed_other
                 if byf[(t, "goodput")]["goodput_rps"] < byf[(t, "round-robin")]["goodput_rps"] - 1e-9]
        checks.append("other traces, fixed fleets: goodput routing's goodput >= round-robin's on "
                      f"{len(fixed_other) - len(worse)} of {len(fixed_other)}"
                      + (f" (below on {', '.join(worse)})" if worse else "") + " -> "
                      + ("met" if not worse else "NOT met"))
    out += ["", "## Targets", ""] + [f"- {c}" for c in checks]
    cmd = (f"python -m goodput.bench.routing --out-dir <dir> --procs {args.procs} --chat-duration "
           f"{args.chat_duration:.0f} --chat-rate {args.chat_rate} --policies {','.join(policies)} "
           f"--other-traces '{','.join(others)}' --other-fixed '{args.other_fixed}'")
    out += ["", f"Made by `{cmd}` (the defaults; finished runs are cached in "
                f"routing-{args.hardware}.jsonl beside this file, so a rerun redoes only what is missing).", ""]
    print(f"{time.time() - t0:.0f} s", file=sys.stderr)
    text = "\n".join(out)
    print(text)
    if args.out_dir:
        with open(os.path.join(args.out_dir, f"routing-{args.hardware}.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
