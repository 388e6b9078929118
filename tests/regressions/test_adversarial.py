"""Adversarial tests: inputs a real OpenAI / vLLM user sends that broke the worker.

Each test is one defect found by probing a live worker as a skeptical user would (F1-F9: all
fixed; each test now guards against its return). Expected values come from the OpenAI API reference
(nullable parameters, the error body), from greedy decoding (the limit of temperature -> 0) and
from the server's own /health contract, never from the server's current output.

Servers: the shared session fixtures of tests/conftest.py (``server_main``, ``server_chunked``,
``server_tiny``), plus one private server for the tiny-temperature test (F1 used to kill the
engine, so it must never share a server with other tests if it regresses).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_server
from server_utils import TIMEOUT, completion, post

pytestmark = pytest.mark.slow

def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """``r`` is ``status`` with the OpenAI error body; returns ``body["error"]``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _healthy(url: str) -> None:
    r = httpx.get(url + "/health", timeout=TIMEOUT)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ finding 1: tiny temperature

# F1 fixed: the sampler treats temperature < 1e-5 as greedy (model/sampler.py GREEDY_TEMPERATURE)
@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_sampler_tiny_temperature_is_greedy(temperature):
    """temperature -> 0 is greedy decoding, so a tiny positive temperature must pick the argmax
    (vLLM treats a near-zero T as greedy). Today 1e-38 picks a wrong token, 1e-45 raises."""
    import torch
    from goodput.worker.engine.sampling_params import SamplingParams
    from goodput.worker.model.sampler import Row, Sampler

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 49152, generator=g) * 5  # the SmolLM2 vocabulary width, typical scale
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=temperature, seed=7), SamplingParams(temperature=temperature)]
    batch = sampler.prepare([Row(params[0], 0, frozenset({2})), Row(params[1], 3, frozenset({2}))], 49152)
    assert sampler.sample(logits, batch).token_ids == logits.argmax(dim=-1).tolist()


@pytest.fixture(scope="module")
def server_disposable():
    """A private server: if F1 regresses, the tiny-temperature request kills its engine."""
    server = start_server(["--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "128"])
    try:
        yield server
    finally:
        server.stop()


def test_tiny_temperature_request_does_not_kill_the_engine(server_disposable):
    url = server_disposable.url
    body = {"prompt": "The capital of France is", "max_tokens": 4, "seed": 1}
    greedy = completion(url, **body, temperature=0)["choices"][0]["text"]
    for temperature in (1e-38, 1e-45):  # today: 1e-38 gives garbage text or kills it, 1e-45 kills it
        r = post(url, "/v1/completions", {**body, "temperature": temperature})
        health = httpx.get(url + "/health", timeout=TIMEOUT)
        assert health.status_code == 200, f"T={temperature}: engine died: {health.text}"
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy, f"T={temperature}"  # the T -> 0 limit
    assert completion(url, **body, temperature=0)["choices"][0]["text"] == greedy


# -------------------------------------- finding 9: --max-model-len beyond the model's context

SMOLLM2_CONTEXT_LENGTH = 8192  # llama.context_length in the bundled GGUF's metadata


def test_max_model_len_beyond_model_context_is_refused_or_clamped():
    """Repro of the crash (about 100 s on CPU, so not run here): serve with --max-model-len 100000,
    POST {"prompt": [28120] * 8188, "max_tokens": 10} -> 500 "positions [8192, 8193) outside the
    model's context length 8192", then /health 503. Accepted fixes: refuse to start (the load error
    names 8192) or clamp, so that /v1/models never advertises more than the model can do."""
    import os
    import subprocess
    import sys
    import tempfile

    from conftest import REPO, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fd, log_path = tempfile.mkstemp(prefix="goodput-adv-", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "goodput.worker", "serve", "--model", "smollm2",
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                             "--kv-cache-memory", "8MiB", "--max-model-len", "100000"],
                            stdout=fd, stderr=subprocess.STDOUT, cwd=str(REPO),
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    os.close(fd)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:  # refused at start-up: the CLI exits 1 naming the limit
                out = Path(log_path).read_text(errors="replace")
                assert proc.returncode == 1, out[-2000:]
                assert str(SMOLLM2_CONTEXT_LENGTH) in out, out[-2000:]
                return
            try:
                health = httpx.get(url + "/health", timeout=5)
                if health.json().get("status") == "error":  # refused in the model load (stays up)
                    assert str(SMOLLM2_CONTEXT_LENGTH) in health.text, health.text
                    return
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    card = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]
                    assert card["max_model_len"] <= SMOLLM2_CONTEXT_LENGTH, card
                    return
            except httpx.HTTPError:  # not listening yet, or exiting after a refused load
                pass
            time.sleep(0.5)
        pytest.fail("the server neither started nor refused within 300 s")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------- finding 2: null optional params

@pytest.mark.parametrize("param", ["temperature", "top_p", "n", "presence_penalty",
                                   "frequency_penalty", "stream", "logprobs"])
def test_openai_client_none_parameter_means_default(server_main, param):
    """``client.chat.completions.create(..., temperature=None)`` sends ``"temperature": null``;
    the OpenAI API reference types these parameters "number or null" (etc.), null = the default."""
    from openai import OpenAI

    client = OpenAI(base_url=server_main.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi"}], max_tokens=1, seed=0,
        **{param: None})
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == 1
    _healthy(server_main.url)


# -------------------------------------------------------------- finding 3: lone surrogate -> 500

@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", '{"prompt": "abc \\ud800 def", "max_tokens": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'),
    ("/tokenize", '{"prompt": "\\ud83d"}'),
])
def test_unpaired_surrogate_is_a_400_not_a_500(server_main, path, raw):
    r = httpx.post(server_main.url + path, content=raw.encode(),
                   headers={"content-type": "application/json"}, timeout=TIMEOUT)
    _assert_openai_error(r, 400)
    _healthy(server_main.url)


# --------------------------------------------------- finding 4: a huge prompt blocks everyone

def test_huge_prompt_does_not_stall_the_event_loop(server_main):
    """While one client's ~3.6 MB prompt is being handled, ``/health`` keeps answering 200 and the
    prompt is refused with 400 (it can never fit). No wall-clock threshold: the server refuses a
    prompt longer than max_model_len by its byte count before tokenizing, so there is no long
    blocking step left to time; every /health probe sent meanwhile must succeed."""
    url = server_main.url
    big = {"prompt": "hello world " * 300_000, "max_tokens": 1}
    box: dict = {}

    def send_big():
        t0 = time.monotonic()
        box["r"] = httpx.post(url + "/v1/completions", json=big, timeout=TIMEOUT)
        box["dt"] = time.monotonic() - t0

    worker = threading.Thread(target=send_big)
    worst, probes = 0.0, 0
    with httpx.Client(timeout=TIMEOUT) as c:
        c.get(url + "/health")  # connection warm before the big request starts
        worker.start()
        while worker.is_alive():
            t0 = time.monotonic()
            assert c.get(url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            probes += 1
            time.sleep(0.05)
    worker.join()
    _assert_openai_error(box["r"], 400)  # 600k tokens can never fit max_model_len 512
    # the worker still serves after the refusal (nothing stuck, nothing leaked)
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    print(f"{probes} /health probes during the big request, worst {worst:.3f}s of {box['dt']:.3f}s")


# -------------------------------------- finding 5: chat without max_tokens on a small KV pool

def test_chat_without_max_tokens_fits_the_pool(server_tiny):
    """server_tiny: 4 blocks x 16 = 64 tokens of KV, max_model_len 128. A user who sets no
    max_tokens asked for nothing that cannot fit; the default must be bounded by what the pool
    can hold (or the worker must refuse to start with a pool below max_model_len)."""
    r = post(server_tiny.url, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Say hi"}], "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 4 * 16


# --------------------------------------------------- finding 7: the error names the wrong param

def test_prompt_longer_than_context_names_prompt(server_chunked):
    """server_chunked has max_model_len 32; a 40+ token prompt with max_tokens=1."""
    r = post(server_chunked.url, "/v1/completions", {"prompt": "one two three four five " * 8,
                                                     "max_tokens": 1})
    err = _assert_openai_error(r, 400)
    assert err["param"] == "prompt", err
    assert "32" in err["message"]


# ------------------------------------------- finding 8: unreadable messages for a wrong body

@pytest.mark.parametrize("raw,ctype", [(b"", None), (b"[]", "application/json"),
                                       (b"prompt=hi", "application/x-www-form-urlencoded")])
def test_non_object_body_message_says_what_is_wrong(server_main, raw, ctype):
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(server_main.url + "/v1/completions", content=raw, headers=headers, timeout=TIMEOUT)
    err = _assert_openai_error(r, 400)
    assert "''" not in err["message"], err["message"]
    assert "JSON object" in err["message"] or "body" in err["message"], err["message"]


# ------------------------------------------- finding 6: min_tokens does not hold off stop strings

def test_min_tokens_holds_off_stop_strings(server_main):
    """Greedy "A B C D" continues " E F G ..."; with stop=[" F"] and min_tokens=8 the request may
    not finish before its 8th token unless it hits max_tokens (vLLM's sampling-params docs:
    min_tokens is the minimum generated before EOS, stop_token_ids or stop strings can end it)."""
    body = completion(server_main.url, prompt="A B C D", max_tokens=12, min_tokens=8, temperature=0,
                      stop=[" F"])
    assert body["usage"]["completion_tokens"] >= 8, body


# ------------------------------------ guards: bad inputs that are answered well today (no model run)

BAD_INPUTS = [
    # (name, path, body, expected status, expected param)
    ("max_tokens zero", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens float", "/v1/completions", {"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("temperature above 2", "/v1/completions", {"prompt": "a", "temperature": 3}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("n=0", "/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("best_of < n", "/v1/completions", {"prompt": "a", "n": 3, "best_of": 2}, 400, "best_of"),
    ("logit_bias past vocab", "/v1/completions", {"prompt": "a", "logit_bias": {"49152": 1.0}}, 400,
     "logit_bias"),
    ("logprobs 21", "/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("suffix", "/v1/completions", {"prompt": "a", "suffix": "z"}, 400, "suffix"),
    ("unknown field", "/v1/completions", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ("empty prompt", "/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ("empty id list", "/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("id past vocab", "/v1/completions", {"prompt": [49152], "max_tokens": 4}, 400, "prompt"),
    ("negative id", "/v1/completions", {"prompt": [-1], "max_tokens": 4}, 400, "prompt"),
    ("batch with a bad prompt", "/v1/completions", {"prompt": ["a", [49152]]}, 400, "prompt"),
    ("empty stop", "/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("huge max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 10**30}, 400, "max_tokens"),
    ("stream_options unstreamed", "/v1/completions",
     {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "narrator", "content": "x"}]}, 400,
     "messages.0.role"),
    ("tool result without its call id", "/v1/chat/completions",
     {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),
    ("tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools.0.function"),
    ("unknown response_format", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex"}}, 400,
     "response_format"),
    ("unknown model", "/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
]


def test_bad_inputs_get_openai_errors_and_lose_nothing(server_main):
    """Each bad request: the documented status, the OpenAI error body naming the parameter; then
    nothing is admitted, no KV block is referenced, /health is 200."""
    url = server_main.url
    before = httpx.get(url + "/admin/state", timeout=TIMEOUT).json()
    failures = []
    for name, path, body, status, param in BAD_INPUTS:
        r = post(url, path, body)
        try:
            _assert_openai_error(r, status, param)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)
    after = httpx.get(url + "/admin/state", timeout=TIMEOUT).json()
    assert after["counters"]["admitted"] == before["counters"]["admitted"]
    assert after["kv_blocks_used"] == 0 and after["running"] == 0 and after["waiting"] == 0, after
    _healthy(url)


def test_malformed_json_is_a_400_naming_json(server_main):
    r = httpx.post(server_main.url + "/v1/completions", content=b'{"prompt": "hi", ',
                   headers={"content-type": "application/json"}, timeout=TIMEOUT)
    err = _assert_openai_error(r, 400)
    assert "JSON" in err["message"]
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"
