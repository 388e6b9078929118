"""Worker settings and engine configuration (torch-free): the one declaration of every setting.

Each setting is a dataclass field made by ``goodput.api.settings.setting`` (help text, bounds,
choices, where it lives in an ``InferenceService``: the machinery every deployable declares its
settings with). Everything else is derived from these fields, so a new setting is one new field here:

- ``goodput-worker serve``'s flags (``goodput.worker.cli.build_parser`` with
  ``goodput.api.settings.add_flags``; as vLLM builds its CLI from its config dataclasses), with
  ``--help`` text from the metadata;
- the operator's worker arguments (:func:`to_cli_args`) and the CRD's ``spec.engine`` schema
  (``goodput.api.crd.EngineSpec``, a pydantic model built from :func:`settings`);
- validation at construction (a bad value raises ``ValueError`` naming the field and the value).

Flag names follow vLLM's where they mean the same (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--max-model-len``, ``--block-size``), so operators can carry their intuition over.

:class:`SchedulerSettings` are the settings the scheduler reads; :class:`EngineArgs` (what a
worker is started with) and :class:`EngineConfig` (one loaded engine: KV pool size, EOS ids,
cache identity) both inherit them, so they are declared and mapped once.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from goodput.api.policy import SloClass, check_slo_classes, parse_slo_class
from goodput.api.settings import SettingField, check, flag_value, setting, settings, validate
from goodput.api.units import parse_bytes

SCHEDULING_POLICIES = ("continuous", "static")
SPECULATIVE_MODES = ("off", "on", "adaptive")
QUANTIZATIONS = ("none", "int8", "int4")


def in_flag_order(ss: list[SettingField]) -> list[SettingField]:
    """What to serve and where first (model, name, revision, host, port), then the rest in
    declaration order: the order of ``--help`` and of generated argument lists."""
    return sorted(ss, key=lambda s: not (s.meta.crd is None or s.meta.crd.startswith("model.")))


def to_cli_args(values: Mapping[str, Any]) -> list[str]:
    """``goodput-worker serve`` arguments for the given settings (name -> value), in declaration
    order: the inverse of the CLI parser. None means "unset" (the worker's default applies);
    a boolean is spelled ``--flag`` / ``--no-flag`` only when it differs from the default; a
    value with units is passed in its base unit (bytes). Raises ValueError for an unknown name
    or a value the setting refuses."""
    known = {s.name: s for s in in_flag_order(settings(EngineArgs))}
    unknown = set(values) - set(known)
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    out = []
    for name, s in known.items():
        value = values.get(name)
        if value is None:
            continue
        if s.meta.parse is not None and isinstance(value, str):
            value = s.meta.parse(value)
        check(s, value)
        if s.type is bool:
            if value != s.default:
                out.append(s.flag if value else "--no-" + s.flag[2:])
        elif s.type is list:   # a repeatable flag: once per item
            for item in value:
                out += [s.flag, str(item)]
        else:
            out += [s.flag, flag_value(s, value)]
    return out


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
    """The settings the scheduler reads (units: tokens, requests)."""

    block_size: int = setting(16, "tokens per KV block (PagedAttention; Kwon et al., SOSP 2023)",
                              ge=1, le=256, crd="engine")
    max_num_seqs: int = setting(
        64, "most requests in the running set (iteration-level batching, Orca OSDI 2022); also the "
            "initial runtime admission limit", ge=1, le=4096, crd="engine")
    max_num_batched_tokens: int = setting(
        512, "token budget of one step: decodes plus prefill chunks (chunked prefill, "
             "Sarathi-Serve OSDI 2024)", ge=1, le=1048576, crd="engine")
    max_waiting: int = setting(
        256, "waiting-queue limit (preempted requests included); beyond it requests get 429 with "
             "Retry-After; 0 refuses every new request (drain)", ge=0, le=1000000, crd="engine")
    max_waiting_tokens: int = setting(
        0, "prompt-token limit of the queue: a request is refused (429 with Retry-After) when the prompt "
           "tokens still to be prefilled ahead of it plus its own exceed it, so what is admitted can meet a "
           "TTFT of this over the prefill rate; 0 = no token bound (only max_waiting)",
        ge=0, le=1 << 30, crd="engine")
    enable_prefix_caching: bool = setting(
        True, "reuse KV blocks of identical prompt prefixes (same model revision and cache_salt)",
        crd="engine")
    scheduling_policy: str = setting(
        "continuous", "continuous admits whenever a slot and blocks are free; static admits a new "
                      "cohort only when the whole batch finished (a baseline)",
        choices=SCHEDULING_POLICIES, crd="engine")
    speculative_mode: str = setting(
        "off", "n-gram (prompt-lookup) speculative decoding: on drafts at every decode step, adaptive "
               "backs off a request whose drafts keep failing (a request's 'speculative' field overrides "
               "it; requests with penalties, a grammar or logprobs never draft); output is unchanged in "
               "float32 (sampled: the same distribution), in bfloat16 equal up to the rounding of a "
               "multi-row step (as batching)",
        choices=SPECULATIVE_MODES, crd="engine")
    num_speculative_tokens: int = setting(
        8, "most draft tokens one speculative step verifies (Leviathan et al., ICML 2023)",
        ge=1, le=16, crd="engine")
    prompt_lookup_max: int = setting(
        4, "longest n-gram matched against the request's own text to find a draft", ge=1, le=16,
        crd="engine")
    prompt_lookup_min: int = setting(
        2, "shortest n-gram matched (at most prompt_lookup_max)", ge=1, le=16, crd="engine")
    slo_class_aging_seconds: float = setting(
        2.0, "with SLO classes (--slo-class), waiting requests are admitted tightest TTFT first; a request "
             "of a looser class moves up one band for every this many seconds it has waited (band 0: "
             "first come first served with the rest), so every class makes progress",
        gt=0, le=3600, crd=None)
    speculative_max_running: int = setting(
        0, "draft only while at most this many requests run (0: at any batch size); a drafted step "
           "lengthens the step of every request in the batch (vLLM's disable_by_batch_size)",
        ge=0, le=4096, crd="engine")

    def check_prompt_lookup(self) -> None:
        """Raise ValueError unless ``prompt_lookup_min <= prompt_lookup_max``."""
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")


@dataclass(frozen=True, kw_only=True)
class EngineArgs(SchedulerSettings):
    """Everything a worker is started with (``goodput-worker serve``'s flags; units: bytes,
    tokens, milliseconds). Validated at construction."""

    model: str = setting("smollm2", "'smollm2' (bundled) or a path to a llama-architecture .gguf",
                         crd="model.name")
    served_model_name: str | None = setting(
        None, "name in /v1/models, requests and metrics (default: --model without .gguf)",
        crd="model.servedModelName")
    revision: str | None = setting(
        None, "model revision for the prefix-cache identity (default: a hash of the GGUF)",
        crd="model.revision")
    role: str = setting(
        "both", "disaggregated serving: both (prefill and decode here, the default), prefill (computes "
                "prompts' KV for decode pods to pull) or decode (pulls a prompt's KV from a prefill pod when "
                "the request names one, else prefills locally); the operator sets it per pool",
        choices=("both", "prefill", "decode"), crd=None)
    host: str = setting("127.0.0.1", "address to listen on", crd=None)
    port: int = setting(8000, "TCP port to listen on", ge=1, le=65535, crd=None)
    dtype: str = setting("bfloat16", "weights and KV cache dtype", choices=("float32", "bfloat16"),
                         crd="engine")
    device: str = setting("auto", "auto: CUDA when available, else CPU", choices=("auto", "cpu", "cuda"),
                          crd="engine")
    quantization: str = setting(
        "none", "weight-only quantized linears on torch's CPU kernels: int8 per output channel, "
                "int4 in groups of 32 (a Q4_0/Q4_1 GGUF's own blocks, repacked); none keeps --dtype "
                "weights. CPU only", choices=QUANTIZATIONS, crd="engine")
    kv_cache_memory: int = setting(
        1 << 30, "KV cache budget in bytes; units K/M/G (powers of 1000) or Ki/Mi/Gi, KiB/MiB/GiB "
                 "(powers of 1024), e.g. 512Mi", ge=1, parse=parse_bytes, crd="engine")
    max_model_len: int | None = setting(
        None, "longest prompt + output in tokens (default: the model's context length)",
        ge=1, le=1048576, crd="engine")
    attention_backend: str = setting(
        "auto", "auto: triton on CUDA; on CPU the C++ paged decode kernel (cpu, built on first use) "
        "when it builds, else the torch reference (torch)", choices=("auto", "torch", "cpu", "triton"),
        crd="engine")
    num_threads: int | None = setting(
        None, "torch CPU threads (default: torch's choice; 1 is best on an oversubscribed CPU)", ge=1,
        crd="engine")
    slo_ttft_ms: float | None = setting(None, "TTFT SLO for goodput_requests_slo_met_total (ms)",
                                        gt=0, crd="slo.ttftMs")
    slo_tpot_ms: float | None = setting(None, "TPOT SLO for goodput_requests_slo_met_total (ms)",
                                        gt=0, crd="slo.tpotMs")
    slo_classes: list[str] = setting(
        [], "an SLO class NAME:TTFT_MS:TPOT_MS (repeatable, e.g. batch:5000:200): requests naming it in the "
            "x-goodput-slo-class header are judged by its TTFT/TPOT for goodput_requests_slo_met_total and "
            "counted under slo_class=NAME; others by --slo-ttft-ms/--slo-tpot-ms as slo_class=default",
        crd="slo.classes", flag="--slo-class", metavar="NAME:TTFT_MS:TPOT_MS")
    vllm_metric_aliases: bool = setting(False, "also export vLLM's metric names (docs/metrics.md)",
                                        crd="engine")
    logprobs_mode: str = setting(
        "processed", "log-probabilities returned with logprobs: processed = of the distribution each "
                     "token was sampled from (after penalties, temperature, top-k/top-p); raw = the "
                     "model's log_softmax", choices=("processed", "raw"), crd=None)
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"), crd="engine")
    # Request limits the HTTP server enforces (400, or 413 for the body, naming the flag): one
    # request may not make the engine do unbounded work per token (stop strings are searched
    # after every token) nor make the server parse unbounded JSON.
    max_stop_strings: int = setting(32, "most stop strings in one request (400 beyond)", ge=1, le=1000000,
                                    crd="engine")
    max_stop_string_chars: int = setting(1024, "longest stop string, in characters (400 beyond)",
                                         ge=1, le=1000000, crd="engine")
    max_stop_token_ids: int = setting(128, "most stop_token_ids in one request (400 beyond)",
                                      ge=1, le=1000000, crd="engine")
    max_request_body_bytes: int = setting(
        8 << 20, "largest HTTP request body in bytes (413 beyond); units as --kv-cache-memory",
        ge=1, parse=parse_bytes, crd="engine")
    # Disaggregated prefill and decode (docs/disaggregation.md; --role above). Not in spec.engine:
    # worker-level transfer settings, their defaults hold for every pool.
    kv_lease_seconds: float = setting(
        30.0, "how long a remote prefill's prompt KV stays allocated for a decode worker to pull "
              "(freed at once when pulled or deleted)", gt=0, le=3600, crd=None)
    kv_transfer_timeout_seconds: float = setting(
        10.0, "longest KV pull from a prefill worker (connect + whole stream); past it, or on any "
              "transfer error, the prompt is prefilled locally", gt=0, le=600, crd=None)

    def __post_init__(self) -> None:
        validate(self)
        self.check_prompt_lookup()
        self.slo_class_list()   # raises ValueError naming --slo-class
        if self.quantization != "none" and self.device == "cuda":
            raise ValueError(f"quantization {self.quantization!r} runs on torch's CPU kernels only; "
                             "use device 'cpu', or quantization 'none' on CUDA")

    def slo_class_list(self) -> tuple[SloClass, ...]:
        """``--slo-class`` parsed (at most 8, names unique). Raises ValueError naming the flag."""
        try:
            classes = tuple(parse_slo_class(c) for c in self.slo_classes)
            check_slo_classes(classes)
        except ValueError as e:
            raise ValueError(f"--slo-class: {e}") from None
        return classes

    @property
    def model_name(self) -> str:
        """The served model name: ``served_model_name``, else the model's file name without .gguf."""
        if self.served_model_name:
            return self.served_model_name
        return self.model.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".gguf")

    def scheduler_settings(self) -> dict[str, Any]:
        """The :class:`SchedulerSettings` part, as keyword arguments for :class:`EngineConfig`."""
        return {s.name: getattr(self, s.name) for s in settings(SchedulerSettings)}


@dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulerSettings):
    """Configuration of one engine (scheduler + block manager), resolved once the model is loaded.

    The scheduler settings are inherited from :class:`SchedulerSettings`; ``max_num_seqs`` is
    also the initial runtime admission limit (``Scheduler.set_limits`` changes that).

    num_blocks: KV blocks in the pool (capacity in tokens = num_blocks * block_size). The model
        side derives it from a memory budget (m = 2·L·n_kv·d_head·bytes·T).
    max_model_len: longest sequence (prompt + generated tokens) a request may reach, in tokens.
    eos_token_ids: token ids that finish a request with reason "stop" (unless ``ignore_eos``).
    model_name, revision: the cache identity; blocks are only shared between requests whose
        identity (plus per-request ``cache_salt``) is equal, so a new model revision never reads
        an old revision's KV.
    vocab_size: when set, prompts with token ids outside ``[0, vocab_size)`` are rejected as
        ``invalid`` at admission (they would crash the embedding lookup).
    queue_full_retry_after_s: the ``retry_after`` (seconds) suggested with a ``queue_full``
        rejection (HTTP Retry-After).
    rejecting_window_s: how long after a ``queue_full`` rejection the engine reports the state
        "rejecting" (seconds).
    kv_lease_s: how long a remote prefill's prompt KV stays leased for a decode worker to pull
        (seconds; ``EngineArgs.kv_lease_seconds``).
    """

    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    model_name: str = ""
    revision: str = ""
    vocab_size: int | None = None
    queue_full_retry_after_s: float = 1.0
    rejecting_window_s: float = 5.0
    kv_lease_s: float = 30.0

    def __post_init__(self) -> None:
        validate(self)
        self.check_prompt_lookup()
        for name in ("num_blocks", "max_model_len") + (("vocab_size",) if self.vocab_size is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.eos_token_ids, int):
            object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
        eos = tuple(self.eos_token_ids)
        for t in eos:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"eos_token_ids must be non-negative integers, got {eos!r}")
        object.__setattr__(self, "eos_token_ids", eos)
        for name in ("queue_full_retry_after_s", "rejecting_window_s", "kv_lease_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def cache_identity(self) -> str:
        """Identity mixed into every prefix-cache block hash: ``"<model_name>@<revision>"``."""
        return f"{self.model_name}@{self.revision}"

    @property
    def kv_capacity_tokens(self) -> int:
        """KV capacity of the pool in tokens (num_blocks * block_size)."""
        return self.num_blocks * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV entries: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)
