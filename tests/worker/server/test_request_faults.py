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
