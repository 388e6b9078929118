"""Static discovery: ``--static MODEL=URL,URL,...`` (repeatable), as vLLM production-stack's
router has, for local fleets and tests.

Each ``MODEL=URL,...`` is one service (a URL may end in ``#prefill`` / ``#decode``: the worker's role
in disaggregated serving) (namespace ``""``, name = the model) whose pods are the URLs
(pod name = ``host:port`` of the URL). Without a kubelet to say which pod is Ready, the source
probes each pod's ``GET /ready`` every ``period_s`` (the router's ``--scrape-period``): 200 →
Ready; 503 with ``{"status": "draining"}`` → draining (the worker's drain, see
worker_image/goodput/worker/server/app.py); anything else, or no answer within the probe timeout
→ not Ready. Pods start not Ready until their first probe. The probes go through the router's one
client (goodput.router.upstream; the router hands it over as ``http``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from goodput.api.states import WorkerRole
from goodput.router.fleet import Fleet, PodInfo, ServiceInfo
from goodput.router.upstream import ERRORS, Timeouts, Upstream


ROLES = tuple(r.value for r in WorkerRole)


def parse_static(spec: str) -> tuple[str, list[str]]:
    """``"MODEL=URL,URL"`` → (model, [url, ...]) with trailing slashes removed.

    Raises ValueError naming the problem (no ``=``, empty model, no URL, a URL that is not
    ``http(s)://host:port``)."""
    model, sep, urls = spec.partition("=")
    model = model.strip()
    if not sep or not model:
        raise ValueError(f"--static {spec!r}: expected MODEL=URL[,URL...]")
    out = []
    for u in (x.strip().rstrip("/") for x in urls.split(",")):
        if not u:
            continue
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--static {spec!r}: {u!r} is not an http(s)://host:port URL")
        out.append(u)
    if not out:
        raise ValueError(f"--static {spec!r}: no URL for model {model!r}")
    return model, out


def static_pod(spec: str, url: str) -> PodInfo:
    """A static pod from one URL of a spec: ``URL`` or ``URL#ROLE`` (a worker's ``--role``,
    ``both`` / ``prefill`` / ``decode``, for disaggregated prefill; default both). Raises
    ValueError for another role."""
    base, _, role = url.partition("#")
    base = base.rstrip("/")
    if role and role not in ROLES:
        raise ValueError(f"--static {spec!r}: role {role!r} of {base!r} is not one of {ROLES}")
    return PodInfo(name=pod_name(base), url=base, ready=False, role=role or "both")


def pod_name(url: str) -> str:
    """The pod name static mode gives a URL: its ``host:port``."""
    return urlsplit(url).netloc


@dataclass
class StaticDiscovery:
    """Fills the fleet from ``--static`` specs once, then probes the pods. ``startup_timeout_s``:
    the ``--hold-timeout`` (None: the router's default); ``period_s``: seconds between probes;
    ``http``: the router's client (the router sets it before :meth:`run`; None: :meth:`run` opens
    one of its own with default timeouts)."""

    specs: list[str]
    startup_timeout_s: float | None = None
    period_s: float = 2.0
    http: Upstream | None = None

    def services(self) -> list[tuple[ServiceInfo, list[PodInfo]]]:
        """The parsed specs; raises ValueError for a bad spec or a model given twice."""
        seen: dict[str, int] = {}
        out = []
        for spec in self.specs:
            model, urls = parse_static(spec)
            if model in seen:
                raise ValueError(f"--static: model {model!r} given twice (list its URLs in one flag)")
            seen[model] = 1
            info = ServiceInfo(namespace="", name=model, model=model,
                               startup_timeout_s=self.startup_timeout_s)
            out.append((info, [static_pod(spec, u) for u in urls]))
        return out

    def fill(self, fleet: Fleet) -> None:
        for info, pods in self.services():
            fleet.set_service(info)
            fleet.replace_pods(info.namespace, info.name, pods)

    async def run(self, fleet: Fleet) -> None:
        """Fill the fleet, then probe every pod's ``/ready`` each ``period_s``, forever."""
        self.fill(fleet)
        own = self.http is None
        client = Upstream(Timeouts(connect_s=2.0, probe_s=2.0), max_connections=100) if own else self.http
        client.open()
        try:
            await self.probe_all(fleet, client)
            fleet.mark_synced()
            while True:
                await asyncio.sleep(self.period_s)
                await self.probe_all(fleet, client)
        finally:
            if own:
                await client.close()

    async def probe_all(self, fleet: Fleet, client: Upstream) -> None:
        """One probe of every pod of every service; updates the pods whose state changed."""
        pods = [(svc.key, pod.info) for svc in fleet.services() for pod in svc.pods.values()]
        states = await asyncio.gather(*(probe_ready(client, info.url) for _, info in pods))
        for (key, info), (ready, draining) in zip(pods, states):
            if (info.ready, info.draining) != (ready, draining) and fleet.service(key) is not None:
                fleet.set_pod(key[0], key[1], dataclasses.replace(info, ready=ready, draining=draining))


async def probe_ready(client: Upstream, url: str) -> tuple[bool, bool]:
    """``GET url/ready`` → (ready, draining): 200 → (True, False); 503 whose JSON ``status`` is
    ``"draining"`` → (False, True); any other answer, a transport error or a timeout → (False, False)."""
    try:
        r = await client.get(url + "/ready")
    except ERRORS:
        return False, False
    if r.status == 200:
        return True, False
    try:
        draining = json.loads(r.body).get("status") == "draining"
    except (ValueError, AttributeError):
        draining = False
    return False, draining
