"""Scheduler: named cases with hand-computed schedules, admission, stop rules, engine state, and a
hypothesis-driven simulation against a fake runner that reads its "KV" through the block tables."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodput.worker.engine.block_manager import BlockManager
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import RunnerOutput, SchedulerOutput
from goodput.worker.engine.request import FinishReason, Request, RequestStatus
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import AdmissionError, Scheduler, next_waiting, waiting_band
from goodput.api.states import RejectReason
from slot_model import SlotRunner, reference_output


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def req(rid, prompt, max_tokens=16, **kw) -> Request:
    priority = kw.pop("priority", 0)
    salt = kw.pop("cache_salt", None)
    rank = kw.pop("slo_rank", 0)
    kw.setdefault("ignore_eos", True)
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, **kw),
                   priority=priority, cache_salt=salt, slo_rank=rank)


def run_step(s: Scheduler, token=7) -> tuple[SchedulerOutput, list]:
    """One engine step with a runner that samples ``token`` (or token(chunk)) for each chunk."""
    out = s.schedule()
    toks = {c.request_id: (token(c) if callable(token) else token) for c in out.chunks if c.sample}
    results = s.update_from_output(out, RunnerOutput(toks))
    s.check_invariants()
    return out, results


def layout(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start_pos, c.num_tokens) for c in out.chunks]


# ---- the seed's example: static vs continuous batching ---------------------------------------

@pytest.mark.parametrize("policy, expected_steps, expected_util, expected_sets", [
    # A(2) B(8) C(3) D(7) decode iterations, 2 slots. Static: cohort {A,B} runs 8 steps, then
    # {C,D} 7 steps = 15 steps, 20 slot-steps / 30 = 66.7%.
    ("static", 15, 20 / 30,
     [{"A", "B"}] * 2 + [{"B"}] * 6 + [{"C", "D"}] * 3 + [{"D"}] * 4),
    # Continuous: C takes A's slot at step 3, D takes C's at step 6 = 12 steps, 20/24 = 83.3%.
    ("continuous", 12, 20 / 24,
     [{"A", "B"}] * 2 + [{"B", "C"}] * 3 + [{"B", "D"}] * 3 + [{"D"}] * 4),
])
def test_seed_example_static_vs_continuous(policy, expected_steps, expected_util, expected_sets):
    cfg = EngineConfig(num_blocks=64, max_model_len=64, max_num_seqs=2, scheduling_policy=policy)
    s = Scheduler(cfg)
    for rid, n in zip("ABCD", [2, 8, 3, 7]):
        s.add_request(req(rid, [1], max_tokens=n))
    sets = []
    while s.has_unfinished():
        out, _ = run_step(s)
        sets.append({c.request_id for c in out.chunks})
    assert len(sets) == expected_steps
    assert sets == expected_sets
    util = sum(len(x) for x in sets) / (len(sets) * cfg.max_num_seqs)
    assert util == pytest.approx(expected_util)
    assert round(util * 100, 1) == {"static": 66.7, "continuous": 83.3}[policy]


# ---- chunked prefill ---------------------------------------------------------------------------

def test_chunked_prefill_splits_long_prompt_with_decodes_first():
    cfg = EngineConfig(num_blocks=32, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    s = Scheduler(cfg)
    s.add_request(req("A", [1, 2], max_tokens=10))
    out, _ = run_step(s)
    assert layout(out) == [("A", 0, 2)]
    s.add_request(req("B", range(20), max_tokens=3))
    # Budget 8 = A's decode (1) + a 7-token chunk of B; B's chunks: [0,7) [7,14) [14,20).
    expected = [
        [("A", 2, 1), ("B", 0, 7)],
        [("A", 3, 1), ("B", 7, 7)],
        [("A", 4, 1), ("B", 14, 6)],
        [("A", 5, 1), ("B", 20, 1)],
    ]
    samples = [[True, False], [True, False], [True, True], [True, True]]
    for want, want_sample in zip(expected, samples):
        out, _ = run_step(s)
        assert layout(out) == want
        assert [c.sample for c in out.chunks] == want_sample
        assert out.num_batched_tokens == sum(n for _, _, n in want) <= 8
    b = s.get_request("B")
    assert b.num_output_tokens == 2 and b.first_token_time is not None
    # The chunk's block table covers every position it writes.
    out = s.schedule()
    for c in out.chunks:
        assert len(c.block_table) * 4 >= c.seq_len


def test_long_prompt_alone_is_chunked_by_budget():
    cfg = EngineConfig(num_blocks=32, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    s = Scheduler(cfg)
    s.add_request(req("L", range(20), max_tokens=2))
    layouts = [layout(run_step(s)[0]) for _ in range(4)]
    assert layouts == [[("L", 0, 8)], [("L", 8, 8)], [("L", 16, 4)], [("L", 20, 1)]]
    assert not s.has_unfinished()


# ---- preemption by recompute ------------------------------------------------------------------

def test_preemption_newest_victim_rehits_its_cached_prefix():
    # 4 blocks of 4 tokens; A and B: 4-token prompts, 9 tokens each (12 KV tokens = 3 blocks).
    cfg = EngineConfig(num_blocks=4, max_model_len=32, block_size=4)
    s = Scheduler(cfg)
    s.add_request(req("A", [1, 2, 3, 4], max_tokens=9))
    s.add_request(req("B", [5, 6, 7, 8], max_tokens=9))
    expected = [
        ([("A", 0, 4), ("B", 0, 4)], []),
        ([("A", 4, 1), ("B", 4, 1)], []),   # blocks 2, 3
        ([("A", 5, 1), ("B", 5, 1)], []),
        ([("A", 6, 1), ("B", 6, 1)], []),
        ([("A", 7, 1), ("B", 7, 1)], []),
        ([("A", 8, 1)], ["B"]),             # pool full: newest (B) preempted by recompute
        ([("A", 9, 1)], []),                # B waits at the queue front, blocked on KV
        ([("A", 10, 1)], []),
        ([("A", 11, 1)], []),               # A's 9th token: finished, blocks freed
        ([("B", 4, 5)], []),                # B re-hits its prompt block, recomputes 4..8
        ([("B", 9, 1)], []),
        ([("B", 10, 1)], []),
        ([("B", 11, 1)], []),
    ]
    b = s.get_request("B")
    hits_before = None
    for i, (want, preempted) in enumerate(expected):
        if i == 9:
            hits_before = s.stats().prefix_cache_hits_total
        out, _ = run_step(s)
        assert (layout(out), out.preempted_ids) == (want, preempted), f"step {i + 1}"
        if i == 5:
            assert b.status is RequestStatus.PREEMPTED and s.waiting[0] is b
            assert b.num_computed_tokens == 0 and b.block_ids == []
        if 6 <= i <= 7:
            assert s.engine_state() == "blocked"
        if i == 9:
            # Block 1 held B's prompt KV before the preemption; it is reused, not recomputed.
            assert out.chunks[0].block_table[0] == 1
            assert s.stats().prefix_cache_hits_total - hits_before == 4
    assert not s.has_unfinished()
    st_ = s.stats()
    assert st_.preemptions_total == 1 and b.num_preemptions == 1
    assert b.num_output_tokens == 9 and s.get_request("A") is None
    assert st_.generation_tokens_total == 18 and st_.kv_usage_ratio == 0.0


def test_preemption_victim_is_lowest_priority_not_newest():
    cfg = EngineConfig(num_blocks=4, max_model_len=32, block_size=4)
    s = Scheduler(cfg)
    s.add_request(req("A", [1, 2, 3, 4], max_tokens=9, priority=1))
    s.add_request(req("B", [5, 6, 7, 8], max_tokens=9, priority=0))  # newer but more important
    for _ in range(5):
        run_step(s)
    out, _ = run_step(s)
    # A needs a block first; the victim is A itself (priority 1), then B gets A's freed block.
    assert out.preempted_ids == ["A"] and layout(out) == [("B", 8, 1)]


@pytest.mark.parametrize("now, victim, runs", [
    (0.0, "A", ("B", 8, 1)),     # A (batch class, older) has waited 0 s: band 1, preempted first
    (6.0, "B", ("A", 8, 1)),     # A arrived 6 s ago (> aging 5 s): band 0 like B, the newest goes
])
def test_preemption_victim_is_the_looser_band_before_the_newest(now, victim, runs):
    clock = FakeClock()
    cfg = EngineConfig(num_blocks=4, max_model_len=32, block_size=4, slo_class_aging_seconds=5.0)
    s = Scheduler(cfg, clock=clock)
    s.add_request(req("A", [1, 2, 3, 4], max_tokens=9, slo_rank=1))   # older, batch class
    s.add_request(req("B", [5, 6, 7, 8], max_tokens=9))               # newer, interactive
    for _ in range(5):
        run_step(s)
    clock.t = now
    out, _ = run_step(s)
    assert out.preempted_ids == [victim] and layout(out) == [runs]


def test_request_that_exactly_fills_the_pool_runs_alone_without_deadlock():
    cfg = EngineConfig(num_blocks=4, max_model_len=128, block_size=16)
    s = Scheduler(cfg)
    s.add_request(req("big", range(60), max_tokens=5))   # KV 60 + 5 - 1 = 64 = whole pool
    s.add_request(req("small", range(3), max_tokens=4))
    steps = 0
    while s.has_unfinished():
        out, _ = run_step(s)
        assert out.chunks, "a step with work pending scheduled nothing (deadlock)"
        steps += 1
        assert steps < 100
    assert s.finished_total["length"] == 2


# ---- SLO classes: waiting requests by band ------------------------------------------------------

@pytest.mark.parametrize("rank, waited, aging, band", [
    (0, 0.0, 5.0, 0),
    (0, 100.0, 5.0, 0),
    (1, 0.0, 5.0, 1),
    (1, 4.99, 5.0, 1),
    (1, 5.0, 5.0, 0),      # one aging period: the batch class joins band 0
    (2, 5.0, 5.0, 1),
    (2, 9.99, 5.0, 1),
    (2, 10.0, 5.0, 0),
    (3, 12.0, 5.0, 1),     # 3 - floor(12 / 5) = 1
    (1, 7.0, 2.0, 0),      # never below 0
])
def test_waiting_band(rank, waited, aging, band):
    assert waiting_band(rank, waited, aging) == band


@pytest.mark.parametrize("queue, want", [
    ([(0, 0.0)], 0),
    ([(0, 3.0), (0, 1.0)], 0),                 # one class: the head (first-come first-served)
    ([(1, 1.0), (0, 0.5)], 1),                 # an interactive request goes before a younger batch one
    ([(1, 6.0), (0, 0.5)], 0),                 # a batch request waiting 6 s > 5 s is band 0, first by position
    ([(1, 1.0), (1, 0.5)], 0),                 # one band: by position
    ([(2, 6.0), (1, 1.0), (2, 1.0)], 0),       # bands 1, 1, 2: the first of band 1
    ([(2, 1.0), (1, 1.0), (0, 9.0)], 2),       # bands 2, 1, 0
    ([(1, 0.0), (1, 0.0), (0, 0.0), (0, 0.0)], 2),   # the first of band 0, not the last
])
def test_next_waiting(queue, want):
    assert next_waiting(queue, 5.0) == want


def _one_slot(max_waiting=8) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    cfg = EngineConfig(num_blocks=32, max_model_len=64, block_size=4, max_num_seqs=1,
                       max_waiting=max_waiting, slo_class_aging_seconds=5.0)
    return Scheduler(cfg, clock=clock), clock


def _admitted_order(s: Scheduler, clock: FakeClock, dt: float = 1.0) -> list[str]:
    """Run to the end, one step per ``dt`` seconds; the order requests first ran in."""
    order = []
    while s.has_unfinished():
        out, _ = run_step(s)
        order += [c.request_id for c in out.chunks if c.request_id not in order]
        clock.t += dt
    return order


def test_a_tighter_class_is_admitted_before_an_older_looser_one():
    s, clock = _one_slot()
    s.add_request(req("run", [1], max_tokens=3))           # holds the one slot for 3 steps
    run_step(s)
    s.add_request(req("b1", [2], max_tokens=1, slo_rank=1))
    s.add_request(req("i1", [3], max_tokens=1))
    s.add_request(req("b2", [4], max_tokens=1, slo_rank=1))
    s.add_request(req("i2", [5], max_tokens=1))
    assert _admitted_order(s, clock, dt=0.5) == ["run", "i1", "i2", "b1", "b2"]


def test_one_class_keeps_first_come_first_served():
    s, clock = _one_slot()
    s.add_request(req("run", [1], max_tokens=3))
    run_step(s)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, [2], max_tokens=1))
    assert _admitted_order(s, clock) == ["run", "a", "b", "c"]


def test_an_aged_batch_request_goes_before_later_interactive_ones():
    """Progress for the batch class: b1 (arrived at 0) waits behind interactive requests only
    for its first aging period (5 s); then it is band 0 and goes first by its earlier position.
    One step per second; every request holds the one slot for 2 steps (prefill + 1 decode)."""
    s, clock = _one_slot()
    s.add_request(req("run", [1], max_tokens=2))
    s.add_request(req("b1", [2], max_tokens=2, slo_rank=1))
    started = {}
    for t in range(12):
        clock.t = float(t)
        if t >= 1:
            s.add_request(req(f"i{t}", [3], max_tokens=2))   # one interactive arrival per second
        out, _ = run_step(s)
        for c in out.chunks:
            started.setdefault(c.request_id, t)
    # slot: run 0-1, i1 2-3 (b1 waited 2 s: band 1), i2 4-5 (b1 waited 4 s), b1 6-7 (waited 6 s:
    # band 0, before i3..i6 by position), then i3 8-9, i4 10-11
    assert started == {"run": 0, "i1": 2, "i2": 4, "b1": 6, "i3": 8, "i4": 10}


def test_queue_full_counts_the_requests_a_new_one_would_wait_behind():
    s, _ = _one_slot(max_waiting=2)
    s.add_request(req("b1", [1], slo_rank=1))
    s.add_request(req("b2", [1], slo_rank=1))
    with pytest.raises(AdmissionError) as ei:
        s.add_request(req("b3", [1], slo_rank=1))              # 2 of rank <= 1 waiting
    assert ei.value.reason == "queue_full" and "2 requests of rank <= 1" in ei.value.message
    s.add_request(req("i1", [1]))                               # rank 0: none ahead of it
    s.add_request(req("i2", [1]))                               # 1 ahead
    with pytest.raises(AdmissionError):
        s.add_request(req("i3", [1]))                           # 2 ahead
    assert (s.queued_ahead(0), s.queued_ahead(1), len(s.waiting)) == (2, 4, 4)
    s.check_invariants()


# ---- admission -----------------------------------------------------------------------------

def test_admission_rejections_name_the_numbers():
    cfg = EngineConfig(num_blocks=4, max_model_len=32, block_size=16, max_waiting=2,
                       queue_full_retry_after_s=2.5, vocab_size=100)
    s = Scheduler(cfg)
    cases = [  # request, reason, text in the message, the field at fault
        (req("e", []), "invalid", "empty", "prompt"),
        (req("v", [5, 100]), "invalid", "100", "prompt"),
        (req("m", range(40), max_tokens=1), "never_fits", "max_model_len (32)", "prompt"),
        (req("m2", range(30), max_tokens=3), "never_fits", "= 33 tokens", "max_tokens"),
        (req("p", range(10), max_tokens=20), "never_fits", "needs 2 KV blocks", "max_tokens"),
    ]
    cfg_small_pool = EngineConfig(num_blocks=1, max_model_len=32, block_size=16, vocab_size=100)
    for r, reason, text, param in cases:
        with pytest.raises(AdmissionError) as ei:
            (Scheduler(cfg_small_pool) if r.request_id == "p" else s).add_request(r)
        assert ei.value.reason == reason and text in ei.value.message
        assert ei.value.retry_after is None and ei.value.param == param
    s.add_request(req("ok1", range(3), max_tokens=2))
    with pytest.raises(AdmissionError) as ei:
        s.add_request(req("ok1", range(3)))
    assert ei.value.reason == "invalid" and "already in use" in ei.value.message
    assert ei.value.param is None
    s.add_request(req("ok2", range(3), max_tokens=2))
    with pytest.raises(AdmissionError) as ei:
        s.add_request(req("ok3", range(3), max_tokens=2))
    assert ei.value.reason == "queue_full" and ei.value.retry_after == 2.5
    assert s.stats().rejected_total == {"queue_full": 1, "never_fits": 2, "invalid": 3}
    assert s.stats().admitted_total == 2
    s.count_rejection("invalid")  # the server's own refusals land in the same counters
    s.count_rejection(RejectReason.NEVER_FITS)
    assert s.stats().rejected_total == {"queue_full": 1, "never_fits": 3, "invalid": 4}
    with pytest.raises(ValueError):
        s.count_rejection("bogus")


def test_restate_finish_reason_moves_the_count():
    s = Scheduler(EngineConfig(num_blocks=8, max_model_len=64, block_size=4))
    r = req("r", [1, 2], max_tokens=1)
    s.add_request(r)
    run_step(s)
    assert r.finish_reason == "length" and s.finished_total == {"stop": 0, "length": 1, "abort": 0}
    s.restate_finish_reason(r, "stop")
    assert r.finish_reason is FinishReason.STOP and s.finished_total == {"stop": 1, "length": 0, "abort": 0}
    with pytest.raises(ValueError):
        s.restate_finish_reason(req("live", [1]), "stop")


def test_prompt_bigger_than_pool_rejected_at_once_small_requests_still_finish():
    # Bug report: pool of 4 x 16 tokens, max_model_len 128, a 100-token prompt must not hang.
    cfg = EngineConfig(num_blocks=4, max_model_len=128, block_size=16)
    s = Scheduler(cfg)
    with pytest.raises(AdmissionError) as ei:
        s.add_request(req("huge", range(100), max_tokens=8))
    assert ei.value.reason == "never_fits"
    assert "needs 7 KV blocks" in ei.value.message and "4 blocks (64 tokens)" in ei.value.message
    # prompt + max_tokens - 1 tokens of KV: 60 + 6 - 1 = 65 > 64 does not fit; 60 + 5 - 1 does.
    with pytest.raises(AdmissionError):
        s.add_request(req("edge", range(60), max_tokens=6))
    for i in range(3):
        s.add_request(req(f"s{i}", range(5), max_tokens=3))
    while s.has_unfinished():
        run_step(s)
    assert s.finished_total["length"] == 3


def test_max_model_len_32_and_40_token_prompt_then_normal_request():
    s = Scheduler(EngineConfig(num_blocks=16, max_model_len=32, block_size=16))
    with pytest.raises(AdmissionError) as ei:
        s.add_request(req("long", range(40), max_tokens=1))
    assert ei.value.reason == "never_fits" and "40 tokens" in ei.value.message
    s.add_request(req("next", range(10), max_tokens=4))
    while s.has_unfinished():
        run_step(s)
    assert s.finished_total == {"stop": 0, "length": 1, "abort": 0}


def test_queue_full_then_state_recovers_after_window():
    clock = FakeClock(10.0)
    cfg = EngineConfig(num_blocks=16, max_model_len=64, block_size=4, max_waiting=1, rejecting_window_s=5)
    s = Scheduler(cfg, clock=clock)
    s.add_request(req("a", [1, 2], max_tokens=2))
    assert s.engine_state() == "rejecting"  # the queue is at its limit
    with pytest.raises(AdmissionError):
        s.add_request(req("b", [1, 2], max_tokens=2))
    run_step(s)  # a starts running: queue empty, but a rejection happened just now
    assert s.engine_state() == "rejecting"
    clock.t = 15.1
    assert s.engine_state() == "running"
    s.add_request(req("b", [1, 2], max_tokens=2))


# ---- abort, finish, limits, state ------------------------------------------------------------

def test_abort_frees_blocks_at_once_even_mid_step():
    s = Scheduler(EngineConfig(num_blocks=8, max_model_len=64, block_size=4))
    s.add_request(req("a", range(9), max_tokens=5))
    s.add_request(req("w", range(3), max_tokens=5))
    run_step(s)
    assert s.block_manager.num_used_blocks == 3 + 1
    out = s.schedule()
    assert s.abort_request("a").finish_reason is FinishReason.ABORT
    assert s.block_manager.num_used_blocks == 1
    results = s.update_from_output(out, RunnerOutput({c.request_id: 1 for c in out.chunks}))
    assert [r.request_id for r in results] == ["w"]  # the aborted request's chunk is dropped
    s.check_invariants()
    assert s.abort_request("a") is None  # idempotent
    assert s.schedule().finished_ids == ["a"]
    s2 = Scheduler(EngineConfig(num_blocks=8, max_model_len=64, block_size=4))
    s2.add_request(req("q", range(3)))
    s2.abort_request("q")  # still waiting
    assert not s2.has_unfinished() and s2.finished_total["abort"] == 1
    assert s2.schedule().is_empty


def test_finish_request_stop_string_frees_blocks():
    s = Scheduler(EngineConfig(num_blocks=8, max_model_len=64, block_size=4))
    s.add_request(req("a", range(5), max_tokens=10))
    run_step(s)
    r = s.finish_request("a", "stop")
    assert r.finish_reason == "stop" and r.finished_time is not None and r.e2e is not None
    assert s.block_manager.usage == 0.0 and s.stats().finished_total["stop"] == 1


@pytest.mark.parametrize("name, params, tokens, want_len, want_reason", [
    ("eos stops", dict(ignore_eos=False), [5, 5, 2], 3, "stop"),
    ("ignore_eos continues", dict(ignore_eos=True), [5, 2, 2, 2], 4, "length"),
    ("min_tokens masks early eos", dict(ignore_eos=False, min_tokens=2), [2, 2, 2], 3, "stop"),
    ("stop_token_ids", dict(stop_token_ids=(9,)), [5, 9], 2, "stop"),
    ("stop token ignores ignore_eos", dict(ignore_eos=True, stop_token_ids=(9,)), [9], 1, "stop"),
    ("max_tokens", dict(ignore_eos=False), [5, 5, 5, 5], 4, "length"),
    ("second eos id", dict(ignore_eos=False), [5, 3], 2, "stop"),
])
def test_stop_rules(name, params, tokens, want_len, want_reason):
    s = Scheduler(EngineConfig(num_blocks=8, max_model_len=64, block_size=4, eos_token_ids=(2, 3)))
    s.add_request(req("a", [1, 1], max_tokens=4, **params))
    it = iter(tokens)
    results = []
    while s.has_unfinished():
        _, res = run_step(s, token=lambda c: next(it))
        results += res
    r = results[-1].request
    assert r.num_output_tokens == want_len and results[-1].finished
    assert results[-1].finish_reason == want_reason and r.finish_reason == want_reason
    assert str(r.finish_reason) == f"{r.finish_reason}" == want_reason  # labels/JSON see the value
    assert [x.new_token_ids[0] for x in results] == tokens[:want_len]
    assert all(not x.finished for x in results[:-1])


def test_set_limits_lowering_max_num_seqs_kills_nothing():
    s = Scheduler(EngineConfig(num_blocks=32, max_model_len=64, block_size=4, max_num_seqs=4))
    for i in range(3):
        s.add_request(req(f"r{i}", [1, 2], max_tokens=3))
    run_step(s)
    assert s.set_limits(max_num_seqs=1) == {"max_num_seqs": 1, "max_waiting": 256, "max_waiting_tokens": 0}
    s.add_request(req("late", [1, 2], max_tokens=2))
    out, _ = run_step(s)
    assert {c.request_id for c in out.chunks} == {"r0", "r1", "r2"}
    assert s.engine_state() == "waiting" and s.stats().max_num_seqs == 1
    run_step(s)  # r0..r2 finish (3 tokens)
    out, _ = run_step(s)
    assert layout(out) == [("late", 0, 2)]
    for bad in (dict(max_num_seqs=0), dict(max_waiting=-1), dict(max_num_seqs=True), dict(max_waiting_tokens=-1),
                dict(max_waiting_tokens=1.5)):
        with pytest.raises(ValueError):
            s.set_limits(**bad)
    assert s.set_limits(max_waiting=0)["max_waiting"] == 0
    with pytest.raises(AdmissionError) as ei:
        s.add_request(req("drain", [1]))
    assert ei.value.reason == "queue_full"


def test_max_waiting_tokens_bounds_the_prompt_tokens_ahead():
    """Budget 8 tokens per step, limit 20 prompt tokens: a prompt is refused when the uncomputed
    prompt tokens ahead of it (running chunks left + waiting prompts) plus its own exceed 20."""
    s = Scheduler(EngineConfig(num_blocks=64, max_model_len=64, block_size=4, max_num_seqs=4,
                               max_num_batched_tokens=8, max_waiting_tokens=20))
    s.add_request(req("a", range(1, 13), max_tokens=2))     # 12 tokens; nothing ahead: 12 <= 20
    assert s.prompt_tokens_ahead(0) == 12
    s.add_request(req("b", range(1, 7), max_tokens=2))      # 12 ahead + 6 = 18 <= 20
    with pytest.raises(AdmissionError) as ei:
        s.add_request(req("c", range(1, 4), max_tokens=2))  # 18 ahead + 3 = 21 > 20
    assert ei.value.reason == "queue_full" and "18 prompt tokens" in str(ei.value)
    assert ei.value.retry_after is not None
    s.add_request(req("d", [1, 2], max_tokens=2))           # 18 + 2 = 20: admitted
    assert s.prompt_tokens_ahead(0) == 20
    run_step(s)                                             # a's first chunk: 8 of its 12 tokens
    assert s.prompt_tokens_ahead(0) == 4 + 6 + 2
    s.add_request(req("c", range(1, 4), max_tokens=2))      # 12 + 3 = 15: admitted now
    assert s.rejected_total["queue_full"] == 1


def test_max_waiting_tokens_never_refuses_a_prompt_with_nothing_ahead():
    s = Scheduler(EngineConfig(num_blocks=64, max_model_len=64, block_size=4, max_waiting_tokens=5))
    s.add_request(req("long", range(1, 41), max_tokens=2))  # 40 tokens > 5, but nothing is ahead
    assert s.set_limits(max_waiting_tokens=0)["max_waiting_tokens"] == 0     # 0: no token bound
    s.add_request(req("next", range(1, 41), max_tokens=2))
    assert s.stats().max_waiting_tokens == 0 and s.rejected_total["queue_full"] == 0


def test_max_waiting_tokens_counts_only_the_classes_a_prompt_queues_behind():
    s = Scheduler(EngineConfig(num_blocks=64, max_model_len=64, block_size=4, max_num_seqs=1,
                               max_num_batched_tokens=8, max_waiting_tokens=10))
    s.add_request(req("run", [1, 2], max_tokens=8))
    run_step(s)                                             # "run" decodes; its prompt is done
    s.add_request(req("batch", range(1, 10), slo_rank=1))   # 9 tokens of the looser class
    assert (s.prompt_tokens_ahead(0), s.prompt_tokens_ahead(1)) == (0, 9)
    s.add_request(req("chat", range(1, 9), slo_rank=0))     # 0 ahead of rank 0: admitted
    with pytest.raises(AdmissionError):
        s.add_request(req("batch2", range(1, 4), slo_rank=1))   # 9 + 8 ahead of rank 1, + 3 > 10


def test_engine_state_running_when_idle_and_stats_snapshot():
    s = Scheduler(EngineConfig(num_blocks=8, max_model_len=64, block_size=4, model_name="m", revision="r"))
    assert s.engine_state() == "running" and not s.has_unfinished()
    assert s.block_manager.cache_identity == "m@r"
    st_ = s.stats()
    assert (st_.num_running, st_.num_waiting, st_.num_blocks, st_.kv_usage_ratio) == (0, 0, 8, 0.0)


# ---- prefix caching through the scheduler ---------------------------------------------------

def test_prefix_hit_same_identity_miss_with_other_salt():
    cfg = EngineConfig(num_blocks=32, max_model_len=64, block_size=4, model_name="smollm2", revision="r1")
    s = Scheduler(cfg)
    system = list(range(10, 22))  # 12 tokens: 3 full blocks
    s.add_request(req("a", system + [1], max_tokens=2))
    while s.has_unfinished():
        run_step(s)
    s.add_request(req("b", system + [2, 3], max_tokens=2))
    s.add_request(req("c", system + [2, 3], max_tokens=2, cache_salt="tenant-2"))
    out, _ = run_step(s)
    assert layout(out) == [("b", 12, 2), ("c", 0, 14)]
    st_ = s.stats()
    assert st_.prefix_cache_queries_total == 13 + 14 + 14 and st_.prefix_cache_hits_total == 12
    assert st_.prompt_tokens_total == 13 + 14 + 14


def test_prefix_caching_disabled():
    cfg = EngineConfig(num_blocks=32, max_model_len=64, block_size=4, enable_prefix_caching=False)
    s = Scheduler(cfg)
    for rid in ("a", "b"):
        s.add_request(req(rid, range(13), max_tokens=1))
        out, _ = run_step(s)
        assert layout(out) == [(rid, 0, 13)]
    assert s.stats().prefix_cache_queries_total == 0


def test_config_validation():
    for bad in (dict(num_blocks=0), dict(block_size=-1), dict(max_num_seqs=0),
                dict(max_num_batched_tokens=0), dict(max_waiting=-1), dict(scheduling_policy="fifo"),
                dict(eos_token_ids=(-1,)), dict(max_model_len=2.5), dict(queue_full_retry_after_s=-1)):
        with pytest.raises(ValueError):
            EngineConfig(**{"num_blocks": 8, "max_model_len": 64, **bad})
    assert EngineConfig(num_blocks=8, max_model_len=64, eos_token_ids=2).eos_token_ids == (2,)
    with pytest.raises(ValueError):
        Scheduler(EngineConfig(num_blocks=8, max_model_len=64), BlockManager(4, 16))
    for bad in (dict(min_tokens=5, max_tokens=2), dict(min_tokens=-1), dict(stop_token_ids=(-3,)),
                dict(max_tokens=0), dict(top_p=0.0), dict(temperature=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(TypeError):
        Request("x", [1.5])
    with pytest.raises(ValueError):
        Request("", [1])


# ---- random simulation against a fake runner ------------------------------------------------

EOS = 0


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence (EOS sometimes)."""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return h % 7  # 0..6; 0 is EOS


BASE = [5, 1, 4, 1, 5, 2, 6, 5, 3, 5, 8, 9, 7, 9]  # a shared "system prompt"
request_spec = st.tuples(
    st.builds(lambda k, tail: BASE[:k] + tail,                # prompt: shared prefix + own tail
              st.integers(0, len(BASE)), st.lists(st.integers(1, 3), max_size=8)),
    st.integers(1, 12),                                     # max_tokens
    st.booleans(),                                          # ignore_eos
    st.integers(0, 2),                                      # priority
    st.sampled_from([None, "t1"]),                          # cache_salt
    st.integers(0, 12),                                     # arrival step
    st.integers(0, 2),                                      # min_tokens
    st.integers(0, 2),                                      # slo_rank
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pool_tokens=st.integers(12, 48),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    policy=st.sampled_from(["continuous", "static"]),
    caching=st.booleans(),
    specs=st.lists(request_spec, min_size=1, max_size=10),
    abort_at=st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(0, 10))),
)
def test_random_simulation_keeps_invariants_and_reference_outputs(
        pool_tokens, block_size, budget, max_num_seqs, policy, caching, specs, abort_at):
    num_blocks = max(2, pool_tokens // block_size)
    cfg = EngineConfig(num_blocks=num_blocks, max_model_len=40, block_size=block_size,
                       max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_waiting=8,
                       scheduling_policy=policy, enable_prefix_caching=caching, eos_token_ids=(EOS,),
                       slo_class_aging_seconds=3.0)
    clock = FakeClock()
    s = Scheduler(cfg, clock=clock)
    runner = SlotRunner(cfg, next_token)
    admitted: dict[str, Request] = {}
    aborted: set[str] = set()
    step = 0
    pending = sorted(enumerate(specs), key=lambda x: x[1][5])
    while pending or s.has_unfinished():
        while pending and pending[0][1][5] <= step:
            i, (prompt, mt, ign, prio, salt, _, mn, rank) = pending.pop(0)
            r = Request(f"r{i}", prompt, SamplingParams(max_tokens=mt, ignore_eos=ign, min_tokens=min(mn, mt),
                                                        stop_token_ids=(6,)),
                        priority=prio, cache_salt=salt, slo_rank=rank)
            try:
                s.add_request(r)
            except AdmissionError as e:
                kv = len(prompt) + mt - 1
                if e.reason == "invalid":
                    assert not prompt
                elif e.reason == "never_fits":
                    assert len(prompt) + mt > 40 or -(-kv // block_size) > num_blocks
                else:
                    assert e.reason == "queue_full" and s.queued_ahead(rank) >= 8
                continue
            admitted[r.request_id] = r
        if abort_at is not None and abort_at[1] == step and f"r{abort_at[0]}" in s.requests:
            s.abort_request(f"r{abort_at[0]}")
            aborted.add(f"r{abort_at[0]}")
        pre_decode = {r.request_id for r in s.running if r.num_tokens - r.num_computed_tokens == 1}
        out = s.schedule()
        s.check_invariants()
        # Budget, slot cap, decodes before prefill chunks, no request twice.
        assert out.num_batched_tokens <= budget
        assert len(out.chunks) <= max_num_seqs
        ids = [c.request_id for c in out.chunks]
        assert len(set(ids)) == len(ids)
        assert all(c.num_tokens >= 1 for c in out.chunks)  # the model needs a row for logits
        kinds = [c.request_id in pre_decode for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True)
        if s.has_unfinished():
            assert out.chunks, "work pending but nothing scheduled: deadlock"
        s.update_from_output(out, runner.execute(out))
        s.check_invariants()
        step += 1
        clock.t = float(step)
        assert step < 2000
    assert s.block_manager.usage == 0.0
    st_ = s.stats()
    assert sum(st_.finished_total.values()) == st_.admitted_total == len(admitted)
    assert st_.generation_tokens_total == sum(r.num_output_tokens for r in admitted.values())
    for rid, r in admitted.items():
        assert r.status is RequestStatus.FINISHED
        if rid in aborted:
            continue
        want, reason = reference_output(r.prompt_token_ids, r.sampling_params, 40, next_token, EOS)
        assert r.output_token_ids == want, rid
        assert r.finish_reason == reason
        assert len(r.token_times) == r.num_output_tokens


# ---- counters: admitted = finished + running + waiting -----------------------------------------

def _in_flight_balance(s: Scheduler) -> tuple[int, int]:
    """(admitted, finished + running + waiting) from the exported snapshot."""
    st_ = s.stats()
    return st_.admitted_total, sum(st_.finished_total.values()) + st_.num_running + st_.num_waiting


def test_dropping_an_n_request_before_its_prompt_runs_keeps_the_counters_balanced():
    """A client that drops an ``n = 3`` request while it waits: 3 choices admitted, 3 finished
    (abort), none in flight — not 1 admitted and 3 finished."""
    s = Scheduler(EngineConfig(num_blocks=16, max_model_len=64, block_size=4))
    parent = req("p", [1, 2, 3], max_tokens=4)
    s.add_request(parent, [req("p-1", [1, 2, 3], max_tokens=4), req("p-2", [1, 2, 3], max_tokens=4)])
    st_ = s.stats()
    assert (st_.admitted_total, st_.num_waiting, st_.num_running) == (3, 3, 0)
    s.abort_request("p")
    st_ = s.stats()
    assert (st_.admitted_total, st_.finished_total["abort"], st_.num_waiting) == (3, 3, 0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pool_blocks=st.integers(3, 10),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(2, 16),
    specs=st.lists(st.tuples(st.integers(1, 6),        # prompt length
                             st.integers(1, 6),        # max_tokens
                             st.integers(1, 4),        # n (choices: the request and n - 1 forks)
                             st.integers(0, 8)),       # arrival step
                   min_size=1, max_size=8),
    aborts=st.lists(st.tuples(st.integers(0, 12),      # step
                              st.integers(0, 7),       # request
                              st.integers(0, 3)),      # choice (0 = the parent)
                    max_size=6),
)
def test_admitted_equals_finished_plus_running_plus_waiting(pool_blocks, max_num_seqs, budget, specs, aborts):
    """Property: after every admission, abort and step — with random ``n``, aborts of a parent
    or of one fork at any point (before its prompt ran included), and preemption by recompute
    (a pool of 3–10 blocks of 2 tokens) — the exported counters satisfy
    admitted = finished + running + waiting, and everything admitted finishes."""
    cfg = EngineConfig(num_blocks=pool_blocks, max_model_len=16, block_size=2, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_waiting=4)
    s = Scheduler(cfg, clock=FakeClock())
    n_admitted = 0
    step = 0
    pending = sorted(enumerate(specs), key=lambda x: x[1][3])
    while pending or s.has_unfinished() or s.num_pending_forks:
        while pending and pending[0][1][3] <= step:
            i, (plen, mt, n, _) = pending.pop(0)
            prompt = [1 + (i + k) % 5 for k in range(plen)]
            try:
                s.add_request(req(f"r{i}", prompt, max_tokens=mt),
                              [req(f"r{i}-{c}", prompt, max_tokens=mt) for c in range(1, n)])
                n_admitted += n
            except AdmissionError:
                pass
            admitted, balance = _in_flight_balance(s)
            assert admitted == balance == n_admitted
        for at, i, c in aborts:
            if at == step:
                s.abort_request(f"r{i}" if c == 0 else f"r{i}-{c}")
                admitted, balance = _in_flight_balance(s)
                assert admitted == balance
        run_step(s)
        admitted, balance = _in_flight_balance(s)
        assert admitted == balance
        step += 1
        assert step < 500
    st_ = s.stats()
    assert st_.admitted_total == n_admitted == sum(st_.finished_total.values())
    assert st_.num_running == st_.num_waiting == 0


def test_check_room_never_fits_versus_not_now():
    """A batch enters the waiting queue whole: more prompts than max_waiting can never be
    admitted (never_fits, 400); a batch that fits the limit but not the queue's room now is
    queue_full (429); max_waiting = 0 (a drain) is always "not now"."""
    cfg = EngineConfig(num_blocks=16, max_model_len=64, block_size=4, max_waiting=3, max_num_seqs=2)
    s = Scheduler(cfg)
    with pytest.raises(AdmissionError) as ei:
        s.check_room(4)
    assert ei.value.reason == "never_fits" and "max_waiting=3" in ei.value.message
    assert ei.value.param == "prompt"
    s.check_room(3)  # an empty queue holds 3
    s.add_request(req("a", [1, 2], max_tokens=2))
    with pytest.raises(AdmissionError) as ei:
        s.check_room(3)  # 1 waiting + 3 > 3: room for 2 now
    assert ei.value.reason == "queue_full" and ei.value.retry_after is not None
    s.check_room(2)
    s.set_limits(max_waiting=0)
    with pytest.raises(AdmissionError) as ei:
        s.check_room(5)
    assert ei.value.reason == "queue_full"
    assert s.stats().rejected_total == {"queue_full": 2, "never_fits": 1, "invalid": 0}
