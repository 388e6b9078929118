"""The tool-call parser and schema helpers (pure): Hermes ``<tool_call>`` blocks and
``tool_choice: "required"`` arrays split into content and calls, the same whether the text comes
whole or one character at a time; parameter schemas closed as OpenAI's strict mode closes them."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.worker.server.tool_calls import (
    ToolCallParser,
    closed_schema,
    required_schema,
    template_messages,
)


def _ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def _collect(mode: str, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed ``pieces`` one by one; (content, calls as {id, name, arguments}) accumulated the way
    an OpenAI client accumulates streamed deltas."""
    p = ToolCallParser(mode, _ids())
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        d = p.feed(piece, final=i == len(pieces) - 1)
        content += d.content
        for c in d.calls:
            if c.id is not None:
                assert c.index not in calls
                calls[c.index] = {"id": c.id, "name": c.name, "arguments": c.arguments}
            else:
                calls[c.index]["arguments"] += c.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": [1, 2], "note": "a \\"quoted\\" } brace"}}\n</tool_call>\n<tool_call>\n'
          '{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>')
# written by hand from HERMES: the text before the first block, and the two calls
HERMES_CONTENT = "Let me check.\n"
HERMES_CALLS = [("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a "quoted" } brace'}),
                ("search", {"q": "x"})]


@pytest.mark.parametrize("chunking", ["whole", "chars", "pairs"])
def test_hermes_blocks_become_calls_whole_or_streamed(chunking):
    text = HERMES
    pieces = {"whole": [text], "chars": list(text), "pairs": [text[i:i + 2] for i in range(0, len(text), 2)]}
    content, calls = _collect("hermes", pieces[chunking])
    assert content.strip() == HERMES_CONTENT.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == HERMES_CALLS
    assert [c["id"] for c in calls] == ["call-0", "call-1"]


def test_streamed_arguments_arrive_before_the_block_closes():
    """The name-first call streams: the name once it is complete, then argument text as it comes."""
    p = ToolCallParser("hermes", _ids())
    assert p.feed("<tool_call>\n{\"name\": \"f\", ").calls == []
    d = p.feed('"arguments": {"a": 1')
    assert [(c.index, c.id, c.name) for c in d.calls] == [(0, "call-0", "f")]
    assert "".join(c.arguments for c in d.calls) == '{"a": 1'
    d = p.feed('2}}\n</tool_call>')
    assert [(c.index, c.id, c.arguments) for c in d.calls] == [(0, None, "2}")]


def test_text_that_only_looks_like_a_tag_is_content():
    content, calls = _collect("hermes", list("a < b and <tool not a call>"))
    assert content == "a < b and <tool not a call>" and calls == []
    bad = "<tool_call>not json</tool_call> tail"
    content, calls = _collect("hermes", [bad])
    assert content == bad and calls == []
    # held back while it may still be the tag, released at the end
    p = ToolCallParser("hermes", _ids())
    assert p.feed("x <tool_").content == "x "
    assert p.feed("", final=True).content == "<tool_"


def test_an_unclosed_block_at_the_end_still_yields_its_call():
    content, calls = _collect("hermes", ['<tool_call>{"name": "f", "arguments": {"a": 1}}'])
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": 1})]


ARRAY = '[{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}, {"name": "b", "arguments": {}}]'


@pytest.mark.parametrize("step", [1, 3, len(ARRAY)])
def test_required_array_is_all_calls(step):
    content, calls = _collect("array", [ARRAY[i:i + step] for i in range(0, len(ARRAY), step)])
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("a", {"x": [1, {"y": "}"}]}), ("b", {})]


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(HERMES)), max_size=12))
def test_any_chunking_gives_the_whole_text_result(cuts):
    bounds = sorted(set(cuts) | {0, len(HERMES)})
    pieces = [HERMES[a:b] for a, b in zip(bounds, bounds[1:])] or [HERMES]
    assert _collect("hermes", pieces) == _collect("hermes", [HERMES])


def test_closed_schema_closes_every_object_that_does_not_say():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "c": {"type": "array", "items": {"properties": {"d": {"type": "integer"}}}},
        "e": {"type": "object", "additionalProperties": True},
        "f": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
        "$defs": {"G": {"type": "object"}}}
    out = closed_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["e"]["additionalProperties"] is True  # it says otherwise
    assert out["properties"]["f"]["anyOf"] == [{"type": "object", "additionalProperties": False}, {"type": "null"}]
    assert out["$defs"]["G"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy


def test_required_schema_is_an_array_of_named_calls():
    fns = [{"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
           {"name": "b"}]
    s = required_schema(fns, parallel=False)
    assert s["type"] == "array" and s["minItems"] == 1 and s["maxItems"] == 1
    first, second = s["items"]["anyOf"]
    assert first["properties"]["name"] == {"const": "a"}
    assert first["properties"]["arguments"]["additionalProperties"] is False
    assert second["properties"]["arguments"] == {"type": "object", "properties": {}, "additionalProperties": False}


def test_template_messages_write_hermes_turns_for_a_template_without_tools():
    fns = [{"name": "f", "parameters": {"type": "object"}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "tool", "content": "43", "tool_call_id": "c2"}]
    out, extra = template_messages(msgs, fns, native=False)
    assert extra == {}
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "f"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>"
    native, extra = template_messages(msgs, fns, native=True)
    assert extra == {"tools": [{"type": "function", "function": fns[0]}]}
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
