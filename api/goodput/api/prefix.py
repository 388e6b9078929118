"""The request's chunk chain: the keys the router's prefix index and the worker's KV events share
(pure, standard library only).

The router has no tokenizer: it cuts a request's canonical content (:func:`content_of`: chat
messages rendered by :func:`render_messages`, a completions prompt, or its token ids) into
fixed-size chunks and hashes them as a chain (:func:`chunk_hashes`), so chunk ``i``'s 64-bit key
stands for the whole prefix up to it, seeded by model, revision and tenant ``cache_salt``. The
worker computes the same chain for each request it serves and publishes the keys its prefix
cache holds (``goodput.api.kv_events``); :func:`chunk_ends` says where each chunk ends in the
content, so the worker can tie a chunk to the KV block holding its last token.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["chunk_hashes", "chunk_ends", "render_messages", "content_of", "canonical_text"]


def _h64(data: bytes) -> int:
    """64-bit BLAKE2b of ``data`` as an unsigned int (big-endian digest)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _field(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack(">I", len(b)) + b


def _seed(model: str, revision: str, cache_salt: str | None, kind: str) -> int:
    """The chain's seed: length-prefixed model, revision, salt (a flag byte tells None from "")
    and the kind of content ("chat", "text", "ids"), so none of them can spell another."""
    salt = b"\x00" if cache_salt is None else b"\x01" + _field(cache_salt)
    return _h64(b"goodput-route-v1" + _field(model) + _field(revision) + salt + _field(kind))


def _content_text(content: Any) -> Any:
    """Message content as the chat template sees it: a list made only of text parts is the
    concatenation of their text (OpenAI allows both spellings); anything else unchanged."""
    if isinstance(content, list) and content and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    return content


def render_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> str:
    """Canonical text of a chat request: ``tools`` (when given; templates render them before the
    conversation) then one line per message, each the message as JSON with sorted keys and no
    spaces (content of only text parts joined into one string). The rendering of a conversation is
    a prefix of the rendering of its continuation (messages appended), which is what makes the
    next turn's chunk chain extend this one's."""
    out = []
    if tools:
        out.append(json.dumps({"tools": list(tools)}, sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False))
    for m in messages:
        msg = dict(m)
        if "content" in msg:
            msg["content"] = _content_text(msg["content"])
        out.append(json.dumps(msg, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
    return "".join(line + "\n" for line in out)


def chunk_hashes(model: str, revision: str, cache_salt: str | None, *,
                 messages: Sequence[Mapping[str, Any]] | None = None, tools: Sequence[Any] | None = None,
                 prompt: str | None = None, token_ids: Sequence[int] | None = None,
                 chunk_size: int = 256) -> tuple[int, ...]:
    """Chained 64-bit hashes of the request's content in chunks of ``chunk_size``.

    Exactly one of ``messages`` (chat; rendered by :func:`render_messages`, with ``tools``),
    ``prompt`` (completions text) or ``token_ids`` (completions token ids, each 0 <= id < 2**32)
    is given. The content is cut into chunks of ``chunk_size`` characters (text) or ids; the last
    chunk may be shorter (an empty content has no chunk). With ``h_0`` the seed of (model,
    revision, cache_salt, kind) and ``c_i`` the i-th chunk's bytes (UTF-8 text, or each id as 4
    big-endian bytes): ``h_i = blake2b64(h_{i-1} as 8 big-endian bytes + c_i)``. Returns
    ``(h_1, ..., h_k)``. Raises ValueError when not exactly one content is given, or for a bad
    ``chunk_size``.
    """
    if sum(x is not None for x in (messages, prompt, token_ids)) != 1:
        raise ValueError("give exactly one of messages, prompt or token_ids")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if token_ids is not None:
        kind = "ids"
        ids = list(token_ids)
        pieces: Iterable[bytes] = (struct.pack(f">{len(ids[i:i + chunk_size])}I", *ids[i:i + chunk_size])
                                   for i in range(0, len(ids), chunk_size))
    else:
        kind = "chat" if messages is not None else "text"
        text = render_messages(messages, tools) if messages is not None else prompt
        pieces = (text[i:i + chunk_size].encode("utf-8") for i in range(0, len(text), chunk_size))
    h = _seed(model, revision, cache_salt, kind)
    out = []
    for piece in pieces:
        h = _h64(h.to_bytes(8, "big") + piece)
        out.append(h)
    return tuple(out)


def canonical_text(messages: Sequence[Mapping[str, Any]] | None = None, tools: Sequence[Any] | None = None,
                   prompt: str | None = None) -> str:
    """The text :func:`chunk_hashes` cuts for chat (``messages`` + ``tools``) or a prompt."""
    return render_messages(messages, tools) if messages is not None else (prompt or "")


def chunk_ends(*, messages: Sequence[Mapping[str, Any]] | None = None, tools: Sequence[Any] | None = None,
               prompt: str | None = None, token_ids: Sequence[int] | None = None,
               chunk_size: int = 256) -> tuple[int, ...]:
    """Where each chunk of :func:`chunk_hashes` (same arguments) ends, exclusive: a character
    offset into :func:`canonical_text` (chat, prompt) or a token index (``token_ids``). Chunk
    ``i`` covers ``[0, ends[i])`` of the content (the chain makes its key stand for all of it)."""
    if sum(x is not None for x in (messages, prompt, token_ids)) != 1:
        raise ValueError("give exactly one of messages, prompt or token_ids")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    n = len(token_ids) if token_ids is not None else len(canonical_text(messages, tools, prompt))
    return tuple(min(n, i + chunk_size) for i in range(0, n, chunk_size))


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                                       for t in x)


def content_of(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword content of :func:`chunk_hashes` for an OpenAI request body sent to ``path``:
    ``messages`` (+ ``tools``) for ``.../chat/completions``, else the completions ``prompt`` (a
    string, or token ids; a batch keys on its first prompt). A body with no usable content keys
    on the empty prompt (no chunks)."""
    if path.endswith("/chat/completions"):
        msgs = body.get("messages")
        if isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs):
            tools = body.get("tools")
            return {"messages": msgs, "tools": tools if isinstance(tools, list) else None}
        return {"prompt": ""}
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return {"prompt": first}
        if _is_ids(prompt):
            return {"token_ids": prompt}
        if _is_ids(first):
            return {"token_ids": first}
    return {"prompt": ""}
