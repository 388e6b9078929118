"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, errors).

Request models are strict: an unknown field, or an OpenAI parameter this server does not
implement (``suffix``, legacy ``functions`` with entries, ``best_of`` with ``stream`` ...), is a 400 naming
the parameter — never silently ignored. Implemented generation parameters: ``n`` (forks sharing
the prompt's KV blocks), ``best_of`` (non-streamed), ``logprobs`` / ``top_logprobs``, ``echo``
(also with ``max_tokens: 0``), batched ``prompt`` lists, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, vLLM's ``repetition_penalty``, chat
``response_format`` ``json_object`` / ``json_schema`` (a grammar masks the tokens), chat
``tools`` with ``tool_choice`` none / auto / required / named (server/tool_calls.py). Field
types are strict too (pydantic strict types, finite numbers: a bare ``NaN`` is a 400): a
boolean is not an integer (``"prompt": [true]``, ``"max_tokens": true`` are 400), a string is
not a boolean (``"stream": "yes"``), a number is not a string; JSON integers are accepted where
a number is. OpenAI parameters that do not change generation (``user``, ``store``,
``metadata``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
``stream_options.include_obfuscation``) are type-checked and ignored,
as OpenAI-compatible servers do. Extra (non-OpenAI) sampling parameters accepted as vLLM
does: ``top_k``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``cache_salt``,
``priority``, ``return_token_ids``, ``stream_options.continuous_usage_stats``; and goodput's
``speculative`` (true/false: n-gram speculative decoding for this request, overriding
``--speculative-mode``). Field semantics follow the OpenAI API reference for ``/v1/completions`` and
``/v1/chat/completions``.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from goodput.worker.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)


def _utf8(s: str) -> str:
    # JSON may carry lone surrogate escapes ("\ud800"): valid JSON, but not text a tokenizer can
    # encode. Refuse them as bad input instead of failing later.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the string is not valid Unicode text: unpaired surrogate at position "
                         f"{e.start}") from None
    return s


# Strict field types: JSON true is not 1, "yes" is not true, 1 is not "1" (a JSON integer is a
# number, as JSON Schema says).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]  # a bare NaN / Infinity is not a number
Bool = StrictBool
Str = StrictStr
Text = Annotated[StrictStr, AfterValidator(_utf8)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _NullMeansDefault(BaseModel):
    """OpenAI documents most parameters as "<type> or null"; the ``openai`` client sends null for
    a parameter passed as None. Null means the parameter's default here."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None)}
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        # The schema says what the server accepts: null too, for these defaulted fields.
        schema = handler.resolve_ref_schema(handler(core_schema))
        props = schema.get("properties", {})
        for name, f in cls.model_fields.items():
            prop = props.get(name)
            if prop is None or f.default is None or f.is_required():
                continue
            inner = {k: v for k, v in prop.items() if k not in ("title", "default", "description")}
            outer = {k: prop[k] for k in ("title", "default", "description") if k in prop}
            props[name] = {"anyOf": [inner, {"type": "null"}], **outer}
        return schema

FinishReason = Literal["stop", "length", "abort"]
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class UnsupportedParameter(ValueError):
    """An OpenAI parameter (or value) this server does not implement."""

    def __init__(self, param: str, message: str | None = None):
        self.param = param
        super().__init__(message or f"Unsupported parameter: '{param}' is not supported by this server")


# -------------------------------------------------------------------------------------- requests

class StreamOptions(_NullMeansDefault):
    """``include_usage``: one last chunk with ``usage`` and no choices (OpenAI).
    ``continuous_usage_stats`` (vLLM's): every chunk carries ``usage`` so far (prompt tokens,
    completion tokens generated up to that chunk). ``include_obfuscation``: accepted, ignored
    (no obfuscation padding is sent)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False
    continuous_usage_stats: Bool = False
    include_obfuscation: Bool | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``; only ``json`` (a JSON schema, as an object or JSON text)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[Str, Any] | Str = Field(alias="json")


class _SamplingRequest(_NullMeansDefault):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: Str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    n: Int = Field(default=1, ge=1, le=128)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    repetition_penalty: Float = Field(default=1.0, gt=0.0, le=10.0)  # vLLM's; 1 = off
    # vLLM's structured output: {"json": <schema>} (its older spelling: guided_json)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[Str, Any] | Str | None = None
    # OpenAI parameters that do not change generation: type-checked, then ignored.
    user: Str | None = None  # an end-user id for abuse tracking
    store: Bool | None = None  # OpenAI stores completions for its dashboard; nothing is stored here
    metadata: dict[Str, Str] | None = None  # tags for stored completions
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: Str | None = None  # OpenAI's cache routing hint; prefix caching is automatic
    safety_identifier: Str | None = None
    # Extra (non-OpenAI) parameters, as vLLM accepts them.
    top_k: Int = Field(default=0, ge=-1)
    ignore_eos: Bool = False
    min_tokens: Int = Field(default=0, ge=0)
    stop_token_ids: list[Int] | None = None
    cache_salt: Str | None = Field(default=None, min_length=1)  # "" would silently share the cache
    priority: Int = 0
    # goodput's: n-gram speculative decoding for this request (null = the worker's --speculative-mode)
    speculative: Bool | None = None
    # vLLM's extension: choices[].token_ids (generated ids) and the prompt's ids (prompt_token_ids).
    return_token_ids: Bool = False

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for k, b in (v or {}).items():
            if not k.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers as "
                                 f"strings), got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {k}")
        return v

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedParameter` for OpenAI features not implemented here."""
        if self.structured_outputs is not None and self.guided_json is not None:
            raise UnsupportedParameter("guided_json", "give structured_outputs or guided_json, not both")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options is only allowed with stream=true")

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def guided_schema(self) -> str | None:
        """The JSON schema of vLLM's ``structured_outputs.json`` / ``guided_json``, as JSON text."""
        import json
        spec = self.structured_outputs.json_ if self.structured_outputs is not None else self.guided_json
        if spec is None:
            return None
        return spec if isinstance(spec, str) else json.dumps(spec)

    def to_sampling_params(self, max_tokens: int, choice: int = 0, **engine_fields: Any) -> SamplingParams:
        """The engine's parameters for choice number ``choice`` (of ``n``/``best_of``): a seeded
        request's choice i uses seed + i (as vLLM does), so choices differ but each is
        reproducible. ``engine_fields``: logprobs, prompt_logprobs, json_schema."""
        if self.min_tokens > max_tokens:
            raise UnsupportedParameter(
                "min_tokens", f"min_tokens={self.min_tokens} must be <= max_tokens={max_tokens}")
        seed = None if self.seed is None else (self.seed + choice + 2**63) % 2**64 - 2**63
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed,
            max_tokens=max_tokens, stop=self.stop_list,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items()),
            speculative=self.speculative, **engine_fields)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of either
    (a batch: one choice per prompt and per ``n``, ``index = prompt_index * n + i``).
    ``max_tokens: 0`` is allowed with ``echo`` (the prompt's log-probabilities only)."""

    prompt: Text | list[Int] | list[Text] | list[list[Int]]
    max_tokens: Int | None = Field(default=None, ge=0)
    echo: Bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Int | None = Field(default=None, ge=1, le=128)
    suffix: Str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_boolean_ids(cls, v: Any) -> Any:
        # Say it plainly instead of one complaint per member of the union.
        if isinstance(v, list) and any(isinstance(y, bool) for x in v
                                       for y in (x if isinstance(x, list) else [x])):
            raise ValueError("token ids must be integers; true/false are not token ids")
        return v

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise UnsupportedParameter("best_of", f"best_of={self.best_of} must be >= n={self.n}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise UnsupportedParameter("best_of", "best_of > n cannot be streamed (as OpenAI)")
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedParameter("max_tokens", "max_tokens=0 is only allowed with echo=true")
        if self.suffix:
            raise UnsupportedParameter("suffix")
        if isinstance(self.prompt, list) and not self.prompt:
            raise UnsupportedParameter("prompt", "the prompt list is empty")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (one for a plain string or token-id list)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def num_choices(self) -> int:
        """Choices generated per prompt: best_of when given, else n."""
        return self.best_of or self.n


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class FunctionCallIn(BaseModel):
    """An earlier call in the history: ``arguments`` is the JSON text the model wrote."""

    model_config = ConfigDict(extra="forbid")
    name: Str
    arguments: Text


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """One turn. Roles: ``system``, ``developer`` (OpenAI's newer name for system instructions:
    rendered as ``system``, as vLLM and llama.cpp do), ``user``, ``assistant`` (``content`` may
    be null when it has ``tool_calls``), ``tool`` (a result: ``tool_call_id`` and ``content``).
    Any other role, or ``content: null`` anywhere else, is a 400."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Str | None = None

    @model_validator(mode="after")
    def _role_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content' (a string or a list of text parts); "
                             "null content is allowed only in an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"'tool_calls' belongs to assistant messages, not {self.role}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs 'tool_call_id' (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"'tool_call_id' belongs to tool messages, not {self.role}")
        return self

    @property
    def template_role(self) -> str:
        """The role the chat template sees: ``developer`` is ``system``."""
        return "system" if self.role == "developer" else self.role

    def template_dict(self) -> dict[str, Any]:
        """This turn for the chat template (role mapped; text joined; calls and ids kept)."""
        d: dict[str, Any] = {"role": self.template_role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: ``{name, description?, schema, strict?}``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Str
    description: Str | None = None
    schema_: dict[Str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    """``text`` (default), ``json_object`` (any JSON object) or ``json_schema``; the last two are
    enforced by a grammar over the tokens (llguidance)."""

    model_config = ConfigDict(extra="forbid")
    type: Str
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON schema to enforce, as JSON text (None for ``text``)."""
        import json
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            if self.json_schema is None:
                raise UnsupportedParameter("response_format", "response_format json_schema needs "
                                                              "'json_schema': {name, schema}")
            return json.dumps(self.json_schema.schema_ if self.json_schema.schema_ is not None else {})
        return None


class FunctionDef(BaseModel):
    """A function the model may call: ``parameters`` is its arguments' JSON schema (object
    schemas in it are closed unless they say otherwise: OpenAI's strict mode)."""

    model_config = ConfigDict(extra="forbid")
    name: Str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Str | None = None
    parameters: dict[Str, Any] | None = None
    strict: Bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the answer is a call of that function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; the prompt is the model's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (server/tool_calls.py): tools + tool_choice none | auto (the default with
    # tools) | required | a named function; parallel_tool_calls false allows one call at most.
    # The legacy functions / function_call are accepted only where they change nothing.
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[dict[Str, Any]] | None = None
    function_call: Literal["none", "auto"] | dict[Str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not both with different values")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs=true")
        self.named_tool()  # the named function must be among tools
        if self.tool_choice == "required" and not self.tools:
            raise UnsupportedParameter("tool_choice", "tool_choice 'required' needs a non-empty 'tools'")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise UnsupportedParameter("tools", "two tools have the same function name")
        if self.functions:
            raise UnsupportedParameter("functions", "the legacy 'functions' is not supported: send the "
                                                    "same definitions as 'tools'")
        fc = self.function_call
        if fc is not None and fc != "none" and not (fc == "auto" and not self.functions):
            raise UnsupportedParameter("function_call", f"function_call={fc!r} is not supported: use "
                                                        "tool_choice")
        if self.response_format is not None and self.tool_mode() in ("required", "named"):
            raise UnsupportedParameter("response_format", "give response_format or a tool_choice that "
                                                          "forces a call, not both")
        if self.response_format is not None and \
                self.response_format.type not in ("text", "json_object", "json_schema"):
            raise UnsupportedParameter(
                "response_format", f"response_format type {self.response_format.type!r} is not supported "
                                   "(text, json_object, json_schema)")

    def named_tool(self) -> dict[str, Any] | None:
        """The function named by ``tool_choice: {"type": "function", "function": {"name"}}``
        (its entry in ``tools`` as a dict: name, description, parameters), or None. The answer is
        a call of it, its arguments generated under the parameters' closed JSON schema (the same
        grammar engine as ``response_format``). UnsupportedParameter when the name is not among
        ``tools``."""
        choice = self.tool_choice
        if not isinstance(choice, NamedToolChoice):
            return None
        for tool in self.tools or ():
            if tool.function.name == choice.function.name:
                return tool.function.model_dump(exclude_none=True)
        raise UnsupportedParameter("tool_choice", f"tool_choice names function {choice.function.name!r}, "
                                                  "which is not in tools")

    def tool_mode(self) -> Literal["auto", "required", "named"] | None:
        """How tools are used: None (no tools, or ``tool_choice: "none"``), ``"auto"`` (the
        default when tools are given), ``"required"`` or ``"named"``."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def functions_for_prompt(self) -> list[dict[str, Any]] | None:
        """The functions the prompt presents (as dicts), or None when tools are not in use."""
        if self.tool_mode() is None:
            return None
        return [t.function.model_dump(exclude_none=True) for t in self.tools or ()]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): ``prompt`` (raw text; special-token text in it becomes
    control tokens, as in a completion prompt) or ``messages`` (rendered by the chat template;
    special-token text in a message stays text). ``add_generation_prompt`` (messages only,
    default true) appends the assistant header, as a chat completion does.
    ``add_special_tokens``: prepend BOS where the model asks for it (default true for
    ``prompt``, false for ``messages``: the template writes its own), as vLLM does."""

    model_config = ConfigDict(extra="forbid")
    model: Str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDef] | None = None  # presented as a chat request with tools presents them
    add_generation_prompt: Bool | None = None
    add_special_tokens: Bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if self.prompt is None and self.messages is None:
            raise ValueError("missing 'prompt' (text) or 'messages' (a chat): give exactly one")
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give 'prompt' or 'messages', not both")
        if self.add_generation_prompt is not None and self.messages is None:
            raise ValueError("'add_generation_prompt' applies to 'messages' only")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' applies to 'messages' only")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int | None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): the text of ``tokens`` (special tokens included, as vLLM
    does); 400 naming the first id outside the vocabulary."""

    model_config = ConfigDict(extra="forbid")
    model: Str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


class AdminLimits(BaseModel):
    """``PUT /admin/limits``: runtime admission limits (omitted fields stay unchanged)."""

    model_config = ConfigDict(extra="forbid")
    max_num_seqs: Int | None = Field(default=None, ge=1)
    max_waiting: Int | None = Field(default=None, ge=0)
    max_waiting_tokens: Int | None = Field(default=None, ge=0)


# ------------------------------------------------------------------------------------- responses

class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


_OMIT_NONE = Field(default=None, exclude_if=lambda v: v is None)


LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token of probability 0 is reported so (as vLLM)


class CompletionLogprobs(BaseModel):
    """Legacy completions ``logprobs``: per token its text, log-probability (null for the first
    prompt token with echo), the top alternatives ``{text: logprob}`` and the character offset
    of the token in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat ``logprobs``: ``content`` has one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = _OMIT_NONE  # only with return_token_ids
    prompt_token_ids: list[int] | None = _OMIT_NONE  # with return_token_ids (first chunk when streamed)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _OMIT_NONE  # the calls the model made (tools)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    token_ids: list[int] | None = _OMIT_NONE  # only with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = _OMIT_NONE  # only with return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = _OMIT_NONE  # on a call's first delta
    arguments: str  # a piece of the arguments' JSON text ("" on the first delta)


class DeltaToolCall(BaseModel):
    """A streamed piece of call ``index``: its first delta has ``id``, ``type`` and the name."""

    index: int
    id: str | None = _OMIT_NONE
    type: Literal["function"] | None = _OMIT_NONE
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _OMIT_NONE
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = _OMIT_NONE


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    token_ids: list[int] | None = _OMIT_NONE  # only with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _OMIT_NONE  # with return_token_ids, on the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "goodput"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
