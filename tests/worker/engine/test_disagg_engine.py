"""Disaggregated prefill in the engine core: a remote prefill's lease (held, released, aborted,
expired; never leaked) and a KV import (the prompt's blocks written from another engine's bytes),
with two schedulers over the slot-store fake model: the decode engine's output must equal the
model's own one-token-at-a-time answer (``slot_model.reference_output``), so a wrong block, a
block freed under a lease or a wrongly skipped prefix changes it."""
from __future__ import annotations

from array import array

import pytest

from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import KvImport, RunnerOutput
from goodput.worker.engine.request import Request, RequestStatus
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import AdmissionError, Scheduler
from slot_model import SlotRunner, reference_output

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def next_token(tokens: list[int]) -> int:
    """A deterministic "model": depends on every token read back from the KV slots."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97 + 1


class BytesSlotRunner(SlotRunner):
    """SlotRunner whose blocks can leave and enter as bytes (int64 per slot), as the model
    runner's ``export_kv_block`` / ``import_kv`` do with tensors."""

    def export_kv_block(self, block_id: int, ntok: int) -> bytes:
        return array("q", self.kv[block_id * self.bs:block_id * self.bs + ntok]).tobytes()

    def import_kv(self, imports) -> None:
        for imp in imports:
            for bid, payload in zip(imp.block_ids, imp.payloads):
                vals = array("q")
                vals.frombytes(payload)
                self.kv[bid * self.bs:bid * self.bs + len(vals)] = list(vals)


def engine(num_blocks=32, lease_s=5.0) -> tuple[Scheduler, BytesSlotRunner, Clock]:
    clock = Clock()
    cfg = EngineConfig(num_blocks=num_blocks, block_size=BS, max_model_len=256, max_num_batched_tokens=8,
                       kv_lease_s=lease_s)
    return Scheduler(cfg, clock=clock), BytesSlotRunner(cfg, next_token), clock


def step(s: Scheduler, runner: BytesSlotRunner):
    out = s.schedule()
    if out.kv_imports:
        runner.import_kv(out.kv_imports)
    res = s.update_from_output(out, runner.execute(out) if out.chunks else RunnerOutput())
    s.check_invariants()
    return res


def sp(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def remote_prefill(s, runner, rid, prompt) -> list[int]:
    """Run a hold_kv request (max_tokens 1) to its end; returns its output."""
    r = Request(rid, prompt, sp(1), hold_kv=True)
    s.add_request(r)
    while not r.is_finished:
        step(s, runner)
    return r.output_token_ids


def pull(s, runner, handle, first_block=0) -> KvImport:
    lease = s.lease(handle)
    n = lease.num_tokens
    blocks = tuple(runner.export_kv_block(lease.request.block_ids[b], min(BS, n - b * BS))
                   for b in range(first_block, -(-n // BS)))
    return KvImport(n, first_block, blocks, lease.first_token_id)


PROMPT = [5, 9, 2, 7, 3, 3, 8, 1, 6, 4, 2]  # 11 tokens: blocks of 4, 4, 3


def test_lease_holds_the_prompt_blocks_until_released():
    s, runner, _ = engine()
    out = remote_prefill(s, runner, "p1", PROMPT)
    assert out == [next_token(PROMPT)]
    lease = s.lease("p1")
    assert lease is not None and lease.num_tokens == 11 and len(lease.request.block_ids) == 3
    st = s.stats()
    assert (st.num_leases, st.num_leased_blocks, st.num_used_blocks) == (1, 3, 3)
    assert s.finished_total["length"] == 1 and not s.has_unfinished()
    assert s.release_lease("p1") and not s.release_lease("p1")
    assert s.stats().num_used_blocks == 0 and s.stats().num_leases == 0
    s.check_invariants()


def test_aborted_remote_prefill_leases_nothing():
    s, runner, _ = engine()
    r = Request("p1", PROMPT, sp(1), hold_kv=True)
    s.add_request(r)
    step(s, runner)  # 8 of 11 prompt tokens computed
    assert r.status is RequestStatus.RUNNING
    s.abort_request("p1")
    assert s.lease("p1") is None and s.stats().num_used_blocks == 0
    s.check_invariants()


def test_unpulled_lease_expires_and_is_counted():
    s, runner, clock = engine(lease_s=5.0)
    remote_prefill(s, runner, "p1", PROMPT)
    clock.t += 4.999
    assert s.expire_leases() == 0 and s.lease("p1") is not None
    clock.t += 0.001
    assert s.expire_leases() == 1
    assert s.lease("p1") is None and s.stats().num_used_blocks == 0
    assert s.stats().kv_lease_expiries_total == 1
    s.check_invariants()


def serve_other(s, runner) -> None:
    """Run another request (12 prompt tokens, 4 output tokens: 15 KV tokens) to its
    end; its output must be the reference decoder's."""
    other = [1] * 12
    r = Request("o", other, sp(4))
    s.add_request(r)
    while not r.is_finished:
        step(s, runner)
    assert r.output_token_ids == reference_output(other, sp(4), 256, next_token)[0]


def test_a_lease_is_never_evicted_by_other_requests():
    # a pool of 7 blocks: the lease keeps 3; a 12-token request with 4 output tokens needs the
    # other 4 (15 KV tokens), so every free block is reused while the leased ones are not
    s, runner, _ = engine(num_blocks=7)
    remote_prefill(s, runner, "p1", PROMPT)
    serve_other(s, runner)
    held = s.lease("p1").request.block_ids
    assert all(s.block_manager.block_ref_count(b) == 1 for b in held)
    # the leased KV still reads back as the prompt
    assert [runner.kv[held[p // BS] * BS + p % BS] for p in range(11)] == PROMPT


@pytest.mark.parametrize("cached_prefix, max_tokens", [
    (0, 6),     # nothing cached on the decode side: every block moves
    (8, 6),     # the decode side holds the first 2 blocks: only the last one moves
    (0, 1),     # the first token is the whole answer
])
def test_imported_prompt_decodes_as_colocated(cached_prefix, max_tokens):
    pre, pre_runner, _ = engine()
    dec, dec_runner, _ = engine()
    if cached_prefix:  # the decode engine computed a prompt sharing the first blocks earlier
        warm = Request("warm", PROMPT[:cached_prefix] + [50, 51], sp(1))
        dec.add_request(warm)
        while not warm.is_finished:
            step(dec, dec_runner)
    first = remote_prefill(pre, pre_runner, "h", PROMPT)
    probe = Request("probe", PROMPT)
    held = len(dec.block_manager.get_computed_blocks(probe)[0])
    assert held == cached_prefix // BS
    imp = pull(pre, pre_runner, "h", first_block=held)
    assert len(imp.blocks) == 3 - held
    assert pre.release_lease("h")
    r = Request("d", PROMPT, sp(max_tokens), kv_import=imp)
    dec.add_request(r)
    computed_before = dec.batched_tokens_total
    while not r.is_finished:
        step(dec, dec_runner)
    want, reason = reference_output(PROMPT, sp(max_tokens), 256, next_token)
    assert r.output_token_ids == want and r.output_token_ids[0] == first[0]
    assert r.finish_reason == reason
    # the prompt was never computed here: only the decode inputs after the first token were
    assert dec.batched_tokens_total - computed_before == max_tokens - 1
    assert dec.prefills_total == {"local": 1 if cached_prefix else 0, "remote": 1}
    assert dec.stats().num_used_blocks == 0


def test_import_whose_cached_prefix_was_evicted_is_computed_locally():
    dec, dec_runner, _ = engine()
    pre, pre_runner, _ = engine()
    remote_prefill(pre, pre_runner, "h", PROMPT)
    imp = pull(pre, pre_runner, "h", first_block=2)  # "the decode side held 2 blocks" - it does not
    r = Request("d", PROMPT, sp(4), kv_import=imp)
    dec.add_request(r)
    while not r.is_finished:
        step(dec, dec_runner)
    assert r.output_token_ids == reference_output(PROMPT, sp(4), 256, next_token)[0]
    assert dec.prefills_total == {"local": 1, "remote": 0}


def test_import_step_that_never_commits_is_recomputed():
    pre, pre_runner, _ = engine()
    dec, dec_runner, _ = engine()
    remote_prefill(pre, pre_runner, "h", PROMPT)
    imp = pull(pre, pre_runner, "h")
    r = Request("d", PROMPT, sp(3), kv_import=imp)
    dec.add_request(r)
    out = dec.schedule()  # the runner "fails": this step is never committed
    assert [i.request_id for i in out.kv_imports] == ["d"] and r.num_computed_tokens == 0
    while not r.is_finished:
        step(dec, dec_runner)
    assert r.output_token_ids == reference_output(PROMPT, sp(3), 256, next_token)[0]
    dec.check_invariants()


def test_abort_between_schedule_and_commit_frees_the_import():
    pre, pre_runner, _ = engine()
    dec, dec_runner, _ = engine()
    remote_prefill(pre, pre_runner, "h", PROMPT)
    r = Request("d", PROMPT, sp(3), kv_import=pull(pre, pre_runner, "h"))
    dec.add_request(r)
    out = dec.schedule()
    dec_runner.import_kv(out.kv_imports)
    dec.abort_request("d")
    assert dec.update_from_output(out, RunnerOutput()) == []
    assert dec.stats().num_used_blocks == 0
    dec.check_invariants()


@pytest.mark.parametrize("imp", [
    KvImport(10, 0, (b"",) * 3, 1),      # 10 tokens for an 11-token prompt
    KvImport(11, 0, (b"",) * 2, 1),      # 2 payloads for blocks 0..2
    KvImport(11, 1, (b"",) * 3, 1),      # blocks 1..3 of a 3-block prompt
])
def test_an_import_that_does_not_cover_the_prompt_is_refused(imp):
    s, _, _ = engine()
    with pytest.raises(AdmissionError, match="imported KV covers"):
        s.add_request(Request("d", PROMPT, sp(3), kv_import=imp))
    assert s.rejected_total["invalid"] == 1 and s.stats().num_used_blocks == 0


def test_kv_pressure_reclaims_the_oldest_lease_before_anyone_waits_or_is_preempted():
    # 7 blocks: two leases of 3 blocks each leave 1; a 12-token request with 4 output tokens needs 4
    s, runner, clock = engine(num_blocks=7)
    remote_prefill(s, runner, "old", PROMPT)
    clock.t += 1.0
    remote_prefill(s, runner, "new", [4] + PROMPT[1:])
    serve_other(s, runner)
    assert s.preemptions_total == 0
    assert s.lease("old") is None and s.lease("new") is not None  # the one expiring first went
    assert s.stats().kv_lease_expiries_total == 1
