"""schemathesis hooks for a cheap run (``schemathesis_worker.py --cheap``): a generated
``max_tokens`` / ``max_completion_tokens`` above 4 becomes 4, and a generate request without
either gets ``max_tokens: 4``, so the run spends its time on the API rather than on decoding.
Only positive integers are changed (a wrong type, a bound violated from below stay as
generated), so negative cases stay negative."""
from __future__ import annotations

import schemathesis

CAP = 4


@schemathesis.hook
def before_call(context, case, kwargs):
    # before_call runs for every phase's requests (coverage included; map_* hooks do not). The
    # body is replaced, never edited in place: the generator caches and reuses its values.
    body = case.body
    if not isinstance(body, dict) or not ("prompt" in body or "messages" in body):
        return
    new = dict(body)
    if "max_tokens" not in new and "max_completion_tokens" not in new:
        new["max_tokens"] = CAP  # the defaults (16; chat: the rest of the context) cost most
    for key in ("max_tokens", "max_completion_tokens"):
        v = new.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > CAP:
            new[key] = CAP
    case.body = new
