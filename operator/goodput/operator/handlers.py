"""kopf handlers: the operator's only I/O. Start with ``python -m goodput.operator``.

Level-triggered: every trigger (create, spec update, resume at operator start, a periodic resync, any
event of a child Deployment, a worker pod starting or stopping to fail) runs the same ``reconcile(namespace, name)``, which reads the
InferenceService, builds the desired children with the pure ``resources`` module, writes only what
differs from the server's objects, and writes status only when ``status.compute_status`` changed it.
A reconcile with nothing to do writes nothing.

Ownership: ``spec.replicas`` of the InferenceService (also written through its scale subresource by
``kubectl scale``, HPA, KEDA or the goodput autoscaler) is copied to the Deployment; a Deployment
scaled by hand is set back. Children carry a controller owner reference, so deleting the
InferenceService garbage-collects them.

Overlapping releases: a namespaced operator reconciles only the namespaces whose Lease it holds, an
all-namespaces one skips namespaces whose Lease has a live holder (``claims``: the rule and why).

Env: GOODPUT_OPERATOR_RESYNC_SECONDS (resync period, default 60), GOODPUT_OPERATOR_WORKERS (threads
for the synchronous handlers, default 16: reconciles mostly wait on the API server),
GOODPUT_OPERATOR_ROUTER_URL (set by ``--router-url``: ``status.url`` is the router's URL).
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

import kopf
import kubernetes
import pydantic
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError
from kubernetes.utils import parse_quantity

from goodput import kube
from goodput.api import claims, crd
from goodput.operator import model_names, resources, status as status_mod

RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
RESYNC_SECONDS = float(os.environ.get("GOODPUT_OPERATOR_RESYNC_SECONDS", "60"))
ROUTER_URL = os.environ.get(resources.ROUTER_URL_ENV) or None  # --router-url: status.url

log = logging.getLogger("goodput.operator")


class _Cluster:
    """Lazily made API clients, shared by all handler threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dyn: DynamicClient | None = None
        self.pdb_api_version = "policy/v1"
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def dyn(self) -> DynamicClient:
        with self._lock:
            if self._dyn is None:
                # one pooled connection per handler thread (the default, 5 x CPUs, is 10 on 2 cores):
                # a discarded connection costs a new TLS handshake on the next request
                client = kube.load_config(pool_maxsize=_workers() + 4)
                _count_requests(client)
                self._dyn = DynamicClient(client)
                try:
                    self._dyn.resources.get(api_version="policy/v1", kind="PodDisruptionBudget")
                except ResourceNotFoundError:
                    self.pdb_api_version = "policy/v1beta1"  # Kubernetes < 1.21
            return self._dyn

    def resource(self, api_version: str, kind: str) -> Any:
        return self.dyn().resources.get(api_version=api_version, kind=kind)

    def lock_for(self, namespace: str, name: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault((namespace, name), threading.Lock())


class OperatorState:
    """What the handlers remember between calls (all of the operator's mutable state; thread-safe
    through its locks). One instance, :data:`state`; a test makes its own.

    known: (namespace, name) of every InferenceService seen (the resync loop's list).
    complete: (namespace, name, uid) whose last full reconcile found or made every child.
    pod_failures: (namespace, InferenceService) -> {pod name: Problem} from the worker pod watch.
    requests: API requests the reconciles sent, by HTTP method (kopf's own watches not included).
    resync_stop: set to end the resync thread.
    model_claims: (namespace, name) -> its served model name and creation time, from the watch and
    each reconcile's read (``model_names``: the earliest created service owns a name).
    """

    def __init__(self) -> None:
        self.known: set[tuple[str, str]] = set()
        self.known_lock = threading.Lock()
        self.complete: set[tuple[str, str, str]] = set()
        self.pod_failures: dict[tuple[str, str], dict[str, crd.Problem]] = {}
        self.pods_lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.requests_lock = threading.Lock()
        self.resync_stop = threading.Event()
        self.model_claims: dict[tuple[str, str], model_names.Claim] = {}

    def set_claim(self, key: tuple[str, str], body: dict[str, Any] | None) -> list[crd.Problem]:
        """Record ``body``'s model-name claim (None: gone); the problems of ``key``'s claim now."""
        with self.known_lock:
            claim = model_names.claim_of(body) if body is not None else None
            if claim is None:
                self.model_claims.pop(key, None)
            else:
                self.model_claims[key] = claim
            return model_names.problems(key, dict(self.model_claims))

    def count_request(self, method: str) -> None:
        with self.requests_lock:
            self.requests[method] += 1

    def requests_sent(self) -> collections.Counter[str]:
        """A copy of the per-method count of API requests the reconciles sent so far."""
        with self.requests_lock:
            return collections.Counter(self.requests)

    def worker_problem(self, namespace: str, name: str) -> crd.Problem | None:
        """The failure to report for this InferenceService's worker pods (first failing pod by name)."""
        with self.pods_lock:
            failing = self.pod_failures.get((namespace, name)) or {}
            return failing[min(failing)] if failing else None

    def set_pod_problem(self, key: tuple[str, str], pod: str, problem: crd.Problem | None) -> None:
        with self.pods_lock:
            failing = self.pod_failures.setdefault(key, {})
            if problem is None:
                failing.pop(pod, None)
                if not failing:
                    del self.pod_failures[key]
            else:
                failing[pod] = problem

    def forget(self, namespace: str, name: str) -> None:
        with self.known_lock:
            self.known.discard((namespace, name))
            self.model_claims.pop((namespace, name), None)
            for key in [k for k in list(self.complete) if k[:2] == (namespace, name)]:
                self.complete.discard(key)


def _count_requests(client: kubernetes.client.ApiClient) -> None:
    """Count every request ``client`` sends, by method, in ``state.requests``."""
    rest = client.rest_client
    send = rest.request

    def counted(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        state.count_request(method)
        return send(method, url, *args, **kwargs)

    rest.request = counted


def requests_sent() -> collections.Counter[str]:
    """A copy of the per-method count of API requests the reconciles sent so far."""
    return state.requests_sent()


def _workers() -> int:
    return int(os.environ.get("GOODPUT_OPERATOR_WORKERS", "16"))


cluster = _Cluster()
state = OperatorState()
# Set by ``python -m goodput.operator`` from its command line: the exact namespaces it watches, or None
# (all namespaces, or namespace globs). Exact names: kopf does not list namespaces (no cluster-wide
# permission needed) and this operator claims each of them with a Lease (``claims``).
WATCHED_NAMESPACES: tuple[str, ...] | None = None


class _Claims:
    """The Lease I/O of ``claims``: claim/renew the watched namespaces, or read others' claims."""

    CACHE_SECONDS = 5.0

    def __init__(self) -> None:
        # the pod's name (Kubernetes sets HOSTNAME to it) and the process: unique per operator process
        self.identity = f"{os.environ.get('HOSTNAME') or socket.gethostname()}/{os.getpid()}"
        # its release, written on the Leases it holds (the autoscalers of other releases stand down there)
        self.release = os.environ.get(claims.RELEASE_ENV) or None
        self._lock = threading.Lock()
        self.held: set[str] = set()
        self.renewed: dict[str, float] = {}  # namespace -> monotonic time of the last successful claim write
        self._standing_by: dict[str, str] = {}
        self._seen: dict[str, tuple[float, str | None]] = {}  # namespace -> (read at, live holder)
        self._warned: set[str] = set()

    def _read(self, namespace: str) -> dict[str, Any] | None:
        return _get("coordination.k8s.io/v1", "Lease", namespace, claims.LEASE_NAME)

    def renew(self, namespaces: tuple[str, ...]) -> list[str]:
        """One claim pass over ``namespaces``; returns the namespaces newly held."""
        gained = []
        res = cluster.resource("coordination.k8s.io/v1", "Lease")
        for ns in namespaces:
            now = datetime.datetime.now(datetime.timezone.utc)
            lease = None
            try:
                lease = self._read(ns)
                spec = claims.claim(lease, self.identity, now)
                if spec is not None:
                    if lease is None:
                        res.create(body=claims.lease_body(ns, spec, self.release), namespace=ns)
                    else:
                        res.replace(body=claims.lease_body(ns, spec, self.release,
                                                           lease["metadata"]["resourceVersion"]), namespace=ns)
            except ApiException as e:  # 409: someone else wrote it first; the next pass reads it again
                log.warning("Lease %s/%s: %s %s", ns, claims.LEASE_NAME, e.status, e.reason)
                spec = None
                if e.status != 409:
                    continue  # keep what we had until the Lease can be read again
            with self._lock:
                if spec is not None:
                    self.renewed[ns] = time.monotonic()
                if spec is not None and ns not in self.held:
                    self.held.add(ns)
                    self._standing_by.pop(ns, None)
                    gained.append(ns)
                    log.info("namespace %s claimed (Lease %s, holder %s)", ns, claims.LEASE_NAME, self.identity)
                elif spec is None:
                    holder = claims.live_holder(lease, now) or "?"
                    if ns in self.held:
                        self.held.discard(ns)
                        log.warning("namespace %s lost to %s (Lease %s): not reconciling there", ns, holder,
                                    claims.LEASE_NAME)
                    if self._standing_by.get(ns) != holder:
                        self._standing_by[ns] = holder
                        theirs = claims.release_of(lease) or "unknown release"
                        message = (f"the goodput operator {self.identity} (release {self.release or 'unknown'}) "
                                   f"stands by in namespace {ns}: the operator {holder} of release {theirs} "
                                   f"holds Lease {ns}/{claims.LEASE_NAME}; it takes over if that Lease lapses")
                        log.warning("%s", message)
                        if lease is not None:
                            post_lease_event(lease, "Warning", "StandingBy", message)
        return gained

    def release_all(self) -> None:
        with self._lock:
            held, self.held = set(self.held), set()
        for ns in held:
            try:
                lease = self._read(ns)
                spec = claims.release(lease, self.identity)
                if spec is not None and lease is not None:
                    cluster.resource("coordination.k8s.io/v1", "Lease").replace(namespace=ns, body=claims.lease_body(
                        ns, spec, self.release, lease["metadata"]["resourceVersion"]))
                    log.info("namespace %s released (Lease %s)", ns, claims.LEASE_NAME)
            except ApiException as e:
                log.warning("releasing Lease %s/%s: %s %s", ns, claims.LEASE_NAME, e.status, e.reason)

    def other_holder(self, namespace: str) -> str | None:
        """The live holder of ``namespace``'s Lease if it is not us (read at most every CACHE_SECONDS)."""
        t = time.monotonic()
        with self._lock:
            seen = self._seen.get(namespace)
        if seen is None or t - seen[0] > self.CACHE_SECONDS:
            try:
                holder = claims.live_holder(self._read(namespace), datetime.datetime.now(datetime.timezone.utc))
            except ApiException as e:  # e.g. 403 from an install whose RBAC predates Leases: no partition
                holder = None
                if namespace not in self._warned:
                    self._warned.add(namespace)
                    log.warning("cannot read Lease %s/%s (%s %s): reconciling the namespace", namespace,
                                claims.LEASE_NAME, e.status, e.reason)
            seen = (t, None if holder == self.identity else holder)
            with self._lock:
                before = self._seen.get(namespace)
                self._seen[namespace] = seen
            if seen[1] is not None and (before is None or before[1] != seen[1]):
                log.warning("namespace %s is claimed by a namespaced goodput operator (%s, Lease %s/%s): "
                            "not reconciling there", namespace, seen[1], namespace, claims.LEASE_NAME)
        return seen[1]

    def owns(self, namespace: str) -> bool:
        if WATCHED_NAMESPACES is not None:
            t = time.monotonic()
            with self._lock:  # a claim not renewed for a Lease duration may be someone else's by now
                held = frozenset(ns for ns in self.held if t - self.renewed.get(ns, -1e9) < claims.LEASE_SECONDS)
            return claims.owns(namespace, namespaced=True, claimed=held, other_holder=None)
        return claims.owns(namespace, namespaced=False, claimed=frozenset(), other_holder=self.other_holder(namespace))


_claims = _Claims()


def _worker_problem(namespace: str, name: str) -> crd.Problem | None:
    return state.worker_problem(namespace, name)


def _now() -> str:
    return kube.rfc3339(time.time())


def _get(api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return cluster.resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid and r.get("controller") for r in obj["metadata"].get("ownerReferences") or [])


def api_message(e: ApiException) -> str:
    """The API server's own message of a failed request (the Status body's ``message``), else its reason."""
    try:
        msg = json.loads(e.body or "").get("message")
    except (ValueError, AttributeError):
        msg = None
    return str(msg or e.reason or f"HTTP {e.status}")


def is_refusal(e: ApiException) -> bool:
    """A 4xx that repeating the same request cannot fix (invalid, forbidden, ...): report, do not retry.

    404 and 409 are handled where they occur; 429 (throttled) and 408 (timeout) are worth a retry.
    """
    return e.status is not None and 400 <= e.status < 500 and e.status not in (404, 408, 409, 429)


class ChildRefused(Exception):
    """The API server refused a child write with a 4xx; becomes Degraded (reason ChildRefused)."""

    def __init__(self, kind: str, namespace: str, name: str, e: ApiException):
        self.problem = crd.Problem(reason="ChildRefused", message=(
            f"the API server refused {kind} {namespace}/{name} ({e.status}): {api_message(e)}"))
        super().__init__(self.problem.message)


def _ensure(desired: dict[str, Any], uid: str, logger: logging.Logger,
            fresh: bool = False) -> tuple[dict[str, Any] | None, str]:
    """Create or update one child. Returns (object as on the server, action) — action is one of
    created, updated, unchanged, conflict (exists but owned by someone else; left alone).

    ``fresh``: the owner was never reconciled, so try the create first (one request, not two).
    Raises ChildRefused for a 4xx answer to the write (see ``is_refusal``), ApiException otherwise.
    """
    kind, ns, name = desired["kind"], desired["metadata"]["namespace"], desired["metadata"]["name"]
    res = cluster.resource(desired["apiVersion"], kind)
    actual = None if fresh else _get(desired["apiVersion"], kind, ns, name)
    if actual is None:
        try:
            obj = res.create(body=desired, namespace=ns).to_dict()
        except ApiException as e:
            if is_refusal(e):
                raise ChildRefused(kind, ns, name, e) from e
            if e.status != 409:
                raise
            # it exists (a concurrent reconcile, or `fresh` guessed wrong): compare it below
            actual = _get(desired["apiVersion"], kind, ns, name)
            if actual is None:
                return None, "unchanged"
        else:
            logger.info("created %s %s/%s", kind, ns, name)
            return obj, "created"
    if not _owned_by(actual, uid):
        return actual, "conflict"
    if not resources.needs_update(desired, actual, parse_quantity):
        return actual, "unchanged"
    try:
        obj = res.replace(body=resources.replacement(desired, actual), namespace=ns).to_dict()
    except ApiException as e:
        if is_refusal(e):
            raise ChildRefused(kind, ns, name, e) from e
        raise
    logger.info("updated %s %s/%s", kind, ns, name)
    return obj, "updated"


def _ensure_secret(name: str, namespace: str, owner: dict[str, Any], logger: logging.Logger,
                   fresh: bool = False) -> None:
    """Create the admin-token Secret once. Raises ChildRefused for a 4xx answer (see ``is_refusal``)."""
    sname = crd.admin_secret_name(name)
    if not fresh and _get("v1", "Secret", namespace, sname) is not None:
        return  # created once; the token is never rotated behind running workers' backs
    body = resources.admin_secret(name, namespace, secrets.token_urlsafe(32), owner)
    try:
        cluster.resource("v1", "Secret").create(body=body, namespace=namespace)
        logger.info("created Secret %s/%s", namespace, sname)
    except ApiException as e:
        if is_refusal(e):
            raise ChildRefused("Secret", namespace, sname, e) from e
        if e.status != 409:
            raise


def _desired_deployment(child: str, name: str, namespace: str, uid: str,
                        spec: crd.InferenceServiceSpec) -> dict[str, Any]:
    """The Deployment ``child`` of InferenceService ``name`` as the operator wants it: the workers'
    (``child == name``) or the prefill pool's."""
    owner = resources.owner_reference(name, uid)
    if child == name:
        return resources.deployment(name, namespace, spec, owner)
    return resources.prefill_deployment(name, namespace, spec, owner)


def _delete_owned(api_version: str, kind: str, namespace: str, name: str, uid: str,
                  logger: logging.Logger) -> None:
    """Delete a child the spec no longer has, if it exists and this InferenceService controls it."""
    obj = _get(api_version, kind, namespace, name)
    if obj is None or not _owned_by(obj, uid):
        return
    try:
        cluster.resource(api_version, kind).delete(name=name, namespace=namespace)
        logger.info("deleted %s %s/%s (no longer in the spec)", kind, namespace, name)
    except ApiException as e:
        if e.status != 404:
            raise


def reconcile(namespace: str, name: str, logger: logging.Logger | None = None,
              observed_deployment: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Bring one InferenceService's children and status to the desired state; idempotent.

    ``observed_deployment``: the child Deployment as a watch event delivered it. When it already
    matches the desired one (and the children were complete at the last full pass), only the status
    is refreshed from it: one GET instead of one per child, which matters in event storms.
    Returns the new status dict, or None when the object is gone or being deleted, or its namespace
    belongs to another operator (``claims``: then nothing is read or written).
    A 4xx answer to a child write (invalid, forbidden) becomes Degraded (reason ChildRefused, the API
    server's message) and a Warning Event; the other children are still written.
    Raises ApiException for other API errors (5xx, throttling; kopf retries the handler).
    """
    logger = logger or log
    if not _claims.owns(namespace):
        return None
    with cluster.lock_for(namespace, name):
        body = _get(crd.API_VERSION, crd.KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        meta = body["metadata"]
        uid, generation = meta["uid"], meta.get("generation")
        current = body.get("status") or {}
        try:
            spec = crd.InferenceServiceSpec.model_validate(body.get("spec") or {})
            problems = crd.semantic_problems(spec)
        except pydantic.ValidationError as e:  # e.g. an object stored under an older schema
            spec = None
            problems = [crd.Problem(reason="InvalidSpec", message=_short_validation_error(e))]
        problems += crd.name_problems(name)
        name_taken = state.set_claim((namespace, name), body)  # a later service claiming a served name

        deployment: dict[str, Any] | None = None
        service_exists = False
        disaggregated = spec is not None and spec.disaggregation.enabled
        prefill_name = crd.prefill_deployment_name(name)
        prefill: dict[str, Any] | None = None
        observed_name = ((observed_deployment or {}).get("metadata") or {}).get("name")
        if problems:
            deployment = _get("apps/v1", "Deployment", namespace, name)
            service_exists = _get("v1", "Service", namespace, name) is not None
            prefill = _get("apps/v1", "Deployment", namespace, prefill_name) if disaggregated else None
        elif observed_deployment is not None and (namespace, name, uid) in state.complete and \
                (observed_name == name or disaggregated and observed_name == prefill_name) and not \
                resources.needs_update(
                    _desired_deployment(observed_name, name, namespace, uid, spec), observed_deployment,
                    parse_quantity):
            # a child Deployment's event (pods ready, rollout progress) that changes nothing we set:
            # refresh the status from it and read the other pool's Deployment only if there is one
            service_exists = True
            if observed_name == name:
                deployment = observed_deployment
                prefill = _get("apps/v1", "Deployment", namespace, prefill_name) if disaggregated else None
            else:
                prefill = observed_deployment
                deployment = _get("apps/v1", "Deployment", namespace, name)
        else:
            assert spec is not None
            owner = resources.owner_reference(name, uid)
            fresh = not current  # no status yet: never reconciled, its children most likely do not exist
            state.complete.discard((namespace, name, uid))
            try:
                _ensure_secret(name, namespace, owner, logger, fresh)
            except ChildRefused as e:
                problems.append(e.problem)
            for desired in resources.children(name, namespace, uid, spec, cluster.pdb_api_version):
                try:
                    obj, action = _ensure(desired, uid, logger, fresh)
                except ChildRefused as e:  # the next resync tries again; until then Degraded says why
                    problems.append(e.problem)
                    continue
                if action == "conflict":
                    problems.append(crd.Problem(reason="ChildConflict", message=(
                        f"{desired['kind']} {namespace}/{desired['metadata']['name']} exists and is not "
                        f"controlled by this InferenceService")))
                if desired["kind"] == "Deployment" and action != "conflict":
                    if desired["metadata"]["name"] == name:
                        deployment = obj
                    else:
                        prefill = obj
                if desired["kind"] == "Service" and action != "conflict":
                    service_exists = obj is not None
            if current.get("pools"):  # it ran pools: delete what the spec no longer has
                for api_version, kind, child in resources.obsolete_children(name, spec):
                    _delete_owned(api_version, kind, namespace, child, uid, logger)
            if not problems:
                state.complete.add((namespace, name, uid))

        prev_conditions = current.get("conditions") or []
        new = status_mod.compute_status(
            name=name, namespace=namespace, generation=generation,
            desired_replicas=spec.replicas if spec else int((body.get("spec") or {}).get("replicas") or 0),
            deployment=deployment, service_exists=service_exists, problems=problems,
            worker_problem=_worker_problem(namespace, name),
            previous_conditions=prev_conditions, now=_now(), router_url=ROUTER_URL,
            prefill_desired=spec.disaggregation.prefill.replicas if disaggregated else None,
            prefill_deployment=prefill)
        accepted = model_names.condition(name_taken, generation, prev_conditions, _now())
        new["conditions"] = [*new["conditions"], accepted]
        if status_mod.status_changed(current, new):
            cluster.resource(crd.API_VERSION, crd.KIND).status.patch(
                body={"status": new}, name=name, namespace=namespace,
                content_type="application/merge-patch+json")
            _post_events(body, prev_conditions, new["conditions"])
            ev = model_names.event(status_mod.find_condition(prev_conditions, model_names.CONDITION), accepted)
            if ev is not None:
                post_event(body, *ev)
        return new


def _post_events(body: dict[str, Any], before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """A Warning Event when Degraded turns True or changes message; a Normal one when it clears."""
    old = status_mod.find_condition(before, "Degraded") or {}
    new = status_mod.find_condition(after, "Degraded") or {}
    if new.get("status") == "True" and (old.get("status") != "True" or old.get("message") != new.get("message")):
        post_event(body, "Warning", new["reason"], new.get("message") or new["reason"])
    elif new.get("status") == "False" and old.get("status") == "True":
        post_event(body, "Normal", "Recovered", "the spec is valid and rolled out")


def post_event(body: dict[str, Any], etype: str, reason: str, message: str) -> None:
    """Create a core/v1 Event about an InferenceService (works from any thread, unlike kopf.event)."""
    meta = body["metadata"]
    obj = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": meta}
    event = kube.event_body(obj, etype, reason, message, component=resources.MANAGED_BY, now=time.time())
    try:
        cluster.resource("v1", "Event").create(body=event, namespace=meta["namespace"])
    except ApiException as e:  # an event is best effort; the condition already says it
        log.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], e.reason)


def post_lease_event(lease: dict[str, Any], etype: str, reason: str, message: str) -> None:
    """Create a core/v1 Event about a namespace's claim Lease (``kubectl get events -n NS`` shows it)."""
    meta = lease["metadata"]
    obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta}
    event = kube.event_body(obj, etype, reason, message, component=resources.MANAGED_BY, now=time.time())
    try:
        cluster.resource("v1", "Event").create(body=event, namespace=meta["namespace"])
    except ApiException as e:  # best effort: the log line says it too
        log.warning("could not post event %s for Lease %s/%s: %s", reason, meta["namespace"], meta["name"], e.reason)


def _plain(body: Any) -> dict[str, Any]:
    """A kopf Body (read-only mapping views) as plain nested dicts and lists."""
    if isinstance(body, dict) or hasattr(body, "keys"):
        return {k: _plain(v) for k, v in body.items()}
    if isinstance(body, (list, tuple)):
        return [_plain(v) for v in body]
    return body


def _short_validation_error(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"spec.{loc}: {err['msg']}")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------- handlers
@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # progress and diff-base in annotations: a structural schema would prune status.kopf
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # only our own Warning events, not every handler log line
    settings.execution.max_workers = _workers()
    settings.watching.server_timeout = 300
    cluster.dyn()
    state.resync_stop.clear()
    if WATCHED_NAMESPACES is not None:
        # exact namespaces: kopf serves them without listing or watching Namespaces (and CRDs), which a
        # namespaced install has no permission for (kopf would retry the 403 for ~55 s first)
        settings.scanning.disabled = True
        try:
            cluster.resource(crd.API_VERSION, crd.KIND)
        except ResourceNotFoundError:
            raise kopf.PermanentError(f"the {crd.KIND} CRD ({crd.PLURAL}.{crd.GROUP}) is not installed: apply "
                                      "crds/ first (a namespaced operator does not watch for it)") from None
        _claims.renew(WATCHED_NAMESPACES)  # before the first handlers run: they reconcile only what is held
        threading.Thread(target=_claim_loop, args=(state.resync_stop, WATCHED_NAMESPACES), name="claims",
                         daemon=True).start()
    threading.Thread(target=_resync_loop, args=(state.resync_stop,), name="resync", daemon=True).start()


def _claim_loop(stop: threading.Event, namespaces: tuple[str, ...]) -> None:
    """Renew the namespaces' Leases every RENEW_SECONDS; a namespace newly held is reconciled at once."""
    while not stop.wait(claims.RENEW_SECONDS):
        try:
            gained = _claims.renew(namespaces)
        except Exception as e:  # noqa: BLE001 - keep renewing
            log.warning("claim pass failed: %s", e)
            continue
        with state.known_lock:
            todo = sorted(k for k in state.known if k[0] in gained)
        for namespace, name in todo:
            try:
                reconcile(namespace, name)
            except Exception as e:  # noqa: BLE001
                log.warning("reconcile of %s/%s after claiming its namespace failed: %s", namespace, name, e)


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def on_spec(namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
    """Create, spec change (incl. the scale subresource) and operator start."""
    try:
        reconcile(namespace, name, logger)
    except ApiException as e:
        if e.status == 409:
            raise kopf.TemporaryError(f"conflict writing a child: {e.reason}", delay=2)
        raise


@kopf.on.event(*RESOURCE)
def track(type: str | None, namespace: str, name: str, body: Any = None, **_: Any) -> None:  # noqa: A002
    """Remember which InferenceServices exist, for the resync loop (no finalizer, unlike kopf.timer),
    and the served model name each claims (``model_names``)."""
    if type == "DELETED":
        state.forget(namespace, name)
    else:
        with state.known_lock:
            state.known.add((namespace, name))
        if body is not None:
            state.set_claim((namespace, name), _plain(body))


def _resync_loop(stop: threading.Event) -> None:
    """Periodic drift repair: a child deleted or edited by hand comes back within RESYNC_SECONDS.

    A plain thread instead of ``kopf.timer``: kopf timers put a finalizer on every object, which would
    block deleting InferenceServices whenever the operator is not running. A pass is spread over half
    the period (object i starts no earlier than i/n of it): its reads do not arrive as one burst
    that delays the handling of new objects (measured with e2e/measure_latency.py).
    """
    while not stop.wait(RESYNC_SECONDS):
        with state.known_lock:
            todo = sorted(state.known)
        before, t0 = requests_sent(), time.monotonic()
        step = RESYNC_SECONDS / 2 / max(1, len(todo))
        for i, (namespace, name) in enumerate(todo):
            if stop.wait(max(0.0, t0 + i * step - time.monotonic())):
                return
            try:
                reconcile(namespace, name)
            except Exception as e:  # noqa: BLE001 - keep resyncing the others
                log.warning("resync of %s/%s failed: %s", namespace, name, e)
        sent = requests_sent() - before
        # the cost of drift repair, e.g. for e2e/measure_latency.py: a no-op pass only reads
        log.info("resync of %d objects in %.2f s: %d API requests (%s)", len(todo), time.monotonic() - t0,
                 sum(sent.values()), ", ".join(f"{m} {n}" for m, n in sorted(sent.items())) or "none")


@kopf.on.cleanup()
def _stop_resync(**_: Any) -> None:
    state.resync_stop.set()
    _claims.release_all()  # the next operator for these namespaces takes over at once


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": resources.MANAGED_BY})
def on_deployment_event(type: str | None, body: kopf.Body, namespace: str, logger: logging.Logger,  # noqa: A002
                        **_: Any) -> None:
    """A child Deployment changed (pods ready, rollout progress, deleted): refresh its owner."""
    observed = None if type == "DELETED" else _plain(body)
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == crd.KIND and ref.get("apiVersion", "").startswith(crd.GROUP + "/") \
                and ref.get("controller"):
            try:
                reconcile(namespace, ref["name"], logger, observed_deployment=observed)
            except ApiException as e:
                logger.warning("reconcile of %s/%s after a Deployment event failed: %s %s",
                               namespace, ref["name"], e.status, e.reason)


@kopf.on.event("", "v1", "pods", labels={"app.kubernetes.io/managed-by": resources.MANAGED_BY,
                                          crd.LABEL_COMPONENT: kopf.PRESENT})
def on_worker_pod_event(type: str | None, body: kopf.Body, namespace: str, logger: logging.Logger,  # noqa: A002
                        **_: Any) -> None:
    """A worker pod (of either pool) changed: record whether it is failing (crash loop, cannot
    start) and, when that changes what its InferenceService reports, reconcile it (WorkerCrashLoop
    within seconds of the kubelet's report, not at the Deployment's progress deadline)."""
    pod = _plain(body)
    labels = pod["metadata"].get("labels") or {}
    owner = labels.get(crd.LABEL_ISVC)
    if not owner or labels.get(crd.LABEL_COMPONENT) not in (crd.WORKER_COMPONENT, crd.PREFILL_COMPONENT):
        return
    problem = None if type == "DELETED" else status_mod.pod_failure(pod)
    key, pname = (namespace, owner), pod["metadata"]["name"]
    before = state.worker_problem(*key)
    state.set_pod_problem(key, pname, problem)
    if state.worker_problem(*key) != before:
        try:
            reconcile(namespace, owner, logger)
        except ApiException as e:
            logger.warning("reconcile of %s/%s after a pod event failed: %s %s", namespace, owner, e.status, e.reason)
