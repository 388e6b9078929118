"""Model hyper-parameters read entirely from GGUF metadata.

Key names follow the GGUF specification (ggml's docs/gguf.md): ``general.architecture`` names
the architecture ``{arch}``, and ``{arch}.block_count``, ``{arch}.embedding_length``,
``{arch}.attention.head_count`` ... hold the numbers. Nothing here knows about a particular
model: every llama-architecture GGUF yields its own :class:`ModelConfig`.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# Architectures whose forward pass is exactly Llama's (RMSNorm, rotate-half RoPE, GQA, SwiGLU).
SUPPORTED_ARCHITECTURES = ("llama",)


class UnsupportedModelError(ValueError):
    """The GGUF file describes a model this loader cannot run (named field and value)."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-architecture model.

    num_layers: transformer blocks (L). hidden_size: model width. num_heads / num_kv_heads:
    query and key/value heads (GQA when they differ). head_dim: per-head width (d_head).
    intermediate_size: SwiGLU hidden width. vocab_size: rows of the embedding.
    max_position_embeddings: the trained context length in tokens. rope_theta: RoPE base.
    rope_dim: rotated dimensions per head (== head_dim for Llama). rms_norm_eps: RMSNorm epsilon.
    tie_word_embeddings: the LM head reuses ``token_embd.weight`` (no ``output.weight`` tensor).
    rope_scaling_type / rope_scaling_factor: ``{arch}.rope.scaling.*`` (only "none" and
    "linear" are implemented). bos/eos/pad_token_id: from ``tokenizer.ggml.*`` (None if absent).
    """

    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_scaling_type: str = "none"
    rope_scaling_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tensor_names: Collection[str] = (),
                           tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelConfig:
        """Build a config from GGUF key/value metadata (values already decoded to Python).

        meta: ``{key: value}`` as in the GGUF file. tensor_names: names of the file's tensors
        (decides tied embeddings). tensor_shapes: numpy-order shapes, used only for the vocab
        size when neither ``{arch}.vocab_size`` nor ``tokenizer.ggml.tokens`` is present.
        Raises UnsupportedModelError naming the key when a required key is missing or a value is
        out of range, and for architectures other than Llama.
        """
        arch = meta.get("general.architecture")
        if arch is None:
            raise UnsupportedModelError("GGUF metadata has no 'general.architecture'")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"general.architecture={arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")

        def req(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise UnsupportedModelError(f"GGUF metadata is missing required key {full!r}")
            return meta[full]

        num_layers = int(req("block_count"))
        hidden = int(req("embedding_length"))
        n_heads = int(req("attention.head_count"))
        n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
        if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
            raise UnsupportedModelError(
                f"attention.head_count={n_heads} must be a positive multiple of head_count_kv={n_kv}")
        if f"{arch}.attention.key_length" in meta:
            head_dim = int(meta[f"{arch}.attention.key_length"])
        else:
            if hidden % n_heads:
                raise UnsupportedModelError(
                    f"embedding_length={hidden} is not divisible by attention.head_count={n_heads}")
            head_dim = hidden // n_heads
        value_len = int(meta.get(f"{arch}.attention.value_length", head_dim))
        if value_len != head_dim:
            raise UnsupportedModelError(
                f"attention.value_length={value_len} != key_length={head_dim} is not supported")
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedModelError(f"partial RoPE (rope.dimension_count={rope_dim} < "
                                        f"head_dim={head_dim}) is not supported")
        scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"rope.scaling.type={scaling!r} is not supported (none, linear)")

        if f"{arch}.vocab_size" in meta:
            vocab = int(meta[f"{arch}.vocab_size"])
        elif "tokenizer.ggml.tokens" in meta:
            vocab = len(meta["tokenizer.ggml.tokens"])
        elif tensor_shapes and "token_embd.weight" in tensor_shapes:
            vocab = int(tensor_shapes["token_embd.weight"][0])
        else:
            raise UnsupportedModelError("cannot determine the vocabulary size from the GGUF file")

        def opt_int(key: str) -> int | None:
            return int(meta[key]) if key in meta else None

        names = set(tensor_names)
        return cls(
            architecture=str(arch),
            name=str(meta.get("general.name", arch)),
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(req("feed_forward_length")),
            vocab_size=vocab,
            max_position_embeddings=int(req("context_length")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=rope_dim,
            rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings=bool(names) and "output.weight" not in names,
            rope_scaling_type=scaling,
            rope_scaling_factor=factor,
            bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
            pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
        )
