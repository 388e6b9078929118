"""The router's next action after an attempt (goodput.router.forward), as a table by hand."""
from __future__ import annotations

import aiohttp
import pytest
from goodput.router.forward import (
    ANSWER,
    CONN_ERROR,
    DELIVER,
    DRAINING,
    FAIL,
    FULL,
    REQUEUE,
    RETRY_OTHER,
    RETRY_SAME,
    SERVER_ERROR,
    Attempt,
    classify,
    connection_failure,
    next_action,
    verdict,
)

DRAIN_BODY = b'{"error": {"message": "draining", "type": "service_unavailable", "param": null, "code": "draining"}}'


@pytest.mark.parametrize("status,body,kind", [
    (200, None, ANSWER), (400, None, ANSWER), (404, None, ANSWER), (429, b"{}", FULL),
    (500, b"{}", SERVER_ERROR), (502, b"", SERVER_ERROR), (503, DRAIN_BODY, DRAINING),
    (503, b'{"error": {"code": "no_ready_pod"}}', SERVER_ERROR), (503, b"not json", SERVER_ERROR),
    (504, None, SERVER_ERROR),
])
def test_classify(status, body, kind):
    assert classify(status, body).kind == kind


def test_connection_failures():
    refused = connection_failure(aiohttp.ClientOSError(104, "Connection reset by peer"))
    assert refused.kind == CONN_ERROR and not refused.stale
    closed = connection_failure(aiohttp.ServerDisconnectedError())
    assert closed.kind == CONN_ERROR and closed.stale


@pytest.mark.parametrize("kind,v", [(ANSWER, True), (SERVER_ERROR, False), (CONN_ERROR, False),
                                    (FULL, None), (DRAINING, None)])
def test_verdict(kind, v):
    assert verdict(Attempt(kind)) is v


A = Attempt
STALE = A(CONN_ERROR, stale=True)


@pytest.mark.parametrize("a,moved,other,requeued,stale_retried,want", [
    # an answer is delivered, whatever else
    (A(ANSWER, 200), False, True, False, False, DELIVER),
    (A(ANSWER, 404), True, False, True, True, DELIVER),
    # before the first byte, once: another pod with room
    (A(SERVER_ERROR, 500), False, True, False, False, RETRY_OTHER),
    (A(CONN_ERROR), False, True, False, False, RETRY_OTHER),
    (STALE, False, True, False, False, RETRY_OTHER),
    (A(DRAINING, 503), False, True, False, False, RETRY_OTHER),
    (A(FULL, 429), False, True, False, False, RETRY_OTHER),
    # already moved once: no second move
    (A(SERVER_ERROR, 500), True, True, False, False, DELIVER),   # the second pod's own 5xx
    (A(CONN_ERROR), True, True, False, False, FAIL),
    # no other pod
    (A(SERVER_ERROR, 500), False, False, False, False, DELIVER),  # the pod's 5xx reaches the client
    (A(DRAINING, 503), False, False, False, False, DELIVER),
    (A(FULL, 429), False, False, False, False, REQUEUE),          # stale limits: admission again, once
    (A(FULL, 429), False, False, True, False, DELIVER),
    (STALE, False, False, False, False, RETRY_SAME),              # keep-alive race: same pod, new connection
    (STALE, False, False, False, True, FAIL),
    (A(CONN_ERROR), False, False, False, False, FAIL),
])
def test_next_action(a, moved, other, requeued, stale_retried, want):
    assert next_action(a, moved=moved, other=other, requeued=requeued, stale_retried=stale_retried) == want
