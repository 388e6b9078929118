"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/v1/models/{model}``, and vLLM's ``/tokenize`` and ``/detokenize``.

One request = one engine request (n=1). Streaming answers are server-sent events with one event
per generated token (its text may be empty while a multi-byte character or a possible stop-string
prefix is held back), the finish reason on the last token's event, an optional usage event
(``stream_options.include_usage``) and ``data: [DONE]``; with vLLM's
``stream_options.continuous_usage_stats`` every event also carries ``usage`` so far. Chat streams
start with one extra event carrying ``{"role": "assistant"}``. ``usage.completion_tokens`` counts
generated token ids (never re-tokenized text). A client that disconnects aborts its request,
freeing its KV blocks (streamed or not; a non-streamed request is answered 499 to nobody).

Request limits (``EngineArgs.max_stop_strings``, ``max_stop_string_chars``,
``max_stop_token_ids``; the body size is checked in server/app.py) are 400s naming the flag that
raises them. ``stop_token_ids`` outside the vocabulary are a 400 naming the id and the size.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import StreamingResponse
from goodput.worker.engine.scheduler import AdmissionError
from goodput.worker.async_engine import EngineDeadError, RequestStream
from goodput.worker.llm_engine import RequestDelta
from goodput.worker.server import sse
from goodput.worker.server.errors import APIError
from goodput.worker.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnsupportedParameter,
    UsageInfo,
    error_body,
    new_id,
    now_s,
)

router = APIRouter()


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route can answer (OpenAI error body)."""
    why = {400: "Invalid or unsupported input (the message names the parameter)",
           401: "Missing or wrong bearer token", 403: "Admin writes are disabled",
           404: "Unknown model (or route)", 413: "Request body larger than --max-request-body-bytes",
           429: "Waiting queue full; retry after the Retry-After header's seconds",
           500: "The engine failed while running this request",
           503: "Model still loading, failed to load, or engine loop dead"}
    return {c: {"model": ErrorResponse, "description": why[c]} for c in codes}


def _sse_doc(chunk_model: type) -> dict[int | str, dict[str, Any]]:
    """OpenAPI for a route that answers JSON, or server-sent events when ``stream`` is true. The
    event-stream schema describes ONE event (OpenAPI 3.1 reading): its ``data`` is a chunk as JSON
    (``contentSchema``), an error body, or the literal ``[DONE]``."""
    ref = "#/components/schemas/"
    data = {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [{"$ref": ref + chunk_model.__name__}, {"$ref": ref + "ErrorResponse"}]}}]}
    return {200: {"description": f"JSON; with \"stream\": true, server-sent events, each "
                                 f"``data: <{chunk_model.__name__}>`` and then ``data: [DONE]``",
                  "content": {"text/event-stream": {"schema": {
                      "type": "object", "required": ["data"], "properties": {"data": data}}}}}}

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


def _state(request: Request):
    return request.app.state.server


def _check_model(st, model: str | None) -> None:
    if model is not None and model != st.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{st.model_name}`.",
                       param="model", code="model_not_found")


def _invalid(st, err: APIError) -> APIError:
    if st.llm is not None:
        st.llm.count_invalid()
    return err


def _chat_messages(body_messages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text()} for m in body_messages]


def _max_token_bytes(st) -> int | None:
    """Most UTF-8 bytes any single token stands for (byte-level BPE: one vocabulary character is
    one byte), computed once; None when the tokenizer cannot say."""
    if not hasattr(st, "_max_token_bytes"):
        tok = st.llm.tokenizer
        try:
            pieces = tok.convert_ids_to_tokens(range(tok.vocab_size))
            st._max_token_bytes = max(len(p.encode("utf-8")) for p in pieces)
        except (AttributeError, TypeError, ValueError):
            st._max_token_bytes = None
    return st._max_token_bytes


def _refuse_if_surely_too_long(st, nbytes: int) -> None:
    """Refuse a prompt that cannot fit before tokenizing it: it has at least
    ceil(bytes / max bytes per token) tokens. Tokenizing megabytes would hold the GIL (and so
    the event loop) for seconds only to say 400."""
    per_token = _max_token_bytes(st)
    if not per_token:
        return
    min_tokens = -(-nbytes // per_token)
    limit = st.max_model_len
    if min_tokens + 1 > limit:
        st.llm.count_rejected("never_fits")
        raise APIError(400, f"the prompt is {nbytes} bytes, so at least {min_tokens} tokens (at most "
                            f"{per_token} bytes per token); prompt + max_tokens must fit max_model_len "
                            f"({limit})", param="prompt", code="never_fits")


async def _encode(st, text: str) -> list[int]:
    _refuse_if_surely_too_long(st, len(text.encode("utf-8")))
    return list(await asyncio.to_thread(st.llm.tokenizer.encode, text))


async def _render_chat(st, messages, for_generation: bool = True,
                       add_generation_prompt: bool = True) -> list[int]:
    from goodput.worker.model.tokenizer import ChatTemplateError
    if for_generation:
        _refuse_if_surely_too_long(st, sum(len(m.text().encode("utf-8")) for m in messages))
    try:
        return list(await asyncio.to_thread(st.llm.tokenizer.apply_chat_template, _chat_messages(messages),
                                            add_generation_prompt=add_generation_prompt, tokenize=True))
    except ChatTemplateError as e:
        raise _invalid(st, APIError(400, str(e), param="messages"))


def _check_limits(st, body: CompletionRequest | ChatCompletionRequest) -> None:
    """The request limits of the server's configuration and the vocabulary (400 naming the
    parameter, the limit and the flag that raises it)."""
    args = st.args
    stops = body.stop_list
    if len(stops) > args.max_stop_strings:
        raise _invalid(st, APIError(400, f"{len(stops)} stop strings; at most {args.max_stop_strings} are "
                                         f"allowed (--max-stop-strings)", param="stop"))
    longest = max(map(len, stops), default=0)
    if longest > args.max_stop_string_chars:
        raise _invalid(st, APIError(400, f"a stop string of {longest} characters; at most "
                                         f"{args.max_stop_string_chars} are allowed (--max-stop-string-chars)",
                                    param="stop"))
    ids = body.stop_token_ids or ()
    if len(ids) > args.max_stop_token_ids:
        raise _invalid(st, APIError(400, f"{len(ids)} stop_token_ids; at most {args.max_stop_token_ids} are "
                                         f"allowed (--max-stop-token-ids)", param="stop_token_ids"))
    vocab = st.llm.config.vocab_size
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise _invalid(st, APIError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                                         f"[0, {vocab}) (vocabulary size {vocab})", param="stop_token_ids"))


def _admit(st, body, prompt_ids: list[int], max_tokens: int, arrival: float) -> tuple[str, RequestStream]:
    engine = st.require_engine()
    try:
        params = body.to_sampling_params(max_tokens)
    except UnsupportedParameter as e:
        raise _invalid(st, APIError.unsupported(e))
    except ValueError as e:
        raise _invalid(st, APIError(400, str(e)))
    rid = new_id("cmpl" if isinstance(body, CompletionRequest) else "chatcmpl")
    try:
        stream = engine.add_request(rid, prompt_ids, params, arrival_time=arrival,
                                    priority=body.priority, cache_salt=body.cache_salt)
    except AdmissionError as e:
        raise APIError.from_admission(e)
    except EngineDeadError as e:
        raise APIError(503, str(e))
    except (ValueError, TypeError) as e:
        raise _invalid(st, APIError(400, str(e), param="prompt"))
    return rid, stream


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(request: Request, stream: RequestStream) -> tuple[str, list[int], RequestDelta]:
    """Run a non-streamed request to the end; abort it if the client disconnects first."""
    async def consume():
        text, ids, last = [], [], None
        async for d in stream:
            text.append(d.text)
            ids.extend(d.token_ids)
            last = d
        return "".join(text), ids, last

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this handler is cancelled: the request must not outlive it.
        gone.cancel()
        if not work.done():
            stream.abort()  # frees the KV blocks at the next step boundary
            work.cancel()
            # cancel() only requests it: wait until the task is really done before looking at it.
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise APIError(499, "client closed the request")
    text, ids, last = work.result()
    if last is not None and last.error:
        raise APIError(500, last.error)
    return text, ids, last


async def _sse_stream(stream: RequestStream, first: list[Any],
                      chunk: Callable[[RequestDelta], Any], usage_chunk: Callable[[UsageInfo], Any] | None,
                      prompt_tokens: int, continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """``first``: chunks sent before any token; ``continuous_usage``: every chunk carries
    ``usage`` so far (vLLM's ``stream_options.continuous_usage_stats``)."""
    n_out = 0
    try:
        for c in first:
            if continuous_usage:
                c.usage = UsageInfo.of(prompt_tokens, 0)
            yield sse.event(c)
        async for d in stream:
            if d.error:
                yield sse.event(error_body(d.error, "internal_error"))
                break
            n_out = d.num_output_tokens
            c = chunk(d)
            if continuous_usage:
                c.usage = UsageInfo.of(prompt_tokens, n_out)
            yield sse.event(c)
        if usage_chunk is not None:
            yield sse.event(usage_chunk(UsageInfo.of(prompt_tokens, n_out)))
        yield sse.DONE
    finally:
        stream.abort()  # no-op when finished; a disconnect cancels us here and frees the blocks


def _checked_state(request: Request, body: CompletionRequest | ChatCompletionRequest):
    """The server state after the checks both generate routes share: not draining (503), the
    model name (404), unsupported OpenAI parameters (400 naming the parameter), a loaded, live
    engine (503)."""
    st = _state(request)
    st.require_admitting()
    _check_model(st, body.model)
    try:
        body.check_supported()
    except UnsupportedParameter as e:
        raise _invalid(st, APIError.unsupported(e))
    st.require_engine()
    _check_limits(st, body)
    return st


def _model_card(st) -> ModelCard:
    return ModelCard(id=st.model_name, created=st.created, max_model_len=st.max_model_len)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The one model this worker serves (``max_model_len`` is null while it loads)."""
    return ModelList(data=[_model_card(_state(request))])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=_errors(404))
async def retrieve_model(request: Request, model: str = Path(description="the served model name")) -> ModelCard:
    """OpenAI's "retrieve model" (``client.models.retrieve``): the model card, or 404 naming the
    model this server serves."""
    st = _state(request)
    if model != st.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{st.model_name}`.",
                       param="model", code="model_not_found")
    return _model_card(st)


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**_sse_doc(CompletionResponse), **_errors(400, 404, 413, 429, 500, 503)})
async def create_completion(body: CompletionRequest, request: Request):
    arrival = time.monotonic()
    st = _checked_state(request, body)
    prompt = body.prompt_input()
    prompt_ids = await _encode(st, prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    rid, stream = _admit(st, body, prompt_ids, max_tokens, arrival)
    created, model, n_prompt = now_s(), st.model_name, len(prompt_ids)

    want_ids = body.return_token_ids
    if body.stream:
        include_usage = body.include_usage
        first_chunk = [True]

        def chunk(d: RequestDelta) -> CompletionResponse:
            prompt_ids_once = prompt_ids if want_ids and first_chunk[0] else None
            first_chunk[0] = False
            return CompletionResponse(id=rid, created=created, model=model, choices=[
                CompletionChoice(text=d.text, finish_reason=d.finish_reason if d.finished else None,
                                 token_ids=d.token_ids if want_ids else None,
                                 prompt_token_ids=prompt_ids_once)])

        def usage_chunk(u: UsageInfo) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=model, choices=[], usage=u)

        return StreamingResponse(_sse_stream(stream, [], chunk, usage_chunk if include_usage else None,
                                             n_prompt, body.continuous_usage),
                                 media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

    text, ids, last = await _collect(request, stream)
    return CompletionResponse(id=rid, created=created, model=model,
                              choices=[CompletionChoice(text=text, finish_reason=last.finish_reason,
                                                        token_ids=ids if want_ids else None,
                                                        prompt_token_ids=prompt_ids if want_ids else None)],
                              usage=UsageInfo.of(n_prompt, len(ids)))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={**_sse_doc(ChatCompletionChunk), **_errors(400, 404, 413, 429, 500, 503)})
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    arrival = time.monotonic()
    st = _checked_state(request, body)
    prompt_ids = await _render_chat(st, body.messages)
    max_tokens = body.requested_max_tokens
    if max_tokens is None:
        # As much as the context AND the KV pool allow (prompt + output <= pool tokens);
        # admission names the numbers when not even one token fits.
        cfg = st.llm.config
        n = len(prompt_ids)
        max_tokens = max(1, min(cfg.max_model_len, cfg.kv_capacity_tokens) - n)
    rid, stream = _admit(st, body, prompt_ids, max_tokens, arrival)
    created, model, n_prompt = now_s(), st.model_name, len(prompt_ids)

    if body.stream:
        want_ids = body.return_token_ids

        def chunk(d: RequestDelta) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[ChatChunkChoice(
                delta=DeltaMessage(content=d.text), finish_reason=d.finish_reason if d.finished else None,
                token_ids=d.token_ids if want_ids else None)])

        def usage_chunk(u: UsageInfo) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=u)

        first = [ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))],
            prompt_token_ids=prompt_ids if want_ids else None)]
        return StreamingResponse(
            _sse_stream(stream, first, chunk, usage_chunk if body.include_usage else None, n_prompt,
                        body.continuous_usage),
            media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

    text, ids, last = await _collect(request, stream)
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=[
        ChatChoice(message=ChatMessageOut(content=text), finish_reason=last.finish_reason,
                   token_ids=ids if body.return_token_ids else None)],
        usage=UsageInfo.of(n_prompt, len(ids)), prompt_token_ids=prompt_ids if body.return_token_ids else None)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 404, 413, 503))
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a prompt, or of a chat rendered exactly as ``/v1/chat/completions`` renders
    it (``add_generation_prompt`` true) — ``count`` then equals that request's
    ``usage.prompt_tokens``."""
    st = _state(request)
    _check_model(st, body.model)
    st.require_engine()
    tok = st.llm.tokenizer
    if body.messages is not None:
        gen = True if body.add_generation_prompt is None else body.add_generation_prompt
        ids = await _render_chat(st, body.messages, for_generation=False, add_generation_prompt=gen)
        if body.add_special_tokens and getattr(tok, "add_bos_token", False) and ids[:1] != [tok.bos_token_id]:
            ids = [tok.bos_token_id, *ids]
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tok.encode, body.prompt, add_special_tokens=add)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=st.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 404, 413, 503))
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of ``tokens`` (special tokens spelled out, as vLLM's ``/detokenize`` does)."""
    st = _state(request)
    _check_model(st, body.model)
    st.require_engine()
    try:
        text = await asyncio.to_thread(st.llm.tokenizer.decode, body.tokens, skip_special_tokens=False)
    except (ValueError, IndexError, OverflowError) as e:
        raise APIError(400, str(e), param="tokens")
    return DetokenizeResponse(prompt=text)
