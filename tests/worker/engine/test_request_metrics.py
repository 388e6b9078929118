"""Request latency formulas (TTFT, ITL, TPOT, E2E, queue time) on hand-made timestamps, and the
timestamps the scheduler records under a fake clock."""
from __future__ import annotations

import pytest

from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import RunnerOutput
from goodput.worker.engine.request import FinishReason, Request, RequestStatus
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import Scheduler


def _req(**kw) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(temperature=0, **kw))


def test_formulas_on_hand_made_timeline():
    r = _req(max_tokens=4)
    r.arrival_time = 10.0
    r.first_scheduled_time = 10.5
    for t in (11.0, 11.2, 11.5, 12.1):
        r.append_output_token(7, t)
    r.finished_time = 12.1
    # TTFT = 11.0 - 10.0; ITL = gaps; E2E = 12.1 - 10.0; TPOT = (2.1 - 1.0) / 3; queue = 0.5
    assert r.ttft == pytest.approx(1.0)
    assert r.itl == pytest.approx([0.2, 0.3, 0.6])
    assert r.e2e == pytest.approx(2.1)
    assert r.tpot == pytest.approx(1.1 / 3)
    assert r.queue_time == pytest.approx(0.5)
    # With no preemption and finish at the last token, TPOT is the mean ITL.
    assert r.tpot == pytest.approx(sum(r.itl) / len(r.itl))


def test_undefined_values_are_none():
    r = _req(max_tokens=4)
    assert r.ttft is None and r.e2e is None and r.tpot is None and r.queue_time is None
    assert r.itl == []
    r.arrival_time = 0.0
    r.append_output_token(5, 0.25)
    assert r.ttft == pytest.approx(0.25)
    assert r.tpot is None  # unfinished
    r.finished_time = 0.3
    assert r.e2e == pytest.approx(0.3)
    assert r.tpot is None  # n_out == 1: undefined
    assert r.itl == []


def test_tpot_counts_time_after_last_token():
    # E2E ends at finish, which may come after the last token (e.g. detokenizer stop).
    r = _req(max_tokens=8)
    r.arrival_time = 0.0
    r.append_output_token(1, 1.0)
    r.append_output_token(2, 2.0)
    r.finished_time = 4.0
    assert r.tpot == pytest.approx((4.0 - 1.0) / 1)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_scheduler_records_every_timestamp():
    clock = FakeClock()
    cfg = EngineConfig(num_blocks=8, max_model_len=64, block_size=4, max_num_batched_tokens=4)
    s = Scheduler(cfg, clock=clock)
    r = Request("a", list(range(1, 7)), SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=99.0)
    s.add_request(r)
    assert r.queued_time == 100.0 and r.status is RequestStatus.WAITING
    clock.t = 101.0
    out = s.schedule()  # 6-token prompt under a budget of 4: first chunk, no sample
    assert r.first_scheduled_time == 101.0 and not out.chunks[0].sample
    s.update_from_output(out, RunnerOutput())
    assert r.first_token_time is None
    times = [102.0, 103.5, 104.0]
    for t in times:
        clock.t = t
        out = s.schedule()
        clock.t = t + 0.25
        s.update_from_output(out, RunnerOutput({"a": 9}))
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH
    assert r.token_times == [102.25, 103.75, 104.25]
    assert r.first_token_time == 102.25
    assert r.finished_time == 104.25
    assert r.ttft == pytest.approx(102.25 - 99.0)
    assert r.queue_time == pytest.approx(101.0 - 99.0)
    assert r.e2e == pytest.approx(104.25 - 99.0)
    assert r.tpot == pytest.approx((104.25 - 102.25) / 2)
    assert r.itl == pytest.approx([1.5, 0.5])


def test_arrival_defaults_to_scheduler_clock_and_preemption_is_timed():
    clock = FakeClock()
    # Two 4-token prompts with block_size 4 in a 3-block pool: the newer one is preempted when
    # the older needs its second block.
    cfg = EngineConfig(num_blocks=3, max_model_len=16, block_size=4)
    s = Scheduler(cfg, clock=clock)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True))
    b = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    s.add_request(a)
    clock.t = 100.5
    s.add_request(b)
    assert a.arrival_time == 100.0 and b.arrival_time == 100.5
    step = 0
    while s.has_unfinished() and step < 50:
        clock.t += 1
        out = s.schedule()
        s.update_from_output(out, RunnerOutput({c.request_id: 3 for c in out.chunks if c.sample}))
        step += 1
    assert b.num_preemptions >= 1 and all(t > 100.5 for t in b.preempted_times)
    assert a.num_preemptions == 0
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
