"""The real ``openai`` Python client against a live worker on 127.0.0.1, streaming and not."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server_main):
    return openai.OpenAI(base_url=server_main.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_completions_streamed_and_not(client):
    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in full.choices[0].text
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens <= 8
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0)
    answer = full.choices[0].message.content
    assert "Paris" in answer and full.choices[0].message.role == "assistant"
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20,
                                                temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == answer and finish == full.choices[0].finish_reason


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="smollm2", prompt="My favourite animal is", max_tokens=8, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_errors_map_to_client_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="x", max_tokens=2, n=2, best_of=1)
    assert e.value.param == "best_of"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
