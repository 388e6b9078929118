"""Model runner: turns a SchedulerOutput into one flat forward pass and sampled tokens.

A step's chunks (decodes first, then prefill chunks; see ``engine/outputs.py``) are laid out
back to back: ``input_ids`` and ``positions`` [T], the flat KV ``slot_mapping`` [T]
(``block_table[p // block_size] * block_size + p % block_size``), and per sequence
``query_start_loc`` [B+1], ``seq_lens``, ``context_lens`` and a padded ``block_tables`` [B, nb]
(the varlen layout of vLLM / flash-attn). Logits are computed only for chunks with
``sample=True`` (the last row of each) and for the rows of requests that asked for prompt
log-probabilities; the sampler then draws one token per sampled chunk (a JSON-schema grammar,
if any, masks the logits first: ``structured.py``).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
from goodput.worker.engine.outputs import RunnerOutput, ScheduledChunk, SchedulerOutput, TokenLogprobs
from goodput.worker.engine.speculative import accept_greedy
from goodput.worker.model import block_linear
from goodput.worker.model.attention.base import AttentionBackend, AttentionMetadata
from goodput.worker.model.gguf_loader import load_blocks, load_gguf, load_q4_blocks, parse_dtype
from goodput.worker.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_token, num_blocks_for_budget
from goodput.worker.model.llama import LlamaModel
from goodput.worker.model.quant import check_supported
from goodput.worker.model.sampler import Row, Sampler, greedy_tokens, prompt_logprobs
from goodput.worker.model.structured import StructuredOutputs
from goodput.worker.model.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> cuda when available else cpu; ValueError for an unavailable device."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def make_attention_backend(name: str | AttentionBackend, device: torch.device) -> AttentionBackend:
    """An AttentionBackend from a name ("auto" | "torch" | "cpu" | "triton", see ``attention.selector``)
    or an instance (returned as is)."""
    if not isinstance(name, str):
        return name
    from goodput.worker.model.attention.selector import select_backend

    return select_backend(name, device)


class ModelRunner:
    """Loads a GGUF model, allocates the paged KV cache and executes scheduler steps.

    model: bundled name (e.g. "smollm2") or path to a llama-architecture ``.gguf``.
    dtype: "float32" | "bfloat16" (| "float16"); weights, activations and KV cache.
    device: "cpu" | "cuda" | "auto". kv_cache_memory_bytes: KV budget; the pool gets
    ``floor(budget / (bytes_per_token · block_size))`` blocks (``num_blocks`` overrides it).
    attention_backend: "auto" | "torch" | "cpu" | "triton" or an AttentionBackend instance.
    weight_cache_dir: see ``gguf_loader.load_gguf`` (None = default, False = off).
    seed: seed of the generator used by requests without their own seed.
    logprobs_mode: "processed" (the distribution sampled from) or "raw"; see ``sampler.py``.
    quantization: "none" | "int8" | "int4" weight-only linears (``quant.py``; CPU only, ValueError
    on another device).
    num_threads: torch intra-op CPU threads for this process (None = torch's default, one per
    core). On a CPU shared with other busy processes, fewer threads (or OMP_WAIT_POLICY=PASSIVE
    set before torch is imported) avoid OpenMP spin-waiting that can slow steps down ~10x.

    Attributes: model_config, tokenizer, revision, block_size, num_blocks,
    kv_bytes_per_token, kv_cache_bytes, max_model_len (the model's context length),
    load_seconds.
    """

    def __init__(self, model: str = "smollm2", dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", kv_cache_memory_bytes: int = 256 << 20,
                 block_size: int = 16, attention_backend: str | AttentionBackend = "auto",
                 num_blocks: int | None = None, weight_cache_dir: Any = None,
                 seed: int | None = None, num_threads: int | None = None,
                 logprobs_mode: str = "processed", quantization: str = "none"):
        t0 = time.perf_counter()
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        self.dtype = parse_dtype(dtype)
        self.device = resolve_device(device)
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        check_supported(quantization, self.dtype, self.device)  # before seconds of loading
        loaded = load_gguf(model, self.dtype, cache_dir=weight_cache_dir)
        self.model_path = loaded.path
        self.revision = loaded.revision
        self.model_config = loaded.config
        self.tokenizer = GGUFTokenizer(loaded.metadata)
        blocks = load_q4_blocks(loaded, weight_cache_dir) if quantization == "int4" else None
        block_kernels, why = block_linear.choose(self.device, self.dtype, quantization)
        all_blocks = load_blocks(loaded, weight_cache_dir) if block_kernels is not None else None
        self.model = LlamaModel(loaded.config, loaded.tensors, self.dtype, self.device,
                                quantization=quantization, q4_blocks=blocks, blocks=all_blocks,
                                block_kernels=block_kernels)
        if self.model.small_batch_bytes:
            log.info("linears: calls of <= %d rows (4-bit) / %d (8-bit LM head; both measured here at load) read "
                     "the file's own blocks "
                     "(C++ block kernel; %s: fewer bytes per decode step of few sequences), larger "
                     "batches the %s weights (oneDNN, faster there); the blocks add %.1f MB resident",
                     self.model.small_rows.get(0, 0), self.model.small_rows.get(1, 0), why,
                     str(self.dtype).removeprefix("torch."), self.model.small_batch_bytes / 1e6)
        else:
            log.info("linears: %s weights at every batch size (block kernel off: %s)",
                     "quantized" if quantization != "none" else str(self.dtype).removeprefix("torch."),
                     why if block_kernels is None else "the file has no Q4_0/Q4_1/Q8_0 linears")
        rows = max((r for r in range(1, block_linear.MAX_ROWS[0] + 1) if self.model.native_eligible(r)), default=0)
        if rows:
            log.info("decode steps of <= %d rows (decode rows only, cpu attention backend) run the whole layer "
                     "stack as one native call (csrc/decode_step.cpp)", rows)
        del blocks, all_blocks
        del loaded
        c = self.model_config
        self.block_size = block_size
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_token = kv_cache_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim,
                                                           dtype_bytes)
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(kv_cache_memory_bytes, c.num_layers, c.num_kv_heads,
                                               c.head_dim, dtype_bytes, block_size)
        elif num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.kv_cache_bytes = self.num_blocks * block_size * self.kv_bytes_per_token
        self.kv_caches = allocate_kv_caches(c.num_layers, self.num_blocks, block_size, c.num_kv_heads,
                                            c.head_dim, self.dtype, self.device)
        self.attention_backend = make_attention_backend(attention_backend, self.device)
        self.max_model_len = c.max_position_embeddings
        self.sampler = Sampler(seed=seed, device=self.device, logprobs_mode=logprobs_mode)
        self.structured = StructuredOutputs(self.tokenizer.backend.to_str(), c.vocab_size,
                                            self.tokenizer.eos_token_id)
        self.load_seconds = time.perf_counter() - t0
        log.info("loaded %s (%s, rev %s) in %.1fs: %d KV blocks x %d tokens = %d tokens, %d B/token",
                 c.name, self.dtype, self.revision[:12], self.load_seconds, self.num_blocks, block_size,
                 self.num_blocks * block_size, self.kv_bytes_per_token)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # -- disaggregated prefill: a block's K/V as raw bytes (goodput.api.disagg.KV_LAYOUT) ------
    def _kv_pool(self) -> torch.Tensor | None:
        """The one ``[L, 2, num_blocks, block_size, n_kv, d_head]`` tensor the per-layer caches
        view (``kv_cache.allocate_kv_caches``), or None when the caches are separate tensors."""
        base = self.kv_caches[0][0]._base
        c = self.model_config
        want = (c.num_layers, 2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        return base if base is not None and tuple(base.shape) == want else None

    def export_kv_blocks(self, block_ids: list[int], num_tokens: list[int]) -> list[bytes]:
        """For each physical block, its first ``num_tokens[i]`` slots as the bytes of a
        ``[L, 2 (k, v), tokens, n_kv, d_head]`` tensor in the cache's dtype (native
        little-endian): ``2·L·n_kv·d_head·b·tokens`` bytes each. One gather for all of them.
        ValueError for a bad id or count."""
        for bid, n in zip(block_ids, num_tokens, strict=True):
            if not 0 <= bid < self.num_blocks or not 0 < n <= self.block_size:
                raise ValueError(f"block {bid} / {n} tokens outside the pool "
                                 f"({self.num_blocks} blocks of {self.block_size})")
        if not block_ids:
            return []
        pool = self._kv_pool()
        if pool is None:
            ts = [torch.stack([torch.stack((k[b], v[b])) for k, v in self.kv_caches]) for b in block_ids]
            blocks = torch.stack(ts)
        else:
            idx = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
            blocks = pool.index_select(2, idx).permute(2, 0, 1, 3, 4, 5)  # [nb, L, 2, bs, H, D]
        blocks = blocks.cpu()
        out = []
        for i, n in enumerate(num_tokens):
            t = blocks[i, :, :, :n].contiguous()
            out.append(t.view(torch.uint8).numpy().tobytes())
        return out

    def export_kv_block(self, block_id: int, num_tokens: int) -> bytes:
        """:meth:`export_kv_blocks` of one block."""
        return self.export_kv_blocks([block_id], [num_tokens])[0]

    def import_kv(self, imports) -> None:
        """Write imported prompts' blocks (``engine.outputs.KvImportChunk``: payloads of
        :meth:`export_kv_blocks`'s format) into the paged cache. ValueError, before anything is
        written, for a payload whose size is not ``2·L·n_kv·d_head·b·tokens``."""
        c = self.model_config
        L, H, D, bs = c.num_layers, c.num_kv_heads, c.head_dim, self.block_size
        per_token = self.kv_bytes_per_token
        plan = []
        for imp in imports:
            for i, (bid, payload) in enumerate(zip(imp.block_ids, imp.payloads)):
                ntok = min(bs, imp.num_tokens - (imp.first_block + i) * bs)
                if len(payload) != ntok * per_token or not 0 <= bid < self.num_blocks:
                    raise ValueError(f"request {imp.request_id!r}: block {imp.first_block + i} payload of "
                                     f"{len(payload)} bytes, expected {ntok * per_token} ({ntok} tokens)")
                plan.append((bid, ntok, payload))
        pool = self._kv_pool()
        for bid, ntok, payload in plan:
            t = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).view(L, 2, ntok, H, D)
            t = t.to(self.device)
            if pool is not None:
                pool[:, :, bid, :ntok].copy_(t)
                continue
            for layer, (k, v) in enumerate(self.kv_caches):
                k[bid, :ntok].copy_(t[layer, 0])
                v[bid, :ntok].copy_(t[layer, 1])

    def _build_inputs(self, sched_out: SchedulerOutput):
        bs, V, max_len = self.block_size, self.model_config.vocab_size, self.max_model_len
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        ctx_lens: list[int] = []
        tables: list[tuple[int, ...]] = []
        logits_rows: list[int] = []
        sample_idx: list[int] = []
        plp: list[tuple[int, int, int]] = []  # (chunk index, first logits row, rows)
        spec: list[tuple[int, int]] = []  # (chunk index, first input row of its draft's targets)
        chunk_rows: list[int] = []  # each chunk's first input row
        seen: set[str] = set()
        for ci, ch in enumerate(sched_out.chunks):
            if ch.request_id in seen:
                raise ValueError(f"request {ch.request_id!r} appears twice in one step")
            seen.add(ch.request_id)
            n, start = len(ch.token_ids), ch.start_pos
            if n == 0:
                raise ValueError(f"request {ch.request_id!r}: empty chunk")
            end = start + n
            if start < 0 or end > max_len:
                raise ValueError(f"request {ch.request_id!r}: positions [{start}, {end}) outside the "
                                 f"model's context length {max_len}")
            bt = ch.block_table
            if len(bt) * bs < end:
                raise ValueError(f"request {ch.request_id!r}: block table of {len(bt)} blocks covers "
                                 f"{len(bt) * bs} positions, needs {end}")
            if min(bt) < 0 or max(bt) >= self.num_blocks:
                raise ValueError(f"request {ch.request_id!r}: block id outside [0, {self.num_blocks})")
            if min(ch.token_ids) < 0 or max(ch.token_ids) >= V:
                raise ValueError(f"request {ch.request_id!r}: token id outside the vocabulary [0, {V})")
            input_ids.extend(ch.token_ids)
            positions.extend(range(start, end))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            first_row = qsl[-1]
            chunk_rows.append(first_row)
            # A drafted decode is one decode row per position (context start + i + 1 each): the
            # decode kernel then computes every position as a plain decode step would.
            for s0, s1 in ([(p, p + 1) for p in range(start, end)] if ch.draft_token_ids else [(start, end)]):
                qsl.append(qsl[-1] + s1 - s0)
                seq_lens.append(s1)
                ctx_lens.append(s0)
                tables.append(bt)
            if ch.sample:
                logits_rows.append(qsl[-1] - 1)
                sample_idx.append(ci)
                if ch.draft_token_ids:  # rows predicting each draft token: the chunk's first ones
                    spec.append((ci, first_row))
            if ch.sampling_params.prompt_logprobs is not None:
                # row p predicts prompt token p + 1: rows up to the prompt's second-last position
                m = min(end, len(ch.prompt_token_ids) - 1) - start
                if m > 0:
                    plp.append((ci, first_row, m))
        plp_rows = [r for _, first, m in plp for r in range(first, first + m)]
        spec_rows = [r for ci, first in spec
                     for r in range(first, first + len(sched_out.chunks[ci].draft_token_ids))]
        nb = max(len(t) for t in tables)
        dev = self.device
        i32, i64 = torch.int32, torch.int64
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=i32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=i32, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=i32, device=dev),
            block_tables=torch.tensor([list(t) + [0] * (nb - len(t)) for t in tables], dtype=i32,
                                      device=dev),
            slot_mapping=torch.tensor(slots, dtype=i64, device=dev),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_list=qsl,
            draft_rows=sum(len(sched_out.chunks[ci].draft_token_ids) for ci, _ in spec),
            seq_lens_list=seq_lens,
        )
        return (torch.tensor(input_ids, dtype=i64, device=dev), torch.tensor(positions, dtype=i64, device=dev),
                meta, torch.tensor(logits_rows + plp_rows + spec_rows, dtype=i64, device=dev), sample_idx, plp,
                spec, chunk_rows + [qsl[-1]])

    def forward_logits(self, sched_out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run one step (KV written as by :meth:`execute`) and return float32 logits
        [num_tokens, vocab] for every row of every chunk, keyed by request id; nothing is sampled.
        For tests and prompt log-probabilities."""
        if sched_out.is_empty:
            return {}
        input_ids, positions, meta, *_, rows = self._build_inputs(sched_out)
        logits = self.model.forward(input_ids, positions, meta, self.kv_caches, self.attention_backend)
        return {c.request_id: logits[rows[i]:rows[i + 1]] for i, c in enumerate(sched_out.chunks)}

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        """Run one step: write every chunk's KV, sample one token per ``sample=True`` chunk.

        Raises ValueError (naming the request) for a malformed chunk: empty, positions past the
        context length, a block table too short or with ids outside the pool, token ids outside
        the vocabulary, or a request twice in one step. Nothing is written in that case.
        """
        self.structured.drop(sched_out.finished_ids)
        if sched_out.is_empty:
            return RunnerOutput()
        input_ids, positions, meta, logits_rows, sample_idx, plp, spec, _ = self._build_inputs(sched_out)
        logits = self.model.forward(input_ids, positions, meta, self.kv_caches, self.attention_backend,
                                    logits_rows, float_logits=False)
        out = RunnerOutput()
        n_sampled = len(sample_idx)
        for ci, first, m in plp:
            ch = sched_out.chunks[ci]
            row0 = n_sampled + sum(mm for cj, _, mm in plp if cj < ci)
            targets = ch.prompt_token_ids[ch.start_pos + 1:ch.start_pos + 1 + m]
            out.prompt_logprobs[ch.request_id] = (ch.start_pos + 1, prompt_logprobs(
                logits[row0:row0 + m].float(), targets, ch.sampling_params.prompt_logprobs or 0))
        if not sample_idx:
            return out
        # drafted chunks' last rows are sampled with their drafts (_verify_drafts), not here
        plain = [j for j, ci in enumerate(sample_idx) if not sched_out.chunks[ci].draft_token_ids]
        if plain:
            chunks = [sched_out.chunks[sample_idx[j]] for j in plain]
            rows = logits[:n_sampled] if len(plain) == n_sampled else logits[plain]
            out.sampled_token_ids, out.logprobs = self._sample(rows, chunks)
        if spec:
            self._verify_drafts(logits[n_sampled + sum(m for _, _, m in plp):], logits[:n_sampled], sample_idx,
                                sched_out, spec, out)
        return out

    def _verify_drafts(self, draft_logits: torch.Tensor, sample_logits: torch.Tensor, sample_idx: list[int],
                       sched_out: SchedulerOutput, spec: list[tuple[int, int]], out: RunnerOutput) -> None:
        """Verify each drafted chunk: the target's token at every position — ``draft_logits``
        holds one row per draft token, chunk after chunk; each chunk's last position is its row of
        ``sample_logits`` — then ``speculative.accept_greedy``. Each position is sampled as plain
        decoding would sample that output index (greedy: the argmax; random: the request's own
        noise for that index), so a draft token is accepted with probability p(token) and a
        rejected one is replaced by a draw from p without it: Leviathan et al.'s rule for a
        one-token (deterministic) draft, and for a seeded request the very tokens plain decoding
        draws from the same logits."""
        pos_logits, rows = [], []
        sample_row = {ci: j for j, ci in enumerate(sample_idx)}
        i = 0
        for ci, _ in spec:
            ch = sched_out.chunks[ci]
            k = len(ch.draft_token_ids)
            pos_logits += [draft_logits[i:i + k], sample_logits[sample_row[ci]][None]]
            rows += [Row(ch.sampling_params, ch.num_output_tokens + j, ch.stop_token_ids) for j in range(k + 1)]
            i += k
        logits = torch.cat(pos_logits)
        if self.sampler.all_plain_greedy(rows, logits.shape[-1]):
            targets = self._greedy(logits)
        else:
            targets = self.sampler.sample(logits.float(), self.sampler.prepare(rows, logits.shape[-1])).token_ids
        i = 0
        for ci, _ in spec:
            ch = sched_out.chunks[ci]
            k = len(ch.draft_token_ids)
            toks = accept_greedy(ch.draft_token_ids, targets[i:i + k + 1])
            i += k + 1
            out.spec_token_ids[ch.request_id] = toks
            out.sampled_token_ids[ch.request_id] = toks[0]

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax (logits in the model's dtype): the C++ kernel straight over them where
        the CPU kernels are loaded (no float32 copy; torch.max's rule), else :func:`greedy_tokens`."""
        ops = self.model.fused_ops
        if ops is not None and logits.stride(1) == 1:  # fused_ops: the CPU kernels, loaded on CPU only
            return ops.argmax_rows(logits).tolist()
        return greedy_tokens(logits.float())

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]
                ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        allowed = self.structured.allowed_mask(chunks)
        if allowed is None and self.sampler.all_plain_greedy(chunks, logits.shape[-1]):
            return {c.request_id: t for c, t in zip(chunks, self._greedy(logits))}, {}
        batch = self.sampler.prepare(chunks, logits.shape[-1], allowed)
        res = self.sampler.sample(logits.float(), batch)
        if allowed is not None:
            self.structured.advance(chunks, res.token_ids)
        return ({c.request_id: t for c, t in zip(chunks, res.token_ids)},
                {c.request_id: lp for c, lp in zip(chunks, res.logprobs) if lp is not None})
