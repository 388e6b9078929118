"""The model-loading factory :func:`build_engine` (:class:`EngineArgs`, declared with every other
setting in :mod:`goodput.worker.engine.config`, is re-exported here).

``build_engine`` loads the GGUF, sizes the paged KV pool from ``kv_cache_memory`` by
KV bytes = 2·L·n_kv·d_head·bytes·T, and wires scheduler, model runner, tokenizer and metrics into
an :class:`~goodput.worker.llm_engine.LLMEngine`.
"""
from __future__ import annotations

import logging

from goodput.worker.engine.config import EngineArgs, EngineConfig
from goodput.worker.engine.scheduler import Scheduler
from goodput.worker.llm_engine import LLMEngine
from goodput.worker.metrics import WorkerMetrics

__all__ = ["EngineArgs", "build_engine"]

log = logging.getLogger("goodput.worker.engine")


def build_engine(args: EngineArgs) -> LLMEngine:
    """Load the model (GGUF), size the KV pool from ``args.kv_cache_memory`` and wire the
    scheduler, runner, tokenizer and metrics together. Logs the KV capacity.

    Raises ValueError when ``max_model_len`` exceeds the model's context length, and whatever
    the loader raises for a missing or unsupported model."""
    from goodput.worker.model.runner import ModelRunner

    if args.num_threads is not None:
        import torch
        torch.set_num_threads(args.num_threads)
    runner = ModelRunner(args.model, dtype=args.dtype, device=args.device,
                         kv_cache_memory_bytes=args.kv_cache_memory, block_size=args.block_size,
                         attention_backend=args.attention_backend, logprobs_mode=args.logprobs_mode,
                         quantization=args.quantization)
    mc = runner.model_config
    tok = runner.tokenizer
    max_model_len = args.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context length "
                         f"{mc.max_position_embeddings} (GGUF context_length); positions past it "
                         "have no meaning for this model")
    revision = args.revision or runner.revision
    eos = {i for i in (getattr(tok, "eos_token_id", None), mc.eos_token_id) if i is not None}
    config = EngineConfig(
        **args.scheduler_settings(), num_blocks=runner.num_blocks, max_model_len=max_model_len,
        eos_token_ids=tuple(sorted(eos)), model_name=args.model_name, revision=revision,
        vocab_size=mc.vocab_size, kv_lease_s=args.kv_lease_seconds)
    per_token = runner.kv_bytes_per_token
    dtype_bytes = per_token // (2 * mc.num_layers * mc.num_kv_heads * mc.head_dim)
    log.info("KV cache: %d blocks x %d tokens = %d tokens of capacity; %d bytes/token "
             "(2 * L=%d * n_kv=%d * d_head=%d * %d bytes); budget %d bytes; max_model_len %d",
             config.num_blocks, config.block_size, config.kv_capacity_tokens, per_token,
             mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype_bytes, args.kv_cache_memory,
             max_model_len)
    if config.kv_capacity_tokens < max_model_len:
        log.warning("the KV pool holds %d tokens, fewer than max_model_len %d: longer requests are "
                    "refused with 400, and chat requests without max_tokens get at most what the "
                    "pool holds", config.kv_capacity_tokens, max_model_len)
    engine = LLMEngine(config, Scheduler(config), runner, tok, model_name=args.model_name)
    engine.metrics = WorkerMetrics(
        args.model_name, engine.stats,
        slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000.0,
        slo_tpot_s=None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000.0,
        vllm_aliases=args.vllm_metric_aliases, max_model_len=max_model_len,
        slo_classes=args.slo_class_list())
    engine.kv_bytes_per_token = per_token
    return engine
