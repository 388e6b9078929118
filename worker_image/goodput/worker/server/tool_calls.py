"""Tool calling for chat completions: the prompt side (tools and earlier calls rendered for the
chat template) and the output side (tool calls parsed out of the generated text, incrementally).

Format: Hermes-style, the one Qwen-family and SmolLM2-family chat templates teach their models —
each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text,
each tool result comes back in a ``<tool_response>...</tool_response>`` user turn. The reference
behaviour is vLLM's ``--tool-call-parser hermes`` (its OpenAI-compatible server); the wire format
is OpenAI's Chat Completions API (``tools``, ``tool_choice``, ``message.tool_calls``, streamed
``delta.tool_calls[{index, id, type, function: {name, arguments}}]`` whose ``arguments`` pieces
concatenate to the call's JSON text).

``tool_choice`` modes (:func:`tool_mode`):

- ``"auto"`` (the default when ``tools`` is non-empty): the model writes text and/or calls; the
  :class:`ToolCallParser` in ``"hermes"`` mode splits them.
- ``"required"``: the output is constrained (JSON-schema grammar) to a JSON array of
  ``{"name": <one of the tools>, "arguments": <its parameters>}`` objects, at least one (at most
  one with ``parallel_tool_calls: false``), parsed in ``"array"`` mode — as vLLM does.
- named (``{"type": "function", "function": {"name"}}``): the output is constrained to that
  function's ``arguments`` (no parser: every generated character is argument text).
- ``"none"``: tools are left out of the prompt and nothing is parsed.

Parameter schemas are closed objects unless they say otherwise (:func:`closed_schema`): OpenAI's
strict mode, without which a grammar lets a model invent keys until ``max_tokens``.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ToolMode = Literal["auto", "required", "named"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


# ------------------------------------------------------------------------------------- schemas

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "unevaluatedProperties", "propertyNames")


def closed_schema(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema that does not say
    ``additionalProperties`` gets ``additionalProperties: false`` (OpenAI's strict mode for
    function parameters). A schema "is an object" when its ``type`` is or includes ``"object"``
    or it has ``properties``. Sub-schemas (properties, items, anyOf/oneOf/allOf, $defs ...) are
    closed too; anything that is not a dict is returned as is."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_schema(out[key])
    typ = out.get("type")
    is_object = typ == "object" or (isinstance(typ, list) and "object" in typ) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def parameters_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    """The closed JSON schema of a function's arguments (``{"type": "object"}`` when the
    function declares no ``parameters``: an empty object, as OpenAI treats it)."""
    params = function.get("parameters")
    return closed_schema(params if params else {"type": "object", "properties": {}})


def required_schema(functions: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``'s output: an array of at least one call
    ``{"name": <const>, "arguments": <closed parameters>}`` of the given functions (one at most
    when ``parallel`` is false)."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                "arguments": parameters_schema(f)},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# -------------------------------------------------------------------------------------- prompt

def tools_system_text(functions: Sequence[Mapping[str, Any]]) -> str:
    """Instructions listing the functions (one JSON signature per line inside ``<tools>``) and
    the call format, for chat templates that do not render ``tools`` themselves."""
    sigs = "\n".join(json.dumps({"type": "function", "function": dict(f)}, ensure_ascii=False)
                     for f in functions)
    return ("# Tools\n\nYou can call functions to help answer the user. Their signatures, one per "
            f"line, are inside <tools></tools> tags:\n<tools>\n{sigs}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags, one per call:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def template_messages(messages: Sequence[Mapping[str, Any]], functions: Sequence[Mapping[str, Any]] | None,
                      native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (dicts: role, content, and ``tool_calls`` / ``tool_call_id`` where given) as the
    chat template gets them, plus extra template variables.

    ``native`` (the template renders ``tools`` itself, as Qwen's does): messages pass through with
    each call's ``arguments`` parsed to an object (Hugging Face's convention) and
    ``{"tools": [...]}`` is a template variable. Otherwise the Hermes conventions are written
    into plain turns: the tool instructions (:func:`tools_system_text`) join the system message
    (one is added first when there is none), an assistant turn's calls become
    ``<tool_call>`` blocks after its text, and consecutive ``tool`` results become one user turn
    of ``<tool_response>`` blocks. ``functions`` None: no tools in the prompt."""
    if native:
        out = []
        for m in messages:
            d = dict(m)
            if d.get("tool_calls"):
                d["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments_value(c["function"]["arguments"])}} for c in d["tool_calls"]]
            out.append(d)
        return out, ({"tools": [{"type": "function", "function": dict(f)} for f in functions]}
                     if functions else {})
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": _arguments_value(c["function"]["arguments"])},
                                                    ensure_ascii=False) + f"\n{CALL_CLOSE}"
                      for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for d in out:
        d.pop("_tool_results", None)
    if functions:
        text = tools_system_text(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" if out[0]["content"] else "") + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


# ---------------------------------------------------------------------------------- the output

@dataclass
class ToolCallDelta:
    """A piece of one call: the first piece of call ``index`` has its ``id`` and ``name`` (and
    ``arguments`` "" or the whole text); later pieces carry only ``arguments`` text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    """What one piece of generated text adds: ``content`` text and call pieces."""

    content: str
    calls: list[ToolCallDelta]


# The start of a call object, when the model writes the name first (as the formats teach):
# {"name": "<name>", "arguments": <the value follows>
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_OUTSIDE = "outside"
_HEADER = "header"
_ARGS = "args"
_TAIL = "tail"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Splits generated text into content and tool calls, incrementally.

    mode ``"hermes"`` (``tool_choice: "auto"``): text outside ``<tool_call>...</tool_call>`` is
    content (a possible start of the tag is held back until it is decided); inside, a
    ``{"name", "arguments"}`` object is a call. mode ``"array"`` (``"required"``): the text is a
    JSON array of such objects and nothing is content.

    A call whose object starts ``{"name": "...", "arguments": `` streams: its name as soon as it
    is complete, then its arguments text as it is generated (ending where the JSON value ends).
    Any other block (keys in another order, ``"parameters"``) is parsed whole at its closing tag;
    a block that is not a JSON object with a string ``name`` stays content, as vLLM's hermes
    parser leaves it. Arguments given as an object are kept as the model wrote them; a string
    value is taken as the JSON text. ``new_id()`` makes each call's id.

    ``feed(text, final)`` returns a :class:`ParsedDelta`; with ``final`` everything held back is
    decided (an unclosed block: a call if it parses or has already started streaming, else
    content). The pieces of all deltas concatenate to :meth:`parse`'s result of the whole text.
    """

    def __init__(self, mode: Literal["hermes", "array"], new_id) -> None:
        self.mode = mode
        self._new_id = new_id
        self._buf = ""
        self._state = _OUTSIDE
        self.num_calls = 0
        # argument scanner state
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._started = False
        self._scalar = False

    # -- helpers
    def _start_call(self, name: str, arguments: str) -> ToolCallDelta:
        d = ToolCallDelta(self.num_calls, arguments, id=self._new_id(), name=name)
        self.num_calls += 1
        return d

    def _scan_args(self, text: str) -> int | None:
        """Consume argument characters; the index just past the value's end, or None."""
        for i, ch in enumerate(text):
            if not self._started:
                if ch.isspace():
                    continue
                self._started = True
                if ch in "{[":
                    self._depth = 1
                elif ch == '"':
                    self._in_str, self._scalar = True, True
                else:
                    self._scalar = True
                continue
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._scalar and self._depth == 0:
                        return i + 1
                continue
            if self._scalar and self._depth == 0:
                if ch in ",}]" or ch.isspace():
                    return i
                continue
            if ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _whole_block(self, block: str) -> ToolCallDelta | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return self._start_call(obj["name"], text)

    # -- the machine
    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            buf = self._buf
            if self._state == _OUTSIDE:
                opener = CALL_OPEN if self.mode == "hermes" else "{"
                i = buf.find(opener)
                if i < 0:
                    keep = 0 if final or self.mode == "array" else _held_prefix(buf, opener)
                    if self.mode == "hermes":
                        content.append(buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    break
                if self.mode == "hermes":
                    content.append(buf[:i])
                    self._buf = buf[i + len(opener):]
                else:
                    self._buf = buf[i:]  # the object's "{" is part of it
                self._state = _HEADER
            elif self._state == _HEADER:
                m = _HEAD.match(buf)
                if m is not None:
                    name = json.loads(f'"{m.group(1)}"')
                    calls.append(self._start_call(name, ""))
                    self._buf = buf[m.end():]
                    self._state = _ARGS
                    self._depth, self._in_str, self._esc, self._started, self._scalar = 0, False, False, False, False
                    continue
                end = buf.find(CALL_CLOSE) if self.mode == "hermes" else -1
                if end >= 0 or final:
                    block = buf[:end] if end >= 0 else buf
                    call = self._whole_block(block.strip()) if self.mode == "hermes" else None
                    if call is not None:
                        calls.append(call)
                    elif self.mode == "hermes":
                        content.append(CALL_OPEN + block + (CALL_CLOSE if end >= 0 else ""))
                    self._buf = buf[end + len(CALL_CLOSE):] if end >= 0 else ""
                    self._state = _OUTSIDE
                    if final and end < 0:
                        break
                    continue
                break
            elif self._state == _ARGS:
                if not self._started:  # whitespace before the value is not argument text
                    buf = buf.lstrip()
                end = self._scan_args(buf)
                piece = buf if end is None else buf[:end]
                if piece:
                    calls.append(ToolCallDelta(self.num_calls - 1, piece))
                self._buf = "" if end is None else buf[end:]
                if end is None:
                    break
                self._state = _TAIL
            else:  # _TAIL: the rest of the object (and the closing tag)
                closer = CALL_CLOSE if self.mode == "hermes" else "}"
                j = buf.find(closer)
                if j < 0:
                    if final:
                        self._buf = ""
                    break
                self._buf = buf[j + len(closer):]
                self._state = _OUTSIDE
        return ParsedDelta("".join(content), _merge(calls))

    def parse(self, text: str) -> ParsedDelta:
        """The whole text at once (a non-streamed answer)."""
        return self.feed(text, final=True)


def _merge(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent pieces of the same call joined (one entry per call per delta)."""
    out: list[ToolCallDelta] = []
    for c in calls:
        if out and out[-1].index == c.index and c.id is None:
            out[-1].arguments += c.arguments
        else:
            out.append(ToolCallDelta(c.index, c.arguments, c.id, c.name))
    return out
