"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/v1/models/{model}``, and vLLM's ``/tokenize`` and ``/detokenize``.

One choice = one engine request; the ``n`` (or ``best_of``) choices of a prompt are forks that
share the prompt's KV blocks, and a batch of prompts is admitted whole or not at all. Streaming
answers are server-sent events with one event
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
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from goodput.api.policy import SLO_CLASS_HEADER
from goodput.worker.engine.scheduler import AdmissionError
from goodput.worker.async_engine import EngineDeadError, RequestStream
from goodput.worker.llm_engine import RequestDelta
from goodput.worker.engine.outputs import TokenLogprobs
from goodput.worker.server import disagg, sse
from goodput.worker.server.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from goodput.worker.server.kv_events import tie_later
from goodput.worker.server.errors import APIError
from goodput.worker.server.tool_calls import (
    ToolCallParser,
    parameters_schema,
    required_schema,
    template_messages,
)
from goodput.api.disagg import (
    DECODE_ROLES,
    PREFILL_ROLES,
    REMOTE_PREFILL_HEADER,
    PrefillResult,
    kv_payload_bytes,
)
from goodput.api.errors import ErrorResponse, error_body
from goodput.worker.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    FunctionCall,
    ToolCall,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnsupportedParameter,
    UsageInfo,
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


def _chat_input(st, body_messages, functions: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], dict]:
    """The messages and extra variables the chat template gets: roles mapped (developer ->
    system), tools and earlier calls written as the template expects (server/tool_calls.py)."""
    template = getattr(st.llm.tokenizer, "chat_template", None) or ""
    return template_messages([m.template_dict() for m in body_messages], functions,
                             native="tools" in template)


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


def _refuse_if_surely_too_long(st, nbytes: int, for_generation: bool = True) -> None:
    """Refuse a prompt that cannot fit before tokenizing it: it has at least
    ceil(bytes / max bytes per token) tokens. Tokenizing megabytes would hold the GIL (and so
    the event loop) for seconds only to say 400. A generate request needs room for one token
    more (and is counted as rejected, never_fits); ``/tokenize`` takes at most max_model_len."""
    per_token = _max_token_bytes(st)
    if not per_token:
        return
    min_tokens = -(-nbytes // per_token)
    limit = st.max_model_len
    if min_tokens + (1 if for_generation else 0) > limit:
        if for_generation:
            st.llm.count_rejected("never_fits")
        what = "prompt + max_tokens" if for_generation else "a prompt to tokenize"
        raise APIError(400, f"the prompt is {nbytes} bytes, so at least {min_tokens} tokens (at most "
                            f"{per_token} bytes per token); {what} must fit max_model_len "
                            f"({limit})", param="prompt", code="never_fits")


def _refuse_over_max_model_len(st, n_tokens: int, param: str) -> None:
    """``/tokenize`` and ``/detokenize`` take what a prompt may be: at most max_model_len tokens."""
    limit = st.max_model_len
    if n_tokens > limit:
        raise APIError(400, f"{n_tokens} tokens; at most max_model_len ({limit}) are allowed, as for a "
                            f"completion's prompt", param=param, code="never_fits")


async def _encode(st, text: str) -> list[int]:
    _refuse_if_surely_too_long(st, len(text.encode("utf-8")))
    return list(await asyncio.to_thread(st.llm.tokenizer.encode, text))


async def _render_chat(st, messages, for_generation: bool = True,
                       add_generation_prompt: bool = True,
                       functions: list[dict[str, Any]] | None = None) -> list[int]:
    from goodput.worker.model.tokenizer import ChatTemplateError
    msgs, extra = _chat_input(st, messages, functions)
    _refuse_if_surely_too_long(st, sum(len(str(m.get("content") or "").encode("utf-8")) for m in msgs),
                               for_generation)
    try:
        return list(await asyncio.to_thread(st.llm.tokenizer.apply_chat_template, msgs,
                                            add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **extra))
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


def _engine_error(st, e: BaseException, n_prompt_tokens: int) -> APIError:
    if isinstance(e, AdmissionError):
        return APIError.from_admission(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e))
    return _invalid(st, APIError(400, str(e), param="prompt"))


def _admit_all(st, body, prompts: list[list[int]], max_tokens: int, arrival: float,
               n: int, pd: _Disagg | None = None, *, slo_class: str | None = None,
               **engine_fields: Any) -> list[tuple[int, int, RequestStream]]:
    """Admit ``n`` choices of every prompt (forks sharing each prompt's KV blocks): all of them
    or none (what was admitted is aborted when a later one is refused). Returns
    (choice index = prompt_index * n + i, prompt index, stream) in index order. ``pd``: the
    request's part in disaggregated serving (one prompt, n = 1): a remote prefill (its first
    token only, its KV leased) or an imported prompt. ``slo_class``: the
    ``x-goodput-slo-class`` header (the metrics judge each request by its class, and the engine
    queues it in its class's band, ``Request.slo_rank``; an unknown one is the default class)."""
    engine = st.require_engine()
    try:
        params = [body.to_sampling_params(max_tokens, i, **(engine_fields if i == 0 else {
            k: v for k, v in engine_fields.items() if k != "prompt_logprobs"})) for i in range(n)]
        if pd is not None and pd.hold_kv:  # the prefill worker samples the first token only
            params[0] = dataclasses.replace(params[0], max_tokens=1, min_tokens=min(params[0].min_tokens, 1))
    except UnsupportedParameter as e:
        raise _invalid(st, APIError.unsupported(e))
    except ValueError as e:
        raise _invalid(st, APIError(400, str(e)))
    prefix = new_id("cmpl" if isinstance(body, CompletionRequest) else "chatcmpl")
    admitted: list[tuple[int, int, RequestStream]] = []
    metrics = st.llm.metrics if st.llm is not None else None
    classed: list[str] = []
    rank = metrics.class_rank(slo_class) if metrics is not None else 0
    try:
        if len(prompts) > 1:  # a batch: 400 when it can never fit the queue, 429 when not now
            engine.check_room(len(prompts), rank)
        for pi, ids in enumerate(prompts):
            rid = f"{prefix}-{pi}" if len(prompts) > 1 else prefix
            if pd is not None and pd.handle is not None:
                rid = pd.handle
            if metrics is not None:
                classed += [rid] + [f"{rid}-n{i}" for i in range(1, n)]
                metrics.assign_class(classed[-n:], slo_class)
            streams = engine.add_request_group(
                rid, ids, params[0], arrival_time=arrival, priority=body.priority, slo_rank=rank,
                cache_salt=body.cache_salt,
                forks=[(f"{rid}-n{i}", params[i]) for i in range(1, n)],
                hold_kv=pd is not None and pd.hold_kv, kv_import=pd.kv if pd is not None else None)
            admitted += [(pi * n + i, pi, s) for i, s in enumerate(streams)]
    except (AdmissionError, EngineDeadError, ValueError, TypeError) as e:
        for _, _, s in admitted:
            s.abort()
        if metrics is not None:   # the refused prompt's requests never finish
            metrics.forget(classed[len(admitted):])
        raise _engine_error(st, e, 0)
    return admitted


@dataclass
class _Disagg:
    """A request's part in disaggregated serving: ``hold_kv`` (a remote prefill, admitted under
    ``handle``) or ``kv`` (the prompt's KV pulled from a prefill worker)."""

    hold_kv: bool = False
    handle: str | None = None
    kv: Any = None


async def _disaggregation(st, request: Request, body, prompts: list[list[int]], n: int,
                          fields: dict[str, Any]) -> _Disagg | None:
    """Read the router's disaggregation headers (``goodput.api.disagg``; docs/disaggregation.md).

    :data:`REMOTE_PREFILL_HEADER`: this worker computes the prompt and leases its KV (400 on a
    ``decode`` worker, or for a request of several prompts, ``n > 1``, log-probabilities, echo
    or a grammar: those are served colocated). A KV handle and source: the KV is pulled now (off
    the engine loop); when it cannot be used (role, request kind, mismatch, timeout, error) the
    prompt is prefilled here. None for a plain request."""
    role = st.args.role
    if request.headers.get(REMOTE_PREFILL_HEADER) is not None:
        if role not in PREFILL_ROLES:
            raise _invalid(st, APIError(400, f"this worker's role is {role!r}: it does not compute prompts "
                                             f"for others ({REMOTE_PREFILL_HEADER})", param=REMOTE_PREFILL_HEADER))
        why = _single_choice_only(body, prompts, n, fields)
        if why:
            raise _invalid(st, APIError(400, f"a remote prefill carries one prompt and one plain choice; "
                                             f"{why}", param=REMOTE_PREFILL_HEADER))
        return _Disagg(hold_kv=True, handle=new_id("kv"))
    transfer = disagg.transfer_headers(request)
    if transfer is None:
        return None
    source, handle = transfer
    why = f"this worker's role is {role!r}" if role not in DECODE_ROLES \
        else _single_choice_only(body, prompts, n, fields)
    if why:
        disagg.fallback(st, source, handle, "unsupported", why)
        return None
    res = await disagg.pull_kv(st, source, handle, prompts[0], body.cache_salt)
    return _Disagg(kv=res.kv) if res.kv is not None else None


def _single_choice_only(body, prompts: list[list[int]], n: int, fields: dict[str, Any]) -> str | None:
    """Why a request cannot take part in a KV transfer, or None."""
    if len(prompts) != 1 or n != 1:
        return f"this request has {len(prompts)} prompt(s) x {n} choice(s)"
    if fields:
        return f"it asks for {', '.join(sorted(fields))}"
    if getattr(body, "echo", False):
        return "it asks for echo"
    return None


async def _remote_prefill_answer(st, request: Request, entries, pd: _Disagg, n_prompt: int) -> Response:
    """The prefill worker's answer: the first token and the lease's handle (:class:`PrefillResult`)."""
    results = await _collect(request, [s for _, _, s in entries])
    toks = results[0].token_ids
    info = st.llm.lease_info(pd.handle)
    if not toks or info is None:  # the engine failed the request (its blocks are freed)
        raise APIError(500, "the remote prefill ended without leasing its KV")
    kv = st.llm.kv_layout()
    return JSONResponse(PrefillResult(handle=pd.handle, prompt_tokens=n_prompt, first_token_id=toks[0],
                                      expires_in_s=st.args.kv_lease_seconds, kv=kv,
                                      kv_bytes=kv_payload_bytes(kv, n_prompt)).model_dump())


@dataclass
class _Result:
    """One choice, accumulated from its deltas."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    error: str | None = None

    def add(self, d: RequestDelta) -> None:
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            self.finish_reason, self.error = d.finish_reason, d.error

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.logprobs)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(request: Request, streams: list[RequestStream]) -> list[_Result]:
    """Run non-streamed requests to the end; abort them all if the client disconnects first."""
    async def consume(stream: RequestStream) -> _Result:
        r = _Result()
        async for d in stream:
            r.add(d)
        return r

    work = asyncio.ensure_future(asyncio.gather(*(consume(s) for s in streams)))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    client_left = False
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this handler is cancelled: the requests must not outlive it.
        gone.cancel()
        if not work.done():
            client_left = True
            for s in streams:
                s.abort()  # frees the KV blocks at the next step boundary
            work.cancel()
            # cancel() only requests it: wait until the task is really done before looking at it.
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if client_left:  # (a cancelled gather ends with a CancelledError exception, not "cancelled")
        raise APIError(499, "client closed the request")
    results = work.result()
    for r in results:
        if r.error:
            raise APIError(500, r.error)
    return results


async def _merged(streams: list[tuple[int, RequestStream]]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Deltas of several streams as they come, tagged with their choice index."""
    if len(streams) == 1:
        index, stream = streams[0]
        async for d in stream:
            yield index, d
        return
    queue: asyncio.Queue[tuple[int, RequestDelta] | None] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for d in stream:
                await queue.put((index, d))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in streams]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is None:
                live -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def _sse_stream(streams: list[tuple[int, RequestStream]], first: list[Any],
                      chunk: Callable[[int, RequestDelta], Any], usage_chunk: Callable[[UsageInfo], Any] | None,
                      prompt_tokens: int, continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """``first``: chunks sent before any token; ``chunk(index, delta)``: the chunk of one delta
    of choice ``index``; ``continuous_usage``: every chunk carries ``usage`` so far (vLLM's
    ``stream_options.continuous_usage_stats``)."""
    n_out: dict[int, int] = {}
    try:
        for c in first:
            if continuous_usage:
                c.usage = UsageInfo.of(prompt_tokens, 0)
            yield sse.event(c)
        async for index, d in _merged(streams):
            if d.error:
                yield sse.event(error_body(d.error, "internal_error"))
                break
            n_out[index] = d.num_output_tokens
            c = chunk(index, d)
            if continuous_usage:
                c.usage = UsageInfo.of(prompt_tokens, sum(n_out.values()))
            yield sse.event(c)
        if usage_chunk is not None:
            yield sse.event(usage_chunk(UsageInfo.of(prompt_tokens, sum(n_out.values()))))
        yield sse.DONE
    finally:
        for _, s in streams:
            s.abort()  # no-op when finished; a disconnect cancels us here and frees the blocks


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


def _check_engine_fields(st, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """logit_bias ids inside the vocabulary; the JSON schema of ``response_format`` compiles.
    Returns the schema to enforce (JSON text) or None. 400s name the parameter."""
    vocab = st.llm.config.vocab_size
    bad = [k for k in (body.logit_bias or {}) if vocab is not None and int(k) >= vocab]
    if bad:
        raise _invalid(st, APIError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                         f"[0, {vocab})", param="logit_bias"))
    fmt = getattr(body, "response_format", None)
    mode = body.tool_mode() if isinstance(body, ChatCompletionRequest) else None
    tool = body.named_tool() if mode == "named" else None
    forced = mode in ("named", "required")
    guided = body.guided_schema()
    if sum(x for x in (fmt is not None, forced, guided is not None)) > 1:
        raise _invalid(st, APIError(400, "give one of response_format, a tool_choice that forces a call "
                                         "and structured_outputs/guided_json", param="response_format"))
    if fmt is None and not forced and guided is None:
        return None
    try:
        if forced:
            import json
            schema = json.dumps(parameters_schema(tool) if tool is not None else required_schema(
                body.functions_for_prompt(), parallel=body.parallel_tool_calls is not False))
        elif guided is not None:
            schema = guided
        else:
            schema = fmt.schema_text()
        if schema is not None:
            from goodput.worker.model.structured import schema_grammar
            schema_grammar(schema)
    except ValueError as e:
        where = "tool_choice" if forced else "structured_outputs" if guided is not None \
            else "response_format"
        raise _invalid(st, APIError(400, f"{where}: {e}", param=where))
    return schema


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**_sse_doc(CompletionResponse), **_errors(400, 404, 413, 429, 500, 503)})
async def create_completion(body: CompletionRequest, request: Request):
    """Completions: one choice per prompt and per ``n`` (``index = prompt_index * n + i``);
    ``logprobs: k`` gives the sampled tokens' log-probabilities and the k most likely at each
    position, ``echo`` prepends the prompt (with its log-probabilities when ``logprobs`` is set;
    ``max_tokens: 0`` returns only that), ``best_of > n`` keeps the n choices of highest
    cumulative log-probability."""
    arrival = time.monotonic()
    st = _checked_state(request, body)
    schema = _check_engine_fields(st, body)
    prompts = body.prompts()
    prompt_ids = [await _encode(st, p) if isinstance(p, str) else list(p) for p in prompts]
    tok = st.llm.tokenizer
    echo_only = body.max_tokens == 0  # run one token for the prompt's logits, then drop it
    max_tokens = 1 if echo_only else (body.max_tokens if body.max_tokens is not None
                                      else DEFAULT_COMPLETION_MAX_TOKENS)
    n, keep = body.num_choices, body.n
    fields: dict[str, Any] = {}
    if body.logprobs is not None or n > keep:
        fields["logprobs"] = body.logprobs or 0  # best_of ranks by cumulative logprob
    if body.echo and body.logprobs is not None:
        fields["prompt_logprobs"] = body.logprobs
    if schema is not None:
        fields["json_schema"] = schema
    pd = await _disaggregation(st, request, body, prompt_ids, n, fields)
    entries = _admit_all(st, body, prompt_ids, max_tokens, arrival, n, pd,
                         slo_class=request.headers.get(SLO_CLASS_HEADER), **fields)
    await tie_later(st, request, body, prompt_ids)  # KV events: its chunk keys -> its blocks
    if pd is not None and pd.hold_kv:
        return await _remote_prefill_answer(st, request, entries, pd, len(prompt_ids[0]))
    created, model = now_s(), st.model_name
    n_prompt = sum(len(p) for p in prompt_ids)
    text_of = TokenText(tok)
    prompt_text = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in prompts]
    want_ids, want_lp = body.return_token_ids, body.logprobs is not None

    def prompt_part(pi: int, plp: list[TokenLogprobs | None] | None) -> CompletionLogprobs:
        ids = prompt_ids[pi]
        return completion_logprobs(text_of, plp or [None] * len(ids), ids)[0]

    if body.stream:
        offsets: dict[int, int] = {}  # text_offset of the choice's next token (as unstreamed)

        def chunk(index: int, d: RequestDelta) -> CompletionResponse:
            pi = index // n
            first = index not in offsets
            text, ids = ("", []) if echo_only else (d.text, d.token_ids)
            lp = None
            if want_lp:
                lp, offsets[index] = completion_logprobs(
                    text_of, [] if echo_only else (d.logprobs or []), ids,
                    offsets.get(index, len(prompt_text[pi]) if body.echo else 0))
            else:
                offsets[index] = 0
            if first and body.echo:
                text = prompt_text[pi] + text
                if want_lp:
                    lp = merge_completion_logprobs(prompt_part(pi, d.prompt_logprobs), lp)
            return CompletionResponse(id=rid, created=created, model=model, choices=[CompletionChoice(
                index=index, text=text, logprobs=lp,
                finish_reason=("length" if echo_only else d.finish_reason) if d.finished else None,
                token_ids=ids if want_ids else None,
                prompt_token_ids=prompt_ids[pi] if want_ids and first else None)])

        rid = new_id("cmpl")

        def usage_chunk(u: UsageInfo) -> CompletionResponse:
            if echo_only:
                u = UsageInfo.of(u.prompt_tokens, 0)
            return CompletionResponse(id=rid, created=created, model=model, choices=[], usage=u)

        return StreamingResponse(_sse_stream([(i, s) for i, _, s in entries], [], chunk,
                                             usage_chunk if body.include_usage else None,
                                             n_prompt, body.continuous_usage),
                                 media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

    results = await _collect(request, [s for _, _, s in entries])
    n_generated = 0 if echo_only else sum(len(r.token_ids) for r in results)
    choices = []
    for pi in range(len(prompts)):
        group = results[pi * n:(pi + 1) * n]
        plp = group[0].prompt_logprobs
        if n > keep:
            group = sorted(group, key=lambda r: r.cumulative_logprob, reverse=True)[:keep]
        for i, r in enumerate(group):
            ids = [] if echo_only else r.token_ids
            text = "" if echo_only else "".join(r.text)
            lp = None
            if want_lp:
                lp, _ = completion_logprobs(text_of, [] if echo_only else r.logprobs, ids,
                                            len(prompt_text[pi]) if body.echo else 0)
                if body.echo:
                    lp = merge_completion_logprobs(prompt_part(pi, plp), lp)
            choices.append(CompletionChoice(
                index=pi * keep + i, text=prompt_text[pi] + text if body.echo else text, logprobs=lp,
                finish_reason="length" if echo_only else r.finish_reason,
                token_ids=ids if want_ids else None, prompt_token_ids=prompt_ids[pi] if want_ids else None))
    return CompletionResponse(id=new_id("cmpl"), created=created, model=model, choices=choices,
                              usage=UsageInfo.of(n_prompt, n_generated))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={**_sse_doc(ChatCompletionChunk), **_errors(400, 404, 413, 429, 500, 503)})
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """Chat completions: ``n`` choices (forks sharing the prompt's KV blocks); ``logprobs`` +
    ``top_logprobs``; ``response_format`` json_object / json_schema enforced by a grammar;
    ``tools`` with ``tool_choice`` auto (Hermes ``<tool_call>`` blocks parsed out of the text),
    required (a grammar: at least one call) or named (a grammar: that function's arguments),
    answered as ``message.tool_calls`` or streamed ``delta.tool_calls`` (server/tool_calls.py);
    ``finish_reason`` is ``tool_calls`` when auto or required called a tool."""
    arrival = time.monotonic()
    st = _checked_state(request, body)
    schema = _check_engine_fields(st, body)
    mode = body.tool_mode()
    prompt_ids = await _render_chat(st, body.messages, functions=body.functions_for_prompt())
    max_tokens = body.requested_max_tokens
    if max_tokens is None:
        # As much as the context AND the KV pool allow (prompt + output <= pool tokens);
        # admission names the numbers when not even one token fits.
        cfg = st.llm.config
        n = len(prompt_ids)
        max_tokens = max(1, min(cfg.max_model_len, cfg.kv_capacity_tokens) - n)
    fields: dict[str, Any] = {}
    if body.logprobs:
        fields["logprobs"] = body.top_logprobs or 0
    if schema is not None:
        fields["json_schema"] = schema
    pd = await _disaggregation(st, request, body, [prompt_ids], body.n, fields)
    entries = _admit_all(st, body, [prompt_ids], max_tokens, arrival, body.n, pd,
                         slo_class=request.headers.get(SLO_CLASS_HEADER), **fields)
    await tie_later(st, request, body, [prompt_ids])  # KV events: its chunk keys -> its blocks
    if pd is not None and pd.hold_kv:
        return await _remote_prefill_answer(st, request, entries, pd, len(prompt_ids))
    rid, created, model, n_prompt = new_id("chatcmpl"), now_s(), st.model_name, len(prompt_ids)
    want_ids = body.return_token_ids
    text_of = TokenText(st.llm.tokenizer)
    top_k = body.top_logprobs or 0
    named = body.named_tool()

    def call_id() -> str:
        return new_id("call")

    def new_parser() -> ToolCallParser | None:
        return ToolCallParser("hermes" if mode == "auto" else "array", call_id) \
            if mode in ("auto", "required") else None

    def finish(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" and mode in ("auto", "required") else reason

    if body.stream:
        parsers = {i: new_parser() for i, _, _ in entries}
        named_started: set[int] = set()

        def delta_of(index: int, d: RequestDelta) -> tuple[DeltaMessage, bool]:
            if named is not None:  # every generated character is argument text
                calls = [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=d.text))]
                if index not in named_started:
                    named_started.add(index)
                    calls[0] = DeltaToolCall(index=0, id=call_id(), type="function",
                                             function=DeltaFunctionCall(name=named["name"], arguments=d.text))
                return DeltaMessage(content=None, tool_calls=calls), True
            parser = parsers[index]
            if parser is None:
                return DeltaMessage(content=d.text), False
            p = parser.feed(d.text, final=d.finished)
            calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                   function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                     for c in p.calls] or None
            return DeltaMessage(content=p.content if p.content or not calls else None,
                                tool_calls=calls), parser.num_calls > 0

        def chunk(index: int, d: RequestDelta) -> ChatCompletionChunk:
            delta, called = delta_of(index, d)
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[ChatChunkChoice(
                index=index, delta=delta,
                logprobs=chat_logprobs(text_of, d.logprobs or [], top_k) if body.logprobs else None,
                finish_reason=finish(d.finish_reason, called) if d.finished else None,
                token_ids=d.token_ids if want_ids else None)])

        def usage_chunk(u: UsageInfo) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=u)

        first = [ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i, _, _ in entries],
            prompt_token_ids=prompt_ids if want_ids else None)]
        return StreamingResponse(
            _sse_stream([(i, s) for i, _, s in entries], first, chunk,
                        usage_chunk if body.include_usage else None, n_prompt, body.continuous_usage),
            media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

    results = await _collect(request, [s for _, _, s in entries])

    def message(r: _Result) -> tuple[ChatMessageOut, bool]:
        text = "".join(r.text)
        if named is not None:
            return ChatMessageOut(content=None, tool_calls=[ToolCall(
                id=call_id(), function=FunctionCall(name=named["name"], arguments=text))]), True
        parser = new_parser()
        if parser is None:
            return ChatMessageOut(content=text), False
        p = parser.parse(text)
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in p.calls]
        if not calls:
            return ChatMessageOut(content=p.content), False
        # as vLLM's hermes parser: the text around the calls, or null when there is none
        return ChatMessageOut(content=p.content.strip() or None, tool_calls=calls), True

    choices = []
    for i, r in enumerate(results):
        msg, called = message(r)
        choices.append(ChatChoice(index=i, message=msg, finish_reason=finish(r.finish_reason, called),
                                  logprobs=chat_logprobs(text_of, r.logprobs, top_k) if body.logprobs else None,
                                  token_ids=r.token_ids if want_ids else None))
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=UsageInfo.of(n_prompt, sum(len(r.token_ids) for r in results)),
                                  prompt_token_ids=prompt_ids if want_ids else None)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 404, 413, 503))
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a prompt, or of a chat rendered exactly as ``/v1/chat/completions`` renders
    it (``add_generation_prompt`` true; ``tools`` presented as a chat request with them) —
    ``count`` then equals that request's ``usage.prompt_tokens``. The completions' limits hold:
    the body size (413), and at most max_model_len tokens (400, refused before tokenizing when
    the text's size already proves it). Tokenizing runs off the event loop (the GIL released)."""
    st = _state(request)
    _check_model(st, body.model)
    st.require_engine()
    tok = st.llm.tokenizer
    if body.messages is not None:
        gen = True if body.add_generation_prompt is None else body.add_generation_prompt
        functions = [t.function.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = await _render_chat(st, body.messages, for_generation=False, add_generation_prompt=gen,
                                 functions=functions)
        if body.add_special_tokens and getattr(tok, "add_bos_token", False) and ids[:1] != [tok.bos_token_id]:
            ids = [tok.bos_token_id, *ids]
    else:
        _refuse_if_surely_too_long(st, len(body.prompt.encode("utf-8")), for_generation=False)
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tok.encode, body.prompt, add_special_tokens=add)
    _refuse_over_max_model_len(st, len(ids), "messages" if body.messages is not None else "prompt")
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=st.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 404, 413, 503))
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of ``tokens`` (special tokens spelled out, as vLLM's ``/detokenize`` does); at
    most max_model_len of them (400), decoded off the event loop."""
    st = _state(request)
    _check_model(st, body.model)
    st.require_engine()
    _refuse_over_max_model_len(st, len(body.tokens), "tokens")
    try:
        text = await asyncio.to_thread(st.llm.tokenizer.decode, body.tokens, skip_special_tokens=False)
    except (ValueError, IndexError, OverflowError) as e:
        raise APIError(400, str(e), param="tokens")
    return DetokenizeResponse(prompt=text)
