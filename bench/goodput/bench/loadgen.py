"""Async streaming load generator for any OpenAI-compatible /v1/completions endpoint.

One httpx.AsyncClient; each request is a streamed POST /v1/completions (SSE). The client stamps
`time.perf_counter()` when it sends and when each SSE event arrives. An event whose choice carries
text (or an empty text without a finish_reason: a token the server's detokenizer held back) is
one output token; the final usage chunk (stream_options.include_usage) gives the server's own
token counts when the server sends it. HTTP 429 is recorded as a rejection (admission control),
any other failure as an error: a run never crashes on a bad response.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .metrics import CANCELLED, ERROR, OK, REJECTED, RequestRecord
from .workloads import RequestSpec

now = time.perf_counter


@dataclass
class LoadConfig:
    """base_url: e.g. http://127.0.0.1:8000 (the /v1 prefix is added). model: the "model" field
    (None: ask GET /v1/models). mode: "closed" (concurrency slots) or "open" (each spec's `at`).
    duration_s: stop sending new requests after this many seconds (None: send all specs).
    drain_timeout_s: after sending stops, wait this long for in-flight requests, then cancel
    them (recorded as cancelled). extra_body: merged into every request body."""

    base_url: str
    model: str | None = None
    mode: str = "closed"
    concurrency: int = 1
    duration_s: float | None = None
    drain_timeout_s: float = 120.0
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    #: also send min_tokens = max_tokens (forces the length on servers without ignore_eos)
    min_tokens_equal_max: bool = False
    progress: bool = True
    desc: str = ""


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first model id of GET /v1/models, or None when the server does not list models."""
    try:
        r = await client.get(f"{base_url}/v1/models", timeout=10)
        r.raise_for_status()
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


async def send_one(client: httpx.AsyncClient, cfg: LoadConfig, spec: RequestSpec, rec: RequestRecord,
                   model: str | None) -> None:
    """Send one streamed completion and fill `rec` (never raises except on cancellation)."""
    body: dict[str, Any] = {
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.min_tokens_equal_max:
        body["min_tokens"] = spec.max_tokens
    body.update(cfg.extra_body)
    rec.send_time = now()
    try:
        async with client.stream("POST", f"{cfg.base_url}/v1/completions", json=body,
                                 timeout=httpx.Timeout(cfg.request_timeout_s, connect=30)) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.end_time = now()
                rec.status = REJECTED if resp.status_code == 429 else ERROR
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                t = now()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    rec.status, rec.error = ERROR, f"bad SSE data: {data[:200]}"
                    break
                if "error" in obj:
                    rec.status, rec.error = ERROR, json.dumps(obj["error"])[:300]
                    break
                for ch in obj.get("choices") or []:
                    text = ch.get("text")
                    if text is None:  # chat-style chunk
                        text = (ch.get("delta") or {}).get("content")
                    if text or (text == "" and ch.get("finish_reason") is None):
                        rec.token_times.append(t)
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    rec.usage_prompt_tokens = usage.get("prompt_tokens")
                    rec.usage_completion_tokens = usage.get("completion_tokens")
            rec.end_time = now()
            if rec.status == OK and not rec.token_times:
                rec.status, rec.error = ERROR, "stream ended without tokens"
    except asyncio.CancelledError:
        rec.status, rec.end_time = CANCELLED, now()
        raise
    except (httpx.HTTPError, OSError) as e:
        rec.status, rec.error, rec.end_time = ERROR, f"{type(e).__name__}: {e}"[:300], now()


async def run_load(cfg: LoadConfig, specs: list[RequestSpec]) -> tuple[list[RequestRecord], dict]:
    """Send `specs` per cfg; returns (records, info) with info = {model, t_start, t_end_send, t_end}.

    Closed loop: specs with at=None are served by cfg.concurrency slots in order; specs with `at`
    are injected at that offset whatever the mode. Open loop: every spec needs `at`.
    Raises ValueError on a bad mode/concurrency or an open-loop spec without `at`.
    """
    if cfg.mode not in ("closed", "open"):
        raise ValueError(f"mode must be closed or open, got {cfg.mode!r}")
    if cfg.mode == "closed" and cfg.concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {cfg.concurrency}")
    timed = [s for s in specs if s.at is not None]
    queued = [s for s in specs if s.at is None]
    if cfg.mode == "open" and queued:
        raise ValueError("open-loop mode needs an arrival time (at) on every request")
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(16, cfg.concurrency))
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(specs), desc=cfg.desc or f"{cfg.mode}", unit="req", leave=False)

    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout_s) as client:
        model = cfg.model or await discover_model(client, cfg.base_url)
        t0 = now()
        deadline = t0 + cfg.duration_s if cfg.duration_s is not None else None
        counter = 0

        def new_record(spec: RequestSpec, scheduled: float) -> RequestRecord:
            nonlocal counter
            counter += 1
            rec = RequestRecord(request_id=f"r{counter}", cls=spec.cls, prompt_tokens=spec.prompt_tokens,
                                max_tokens=spec.max_tokens, scheduled_time=scheduled)
            records.append(rec)
            return rec

        async def do(spec: RequestSpec, scheduled: float) -> None:
            rec = new_record(spec, scheduled)
            try:
                await send_one(client, cfg, spec, rec, model)
            finally:
                if bar is not None:
                    bar.update(1)

        it = iter(queued)

        async def slot() -> None:
            for spec in it:
                if deadline is not None and now() >= deadline:
                    return
                await do(spec, now())

        async def timed_sender() -> None:
            tasks = []
            for spec in sorted(timed, key=lambda s: s.at):
                delay = t0 + spec.at - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                if deadline is not None and now() >= deadline:
                    break
                tasks.append(asyncio.create_task(do(spec, t0 + spec.at)))
            if tasks:
                await asyncio.gather(*tasks)

        senders = [asyncio.create_task(timed_sender())]
        if queued:
            senders += [asyncio.create_task(slot()) for _ in range(cfg.concurrency)]
        # stop sending at the deadline; in-flight requests get drain_timeout_s more
        hard = None
        if deadline is not None:
            hard = cfg.duration_s + cfg.drain_timeout_s
        try:
            await asyncio.wait(senders, timeout=hard)
        finally:  # past the deadline, or this run itself was cancelled: stop every sender
            pending = [p for p in senders if not p.done()]
            for p in pending:
                p.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        t_end = now()
    if bar is not None:
        bar.close()
    # requests that never got a send time (cancelled before sending) are dropped
    records = [r for r in records if r.send_time]
    return records, {"model": model, "t_start": t0, "t_end": t_end}
