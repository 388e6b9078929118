"""The admin API's contract module (goodput.api.admin) is the one the worker serves: its
paths are the routes, its limits body is what the route's model accepts."""
from __future__ import annotations

from goodput.api import admin as admin_api
from goodput.worker.server import admin
from goodput.worker.server.protocol import AdminLimits


def test_routes_are_the_contract_paths():
    routes = {(m, r.path) for r in admin.router.routes for m in r.methods}
    assert {("GET", admin_api.LIMITS_PATH), ("PUT", admin_api.LIMITS_PATH), ("GET", admin_api.STATE_PATH),
            ("POST", admin_api.DRAIN_PATH), ("DELETE", admin_api.DRAIN_PATH)} <= routes
    assert (admin_api.LIMITS_PATH, admin_api.DRAIN_PATH) == ("/admin/limits", "/admin/drain")


def test_limits_body_is_what_the_route_accepts():
    assert set(admin_api.limits_body(3, 7, 9000)) == set(AdminLimits.model_fields)
    assert AdminLimits.model_validate(admin_api.limits_body(3, 7, 9000)).max_waiting_tokens == 9000
    assert AdminLimits.model_validate(admin_api.limits_body(3, 7)) == AdminLimits(max_num_seqs=3, max_waiting=7)
    assert admin_api.limits_body(max_waiting=0) == {"max_waiting": 0}     # omitted = unchanged
    assert admin_api.bearer("t") == {"Authorization": "Bearer t"}
