"""Tool calling as agent frameworks use it, through a real HTTP server and real clients.

Against the real model (``server_main``): ``tool_choice: "required"`` and a named function (a
grammar forces the call; streamed and not, the streamed deltas add up to the unstreamed answer),
parameter schemas closed as OpenAI's strict mode closes them (LangChain's
``with_structured_output(method="function_calling")`` returns the parsed object), instructor
streaming a tool call into partial objects, ``tool_choice: "auto"`` accepted from LangChain's
``bind_tools``, earlier calls and tool results in the history.

A 135M model does not choose to call tools by itself, so the Hermes parser of ``"auto"`` is also
driven end to end by a scripted model: the real server and engine (scheduler, detokenizer) over a
runner that writes a fixed text byte by byte — the expected calls are written by hand from it.

langchain-openai and instructor are optional test dependencies: their tests are skipped when
they are not installed.
"""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel

from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import RunnerOutput
from goodput.worker.engine.scheduler import Scheduler
from goodput.worker.engine_args import EngineArgs
from goodput.worker.llm_engine import LLMEngine
from goodput.worker.metrics import WorkerMetrics
from goodput.worker.server.app import create_app

pytestmark = pytest.mark.slow
TIMEOUT = 120

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server_main):
    return openai.OpenAI(base_url=server_main.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _accumulate(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, calls {index: {id, name, arguments}} and finish reason of a streamed answer, put
    together the way OpenAI's docs tell clients to (arguments pieces concatenated)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert slot["id"] is None, "a call's id comes once"
                    slot["id"] = tc.id
                if tc.function.name:
                    slot["name"] = tc.function.name
                slot["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, calls, finish


def _check_city_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)  # closed: no invented keys
    return args


# ------------------------------------------------------------------------ the real model

def test_required_calls_a_listed_tool_streamed_or_not(client):
    kw = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
              max_tokens=80, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        _check_city_args(c.function.arguments)
    assert len({c.id for c in calls}) == len(calls)
    content, streamed, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == \
        [(c.function.name, c.function.arguments) for c in calls]
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_named_tool_streams_its_arguments(client):
    kw = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop"  # named: OpenAI says "stop"
    content, streamed, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
    assert finish == "stop" and content == "" and list(streamed) == [0]
    assert streamed[0]["name"] == "get_weather" and streamed[0]["id"]
    assert streamed[0]["arguments"] == whole.message.tool_calls[0].function.arguments
    _check_city_args(streamed[0]["arguments"])


def test_open_parameter_schemas_are_closed_so_the_call_ends(client):
    """Parameters without ``additionalProperties`` (what LangChain and instructor send): the call
    has only the declared keys and ends on its own (finish "stop"), instead of inventing keys
    until max_tokens."""
    params = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = client.chat.completions.create(
        model="smollm2", max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Extract: Anna is 31 years old."}],
        tools=[{"type": "function", "function": {"name": "Person", "parameters": params}}],
        tool_choice={"type": "function", "function": {"name": "Person"}})
    assert r.choices[0].finish_reason == "stop"
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert set(args) == {"name", "age"} and isinstance(args["age"], int)


def test_auto_with_history_of_calls_and_results_is_answered(client, server_main):
    """tool_choice auto (the default with tools), after an earlier call and its result: a normal
    answer; the prompt carries the tools and the call/result turns (seen in /tokenize)."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C, sunny"}]
    r = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = httpx.post(server_main.url + "/tokenize", json={"messages": history, "tools": [WEATHER]},
                     timeout=TIMEOUT).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    text = httpx.post(server_main.url + "/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text


class Weather(BaseModel):
    city: str


def test_langchain_bind_tools_auto_and_structured_output(server_main):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server_main.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                        max_tokens=60, max_retries=0, timeout=TIMEOUT)
    msg = llm.bind_tools([WEATHER], tool_choice="auto").invoke("What is the weather in Paris?")
    assert isinstance(msg.content, str)
    for call in msg.tool_calls:  # the model may answer in text; a call it makes is well formed
        assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    forced = llm.bind_tools([WEATHER], tool_choice="required").invoke("What is the weather in Paris?")
    assert forced.tool_calls and forced.tool_calls[0]["name"] == "get_weather"
    assert set(forced.tool_calls[0]["args"]) == {"city"}
    out = llm.with_structured_output(Weather, method="function_calling").invoke("What is the weather in Paris?")
    assert isinstance(out, Weather) and out.city


def test_instructor_streams_a_tool_call_into_partial_objects(server_main):
    instructor = pytest.importorskip("instructor")
    raw = openai.OpenAI(base_url=server_main.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    ic = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    partials = list(ic.chat.completions.create_partial(
        model="smollm2", response_model=Weather, max_tokens=60, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}]))
    assert len(partials) > 1  # streamed: the object grows as argument pieces arrive
    assert isinstance(partials[-1].city, str) and partials[-1].city
    whole = ic.chat.completions.create(model="smollm2", response_model=Weather, max_tokens=60, temperature=0,
                                       max_retries=0, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert whole.city == partials[-1].city


# ------------------------------------------------------------------- a scripted model ("auto")

EOS = 0


class ScriptRunner:
    """Writes ``self.script`` one byte token per step (then EOS), whatever the prompt."""

    script = ""

    def execute(self, sched_out):
        data = self.script.encode()
        return RunnerOutput({c.request_id: data[c.num_output_tokens] if c.num_output_tokens < len(data) else EOS
                             for c in sched_out.chunks if c.sample})


class ChatByteTokenizer:
    """Bytes as tokens; a chat renders as ``role: content`` lines (its template has no ``tools``:
    the server writes the Hermes tool instructions into the system turn)."""

    chat_template = "{{ role }}: {{ content }}"
    add_bos_token = False

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


@pytest.fixture(scope="module")
def scripted():
    from server_utils import ServerThread

    runner = ScriptRunner()

    def factory(args):
        cfg = EngineConfig(num_blocks=512, max_model_len=4096, block_size=16, eos_token_ids=(EOS,),
                           max_num_batched_tokens=4096)
        eng = LLMEngine(cfg, Scheduler(cfg), runner, ChatByteTokenizer())
        eng.metrics = WorkerMetrics("scripted", eng.stats)
        return eng

    app = create_app(EngineArgs(model="scripted", served_model_name="scripted"), engine_factory=factory,
                     admin_token="")
    with ServerThread(app) as srv:
        for _ in range(600):
            try:
                if httpx.get(srv.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        yield srv.url, runner


SCRIPT = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris, France"}}\n</tool_call>')


def test_auto_parses_hermes_calls_streamed_or_not(scripted):
    url, runner = scripted
    runner.script = SCRIPT
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    kw = dict(model="scripted", messages=ASK, tools=[WEATHER, TIME], max_tokens=300)
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me look that up."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris, France"})]
    content, calls, finish = _accumulate(c.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and content.strip() == "Let me look that up."
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris, France"})]
    # plain text, and a block that is not a call, stay content
    runner.script = "No tools needed. <tool_call>not json</tool_call>"
    r = c.chat.completions.create(**kw)
    assert r.choices[0].message.content == runner.script and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    # with tool_choice "none" the text is never parsed
    runner.script = SCRIPT
    r = c.chat.completions.create(**kw, tool_choice="none")
    assert r.choices[0].message.content == SCRIPT and r.choices[0].finish_reason == "stop"


def test_the_prompt_presents_the_tools_to_a_template_without_them(scripted):
    url, runner = scripted
    ids = httpx.post(url + "/tokenize", json={"messages": ASK, "tools": [WEATHER]}, timeout=TIMEOUT).json()["tokens"]
    text = bytes(ids).decode()
    assert text.startswith("system: # Tools") and json.dumps(WEATHER) in text
    assert text.endswith("user: What is the weather in Paris?\nassistant: ")


def test_langchain_bind_tools_auto_gets_the_calls(scripted):
    lc = pytest.importorskip("langchain_openai")
    url, runner = scripted
    runner.script = SCRIPT
    llm = lc.ChatOpenAI(base_url=url + "/v1", api_key="unused", model="scripted", max_tokens=300, max_retries=0,
                        timeout=TIMEOUT)
    msg = llm.bind_tools([WEATHER, TIME], tool_choice="auto").invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris, France"})]
    chunks = list(llm.bind_tools([WEATHER, TIME]).stream("What is the weather in Paris?"))
    whole = chunks[0]
    for ch in chunks[1:]:
        whole = whole + ch
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris, France"})]
