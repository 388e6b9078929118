"""Disaggregated prefill and decode on the worker's HTTP side (docs/disaggregation.md).

- ``GET /kv/leases/{handle}?from_block=k``: streams a leased prompt's KV (prefill side), blocks ``k`` on,
  in the binary format of :mod:`goodput.api.disagg`; the lease is freed once the last block is
  sent. 404 when the lease is unknown, pulled, deleted or expired; 400 for ``from_block`` past the
  prompt.
- ``DELETE /kv/leases/{handle}``: frees a lease now (a cancelled request); 204, or 404 when not open.
- :func:`pull_kv` (decode side): pulls a lease's KV into host memory off the engine loop, with one
  deadline for connect + stream (``--kv-transfer-timeout-seconds``), and returns the
  :class:`~goodput.worker.engine.outputs.KvImport` the engine writes into its paged cache, or the
  reason it cannot be used (the request is then prefilled locally).

The KV endpoint has the trust model of the pod network, as the OpenAI routes do: the handle is a
random 128-bit id only the router and the two workers see.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import httpx
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response, StreamingResponse
from goodput.api.disagg import (
    KV_HANDLE_HEADER,
    KV_MEDIA_TYPE,
    KV_PATH,
    KV_SOURCE_HEADER,
    STREAM_VERSION,
    KvStreamDecoder,
    KvStreamError,
    KvStreamHeader,
    block_tokens,
    encode_frame,
    encode_stream_header,
    incompatibility,
    tokens_digest,
)
from goodput.worker.engine.outputs import KvImport
from goodput.worker.server.errors import APIError

log = logging.getLogger("goodput.worker.disagg")
router = APIRouter()

HANDLE_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
READ_BLOCKS = 16  # blocks copied per engine-lock hold while streaming
SOURCE_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]{1,255}$")


def _state(request: Request):
    return request.app.state.server


def check_handle(handle: str, param: str = "handle") -> str:
    """The handle if well-formed (1-128 of ``[A-Za-z0-9_-]``), else a 400 naming ``param``."""
    if not HANDLE_RE.match(handle):
        raise APIError(400, f"{param}: a KV transfer handle is 1-128 letters, digits, '-' or '_'", param=param)
    return handle


def transfer_headers(request: Request) -> tuple[str, str] | None:
    """(prefill worker base URL, handle) from :data:`KV_SOURCE_HEADER` / :data:`KV_HANDLE_HEADER`,
    None when neither is set; a 400 naming the header when one is missing or malformed."""
    handle, source = request.headers.get(KV_HANDLE_HEADER), request.headers.get(KV_SOURCE_HEADER)
    if handle is None and source is None:
        return None
    if handle is None or source is None:
        missing = KV_HANDLE_HEADER if handle is None else KV_SOURCE_HEADER
        raise APIError(400, f"a KV transfer needs both {KV_HANDLE_HEADER} and {KV_SOURCE_HEADER}; "
                            f"{missing} is missing", param=missing)
    check_handle(handle, KV_HANDLE_HEADER)
    if not SOURCE_RE.match(source.rstrip("/")):
        raise APIError(400, f"{KV_SOURCE_HEADER} must be the prefill worker's base URL "
                            f"(http://host:port), got {source[:100]!r}", param=KV_SOURCE_HEADER)
    return source.rstrip("/"), handle


@router.get(KV_PATH, response_class=Response, include_in_schema=False)
async def get_kv(request: Request, handle: str = Path(max_length=128),
                 from_block: int = Query(0, ge=0, le=1 << 20)) -> Response:
    st = _state(request)
    st.require_engine()
    check_handle(handle)
    llm = st.llm
    info = llm.lease_info(handle)
    if info is None:
        raise APIError(404, f"no open KV lease {handle!r} (never made, pulled, deleted or expired)",
                       param="handle", code="kv_lease_not_found")
    num_tokens, first_token, prompt = info
    kv = llm.kv_layout()
    nblocks = -(-num_tokens // kv.block_size)
    if from_block > nblocks:
        raise APIError(400, f"from_block {from_block} is past the prompt's {nblocks} blocks", param="from_block")
    header = KvStreamHeader(version=STREAM_VERSION, handle=handle, kv=kv, num_tokens=num_tokens,
                            first_block=from_block, num_blocks=nblocks - from_block,
                            first_token_id=first_token, tokens_digest=tokens_digest(prompt))
    metrics = llm.metrics

    async def body():
        yield encode_stream_header(header)
        for first in range(from_block, nblocks, READ_BLOCKS):
            # a batch of blocks per engine-lock hold: one gather, off the event loop
            batch = await asyncio.to_thread(llm.read_lease_blocks, handle, first, READ_BLOCKS)
            if batch is None:  # expired or deleted mid-stream: the short stream tells the receiver
                log.warning("KV lease %s ended while streaming block %d", handle, first)
                return
            # one write per batch: fewer trips through the ASGI server than one per frame
            yield b"".join(part for b, data in enumerate(batch, first)
                           for part in (encode_frame(b, block_tokens(num_tokens, kv.block_size, b)), data))
            if metrics is not None:
                metrics.observe_kv_sent(sum(map(len, batch)))
        llm.release_lease(handle)  # pulled: freed at once

    return StreamingResponse(body(), media_type=KV_MEDIA_TYPE)


@router.delete(KV_PATH, status_code=204, response_class=Response, include_in_schema=False)
async def delete_kv(request: Request, handle: str = Path(max_length=128)) -> Response:
    st = _state(request)
    st.require_engine()
    check_handle(handle)
    if not st.llm.release_lease(handle):
        raise APIError(404, f"no open KV lease {handle!r}", param="handle", code="kv_lease_not_found")
    return Response(status_code=204)


@dataclass
class PullResult:
    """A pull's outcome: ``kv`` (the staged import) or ``reason`` (a ``KV_FALLBACK_REASONS``
    value) with ``detail``; ``payload_bytes`` and ``seconds`` of a successful pull."""

    kv: KvImport | None = None
    reason: str | None = None
    detail: str = ""
    payload_bytes: int = 0
    seconds: float = 0.0


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _client(st) -> httpx.AsyncClient:
    client = getattr(st, "kv_client", None)
    if client is None or client.is_closed:
        client = st.kv_client = httpx.AsyncClient(timeout=None, trust_env=False)
    return client


async def pull_kv(st, source: str, handle: str, prompt_ids: list[int], cache_salt: str | None) -> PullResult:
    """Pull lease ``handle`` from ``source`` for a prompt (the blocks this worker's prefix cache
    holds are skipped), within ``--kv-transfer-timeout-seconds``. Never raises for the transfer:
    a refusal (another model revision, dtype, block size, layout, prompt), an HTTP error, a short
    or malformed stream or the deadline give a :class:`PullResult` with ``reason``; the lease is
    then deleted on the prefill worker (best effort)."""
    llm = st.llm
    first_block = llm.cached_prompt_blocks(prompt_ids, cache_salt)
    local = llm.kv_layout()
    dec = KvStreamDecoder()
    t0 = time.monotonic()

    async def transfer() -> None:
        async with _client(st).stream("GET", source + KV_PATH.format(handle=handle), params={"from_block": first_block}) as r:
            if r.status_code != 200:
                body = (await r.aread())[:300].decode(errors="replace")
                raise _Refused("error", f"the prefill worker answered {r.status_code}: {body}")
            async for chunk in r.aiter_raw():
                had_header = dec.header is not None
                try:
                    dec.feed(chunk)
                except KvStreamError as e:
                    raise _Refused("error", str(e)) from None
                if not had_header and dec.header is not None:
                    _check_header(dec.header, local, prompt_ids, first_block, llm.config.vocab_size)
        if not dec.done:
            got = len(dec.blocks) if dec.header else 0
            raise _Refused("error", f"the KV stream ended after {got} of "
                                    f"{dec.header.num_blocks if dec.header else '?'} blocks")

    try:
        await asyncio.wait_for(transfer(), st.args.kv_transfer_timeout_seconds)
    except _Refused as e:
        res = PullResult(reason=e.reason, detail=e.detail)
    except asyncio.TimeoutError:
        res = PullResult(reason="timeout", detail=f"no complete KV stream within "
                                                  f"{st.args.kv_transfer_timeout_seconds} s")
    except httpx.HTTPError as e:
        res = PullResult(reason="error", detail=f"KV pull from {source} failed: {e!r}")
    else:
        h = dec.header
        seconds = time.monotonic() - t0
        if llm.metrics is not None:
            llm.metrics.observe_kv_received(dec.payload_bytes, seconds)
        return PullResult(KvImport(h.num_tokens, h.first_block, tuple(dec.blocks), h.first_token_id),
                          payload_bytes=dec.payload_bytes, seconds=seconds)
    fallback(st, source, handle, res.reason, res.detail)
    return res


def _check_header(h: KvStreamHeader, local, prompt_ids: list[int], first_block: int,
                  vocab_size: int | None) -> None:
    why = incompatibility(local, h.kv)
    if why is None and vocab_size is not None and h.first_token_id >= vocab_size:
        why = f"first token id {h.first_token_id} is outside this model's vocabulary ({vocab_size})"
    if why is None and h.num_tokens != len(prompt_ids):
        why = f"the leased prompt has {h.num_tokens} tokens, this request {len(prompt_ids)}"
    if why is None and h.tokens_digest != tokens_digest(prompt_ids):
        why = "the leased prompt's tokens differ from this request's"
    if why is None and h.first_block != first_block:
        why = f"the stream starts at block {h.first_block}, {first_block} was asked"
    if why is not None:
        raise _Refused("mismatch", why)


_background: set[asyncio.Task] = set()


def fallback(st, source: str | None, handle: str | None, reason: str, detail: str) -> None:
    """Count a local prefill of a request handed a transfer, log why, and delete the lease on the
    prefill worker in the background (so its blocks are freed before the lease expires)."""
    log.warning("KV transfer %s not used (%s): %s; prefilling locally", handle, reason, detail)
    if st.llm.metrics is not None:
        st.llm.metrics.observe_kv_fallback(reason)
    if source is None or handle is None:
        return

    async def delete() -> None:
        try:
            await _client(st).delete(source + KV_PATH.format(handle=handle), timeout=2.0)
        except httpx.HTTPError:
            pass  # the lease expires on its own

    task = asyncio.ensure_future(delete())
    _background.add(task)
    task.add_done_callback(_background.discard)
