"""The request's band in the router's fleet queue (goodput.router.app.request_priority): the body's
``priority`` first, else its SLO class's band among the service's classes; answers worked out by
hand from the ranks given."""
from __future__ import annotations

import pytest
from goodput.router.app import request_priority

RANKS = (("batch", 2), ("default", 1), ("interactive", 0))


@pytest.mark.parametrize("body, slo_class, ranks, want", [
    ({}, None, (), 0),                                   # nothing: band 0
    ({"priority": 3}, None, (), 3),                      # vLLM's priority field
    ({}, "interactive", RANKS, 0),
    ({}, "batch", RANKS, 2),
    ({}, None, RANKS, 1),                                # no class: the unnamed class's band
    ({}, "nightly", RANKS, 1),                           # a class the service does not declare: likewise
    ({"priority": 0}, "batch", RANKS, 0),                # an explicit priority wins over the class
    ({"priority": True}, "batch", RANKS, 2),             # not an integer: ignored
    ({"priority": "high"}, None, RANKS, 1),
    ({}, "batch", (), 0),                                # a service without classes
])
def test_request_priority(body, slo_class, ranks, want):
    assert request_priority(body, slo_class, ranks) == want
