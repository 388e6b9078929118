"""A fake model over a slot store, for the scheduler simulations (tests/worker/engine/test_scheduler.py,
test_speculative.py): the runner writes every chunk's tokens into "KV" slots through its block table
and predicts each needed position from the tokens READ BACK, so a wrong block table, a block freed or
reused while referenced, a wrong prefix hit or a wrong rewind after a rejected draft changes the
output; ``reference_output`` decodes the same model one token at a time, the independent answer."""
from __future__ import annotations

from typing import Callable

from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import RunnerOutput, SchedulerOutput
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.speculative import accept_greedy

NextToken = Callable[[list[int]], int]


def reference_output(prompt, sp: SamplingParams, max_model_len: int, next_token: NextToken,
                     eos: int = 0) -> tuple[list[int], str]:
    """``next_token``'s output for ``prompt`` one token at a time, with the scheduler's stop rules
    (EOS unless ignore_eos, stop_token_ids, after min_tokens; max_tokens; max_model_len)."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) > sp.min_tokens and ((t == eos and not sp.ignore_eos) or t in sp.stop_token_ids):
            return out, "stop"
        if len(out) >= sp.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class SlotRunner:
    """The scheduler's model runner over a slot store (see the module doc); a chunk with draft
    tokens is verified with ``accept_greedy`` against the model's token at every position."""

    def __init__(self, cfg: EngineConfig, next_token: NextToken) -> None:
        self.bs = cfg.block_size
        self.next_token = next_token
        self.kv: list[int | None] = [None] * (cfg.num_blocks * cfg.block_size)

    def _read(self, c, n: int) -> list[int]:
        bs = self.bs
        seq = [self.kv[c.block_table[p // bs] * bs + p % bs] for p in range(n)]
        assert None not in seq
        return seq

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        bs = self.bs
        for c in out.chunks:  # write all KV first (as every attention layer does)
            assert len(c.block_table) * bs >= c.seq_len
            for i, t in enumerate(c.token_ids):
                p = c.start_pos + i
                self.kv[c.block_table[p // bs] * bs + p % bs] = t
        ro = RunnerOutput()
        for c in out.chunks:
            if not c.sample:
                continue
            k = len(c.draft_token_ids)
            targets = [self.next_token(self._read(c, c.seq_len - k + i)) for i in range(k + 1)]
            toks = accept_greedy(c.draft_token_ids, targets)
            ro.sampled_token_ids[c.request_id] = toks[0]
            if k:
                ro.spec_token_ids[c.request_id] = toks
        return ro
