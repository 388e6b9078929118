"""The KV stream of disaggregated prefill (goodput.api.disagg): sizes by the formula, a round trip
fed in any chunking, and every malformed stream refused with a message naming what is wrong."""
from __future__ import annotations

import pytest

from goodput.api.disagg import (
    KV_LAYOUT,
    MAGIC,
    STREAM_VERSION,
    KvLayout,
    KvStreamDecoder,
    KvStreamError,
    KvStreamHeader,
    block_tokens,
    encode_frame,
    encode_stream_header,
    incompatibility,
    kv_payload_bytes,
    tokens_digest,
)

# SmolLM2-135M: L=30, n_kv=3, d_head=64.
SMOL = KvLayout(revision="r1", dtype="bfloat16", block_size=16, layout=KV_LAYOUT, num_layers=30,
                num_kv_heads=3, head_dim=64)
TINY = KvLayout(revision="r1", dtype="float32", block_size=4, layout=KV_LAYOUT, num_layers=2,
                num_kv_heads=1, head_dim=2)  # 2*2*1*2*4 = 32 bytes per token


@pytest.mark.parametrize("kv, tokens, want", [
    (SMOL, 1, 2 * 30 * 3 * 64 * 2),          # 23040 bytes per token (the README's number)
    (SMOL, 1000, 23040 * 1000),
    (SMOL.model_copy(update={"dtype": "float32"}), 7, 2 * 30 * 3 * 64 * 4 * 7),
    (TINY, 11, 32 * 11),
])
def test_payload_is_2_l_nkv_dhead_bytes_tokens(kv, tokens, want):
    assert kv_payload_bytes(kv, tokens) == want


@pytest.mark.parametrize("n, bs, block, want", [(11, 4, 0, 4), (11, 4, 2, 3), (12, 4, 2, 4), (1, 16, 0, 1)])
def test_block_tokens(n, bs, block, want):
    assert block_tokens(n, bs, block) == want


def test_block_past_the_prompt_is_refused():
    with pytest.raises(ValueError, match="outside the prompt's 3 blocks"):
        block_tokens(11, 4, 3)


@pytest.mark.parametrize("field, other, says", [
    ("revision", "r2", "KV revision differs: this worker has 'r1', the prefill worker 'r2'"),
    ("dtype", "float32", "KV dtype differs"),
    ("block_size", 32, "KV block_size differs: this worker has 16, the prefill worker 32"),
    ("layout", "token,layer,kv,head,dim", "KV layout differs"),
    ("num_kv_heads", 4, "KV num_kv_heads differs"),
])
def test_incompatibility_names_the_field_and_both_values(field, other, says):
    assert incompatibility(SMOL, SMOL.model_copy(update={field: other})).startswith(says)
    assert incompatibility(SMOL, SMOL) is None


def stream(prompt: list[int], first_block: int = 0, cut: int | None = None) -> tuple[bytes, list[bytes]]:
    n, bs = len(prompt), TINY.block_size
    nblocks = -(-n // bs)
    h = KvStreamHeader(version=STREAM_VERSION, handle="h1", kv=TINY, num_tokens=n, first_block=first_block,
                       num_blocks=nblocks - first_block, first_token_id=42, tokens_digest=tokens_digest(prompt))
    out, payloads = encode_stream_header(h), []
    for b in range(first_block, nblocks if cut is None else cut):
        t = block_tokens(n, bs, b)
        p = bytes((b * 7 + i) % 256 for i in range(kv_payload_bytes(TINY, t)))
        payloads.append(p)
        out += encode_frame(b, t) + p
    return out, payloads


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
@pytest.mark.parametrize("first_block", [0, 2])
def test_round_trip_in_any_chunking(chunk, first_block):
    prompt = list(range(100, 111))  # 11 tokens: blocks of 4, 4, 3
    data, payloads = stream(prompt, first_block)
    d = KvStreamDecoder()
    for i in range(0, len(data), chunk):
        assert not d.done
        d.feed(data[i:i + chunk])
    assert d.done and d.blocks == payloads
    assert d.header.first_token_id == 42 and d.header.tokens_digest == tokens_digest(prompt)
    assert d.payload_bytes == kv_payload_bytes(TINY, 11 - 4 * first_block)


def test_digest_depends_on_every_token_and_its_place():
    assert tokens_digest([1, 2, 3]) != tokens_digest([1, 3, 2])
    assert tokens_digest([1, 2, 3]) != tokens_digest([1, 2, 3, 0])
    assert tokens_digest([1, 2, 3]) == tokens_digest((1, 2, 3))


def _mutate_frame_block(data: bytes) -> bytes:
    i = data.index(encode_frame(0, 4))
    return data[:i] + encode_frame(1, 4) + data[i + 8:]


def _mutate_frame_tokens(data: bytes) -> bytes:
    i = data.index(encode_frame(0, 4))
    return data[:i] + encode_frame(0, 3) + data[i + 8:]


@pytest.mark.parametrize("mutate, says", [
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: MAGIC + (1 << 30).to_bytes(4, "little") + d[8:], "header of 1073741824 bytes"),
    (lambda d: d[:8] + b"{" * (int.from_bytes(d[4:8], "little")) + d[8 + int.from_bytes(d[4:8], "little"):],
     "bad KV stream header"),
    (_mutate_frame_block, "KV frame for block 1, expected block 0"),
    (_mutate_frame_tokens, "holds 3 tokens, expected 4"),
    (lambda d: d + b"\x00", "1 bytes after the last KV frame"),
])
def test_malformed_streams_are_refused(mutate, says):
    data, _ = stream(list(range(11)))
    with pytest.raises(KvStreamError, match=says):
        KvStreamDecoder().feed(mutate(data))


def test_a_short_stream_is_not_done():
    data, _ = stream(list(range(11)), cut=2)
    d = KvStreamDecoder()
    d.feed(data)
    assert not d.done and len(d.blocks) == 2


def test_header_announcing_the_wrong_blocks_is_refused():
    h = KvStreamHeader(version=STREAM_VERSION, handle="h", kv=TINY, num_tokens=11, first_block=1, num_blocks=3,
                       first_token_id=0, tokens_digest="x")
    with pytest.raises(KvStreamError, match="covers blocks 1..3 of a 3-block prompt"):
        KvStreamDecoder().feed(encode_stream_header(h))
    h2 = h.model_copy(update={"version": 9, "num_blocks": 2})
    with pytest.raises(KvStreamError, match="version 9"):
        KvStreamDecoder().feed(encode_stream_header(h2))
