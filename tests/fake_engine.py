"""A model-free LLMEngine for tests: the real scheduler and block manager over a fake runner that
"counts" (the token after t is t+1; byte tokens, so the text is the alphabet) and a byte tokenizer.

Used by tests/worker/test_server_engine_loop.py and tests/worker/server/test_server_app.py.
"""
from __future__ import annotations

import threading

from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import RunnerOutput
from goodput.worker.engine.scheduler import Scheduler
from goodput.worker.llm_engine import LLMEngine
from goodput.worker.metrics import WorkerMetrics

EOS = 0


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")


class TextByteTokenizer(ByteTokenizer):
    """One token per byte of the text (a server test's prompts as text)."""

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


class CountingRunner:
    """gate: optional threading.Semaphore; each step takes one permit (the test sets the pace)."""

    def __init__(self, fail_after: int | None = None, gate: threading.Semaphore | None = None,
                 fail_on_calls: set[int] = frozenset()):
        self.calls = 0
        self.fail_after = fail_after
        self.fail_on_calls = fail_on_calls
        self.gate = gate

    def execute(self, sched_out):
        if self.gate is not None:
            self.gate.acquire()
        self.calls += 1
        if (self.fail_after is not None and self.calls > self.fail_after) or self.calls in self.fail_on_calls:
            raise RuntimeError("device lost")
        return RunnerOutput({c.request_id: c.token_ids[-1] + 1 for c in sched_out.chunks if c.sample})


def make_engine(num_blocks=16, runner=None, **cfg) -> LLMEngine:
    config = EngineConfig(num_blocks=num_blocks, max_model_len=256, block_size=4, eos_token_ids=(EOS,),
                          max_num_batched_tokens=64, **cfg)
    eng = LLMEngine(config, Scheduler(config), runner or CountingRunner(), ByteTokenizer())
    eng.metrics = WorkerMetrics("fake", eng.stats)
    return eng
