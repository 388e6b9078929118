"""The worker's KV events over real HTTP on 127.0.0.1 (fake engine: block_size 4, byte tokens):
``/kv/snapshot`` and ``/kv/events`` publish the router's chunk keys of the requests served, stored
when their blocks are cached, evicted when the blocks are reused; bad queries get a clear 4xx.
Chunk size 8 here (the module constant, 256 in production) so that short prompts span chunks."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from goodput.api.kv_events import parse_event, parse_snapshot
from goodput.api.prefix import chunk_hashes
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.kv_events import block_ties, token_ends_from_offsets
from goodput.worker.engine.scheduler import Scheduler
from goodput.worker.engine_args import EngineArgs
from goodput.worker.llm_engine import LLMEngine
from goodput.worker.metrics import WorkerMetrics
from goodput.worker.server import kv_events as worker_kv
from goodput.worker.server.app import create_app
from server_utils import ServerThread, metric, metrics

from fake_engine import EOS, ByteTokenizer, CountingRunner

GUARD_S = 60.0


class _Enc:
    def __init__(self, text: str):
        self.ids = list(text.encode())
        self.offsets = [(i, i + 1) for i in range(len(text))]  # ASCII: one byte, one character


class _Backend:
    def encode(self, text, add_special_tokens=False):
        return _Enc(text)


class TextByteTokenizer(ByteTokenizer):
    """One token per byte of ASCII text, with character offsets (the HF backend's shape)."""

    backend = _Backend()

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


def factory(num_blocks: int):
    def make(args):
        config = EngineConfig(num_blocks=num_blocks, max_model_len=64, block_size=4, eos_token_ids=(EOS,),
                              max_num_batched_tokens=64, model_name="fake", revision="")
        eng = LLMEngine(config, Scheduler(config), CountingRunner(), TextByteTokenizer())
        eng.metrics = WorkerMetrics("fake", eng.stats)
        return eng
    return make


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.setattr(worker_kv, "CHUNK_SIZE", 8)
    app = create_app(EngineArgs(model="fake", served_model_name="fake"), engine_factory=factory(8), admin_token="")
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=GUARD_S) as c:
            for _ in range(1200):
                if c.get("/ready").status_code == 200:
                    break
                threading.Event().wait(0.05)
            yield c, app.state.server


def snapshot_until(c: httpx.Client, want: set[int]):
    for _ in range(1200):  # the ties are made in the background after admission
        snap = parse_snapshot(c.get("/kv/snapshot").content)
        if set(snap.keys) == want:
            return snap
        threading.Event().wait(0.05)
    raise AssertionError(f"snapshot never held {want}: {snap}")


def events(c: httpx.Client, since: int, until_seq: int, instance: str | None = None):
    params = {"since": since} | ({"instance": instance} if instance else {})
    out = []
    with c.stream("GET", "/kv/events", params=params) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        for line in r.iter_lines():
            ev = parse_event(line)
            if ev.kind == "heartbeat":
                if ev.seq >= until_seq:
                    return out
                continue
            out.append(ev)
    return out


def test_token_id_prompts_publish_their_chunk_keys_and_their_eviction(worker):
    c, st = worker
    # 20 token ids: chunks of 8 end at 8, 16, 20 -> the last full blocks inside: 1, 3, 4
    ids1 = list(range(1, 21))
    k1 = set(chunk_hashes("fake", "", None, token_ids=ids1, chunk_size=8))
    assert len(k1) == 3
    r = c.post("/v1/completions", json={"model": "fake", "prompt": ids1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    snap = snapshot_until(c, k1)
    instance = r.headers["x-goodput-instance"]
    assert snap.instance == instance
    evs = events(c, 0, snap.seq, instance)
    assert {e.kind for e in evs} == {"stored"} and set().union(*(e.keys for e in evs)) == k1
    assert [e.seq for e in evs] == list(range(1, snap.seq + 1))
    # another prompt taking the whole 8-block pool reuses every cached block: all of k1 evicted
    ids2 = list(range(100, 128))  # 28 tokens + 2 out = 30 -> 8 blocks; chunks end 8, 16, 24, 28
    k2 = set(chunk_hashes("fake", "", None, token_ids=ids2, chunk_size=8))
    assert c.post("/v1/completions", json={"model": "fake", "prompt": ids2, "max_tokens": 2}).status_code == 200
    snap2 = snapshot_until(c, k2)
    later = events(c, snap.seq, snap2.seq)
    assert set().union(*(e.keys for e in later if e.kind == "evicted")) == k1
    assert set().union(*(e.keys for e in later if e.kind == "stored")) == k2
    m = metrics(str(c.base_url))
    assert metric(m, "goodput_kv_event_keys") == 4
    assert metric(m, "goodput_kv_events_total", kind="cleared") == 0
    assert metric(m, "goodput_kv_events_total", kind="stored") == snap2.seq - len(
        [e for e in later if e.kind == "evicted"])


def test_a_text_prompt_ties_chunks_by_character_offsets(worker):
    c, _ = worker
    text = "abcdefghij" * 2  # 20 characters, 20 byte tokens: the same spans as above
    keys = set(chunk_hashes("fake", "", "t1", prompt=text, chunk_size=8))
    r = c.post("/v1/completions", json={"model": "fake", "prompt": text, "max_tokens": 1, "cache_salt": "t1"})
    assert r.status_code == 200, r.text
    snapshot_until(c, keys)


@pytest.mark.parametrize("query, status, param", [
    ("since=-1", 400, "since"), ("since=x", 400, "since"), ("since=1.5", 400, "since"),
    ("since=0&instance=BAD!", 400, "instance"),
    ("since=0&instance=0123456789abcdef", 410, None),  # not this engine: resync
    ("since=99", 410, None),                            # ahead of the engine: resync
])
def test_bad_queries_get_a_clear_4xx(worker, query, status, param):
    c, _ = worker
    r = c.get("/kv/events?" + query)
    assert r.status_code == status, r.text
    err = json.loads(r.text)["error"]
    assert err["param"] == param
    assert ("resync" in err["message"]) == (status == 410)


def test_token_ends_and_block_ties_by_hand():
    # tokens end at characters 3, 5, 9, 12 (4 tokens), one BOS before: a chunk ending at
    # character 4 needs token 1 (ends at 5) -> 1 + 2 = 3; at 9 -> token 2 -> 4; at 20 -> all: 5
    assert token_ends_from_offsets([4, 9, 20], [3, 5, 9, 12], 1) == [3, 4, 5]
    # block_size 4, 3 full blocks: token ends 3 (no full block), 8 (block 1), 30 (capped: block 2)
    assert block_ties([7, 8, 9], [3, 8, 30], [b"a", b"b", b"c"], 4) == [(b"b", 8), (b"c", 9)]


def test_message_content_ends_in_the_rendered_template():
    # "<s>sys: Be brief.</s><s>user: Hi</s><s>assistant: " ; contents end at 17 and 32
    text = "<s>sys: Be brief.</s><s>user: Hi</s><s>assistant: "
    assert worker_kv.message_char_ends(text, ["Be brief.", "Hi"]) == [17, 32]
    # a content found only before the previous end, an empty one, a list: unknown (None)
    assert worker_kv.message_char_ends(text, ["Hi", "Be brief.", "", [1]]) == [32, None, None, None]


def test_the_real_tokenizer_places_text_and_chat_chunks():
    """SmolLM2's GGUF tokenizer: a text prompt's chunk ends (256, 512, 768, 900 characters) map to
    the first token whose prefix decodes to the chunk's whole text; a chat prompt rendered as text
    and encoded with offsets gives the ids the chat template gives (what the chat mapping relies on)."""
    from goodput.api.prefix import chunk_ends
    from goodput.worker.model.tokenizer import GGUFTokenizer
    tok = GGUFTokenizer.from_model("smollm2")
    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = tok.encode(text)
    ends = chunk_ends(prompt=text, chunk_size=256)
    assert ends == (256, 512, 768, 900)
    got = worker_kv._text_ends(tok, text, ids, ends)
    for c, t in zip(ends, got):
        assert tok.decode(ids[:t]).startswith(text[:c])
        assert not tok.decode(ids[:t - 1]).startswith(text[:c])
    msgs = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert list(tok.backend.encode(rendered, add_special_tokens=False).ids) == \
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert all(e is not None for e in worker_kv.message_char_ends(rendered, [m["content"] for m in msgs]))


def test_a_real_worker_publishes_the_routers_keys_of_a_chat(server_main):
    """The real model server: a chat of 442 canonical characters (2 chunks of 256, the first ending
    in the system message); once answered, /kv/snapshot holds exactly the keys the router computes for the same
    body (served model name, revision "", no salt)."""
    system = "You are a careful assistant for the billing team. Answer from the policy. " * 5  # 380 chars
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is due?"}]
    model = httpx.get(server_main.url + "/v1/models").json()["data"][0]["id"]
    want = set(chunk_hashes(model, "", None, messages=msgs, chunk_size=256))
    assert len(want) == 2
    r = httpx.post(server_main.url + "/v1/chat/completions", timeout=GUARD_S,
                   json={"model": model, "messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text
    with httpx.Client(base_url=server_main.url, timeout=GUARD_S) as c:
        for _ in range(1200):
            keys = set(parse_snapshot(c.get("/kv/snapshot").content).keys)
            if want <= keys:
                break
            threading.Event().wait(0.05)
    assert want <= keys


def test_a_draining_worker_refuses_a_new_stream(worker):
    c, st = worker
    st.set_admin_drain(True)
    r = c.get("/kv/events?since=0")
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    assert c.get("/kv/snapshot").status_code == 200  # the snapshot still answers
    st.set_admin_drain(False)
