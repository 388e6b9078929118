"""Greedy decoding straight through a ``ModelRunner`` (no scheduler): one prefill chunk, then
one-token decode chunks, for tests that compare two model paths on the same steps."""
from __future__ import annotations

import torch


def greedy_steps(runner, prompt: str, steps: int) -> tuple[list[int], torch.Tensor]:
    """The token ids (prompt + ``steps`` greedy tokens) and the ``[steps, vocab]`` logits each
    token was taken from. Request ``"r"`` uses KV blocks 0 and 1 (the runner needs >= 2)."""
    from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
    from goodput.worker.engine.sampling_params import SamplingParams
    ids = runner.tokenizer.encode(prompt)
    prompt_ids, logits = tuple(ids), []
    for step in range(steps):
        start = 0 if step == 0 else len(ids) - 1
        chunk = ScheduledChunk(request_id="r", token_ids=tuple(ids[start:]), start_pos=start,
                               block_table=(0, 1), sample=True, sampling_params=SamplingParams(temperature=0.0),
                               num_output_tokens=step, prompt_token_ids=prompt_ids)
        out = runner.forward_logits(SchedulerOutput(chunks=[chunk], num_batched_tokens=len(ids) - start))["r"]
        logits.append(out[-1])
        ids.append(int(out[-1].argmax()))
    return ids, torch.stack(logits)
