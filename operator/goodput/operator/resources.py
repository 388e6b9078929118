"""Pure builders: an InferenceService spec -> its children (Deployment, Service, PodDisruptionBudget,
admin-token Secret) as plain dicts, plus the comparison that decides whether a child needs a write.

No kopf, no kubernetes client here (import-linter contract): ``handlers`` does the I/O.

Naming (``name`` = the InferenceService's name, a DNS-1035 label of at most 63 characters that the
CRD enforces; all in its namespace): Deployment ``name``, Service ``name`` (port ``http`` 8000),
PodDisruptionBudget ``name``, Secret ``child_name(name, "admin")`` = ``name-admin`` while that fits in
63 characters (key ``token``; created once, never rewritten). Every label value the operator sets is
the InferenceService's own name, never a child's, so every accepted name fits a label value.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
from collections.abc import Callable
from decimal import ROUND_UP, Decimal, localcontext
from typing import Any

from pydantic.alias_generators import to_snake

from goodput.api import crd
from goodput.api.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_KEY
from goodput.api.crd import InferenceServiceSpec, admin_secret_name, selector_labels
from goodput.api.settings import settings
from goodput.worker.engine.config import EngineArgs, to_cli_args

MANAGED_BY = "goodput-operator"
ANNOTATION_SPEC_HASH = f"{crd.GROUP}/spec-hash"
# the worker's kernel policy (cpu_kernels.POLICY_ENV, a torch module; a test keeps the two equal)
CPU_KERNELS_ENV = "GOODPUT_CPU_KERNELS"
CONTAINER_NAME = "worker"
MODEL_VOLUME_NAME = "model"
# The worker runs as its image's non-root user (images/worker: USER 65532) on a read-only root filesystem;
# it writes only under /tmp (HOME, compiler caches), an emptyDir. A real kubelet enforces all of it.
WORKER_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]}}
TMP_VOLUME_NAME, TMP_MOUNT_PATH = "tmp", "/tmp"


def common_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "goodput-worker",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(name),
    }


def service_url(name: str, namespace: str) -> str:
    """In-cluster URL of the Service (Service name = InferenceService name)."""
    return f"http://{name}.{namespace}.svc.cluster.local:{crd.WORKER_PORT}"


# ``python -m goodput.operator --router-url URL`` sets this for the handlers (same process).
ROUTER_URL_ENV = "GOODPUT_OPERATOR_ROUTER_URL"


def check_router_url(url: str) -> str:
    """``url`` if it is an absolute http(s) URL with a host (the router's Service URL, e.g.
    ``http://goodput-router.goodput-system.svc:8080``); raises ValueError naming the flag otherwise."""
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--router-url {url!r}: want an absolute http:// or https:// URL with a host")
    return url


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """Controller owner reference to the InferenceService; garbage collection deletes the children."""
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def worker_args(spec: InferenceServiceSpec, role: str | None = None) -> list[str]:
    """Arguments after ``goodput-worker``: ``serve`` + one flag per worker setting the spec sets
    (+ ``--role ROLE`` for a pool of a disaggregated service: pass it the pool's :func:`crd.pool_spec`).

    Driven by the worker's setting declarations (``goodput.worker.engine.config``): each setting
    names where the spec holds it (``spec.engine.<name>``, ``spec.model.name``, ``spec.slo.ttftMs``
    ...), and ``to_cli_args`` spells the flags exactly as ``goodput-worker serve`` parses them.
    Unset fields are omitted so the worker's own defaults apply; sizes are passed as whole bytes;
    ``engine.extraArgs`` is appended verbatim.
    """
    values: dict[str, Any] = {"host": "0.0.0.0", "port": crd.WORKER_PORT, "role": role}
    for s in settings(EngineArgs):
        path = s.meta.crd
        if path is None:
            continue
        obj: Any = spec.engine if path == "engine" else spec
        for attr in ([s.name] if path == "engine" else map(to_snake, path.split("."))):
            obj = None if obj is None else getattr(obj, attr)
        if isinstance(obj, list):   # a repeatable flag (slo.classes: one --slo-class per class)
            obj = [x.flag() if hasattr(x, "flag") else x for x in obj] or None
        values[s.name] = obj
    return ["serve", *to_cli_args(values), *spec.engine.extra_args]


def spec_hash(obj: Any) -> str:
    """Stable short hash (16 hex chars of SHA-256 over canonical JSON)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _http_probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http", "scheme": "HTTP"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


# Context length assumed for the drain budget when engine.maxModelLen is unset: the bundled
# SmolLM2's (8k). A GGUF with a longer context should set maxModelLen or the grace period itself.
DEFAULT_CONTEXT_TOKENS = crd.BUNDLED_MODEL_CONTEXT["smollm2"]
DRAIN_MARGIN_SECONDS = 5


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    """The pod's ``terminationGracePeriodSeconds``: ``spec.terminationGracePeriodSeconds`` when set,
    else ceil(slo.ttft + L x slo.tpot) + 5 s, L = engine.maxModelLen (or DEFAULT_CONTEXT_TOKENS):
    the time a request that just got admitted needs to stream its longest possible output at the
    SLO's pace, so a scale-down never cuts a stream that meets its SLO. Seconds, >= 1.
    """
    if spec.termination_grace_period_seconds is not None:
        return spec.termination_grace_period_seconds
    tokens = spec.engine.max_model_len or DEFAULT_CONTEXT_TOKENS
    return math.ceil((spec.slo.ttft_ms + tokens * spec.slo.tpot_ms) / 1000.0) + DRAIN_MARGIN_SECONDS


def pod_template(name: str, spec: InferenceServiceSpec, role: str | None = None) -> dict[str, Any]:
    """The worker pod template (labels, annotations incl. the spec hash, container, probes, volumes).

    ``role`` (a disaggregated service's pool: ``prefill`` or ``decode``; ``spec`` is then that pool's
    :func:`crd.pool_spec`): the worker's ``--role`` and the pod's :data:`crd.LABEL_ROLE`; the prefill
    pool's pods are selected by :func:`crd.prefill_selector_labels` instead of the workers' labels."""
    p = spec.probes
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["goodput-worker"],
        "args": worker_args(spec, role),
        "ports": [{"name": "http", "containerPort": crd.WORKER_PORT, "protocol": "TCP"}],
        # the worker writes its fatal start-up error there; the log tail when it could not
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": [
            {"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                "name": admin_secret_name(name), "key": ADMIN_TOKEN_KEY}}},
            # a pod never compiles the C++ CPU kernels at start-up: the image's (or setup.sh's) build, or
            # the torch path (worker_image/goodput/worker/model/cpu_kernels.py)
            {"name": CPU_KERNELS_ENV, "value": "prebuilt"},
        ] + [v.model_dump(by_alias=True, exclude_none=True) for v in spec.pod_template.env],
        # /health answers once the server is up; the model loads before that, so allow the whole budget
        "startupProbe": _http_probe("/health", p.period_seconds, p.timeout_seconds,
                                    max(1, math.ceil(p.startup_timeout_seconds / p.period_seconds))),
        "readinessProbe": _http_probe("/ready", p.period_seconds, p.timeout_seconds, 3),
        "livenessProbe": _http_probe("/health", p.liveness_period_seconds, p.timeout_seconds,
                                     p.liveness_failure_threshold),
        "securityContext": copy.deepcopy(WORKER_SECURITY_CONTEXT),
    }
    r = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if r.cpu:
        requests["cpu"] = r.cpu
    if r.memory:
        requests["memory"] = limits["memory"] = r.memory
    if r.gpu:
        # extended resources: requests must equal limits
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(r.gpu)
    if requests or limits:
        container["resources"] = {k: v for k, v in (("limits", limits), ("requests", requests)) if v}
    pod_spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": termination_grace_seconds(spec)}
    vol = spec.model.volume
    if vol is not None:
        source: dict[str, Any]
        if vol.claim_name:
            source = {"persistentVolumeClaim": {"claimName": vol.claim_name, "readOnly": True}}
        else:
            source = {"hostPath": {"path": vol.host_path, "type": "Directory"}}
        pod_spec["volumes"] = [{"name": MODEL_VOLUME_NAME, **source}]
        mount = {"name": MODEL_VOLUME_NAME, "mountPath": vol.mount_path, "readOnly": True}
        if vol.sub_path:
            mount["subPath"] = vol.sub_path
        container["volumeMounts"] = [mount]
    pod_spec.setdefault("volumes", []).append({"name": TMP_VOLUME_NAME, "emptyDir": {}})
    container.setdefault("volumeMounts", []).append({"name": TMP_VOLUME_NAME, "mountPath": TMP_MOUNT_PATH})
    s = spec.scheduling
    if s.node_selector:
        pod_spec["nodeSelector"] = dict(s.node_selector)
    if s.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in s.tolerations]
    if s.affinity:
        pod_spec["affinity"] = copy.deepcopy(s.affinity)
    if s.priority_class_name:
        pod_spec["priorityClassName"] = s.priority_class_name
    if spec.pod_template.service_account_name:
        pod_spec["serviceAccountName"] = spec.pod_template.service_account_name
    labels = {**spec.pod_template.labels, **common_labels(name)}  # ours win: the selector depends on them
    if role is not None:
        labels[crd.LABEL_ROLE] = role
    if role == "prefill":
        labels.update(crd.prefill_selector_labels(name))
    annotations = {
        **spec.pod_template.annotations,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(crd.WORKER_PORT),
        "prometheus.io/path": "/metrics",
    }
    template = {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}
    # a changed template rolls the Deployment; the hash makes the rollout cause visible on each pod
    annotations[ANNOTATION_SPEC_HASH] = spec_hash(template)
    return template


def _meta(name: str, namespace: str, owner: dict[str, Any] | None, child: str | None = None) -> dict[str, Any]:
    """Metadata of a child named ``child`` (default: ``name``); its labels carry the owner's ``name``."""
    m: dict[str, Any] = {"name": child or name, "namespace": namespace, "labels": common_labels(name)}
    if owner:
        m["ownerReferences"] = [owner]
    return m


def _with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """Record a hash of everything the operator sets except spec.replicas (owned by scaling)."""
    hashed = copy.deepcopy(obj)
    hashed.get("spec", {}).pop("replicas", None)
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = spec_hash(hashed)
    return obj


def deployment(name: str, namespace: str, spec: InferenceServiceSpec,
               owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """apps/v1 Deployment of ``spec.replicas`` workers; rolls with maxSurge 1, maxUnavailable 0.
    With ``spec.disaggregation`` on, these are the decode pool's workers (``--role decode``)."""
    disaggregated = spec.disaggregation.enabled
    template = pod_template(name, crd.pool_spec(spec, "decode"), "decode") if disaggregated else \
        pod_template(name, spec)
    return _workers_deployment(namespace, spec, _meta(name, namespace, owner), spec.replicas,
                               selector_labels(name), template)


def prefill_deployment(name: str, namespace: str, spec: InferenceServiceSpec,
                       owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """apps/v1 Deployment of the prefill pool (``spec.disaggregation.prefill.replicas`` workers with
    ``--role prefill``), named :func:`crd.prefill_deployment_name`. Raises ValueError when
    ``spec.disaggregation`` is off."""
    if not spec.disaggregation.enabled:
        raise ValueError("spec.disaggregation is off: no prefill pool")
    template = pod_template(name, crd.pool_spec(spec, "prefill"), "prefill")
    meta = _meta(name, namespace, owner, crd.prefill_deployment_name(name))
    meta["labels"].update(crd.prefill_selector_labels(name))
    return _workers_deployment(namespace, spec, meta, spec.disaggregation.prefill.replicas,
                               crd.prefill_selector_labels(name), template)


def _workers_deployment(namespace: str, spec: InferenceServiceSpec, meta: dict[str, Any], replicas: int,
                        selector: dict[str, str], template: dict[str, Any]) -> dict[str, Any]:
    return _with_hash({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            # a rollout is declared stuck only after the startup budget (model loading) plus a minute
            "progressDeadlineSeconds": spec.probes.startup_timeout_seconds + 60,
            "template": template,
        },
    })


def service(name: str, namespace: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """v1 Service (ClusterIP) named like the InferenceService, port ``http`` -> the workers' 8000."""
    return _with_hash({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": crd.WORKER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def pod_disruption_budget(name: str, namespace: str, api_version: str = "policy/v1",
                          owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """PodDisruptionBudget allowing one voluntary disruption at a time.

    ``api_version``: "policy/v1" (Kubernetes >= 1.21) or "policy/v1beta1" — whichever the server offers.
    """
    if api_version not in ("policy/v1", "policy/v1beta1"):
        raise ValueError(f"unsupported PodDisruptionBudget API version {api_version!r}")
    return _with_hash({
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, namespace, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    })


def admin_secret(name: str, namespace: str, token: str,
                 owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """Opaque Secret with the workers' admin bearer token (key ``token``). Created once; never compared."""
    if not token:
        raise ValueError("admin token must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(name, namespace, owner, child=admin_secret_name(name)),
        "type": "Opaque",
        "data": {ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


# ------------------------------------------------------------------------------------ comparison
QuantityParser = Callable[[str], Decimal]
_MILLI = Decimal("0.001")
_QUANTITY_MAX = Decimal(2**63 - 1)
_BINARY_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def as_stored(value: Decimal, binary: bool = False) -> Decimal:
    """The value the API server stores in a pod's ``resources`` for a quantity of exact ``value``.

    Two rules of Kubernetes (checked against kube-apiserver 1.20, see tests/operator/test_operator_resources.py):
    ParseQuantity (k8s.io/apimachinery/pkg/api/resource/quantity.go) caps a binary-suffixed (``binary``:
    Ki..Ei) quantity above 2^63-1 at 2^63-1, and SetDefaults_ResourceList (pkg/apis/core/v1/defaults.go)
    rounds every non-zero value up, away from zero, to whole milli-units. So "0.0001" is stored as "1m",
    "1.5m" as "2m" and "99999999999Ti" as "9223372036854775807"; a plain "99999999999999999999" stays.
    """
    if value == 0:
        return value
    if binary and abs(value) > _QUANTITY_MAX:
        value = _QUANTITY_MAX.copy_sign(value)
    with localcontext() as ctx:
        ctx.prec = max(ctx.prec, len(value.as_tuple().digits) + 6)  # exact: no rounding but ours
        return value.quantize(_MILLI, rounding=ROUND_UP)


def same_quantity(desired: str, actual: str, parse_quantity: QuantityParser) -> bool:
    """Whether the server's ``actual`` quantity is what it stores for our ``desired`` one, by value.

    ``parse_quantity``: a Kubernetes quantity parser (``kubernetes.utils.parse_quantity``: str ->
    Decimal, ValueError for a non-quantity); injected so this module stays free of the client.
    """
    try:
        return as_stored(parse_quantity(desired), desired.endswith(_BINARY_SUFFIXES)) == parse_quantity(actual)
    except (ValueError, ArithmeticError):
        return False


def is_subset(desired: Any, actual: Any, parse_quantity: QuantityParser | None = None,
              quantities: bool = False) -> bool:
    """True when every field set in ``desired`` has the same value in ``actual``.

    Fields only in ``actual`` (server defaults such as ``terminationMessagePath``) are ignored; lists
    must have the same length and match element-wise. Inside ``requests`` and ``limits`` strings
    are resource quantities and compare by value as the server stores them (``same_quantity``;
    "0.5" equals the server's canonical "500m") when ``parse_quantity`` is given.
    """
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return False
        return all(k in actual and is_subset(v, actual[k], parse_quantity,
                                             quantities or k in ("requests", "limits"))
                   for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(desired) != len(actual):
            return False
        return all(is_subset(d, a, parse_quantity, quantities) for d, a in zip(desired, actual))
    if desired == actual:
        return True
    if quantities and parse_quantity is not None and isinstance(desired, str) and isinstance(actual, str):
        return same_quantity(desired, actual, parse_quantity)
    return False


def needs_update(desired: dict[str, Any], actual: dict[str, Any], parse_quantity: QuantityParser) -> bool:
    """Whether ``actual`` (as read from the server) differs from ``desired`` in anything we own.

    A changed spec-hash annotation catches removed fields (which ``is_subset`` cannot see); the
    subset test catches hand edits and scaling of the child itself. Resource quantities compare by
    value (``same_quantity`` with ``parse_quantity``), so the server's normalized spelling of a
    quantity is no difference: a no-op reconcile writes nothing.
    """
    want = desired.get("metadata", {}).get("annotations", {}).get(ANNOTATION_SPEC_HASH)
    have = (actual.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    if want != have:
        return True
    ours = {k: v for k, v in desired.items() if k != "metadata"}
    meta = {k: desired["metadata"][k] for k in ("labels", "annotations", "ownerReferences")
            if k in desired["metadata"]}
    return not is_subset({**ours, "metadata": meta}, actual, parse_quantity)


def replacement(desired: dict[str, Any], actual: dict[str, Any]) -> dict[str, Any]:
    """The body for a full replace of ``actual`` by ``desired``.

    Keeps what others own: the resourceVersion (optimistic concurrency), labels and annotations that
    other controllers added (e.g. deployment.kubernetes.io/revision), and a Service's allocated
    cluster IPs (immutable).
    """
    body = copy.deepcopy(desired)
    am = actual.get("metadata", {})
    bm = body["metadata"]
    bm["resourceVersion"] = am.get("resourceVersion")
    bm["labels"] = {**(am.get("labels") or {}), **bm.get("labels", {})}
    bm["annotations"] = {**(am.get("annotations") or {}), **bm.get("annotations", {})}
    if body.get("kind") == "Service":
        for k in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if k in (actual.get("spec") or {}):
                body["spec"][k] = actual["spec"][k]
    return body


def children(name: str, namespace: str, uid: str, spec: InferenceServiceSpec,
             pdb_api_version: str = "policy/v1") -> list[dict[str, Any]]:
    """The Deployment, Service and PodDisruptionBudget for one InferenceService, owned by it, and the
    prefill pool's Deployment when ``spec.disaggregation`` is on."""
    owner = owner_reference(name, uid)
    out = [
        deployment(name, namespace, spec, owner),
        service(name, namespace, owner),
        pod_disruption_budget(name, namespace, pdb_api_version, owner),
    ]
    if spec.disaggregation.enabled:
        out.append(prefill_deployment(name, namespace, spec, owner))
    return out


def obsolete_children(name: str, spec: InferenceServiceSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of children this spec no longer has: the prefill pool's Deployment
    once ``spec.disaggregation`` is off (garbage collection removes children only with their owner)."""
    return [] if spec.disaggregation.enabled else [("apps/v1", "Deployment", crd.prefill_deployment_name(name))]
