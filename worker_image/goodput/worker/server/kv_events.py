"""The worker's KV events: ``GET /kv/snapshot`` and ``GET /kv/events`` (``goodput.api.kv_events``),
and the ties between a request's router chunk keys and its KV blocks.

After a generate request is admitted, :func:`tie_later` computes (in a thread, off the request's
path) the router's chunk chain of the body (``goodput.api.prefix``: the served model name, the
``--revision`` or ``""``, the body's ``cache_salt``, the same content the router keys on) and
where each chunk ends in the prompt's tokens, then ties each chunk key to the prefix-cache hash
of the last full KV block inside that span (:meth:`KvEventLog.annotate`). A key is therefore
published as stored once all full blocks of its prefix are cached (the engine can only hit full
blocks: up to ``block_size - 1`` tokens of the chunk's end are not part of a hit), evicted when
that block leaves the cache. Where a chunk ends in tokens:

- token-id prompts: exact (a chunk is ``chunk_size`` token ids);
- text prompts: from the tokenizer's character offsets (the token holding the chunk's last
  character), when its ids are the prompt's; else every chunk is tied to the prompt's last
  full block (conservative: stored only with the whole prompt);
- chat: the canonical text is JSON lines, not the chat template, so a chunk ending inside
  message ``m`` is tied to the token holding the end of ``m``'s content in the template's text
  (rendered once and tokenized once with offsets, used only when those ids are the prompt's);
  with tools, a message without text content, or otherwise, the prompt's last full block
  (conservative).

A tie computed after its block was cached counts at once; one whose block was evicted before is
simply lost (the router then learns less, never more, than the cache holds).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from goodput.api.kv_events import (
    EVENTS_PATH,
    HEARTBEAT,
    HEARTBEAT_S,
    SNAPSHOT_PATH,
    KvEvent,
    check_instance,
    check_since,
    encode_event,
    encode_snapshot,
)
from goodput.api.prefix import chunk_ends, chunk_hashes, content_of, render_messages
from goodput.worker.engine.kv_events import KvEventLog, block_ties, token_ends_from_offsets
from goodput.worker.server.errors import APIError

log = logging.getLogger(__name__)
router = APIRouter()

CHUNK_SIZE = 256  # the router's --picker-chunk-size default; the worker keys with it
STREAM_MAX_S = 300.0  # one /kv/events response lasts at most this long; the reader resumes
POLL_S = 0.05
_tasks: set[asyncio.Task] = set()


def attach(llm) -> KvEventLog:
    """A new :class:`KvEventLog` fed by ``llm``'s block manager, counted by its metrics."""
    kv = KvEventLog()
    llm.scheduler.block_manager.attach_kv_events(kv)
    if llm.metrics is not None:
        llm.metrics.kv_events = kv
    return kv


# ---------------------------------------------------------------------------- ties (tokenizer)
def _encode_offsets(backend, text: str):
    """The backend's encoding of ``text`` (ids and character offsets, no special tokens added),
    the GIL released for long texts as the tokenizer itself does (``encode_batch``)."""
    if len(text) > 4096:
        return backend.encode_batch([text], add_special_tokens=False)[0]
    return backend.encode(text, add_special_tokens=False)


def _text_ends(tok, text: str, prompt_ids: Sequence[int], char_ends: Sequence[int]) -> list[int] | None:
    backend = getattr(tok, "backend", None)
    if backend is None or not text:
        return None
    enc = _encode_offsets(backend, text)
    ids = list(enc.ids)
    shift = len(prompt_ids) - len(ids)
    if shift not in (0, 1) or list(prompt_ids[shift:]) != ids:
        return None
    return token_ends_from_offsets(char_ends, [e for _, e in enc.offsets], shift)


def message_char_ends(text: str, contents: Sequence[Any]) -> list[int | None]:
    """Where each message's content ends in the rendered template ``text``: found in order, each
    after the previous one's end; None for a message whose content is not a non-empty string or
    is not found there (its end is unknown)."""
    out: list[int | None] = []
    pos = 0
    for c in contents:
        if not isinstance(c, str) or not c:
            out.append(None)
            continue
        i = text.find(c, pos)
        if i < 0:
            out.append(None)
            continue
        pos = i + len(c)
        out.append(pos)
    return out


def _chat_ends(st, body, raw: dict[str, Any], prompt_ids: Sequence[int], char_ends: Sequence[int]) -> list[int] | None:
    """Token ends of a chat request's chunks: a chunk ending in message m (its JSON line) ends
    where m's content ends in the template's text (one render, one tokenization with offsets,
    checked against the prompt's ids); unknown ends: the whole prompt."""
    from goodput.worker.server.openai_routes import _chat_input
    tok = st.llm.tokenizer
    backend = getattr(tok, "backend", None)
    if raw.get("tools") or body.functions_for_prompt() or backend is None:
        return None
    msgs = raw["messages"]
    head, extra = _chat_input(st, body.messages, None)
    if len(head) != len(msgs):
        return None
    text = tok.apply_chat_template(head, add_generation_prompt=True, tokenize=False, **extra)
    enc = _encode_offsets(backend, text)
    if list(enc.ids) != list(prompt_ids):  # special-token text in a message: ids differ; be conservative
        return None
    ends = message_char_ends(text, [m.get("content") for m in head])
    tok_end = dict(zip(range(len(ends)), token_ends_from_offsets([e or 0 for e in ends],
                                                                 [e for _, e in enc.offsets], 0)))
    line_ends, at = [], 0
    for i in range(len(msgs)):
        at += len(render_messages(msgs[i:i + 1]))
        line_ends.append(at)
    out, m = [], 0
    for c in char_ends:
        while m < len(msgs) - 1 and line_ends[m] < c:
            m += 1
        out.append(tok_end[m] if ends[m] is not None else len(prompt_ids))
    return out


def compute_ties(st, path: str, body, raw: dict[str, Any], prompts: Sequence[Sequence[int]]) -> list[tuple[bytes, int]]:
    """The (block hash, chunk key) ties of one admitted request (every prompt of a batch)."""
    bm = st.llm.scheduler.block_manager
    salt = raw.get("cache_salt") if isinstance(raw.get("cache_salt"), str) else None
    model, revision = st.model_name, st.args.revision or ""
    if path.endswith("/chat/completions"):
        contents = [content_of(path, raw)]
    else:
        p = raw.get("prompt")
        batch = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        contents = [content_of(path, {"prompt": q}) for q in batch]
    ties: list[tuple[bytes, int]] = []
    for content, ids in zip(contents, prompts):
        keys = chunk_hashes(model, revision, salt, chunk_size=CHUNK_SIZE, **content)
        if not keys:
            continue
        ends = chunk_ends(chunk_size=CHUNK_SIZE, **content)
        if "token_ids" in content:
            tends: list[int] | None = list(ends) if list(content["token_ids"]) == list(ids) else None
        elif "messages" in content:
            tends = _chat_ends(st, body, raw, ids, ends)
        else:
            tends = _text_ends(st.llm.tokenizer, content["prompt"], ids, ends)
        if tends is None:
            tends = [len(ids)] * len(keys)
        ties += block_ties(keys, tends, bm.prompt_block_hashes(ids, salt), bm.block_size)
    return ties


async def tie_later(st, request: Request, body, prompts: Sequence[Sequence[int]]) -> None:
    """Schedule the ties of an admitted request (a background task; errors are logged, never
    raised: the events are an optimisation)."""
    kv: KvEventLog | None = getattr(st, "kv_events", None)
    if kv is None or not st.llm.config.enable_prefix_caching:
        return
    data = await request.body()  # read already (cached): parsed again in the thread, not on the loop
    path = request.url.path

    def ties() -> list[tuple[bytes, int]]:
        raw = json.loads(data)
        return compute_ties(st, path, body, raw, prompts) if isinstance(raw, dict) else []

    async def run() -> None:
        try:
            kv.annotate(await asyncio.to_thread(ties))
        except Exception:  # noqa: BLE001 - never fail a request for its cache knowledge
            log.exception("kv events: could not tie a request's chunks to its blocks")

    task = asyncio.get_running_loop().create_task(run())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


# ---------------------------------------------------------------------------------- routes
def _log(request: Request) -> tuple[Any, KvEventLog, str]:
    st = request.app.state.server
    st.require_engine()
    return st, st.kv_events, st.llm.metrics.instance_id


@router.get(SNAPSHOT_PATH, include_in_schema=False)  # router-facing, like /metrics
async def kv_snapshot(request: Request) -> Response:
    """Every router chunk key the prefix cache holds and the event sequence it is valid at:
    ``{"instance", "seq", "chunk_size", "keys": [16 hex digits, ...]}`` (``goodput.api.kv_events``); 503 while
    the model loads."""
    _, kv, instance = _log(request)
    seq, keys = kv.snapshot()
    return Response(encode_snapshot(instance, seq, keys, CHUNK_SIZE), media_type="application/json")


@router.get(EVENTS_PATH, include_in_schema=False)  # an endless stream: not for fuzzers
async def kv_events(request: Request, since: str = "0", instance: str | None = None) -> Response:
    """NDJSON stream of the events after ``since`` (``goodput.api.kv_events``): 400 for a bad
    ``since`` or ``instance``, 410 when ``instance`` is not this engine's or event ``since + 1``
    is gone (resync from ``/kv/snapshot``), 503 while the model loads or the replica drains. Ends after
    :data:`STREAM_MAX_S`, when the event ring overtakes the reader, or on drain."""
    try:
        seq = check_since(since)
        if instance is not None:
            check_instance(instance)
    except ValueError as e:
        raise APIError(400, str(e), param="instance" if "instance" in str(e) else "since")
    st, kv, me = _log(request)
    if not st.admitting:
        raise APIError(503, "this replica is draining: no event stream", code="draining",
                       headers={"Retry-After": "1"})
    if instance is not None and instance != me:
        raise APIError(410, f"instance {instance} is gone; this engine is {me}: resync from {SNAPSHOT_PATH}",
                       code="instance_changed")
    if kv.since(seq) is None:
        raise APIError(410, f"events after {seq} are no longer kept (or not yet happened): resync from "
                            f"{SNAPSHOT_PATH}", code="events_gone")

    async def lines():
        last, t0 = seq, time.monotonic()
        beat = None
        while st.admitting and st.engine is not None and st.engine.is_healthy():
            evs = kv.since(last)
            if evs is None:
                return
            for s, kind, keys in evs:
                yield encode_event(KvEvent(me, s, kind, keys))
                last = s
            now = time.monotonic()
            if now - t0 >= STREAM_MAX_S:
                return
            if beat is None or now - beat >= HEARTBEAT_S:
                beat = now
                yield encode_event(KvEvent(me, last, HEARTBEAT))
            await asyncio.sleep(POLL_S)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
