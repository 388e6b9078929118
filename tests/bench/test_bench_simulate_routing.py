"""The simulator's --routing option and the chat trace, on tiny hand-checkable cases.

Step time a = 10 ms, b = 1 ms per batched token, c = 0 (as in test_bench_simulate); blocks of 16.
"""
from __future__ import annotations

import json

import pytest

from goodput.bench import baselines, routing
from goodput.bench import simulate as sim
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.request import Request
from goodput.worker.engine.sampling_params import SamplingParams

HW = sim.StepTime("test", a=0.01, b=0.001, c=0.0, num_blocks=2048, block_size=16, max_model_len=4096,
                  max_num_batched_tokens=512)


def two_conversations() -> sim.Trace:
    """Conversations A and B, two turns each: turn 1 = 40 own ids, 9 output tokens; turn 2 = turn 1
    + the 9 replies (ids 1) + 10 new ids = 59 tokens. Arrivals A1 1 s, B1 2 s, A2 5 s, B2 6 s."""
    a1 = tuple(range(100, 140))
    b1 = tuple(range(200, 240))
    a2 = a1 + (1,) * 9 + tuple(range(300, 310))
    b2 = b1 + (1,) * 9 + tuple(range(400, 410))
    tr = sim.Trace("two-conv", [1.0, 2.0, 5.0, 6.0], [40, 40, 59, 59], [9] * 4, [0] * 4, [(10.0, 1.0)],
                   duration=20.0, max_replicas=2, initial_replicas=2)
    tr.tokens = [a1, b1, a2, b2]
    tr.anchor_tokens = [40, 40, 40, 40]
    tr.prefix_caching = True
    return tr


@pytest.mark.parametrize("name,hit_rate", [
    # round-robin: A1 -> pod-0, B1 -> pod-1, A2 -> pod-0, B2 -> pod-1: both second turns find
    # their first turn's blocks: turn 1 computed 40 + 8 tokens (the 9th output is never fed back)
    # = 3 full blocks = 48 tokens per second turn; queries 40 + 40 + 59 + 59 = 198 -> 96 / 198
    ("round-robin", 96 / 198),
    ("goodput", 96 / 198),      # each second turn follows its conversation (affinity)
    ("affinity", 96 / 198),
    # the exact index from the replicas' KV events: a second turn's one chunk (59 ids < 64) is a key
    # no pod holds yet, so it goes by its anchor's rendezvous, as its first turn did
    ("goodput-kv", 96 / 198),
])
def test_second_turns_hit_the_prefix_cache(name, hit_rate):
    r = sim.simulate(two_conversations(), baselines.StaticPeak(2), HW, routing=name)
    assert r.finished == 4 and r.rejected == 0
    assert r.prefix_hit_rate == pytest.approx(hit_rate)


def test_round_robin_splits_conversations_that_affinity_keeps():
    # arrivals A1, A2, B1, B2 (A's second turn before B's first): round-robin sends A2 to pod-1,
    # which never saw A: no hit for A2; B1 -> pod-0, B2 -> pod-1: no hit either -> 0 / 198.
    # The picker sends each second turn to its first turn's pod: 96 / 198 as above.
    tr = two_conversations()
    tr.t = [1.0, 5.0, 6.0, 9.0]
    tr.tokens = [tr.tokens[0], tr.tokens[2], tr.tokens[1], tr.tokens[3]]
    tr.prompt = [40, 59, 40, 59]
    rr = sim.simulate(tr, baselines.StaticPeak(2), HW, routing="round-robin")
    ours = sim.simulate(tr, baselines.StaticPeak(2), HW, routing="goodput")
    assert rr.prefix_hit_rate == 0.0
    assert ours.prefix_hit_rate == pytest.approx(96 / 198)
    # decisions: A1 and B1 by rendezvous (nothing recorded yet, or a different conversation),
    # A2 and B2 by affinity with the 59-token prompt's first chunk of 64 ids... which is partial:
    # chunk 1 of A2 (59 ids) differs from chunk 1 of A1 (40 ids), so no index match: the anchor
    # (A1's 40 ids) sends A2 where A1 went, by rendezvous again
    assert ours.decisions == {"rendezvous": 4}


def replicas(n: int) -> list[sim.Replica]:
    cfg = EngineConfig(num_blocks=64, max_model_len=256, block_size=16, max_num_seqs=4,
                       max_num_batched_tokens=64, max_waiting=8, enable_prefix_caching=False)
    return [sim.Replica(f"pod-{i}", 0.0, 0.0, cfg, [(1.0, 1.0)]) for i in range(n)]


def load(pod: sim.Replica, n: int) -> None:
    base = len(pod.sched.running) + len(pod.sched.waiting)
    for j in range(base, base + n):
        pod.sched.add_request(Request(f"{pod.name}-{j}", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0))


def test_least_loaded_and_round_robin_and_random():
    pods = replicas(3)
    load(pods[0], 2)
    load(pods[2], 1)
    tr = two_conversations()
    ll = routing.SimRouter("least-loaded")
    assert ll.route(tr, 0, pods) is pods[1]           # in flight 2, 0, 1
    load(pods[1], 3)                                  # 2, 3, 1
    assert ll.route(tr, 1, pods) is pods[2]
    rr = routing.SimRouter("round-robin")
    assert [rr.route(tr, k, pods).name for k in range(4)] == ["pod-0", "pod-1", "pod-2", "pod-0"]
    a = [routing.SimRouter("random", seed=3).route(tr, 0, pods).name for _ in range(2)]
    assert a[0] == a[1]                               # seeded
    assert routing.SimRouter("goodput").route(tr, 0, []) is None


def test_goodput_routing_when_every_pod_is_at_its_limits():
    pods = replicas(2)
    for p in pods:
        load(p, 4)
        p.sched.schedule()                            # 4 running
        load(p, 8)                                    # + 8 waiting = max_num_seqs 4 + max_waiting 8
        assert (len(p.sched.running), len(p.sched.waiting)) == (4, 8)
    # the picker says "full"; with no router queue the pod with the fewest in flight gets it
    # (both have 12: the first) and its admission answers 429
    r = routing.SimRouter("goodput")
    assert r.route(two_conversations(), 0, pods) is pods[0]
    assert r.decisions == {"full": 1}
    # affinity routing ignores the limits
    assert routing.SimRouter("affinity").route(two_conversations(), 0, pods) in pods


def test_unknown_routing():
    with pytest.raises(ValueError):
        routing.SimRouter("fastest")


def test_chat_trace_sessions_extend_their_history():
    tr = routing.chat_trace(seed=1, session_rate=0.2, duration=200.0, system_tokens=32, user_median=8,
                            output_median=8)
    assert tr.prefix_caching and len(tr.tokens) == len(tr) == len(tr.anchor_tokens)
    assert tr.t == sorted(tr.t)
    system = tr.tokens[0][:32]
    sessions: dict[tuple, list[int]] = {}
    for k, ids in enumerate(tr.tokens):
        assert ids[:32] == system and tr.prompt[k] == len(ids)
        sessions.setdefault(ids[:tr.anchor_tokens[k]], []).append(k)
    assert len(sessions) > 10
    for ks in sessions.values():
        assert len(ks) <= 8
        for a, b in zip(ks, ks[1:]):                # turn b = turn a + its replies (ids 1) + more
            prev = tr.tokens[a] + (1,) * tr.output[a]
            assert tr.tokens[b][:len(prev)] == prev and len(tr.tokens[b]) > len(prev)
            assert tr.t[b] > tr.t[a]
    # sessions that start early enough run at least 3 turns (8 turns x ~30 s fit in 200 s)
    early = [ks for ks in sessions.values() if tr.t[ks[0]] < 20.0]
    assert early and all(len(ks) >= 3 for ks in early)


def test_cli_routing_option(tmp_path):
    out = tmp_path / "r.json"
    assert sim.main(["--trace", "chat", "--duration", "40", "--rate", "0.1", "--policies", "static-peak",
                     "--routing", "goodput", "--no-progress", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["routing"] == "goodput" and got["trace"] == "chat"
    assert 0.0 <= got["policies"]["static-peak"]["prefix_hit_rate"] <= 1.0


def test_goodput_kv_indexes_what_each_replica_caches():
    """goodput-kv on the two conversations: each conversation's turns on one pod (its anchor's
    rendezvous pod; A's and B's may be the same). Chunks of 64 ids: A1 (40 ids) is one chunk, tied to its last full block (1: ids
    16-31); A2 (59 ids) one chunk, tied to block 2. Nothing is evicted (2,048 blocks), so after the
    run the router's exact index (synced once more) holds A1 and A2 on A's pod, B1 and B2 on B's,
    nothing else."""
    from types import SimpleNamespace

    from goodput.router.picker import chunk_hashes
    tr = two_conversations()
    router = routing.SimRouter("goodput-kv")
    r = sim.simulate(tr, baselines.StaticPeak(2), HW, routing=router)
    assert r.finished == 4
    router._sync([SimpleNamespace(name=n) for n in router.logs])
    key = [chunk_hashes("sim", "r", None, token_ids=t, chunk_size=64)[0] for t in tr.tokens]
    held = [router.index.exact.state(n).keys for n in router.logs]
    a_pod = next(ks for ks in held if key[0] in ks)
    b_pod = next(ks for ks in held if key[1] in ks)
    assert {key[0], key[2]} <= a_pod and {key[1], key[3]} <= b_pod
    assert sorted(map(len, held)) == ([0, 4] if a_pod is b_pod else [2, 2])
