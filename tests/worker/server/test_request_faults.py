"""Faults found by using the worker as its clients do, each through a real server and the real
``openai`` client: a batch that can never fit the waiting queue (400 naming the limit, never a
429 a client would retry forever), the ``developer`` role, unknown roles, ``content: null``,
a bare NaN, and ``/tokenize`` / ``/detokenize`` under the completions' limits and off the event
loop."""
from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
TIMEOUT = 120


@pytest.fixture(scope="module")
def client(server_main):
    # max_retries=0: a 429 here would be retried by a default client; the test wants the first answer
    return openai.OpenAI(base_url=server_main.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _state(url: str) -> dict:
    return httpx.get(url + "/admin/state", timeout=TIMEOUT).json()


# ------------------------------------------------------------------- never fits: 400, not 429

@pytest.mark.parametrize("extra", [1, 64])  # max_waiting + 1, and max_waiting + max_num_seqs
def test_a_batch_larger_than_the_waiting_queue_is_a_400_naming_the_limit(client, server_main, extra):
    """server_main: max_waiting 256 (the default), max_num_seqs 64. A batch enters the waiting
    queue whole, so 257 or 320 prompts can never be admitted on even an idle server: 400 (code
    never_fits) naming max_waiting and its flag; nothing is admitted."""
    url = server_main.url
    limit = _state(url)["limits"]["max_waiting"]
    assert limit == 256
    before = _state(url)["counters"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="smollm2", prompt=["Hi"] * (limit + extra), max_tokens=1)
    err = ei.value.body
    assert err["code"] == "never_fits" and err["param"] == "prompt"
    assert f"max_waiting={limit}" in err["message"] and "--max-waiting" in err["message"]
    after = _state(url)["counters"]
    assert after["admitted"] == before["admitted"]
    assert after["rejected"]["never_fits"] == before["rejected"]["never_fits"] + 1
    assert after["rejected"]["queue_full"] == before["rejected"]["queue_full"]


# ------------------------------------------------------------------------------ roles, content

def _tokens(url: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(url + "/tokenize", json={"messages": messages}, timeout=TIMEOUT)


def test_developer_role_is_the_system_role(client, server_main):
    """OpenAI's newer clients send system instructions as ``developer``: the prompt is exactly the
    one a ``system`` message gives (and so the template's default system prompt is not added)."""
    url = server_main.url
    dev = _tokens(url, [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}])
    sys_ = _tokens(url, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}])
    assert dev.status_code == sys_.status_code == 200
    assert dev.json()["tokens"] == sys_.json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": dev.json()["tokens"]}, timeout=TIMEOUT).json()["prompt"]
    assert "developer" not in text and "SmolLM" not in text  # no untrained turn, no default system prompt
    r = client.chat.completions.create(model="smollm2", max_tokens=2, messages=[
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}])
    assert r.usage.prompt_tokens == len(sys_.json()["tokens"])


@pytest.mark.parametrize("messages,param,words", [
    ([{"role": "narrator", "content": "x"}], "messages.0.role", "'user'"),
    ([{"role": "user", "content": None}], "messages.0", "null content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "messages.0", "null content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}], "messages.1", "tool_calls"),
])
def test_unknown_roles_and_null_content_are_400s(client, messages, param, words):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
    assert ei.value.body["param"] == param and words in ei.value.body["message"]


def test_a_bare_nan_is_a_400_saying_it_is_not_a_number(server_main):
    """Python's json writes NaN bare (not valid JSON, but the server's parser reads it): the 400
    says a finite number is needed, not "should be <= 2"."""
    for field in ("temperature", "top_p", "presence_penalty"):
        body = '{"prompt": "Hi", "max_tokens": 1, "%s": NaN}' % field
        r = httpx.post(server_main.url + "/v1/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=TIMEOUT)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field, r.text
        assert "finite number" in err["message"] and "less than" not in err["message"]
    r = httpx.post(server_main.url + "/v1/completions", content='{"prompt": "Hi", "logit_bias": {"5": Infinity}}',
                   headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 400 and "finite number" in r.json()["error"]["message"]


# -------------------------------------------------------------- /tokenize and /detokenize limits

def test_tokenize_and_detokenize_take_at_most_max_model_len_tokens(server_main):
    url = server_main.url
    limit = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["max_model_len"]
    assert limit == 512
    r = httpx.post(url + "/detokenize", json={"tokens": [28] * (limit + 1)}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert f"max_model_len ({limit})" in r.json()["error"]["message"]
    assert httpx.post(url + "/detokenize", json={"tokens": [28] * limit}, timeout=TIMEOUT).status_code == 200
    # "a " is one token per word here: 600 words are 600 tokens (more than 512), 100 are 100
    r = httpx.post(url + "/tokenize", json={"prompt": "a " * 600}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["code"] == "never_fits"
    assert f"max_model_len ({limit})" in r.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={"prompt": "a " * 100}, timeout=TIMEOUT).json()["count"] <= 101
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "a " * 600}]}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.fixture(scope="module")
def server_long_context():
    """max_model_len 8192 (the model's whole context): a 1.2 MB prompt passes the size check
    (8192 tokens x at most 162 bytes per token) and must really be tokenized."""
    from conftest import start_server
    server = start_server(["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "8192"])
    yield server
    server.stop()


LIVENESS_TIMEOUT_S = 2.0  # the operator's liveness probe timeout: the contract /health must meet


def test_huge_tokenize_calls_leave_health_and_streams_alone(server_long_context):
    """Four ~7 MiB /tokenize calls (refused from their size alone) and four 1.2 MB ones (tokenized
    off the event loop with the GIL released, then refused for their count) while /health is
    polled and a stream runs: every poll answers 200 within the liveness timeout, polls are
    answered while the big calls are in flight, and the stream runs to [DONE]."""
    import threading

    url = server_long_context.url
    huge, long_ = "a " * (7 * 2**19), "a " * 600_000  # 7 MiB; 1.2 MB
    results: dict[str, list] = {"tokenize": [], "health": [], "health_during": []}
    busy = threading.Event()

    def tokenize(text: str) -> None:
        r = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=TIMEOUT)
        results["tokenize"].append((len(text), r.status_code, r.json()["error"]))

    def poll() -> None:
        with httpx.Client(timeout=LIVENESS_TIMEOUT_S) as c:
            while not stop.is_set():
                try:
                    code = c.get(url + "/health").status_code
                except httpx.TimeoutException as e:
                    code = repr(e)
                results["health"].append(code)
                if busy.is_set():
                    results["health_during"].append(code)

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        results["stream"] = lines

    stop = threading.Event()
    poller = threading.Thread(target=poll)
    streamer = threading.Thread(target=stream)
    poller.start()
    streamer.start()
    calls = [threading.Thread(target=tokenize, args=(t,)) for t in (huge, huge, huge, huge, long_, long_, long_, long_)]
    busy.set()
    for t in calls:
        t.start()
    for t in calls:
        t.join()
    busy.clear()
    streamer.join()
    stop.set()
    poller.join()

    assert len(results["tokenize"]) == 8
    for size, status, err in results["tokenize"]:
        assert status == 400 and err["code"] == "never_fits" and "max_model_len (8192)" in err["message"], err
    assert results["health"] and all(c == 200 for c in results["health"]), results["health"]
    assert results["health_during"], "no /health poll was answered while the tokenize calls ran"
    stream_lines = results["stream"]
    assert stream_lines[-1] == "data: [DONE]" and len(stream_lines) == 48 + 1
