"""LLMEngine / AsyncLLMEngine without a model: the real scheduler and block manager, a fake runner.

The fake runner (tests/fake_engine.py) "counts": the token after t is t+1 (byte tokens, so the text is the alphabet),
which makes every expected output computable by hand. Checks: stop strings finish the request
through the scheduler (blocks freed at once, reason "stop", text cut before the stop string),
stop tokens are not in the text, aborts free blocks, one delta per token, a failing step fails only
its own requests, a runner that keeps failing kills the loop (health) and answers every client.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import AdmissionError
from goodput.worker.async_engine import AsyncLLMEngine
from goodput.worker.llm_engine import MAX_CONSECUTIVE_STEP_FAILURES

from fake_engine import CountingRunner, make_engine


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_generate_counts_and_length():
    eng = make_engine()
    [(ids, text, reason)] = eng.generate([[ord("a")]], greedy(5))
    assert ids == [ord(c) for c in "bcdef"] and text == "bcdef" and reason == "length"
    assert eng.stats().num_used_blocks == 0


def test_stop_string_finishes_through_the_scheduler_and_frees_blocks():
    eng = make_engine()
    eng.add_request("r", [ord("a")], greedy(20, stop=("efg",)))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    assert "".join(d.text for d in deltas) == "bcd"
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert deltas[-1].num_output_tokens == 6  # b c d e f g were generated; "efg" is cut from the text
    assert len(deltas) == 6  # one delta per generated token
    s = eng.stats()
    assert s.num_used_blocks == 0 and s.finished_total["stop"] == 1 and s.num_running == 0


def test_stop_token_is_not_part_of_the_text():
    eng = make_engine()
    [(ids, text, reason)] = eng.generate([[ord("a")]], greedy(10, stop_token_ids=(ord("d"),)))
    assert ids == [ord("b"), ord("c"), ord("d")] and text == "bc" and reason == "stop"


def test_admission_errors_pass_through():
    eng = make_engine(num_blocks=2)
    with pytest.raises(AdmissionError) as e:
        eng.add_request("big", list(range(1, 20)), greedy(8))
    assert e.value.reason == "never_fits"
    with pytest.raises(AdmissionError) as e:
        eng.add_request("empty", [], greedy(8))
    assert e.value.reason == "invalid"
    assert eng.stats().rejected_total == {"queue_full": 0, "never_fits": 1, "invalid": 1}


def test_async_abort_frees_blocks_and_failure_marks_dead():
    async def scenario():
        gate = threading.Semaphore(3)
        eng = make_engine(runner=CountingRunner(gate=gate))
        aeng = AsyncLLMEngine(eng, idle_tick_s=0.05)
        aeng.start()
        try:
            stream = aeng.add_request("long", [ord("a")], greedy(40, ignore_eos=True))
            got = [await stream.__anext__() for _ in range(3)]
            assert [d.text for d in got] == ["b", "c", "d"]
            assert eng.stats().num_used_blocks > 0  # the loop now waits in step 4 for a permit
            stream.abort()
            for _ in range(100):
                gate.release()
            for _ in range(200):
                if not eng.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            s = eng.stats()
            assert s.num_used_blocks == 0 and s.finished_total["abort"] == 1
            assert aeng.is_healthy()

            done = [d async for d in aeng.generate("short", [ord("x")], greedy(2))]
            assert [d.text for d in done] == ["y", "z"] and done[-1].finish_reason == "length"
        finally:
            aeng.shutdown()

        # One failing step fails only its own requests; the engine keeps serving.
        once = make_engine(runner=CountingRunner(fail_on_calls={3}))
        flaky = AsyncLLMEngine(once, idle_tick_s=0.05)
        flaky.start()
        try:
            deltas = [d async for d in flaky.generate("r1", [ord("a")], greedy(50))]
            assert [d.text for d in deltas[:2]] == ["b", "c"]
            assert deltas[-1].finish_reason == "abort" and "device lost" in deltas[-1].error
            assert flaky.is_healthy() and once.stats().num_used_blocks == 0
            done = [d async for d in flaky.generate("r2", [ord("k")], greedy(3))]
            assert "".join(d.text for d in done) == "lmn" and done[-1].finish_reason == "length"
        finally:
            flaky.shutdown()

        # A runner that keeps failing: after MAX_CONSECUTIVE_STEP_FAILURES the engine is dead.
        bad = AsyncLLMEngine(make_engine(runner=CountingRunner(fail_after=2)), idle_tick_s=0.05)
        bad.start()
        try:
            for i in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
                deltas = [d async for d in bad.generate(f"r{i}", [ord("a")], greedy(50))]
                assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
                assert "device lost" in deltas[-1].error
            await asyncio.sleep(0.05)
            assert not bad.is_healthy()
        finally:
            bad.shutdown()

    asyncio.run(scenario())


def test_forks_count_n_once_and_every_sample_finished():
    """n = 3 (one request + two forks): three finished samples with their prompt and generated
    tokens, one observation of n = 3; a plain request observes n = 1."""
    from prometheus_client.parser import text_string_to_metric_families
    eng = make_engine()
    eng.add_request("p", [ord("a"), ord("b")], greedy(4, ignore_eos=True),
                    forks=[("p-1", greedy(4, ignore_eos=True)), ("p-2", greedy(4, ignore_eos=True))])
    eng.add_request("q", [ord("x")], greedy(2))
    while eng.has_unfinished():
        eng.step()
    samples = {s.name: s.value for f in text_string_to_metric_families(eng.metrics.render().decode())
               for s in f.samples}
    assert (samples["goodput_request_params_n_count"], samples["goodput_request_params_n_sum"]) == (2, 4)
    assert samples["goodput_request_prompt_tokens_count"] == 4
    assert samples["goodput_request_prompt_tokens_sum"] == 3 * 2 + 1
    assert samples["goodput_request_generation_tokens_sum"] == 3 * 4 + 2
    assert eng.stats().finished_total == {"stop": 0, "length": 4, "abort": 0}
