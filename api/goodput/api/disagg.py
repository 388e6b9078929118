"""Disaggregated prefill and decode: the contract between a router, a prefill worker and a decode
worker (standard library + pydantic, no I/O). The design and its rules: ``docs/disaggregation.md``.

The flow (DistServe, Zhong et al., OSDI 2024; the llm-d / Dynamo split):

1. the router sends the OpenAI request to a prefill-capable worker with the header
   :data:`REMOTE_PREFILL_HEADER` (``1``); that worker computes the prompt's KV and the first token,
   keeps the prompt's KV blocks under a lease (``--kv-lease-seconds``) and answers a
   :class:`PrefillResult` (JSON) carrying the transfer handle;
2. the router sends the same request to a decode worker with :data:`KV_HANDLE_HEADER` (the handle)
   and :data:`KV_SOURCE_HEADER` (the prefill worker's base URL, ``http://10.0.0.5:8000``); the
   decode worker pulls ``GET {source}/kv/leases/{handle}?from_block=k`` (``k``: the prompt's blocks it
   already holds in its own prefix cache), writes the KV into its paged cache and decodes;
3. the stream (:func:`encode_stream_header`, :func:`encode_frame`, :class:`KvStreamDecoder`) is
   binary and block-granular: ``MAGIC``, a 4-byte little-endian length, the :class:`KvStreamHeader`
   as JSON (metadata only: model revision, dtype, block size, layout, dimensions, token count),
   then one frame per block: block index (u32 LE), tokens in the block (u32 LE), then the block's
   raw K/V bytes in :data:`KV_LAYOUT` order (``[layer][k|v][token][kv head][dim]``, the dtype's
   native little-endian bytes). A block of ``t`` tokens carries ``2·L·n_kv·d_head·b·t`` bytes, so
   the payload of ``T`` tokens is ``2·L·n_kv·d_head·b·T`` bytes (:func:`kv_payload_bytes`). No
   pickling, no JSON of tensors.

A sent stream frees the lease; ``DELETE /kv/leases/{handle}`` frees it at once (client cancel); a lease
nobody pulls expires. A decode worker that cannot use the stream (another model revision, dtype,
block size or layout; a dead or stalled prefill worker; a short stream) prefills locally.
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from goodput.api.states import WorkerRole

# Worker roles (``goodput-worker serve --role``): both = today's colocated serving (and either
# side of a transfer), prefill = computes prompts for others (and serves plain requests), decode =
# decodes imported KV (and serves plain requests, prefilling locally).
ROLES = tuple(r.value for r in WorkerRole)
PREFILL_ROLES = (WorkerRole.BOTH.value, WorkerRole.PREFILL.value)
DECODE_ROLES = (WorkerRole.BOTH.value, WorkerRole.DECODE.value)

# Headers the router sets (lower case, as HTTP/2 and ASGI spell them).
REMOTE_PREFILL_HEADER = "x-goodput-remote-prefill"
KV_HANDLE_HEADER = "x-goodput-kv-handle"
KV_SOURCE_HEADER = "x-goodput-kv-source"
# The worker's KV endpoint: GET streams a leased prompt's KV (``?from_block=k``), DELETE frees it.
KV_PATH = "/kv/leases/{handle}"
KV_MEDIA_TYPE = "application/x-goodput-kv"

MAGIC = b"GPKV"
STREAM_VERSION = 1
KV_LAYOUT = "layer,kv,token,head,dim"  # per block; blocks in order, tokens 0..t-1 of each
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LEN = struct.Struct("<I")
_FRAME = struct.Struct("<II")
MAX_HEADER_BYTES = 64 << 10


class KvStreamError(ValueError):
    """A KV stream or its header is malformed or does not fit this worker (the message says which
    field and both values)."""


class KvLayout(BaseModel):
    """What a KV block's bytes mean: equal on both sides or the transfer is refused.

    revision: the model revision (``--revision``, default a hash of the GGUF).
    dtype: the KV cache's dtype (``float32``, ``bfloat16``). block_size: tokens per block.
    layout: the byte order of one block (:data:`KV_LAYOUT`).
    num_layers, num_kv_heads, head_dim: the model's L, n_kv and d_head.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    revision: str = Field(min_length=1, max_length=256)
    dtype: Literal["float32", "bfloat16", "float16"]
    block_size: int = Field(ge=1, le=256)
    layout: str = Field(max_length=64)
    num_layers: int = Field(ge=1, le=4096)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=65536)

    @property
    def bytes_per_token(self) -> int:
        """``2·L·n_kv·d_head·b`` bytes (keys and values of one token over every layer)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


class PrefillResult(BaseModel):
    """A prefill worker's answer to a request with :data:`REMOTE_PREFILL_HEADER` (JSON, HTTP 200).

    handle: the transfer handle (opaque; pass it in :data:`KV_HANDLE_HEADER`).
    prompt_tokens: the prompt's length in tokens (its KV is leased). first_token_id: the token
        sampled from the prompt's last position (the decode worker emits it as output token 0).
    expires_in_s: seconds until the lease expires unless pulled or deleted.
    kv: the leased KV's :class:`KvLayout`; kv_bytes: its payload in bytes (all blocks).
    """

    object: Literal["kv.prefill"] = "kv.prefill"
    handle: str
    prompt_tokens: int
    first_token_id: int
    expires_in_s: float
    kv: KvLayout
    kv_bytes: int


class KvStreamHeader(BaseModel):
    """The stream's header (JSON after ``MAGIC`` and its length).

    version: :data:`STREAM_VERSION`. handle: the lease. kv: the :class:`KvLayout`.
    num_tokens: the prompt's length (tokens whose KV the lease holds).
    first_block, num_blocks: the frames that follow cover blocks ``first_block ..
        first_block + num_blocks - 1`` of the prompt (``ceil(num_tokens / block_size)`` blocks).
    first_token_id: the token sampled after the prompt.
    tokens_digest: :func:`tokens_digest` of the prompt, so a decode worker that tokenized the
        request differently refuses the KV instead of decoding from another text.
    """

    model_config = ConfigDict(extra="forbid")

    version: int
    handle: str = Field(max_length=256)
    kv: KvLayout
    num_tokens: int = Field(ge=1)
    first_block: int = Field(ge=0)
    num_blocks: int = Field(ge=0)
    first_token_id: int = Field(ge=0)
    tokens_digest: str = Field(max_length=128)


def tokens_digest(token_ids: Sequence[int]) -> str:
    """blake2b-128 (hex) of the token ids as little-endian int64: the prompt's identity."""
    a = array("q", token_ids)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()


def kv_payload_bytes(kv: KvLayout, num_tokens: int) -> int:
    """Bytes of K/V for ``num_tokens`` tokens: ``2·L·n_kv·d_head·b·T`` (frame headers excluded)."""
    return kv.bytes_per_token * num_tokens


def block_tokens(num_tokens: int, block_size: int, block: int) -> int:
    """Tokens held by block ``block`` of a ``num_tokens``-token prompt (``block_size``, or the
    remainder for the last block); ValueError for a block past the prompt."""
    nblocks = -(-num_tokens // block_size)
    if not 0 <= block < nblocks:
        raise ValueError(f"block {block} outside the prompt's {nblocks} blocks")
    return min(block_size, num_tokens - block * block_size)


def incompatibility(local: KvLayout, remote: KvLayout) -> str | None:
    """Why ``remote``'s KV cannot be written into ``local``'s cache (the first field that
    differs, with both values), or None when they match."""
    for name in ("revision", "dtype", "block_size", "layout", "num_layers", "num_kv_heads", "head_dim"):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            return f"KV {name} differs: this worker has {a!r}, the prefill worker {b!r}"
    return None


def encode_stream_header(h: KvStreamHeader) -> bytes:
    """``MAGIC`` + u32 LE length + the header as JSON (UTF-8)."""
    raw = h.model_dump_json().encode()
    return MAGIC + _LEN.pack(len(raw)) + raw


def encode_frame(block: int, num_tokens: int) -> bytes:
    """A frame's 8-byte prefix (block index, tokens in it); its payload follows."""
    return _FRAME.pack(block, num_tokens)


class KvStreamDecoder:
    """Incremental parser of a KV stream: :meth:`feed` bytes as they arrive, read ``header`` and
    the completed ``blocks`` (payload bytes per block, in order from ``header.first_block``).

    Raises :class:`KvStreamError` for a bad magic, an oversized or invalid header, a frame out of
    order, a token count that does not match the block, or bytes after the last frame. ``done``:
    every frame the header announced has arrived.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self.header: KvStreamHeader | None = None
        self.blocks: list[bytes] = []
        self.payload_bytes = 0
        self._frame: tuple[int, int] | None = None  # (block, payload bytes) being read

    @property
    def done(self) -> bool:
        return self.header is not None and len(self.blocks) == self.header.num_blocks

    def feed(self, data: bytes) -> None:
        self._buf += data
        while self._step():
            pass

    def _step(self) -> bool:
        buf = self._buf
        if self.header is None:
            if len(buf) < len(MAGIC) + _LEN.size:
                return False
            if bytes(buf[:len(MAGIC)]) != MAGIC:
                raise KvStreamError("not a KV stream (bad magic)")
            (n,) = _LEN.unpack_from(buf, len(MAGIC))
            if n > MAX_HEADER_BYTES:
                raise KvStreamError(f"KV stream header of {n} bytes (at most {MAX_HEADER_BYTES})")
            start = len(MAGIC) + _LEN.size
            if len(buf) < start + n:
                return False
            try:
                h = KvStreamHeader.model_validate(json.loads(bytes(buf[start:start + n])))
            except (ValueError, ValidationError) as e:
                raise KvStreamError(f"bad KV stream header: {e}") from None
            if h.version != STREAM_VERSION:
                raise KvStreamError(f"KV stream version {h.version}, this worker reads {STREAM_VERSION}")
            total = -(-h.num_tokens // h.kv.block_size)
            if h.first_block + h.num_blocks != total:
                raise KvStreamError(f"KV stream covers blocks {h.first_block}..{h.first_block + h.num_blocks - 1} "
                                    f"of a {total}-block prompt")
            self.header = h
            del buf[:start + n]
            return True
        if self.done:
            if buf:
                raise KvStreamError(f"{len(buf)} bytes after the last KV frame")
            return False
        h = self.header
        if self._frame is None:
            if len(buf) < _FRAME.size:
                return False
            block, ntok = _FRAME.unpack_from(buf)
            want = h.first_block + len(self.blocks)
            if block != want:
                raise KvStreamError(f"KV frame for block {block}, expected block {want}")
            expected = block_tokens(h.num_tokens, h.kv.block_size, block)
            if ntok != expected:
                raise KvStreamError(f"KV frame of block {block} holds {ntok} tokens, expected {expected}")
            self._frame = (block, kv_payload_bytes(h.kv, ntok))
            del buf[:_FRAME.size]
            return True
        _, size = self._frame
        if len(buf) < size:
            return False
        with memoryview(buf) as mv:  # one copy out of the buffer
            self.blocks.append(bytes(mv[:size]))
        self.payload_bytes += size
        del buf[:size]
        self._frame = None
        return True


__all__ = ["DECODE_ROLES", "DTYPE_BYTES", "KV_HANDLE_HEADER", "KV_LAYOUT", "KV_MEDIA_TYPE", "KV_PATH",
           "KV_SOURCE_HEADER", "KvLayout", "KvStreamDecoder", "KvStreamError", "KvStreamHeader", "MAGIC",
           "PREFILL_ROLES", "PrefillResult", "REMOTE_PREFILL_HEADER", "ROLES", "STREAM_VERSION", "block_tokens",
           "encode_frame", "encode_stream_header", "incompatibility", "kv_payload_bytes", "tokens_digest"]
