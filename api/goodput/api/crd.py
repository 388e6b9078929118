"""The InferenceService API: pydantic v2 models of its spec and status — the ONLY schema source —
and the names and labels every deployable finds its objects by.

``crdgen`` turns these models into the CustomResourceDefinition (``crds/``); the operator parses every
object it reads with them; example CRs in ``crds/examples/`` are validated by them in tests.

YAML/JSON field names are camelCase (pydantic aliases); Python attributes are snake_case. Objects the
user writes refuse unknown fields (``extra="forbid"``). Kubernetes 1.20 prunes unknown fields
server-side instead of refusing them; ``kubectl apply`` (client-side schema validation, on by default)
refuses them with ``unknown field "..."``. Checks a schema cannot express (``semantic_problems``) become
a ``Degraded`` condition and a Kubernetes Event instead.

Names and labels: the API group, version and kind; the worker pods' selector labels
(:data:`LABEL_ISVC`, :data:`LABEL_COMPONENT`; :func:`selector_labels`), the draining annotation, the
worker port and the admin-token Secret's name (:func:`admin_secret_name`).

This module is pure: no kopf, no kubernetes client (an import-linter contract enforces it).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from goodput.api.policy import (DEFAULT_SLO_CLASS, MAX_SLO_CLASSES, SLO_CLASS_MAX_LENGTH, SLO_CLASS_PATTERN,
                                KnobField, PolicySpec, knobs, slo_class_flag)
from goodput.api.admin import ADMIN_TOKEN_ENV
from goodput.api.settings import SettingField, check, settings
from goodput.worker.engine.config import EngineArgs
from pydantic import AliasGenerator, BaseModel, ConfigDict, Field, create_model
from pydantic.alias_generators import to_camel, to_snake

GROUP = "serving.goodput.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
# not "isvc": KServe's InferenceService owns that short name
SHORT_NAMES = ["gisvc"]
CATEGORIES = ["goodput"]

BUNDLED_MODELS = ("smollm2",)
# context length (GGUF ``llama.context_length``) of each bundled model: a longer maxModelLen is refused
BUNDLED_MODEL_CONTEXT = {"smollm2": 8192}
WORKER_PORT = 8000
# Pod annotation the autoscaler sets before a scale-in; the router sends a pod so marked no new
# request (docs/router-autoscaler-contract.md, "Scale-in").
DRAINING_ANNOTATION = f"{GROUP}/draining"
DEFAULT_IMAGE = "goodput/worker:0.1.0"
# Worker pods carry both; the operator's Deployment, Service and PDB select them by these labels.
LABEL_ISVC = f"{GROUP}/inferenceservice"
LABEL_COMPONENT = "app.kubernetes.io/component"
DNS_LABEL_MAX = 63  # RFC 1123 label; also the limit of a label value


# Disaggregated prefill/decode (``spec.disaggregation``): each worker pod says its role in this label;
# the prefill pool's pods carry their own component (PREFILL_COMPONENT), so the worker Deployment,
# Service and PDB (which select "worker") never see them, and the autoscaler's ``spec.replicas``
# (the scale subresource) sizes the decode pool.
LABEL_ROLE = f"{GROUP}/role"
WORKER_COMPONENT = "worker"
PREFILL_COMPONENT = "prefill-worker"


def selector_labels(name: str) -> dict[str, str]:
    """The labels a Deployment, Service and PDB select worker pods by."""
    return {LABEL_ISVC: name, LABEL_COMPONENT: WORKER_COMPONENT}


def prefill_selector_labels(name: str) -> dict[str, str]:
    """The labels the prefill pool's Deployment selects its pods by (``spec.disaggregation``)."""
    return {LABEL_ISVC: name, LABEL_COMPONENT: PREFILL_COMPONENT}


def selector_string(name: str) -> str:
    """``selector_labels`` as a label-selector string (status.selector, for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def child_name(name: str, suffix: str, limit: int = DNS_LABEL_MAX) -> str:
    """The name of a child of InferenceService ``name``: ``"<name>-<suffix>"`` when it fits in ``limit``
    characters, else ``name`` cut short + ``-`` + 8 hex digits of SHA-256(``name``) + ``-<suffix>``,
    exactly ``limit`` long.

    Stable (a pure function of its arguments) and distinct for names that share the kept prefix. Kept
    within 63 characters so a child name is also a valid DNS label and label value. A cut that ends
    in ``-`` loses that ``-`` (one character shorter). Raises ValueError when ``suffix`` leaves no room.
    """
    full = f"{name}-{suffix}"
    if len(full) <= limit:
        return full
    keep = limit - len(suffix) - 10  # "-" + 8 hex + "-"
    if keep < 1:
        raise ValueError(f"suffix {suffix!r} leaves no room for a name within {limit} characters")
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:keep].rstrip('-')}-{digest}-{suffix}"


def prefill_deployment_name(name: str) -> str:
    """The prefill pool's Deployment of InferenceService ``name`` (``name-prefill``, shortened past 63
    chars)."""
    return child_name(name, "prefill")


def admin_secret_name(name: str) -> str:
    """The admin-token Secret of InferenceService ``name`` (``name-admin``, shortened past 63 chars)."""
    return child_name(name, "admin")


# Kubernetes resource quantity (e.g. "500m", "2", "1.5Gi", "512Mi")
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
# Byte sizes (``engine.kvCacheMemory``) are parsed by the setting's own parser
# (``goodput.api.units.parse_bytes``), so the CRD and the worker accept exactly the same spellings
# (512Mi, 512MiB, 1GiB, 64M ...).


class _Model(BaseModel):
    """Base: camelCase aliases, snake_case attributes, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=AliasGenerator(alias=to_camel),
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )


Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN)]
ByteSize = Annotated[
    int | str,
    Field(description="bytes, or a string with a suffix: 512Mi, 1Gi, 64M"),
]


# ----------------------------------------------------------------------------------------------- spec
class ModelVolume(_Model):
    """Where a ``.gguf`` file comes from: a PersistentVolumeClaim or a host path, mounted read-only."""

    claim_name: str | None = Field(None, min_length=1, description="PersistentVolumeClaim holding the model")
    sub_path: str | None = Field(None, description="subPath inside the volume")
    host_path: str | None = Field(None, min_length=1, description="directory on the node holding the model")
    mount_path: str = Field("/models", pattern=r"^/", description="where the volume is mounted in the worker")


class ModelSource(_Model):
    """The model a worker serves."""

    name: str = Field(
        "smollm2",
        min_length=1,
        description="a bundled model name (smollm2) or the path of a .gguf file inside the worker "
        "(usually under model.volume.mountPath)",
    )
    revision: str | None = Field(None, description="model revision; part of the prefix-cache identity")
    served_model_name: str | None = Field(None, min_length=1, description="name clients use in requests")
    volume: ModelVolume | None = None


class _EngineSpecBase(_Model):
    image: str = Field(DEFAULT_IMAGE, min_length=1, description="worker container image")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    extra_args: list[str] = Field(default_factory=list, description="more worker flags, appended verbatim")


def _engine_field(s: SettingField) -> tuple[Any, Any]:
    """The CRD field of one worker setting: unset (null) means the worker's default, except a
    boolean, which carries the worker's default. A setting with units takes a number or a
    string (checked by ``semantic_problems``, as a structural schema cannot)."""
    description = f"{s.flag}: {s.meta.help}"
    if s.type is bool:
        return bool, Field(s.default, description=description)
    if s.meta.choices is not None:
        typ: Any = Literal[s.meta.choices]
    elif s.meta.parse is not None:
        return ByteSize | None, Field(None, description=description)
    else:
        typ = s.type
    return typ | None, Field(None, ge=s.meta.ge, gt=s.meta.gt, le=s.meta.le, description=description)


# Worker engine settings; each maps to one ``goodput-worker serve`` flag. Built from the worker's
# setting declarations (goodput.worker.engine.config), so a new setting appears here by itself.
ENGINE_SETTINGS = [s for s in settings(EngineArgs) if s.meta.crd == "engine"]
EngineSpec = create_model(
    "EngineSpec", __base__=_EngineSpecBase,
    __doc__="Worker engine settings; each maps to one goodput-worker serve flag. Unset = worker default.",
    **{s.name: _engine_field(s) for s in ENGINE_SETTINGS})


def _override_field(s: SettingField) -> tuple[Any, Any]:
    """A pool's override of one worker setting: like :func:`_engine_field`, but unset (null) for
    every type, booleans included (null = the service's ``spec.engine`` value)."""
    typ, field = _engine_field(s)
    if s.type is bool:
        return bool | None, Field(None, description=field.description)
    return typ, field


PoolEngineSpec = create_model(
    "PoolEngineSpec", __base__=_Model,
    __doc__="Worker engine settings for one pool, over spec.engine: a field set here replaces the "
            "service's; unset ones keep it.",
    **{s.name: _override_field(s) for s in ENGINE_SETTINGS})


class PrefillPoolSpec(_Model):
    """The prefill pool: pods that compute prompts' KV and first tokens for the decode pool to pull."""

    replicas: int = Field(1, ge=0, le=1000, description="prefill worker pods")
    min_replicas: int = Field(1, ge=0, le=1000, description="fewest prefill pods an autoscaler may leave")
    max_replicas: int = Field(4, ge=1, le=1000, description="most prefill pods an autoscaler may run")
    engine: PoolEngineSpec = Field(default_factory=PoolEngineSpec, json_schema_extra={"default": {}})


class DecodePoolSpec(_Model):
    """The decode pool: the service's worker pods (``spec.replicas``, the scale subresource, and
    ``spec.autoscaling`` size it); they stream every response and prefill short prompts themselves."""

    engine: PoolEngineSpec = Field(default_factory=PoolEngineSpec, json_schema_extra={"default": {}})


class DisaggregationSpec(_Model):
    """Disaggregated prefill and decode (DistServe, Zhong et al., OSDI 2024): a prefill pool computes
    long prompts' KV, the decode pool pulls it and streams the output, so a long prompt never
    stretches other streams' inter-token latency. Off by default (docs/disaggregation.md)."""

    enabled: bool = Field(False, description="run a prefill pool beside the decode pool")
    remote_prefill_min_tokens: int = Field(
        512, ge=0, le=1048576, description="the router sends a prompt to the prefill pool only when the "
        "decode pod would prefill more than this many of its tokens (uncached); shorter ones are "
        "prefilled where they decode")
    prefill: PrefillPoolSpec = Field(default_factory=PrefillPoolSpec, json_schema_extra={"default": {}})
    decode: DecodePoolSpec = Field(default_factory=DecodePoolSpec, json_schema_extra={"default": {}})


def served_model_name(model_spec: Mapping[str, Any]) -> str:
    """``spec.model`` (camelCase, as the API returns it) → the name clients put in ``model``:
    ``servedModelName``, else the file name of ``name`` without ``.gguf`` (``EngineArgs.model_name``,
    the worker's own rule)."""
    name = model_spec.get("name") or ModelSource.model_fields["name"].default
    return EngineArgs(model=name, served_model_name=model_spec.get("servedModelName") or None).model_name


def engine_value(engine: Any, name: str) -> Any:
    """The value a worker runs with: the spec's, or the worker's default when unset."""
    value = getattr(engine, name)
    return getattr(EngineArgs, name, None) if value is None else value


class ResourceSpec(_Model):
    """Per-worker resources. CPU and memory are requests (memory is also the limit)."""

    gpu: int = Field(0, ge=0, le=64, description="nvidia.com/gpu per worker (requests = limits)")
    cpu: Quantity | None = Field(None, description="CPU request, e.g. 2 or 500m")
    memory: Quantity | None = Field(None, description="memory request and limit, e.g. 4Gi")


def _knob_field(k: KnobField) -> tuple[Any, Any]:
    """The CRD field of one autoscaling knob: type, default and bounds in the CRD's units."""
    return k.crd_type, Field(k.crd_default, ge=k.meta.ge, gt=k.meta.gt, le=k.meta.le, description=k.meta.help)


def _knob_fields(*prefix: str) -> dict[str, Any]:
    """The knobs held directly under ``.spec.<prefix>``, as pydantic fields (snake_case names,
    camelCase aliases)."""
    return {to_snake(k.path[-1]): _knob_field(k) for k in knobs()
            if k.path[:-1] == prefix}


def _nested(model: Any) -> Any:
    return model, Field(default_factory=model, json_schema_extra={"default": {}})


class SLOClassSpec(_Model):
    """One SLO class: a request naming it in x-goodput-slo-class meets the SLO when TTFT <= ttftMs, TPOT <= tpotMs."""

    name: str = Field(..., min_length=1, max_length=SLO_CLASS_MAX_LENGTH, pattern=SLO_CLASS_PATTERN,
                      description="the class's name, as requests send it in the x-goodput-slo-class header "
                      f"(a DNS label; not {DEFAULT_SLO_CLASS!r}, the unnamed class)")
    ttft_ms: float = Field(..., gt=0, description="time-to-first-token target of the class, milliseconds")
    tpot_ms: float = Field(..., gt=0, description="time-per-output-token target of the class, milliseconds")

    def flag(self) -> str:
        """The worker's ``--slo-class`` value for this class, ``NAME:TTFT_MS:TPOT_MS``."""
        return slo_class_flag(self.name, self.ttft_ms, self.tpot_ms)


# The SLO and autoscaling fields are built from the policy's knob declarations
# (goodput.api.policy.PolicySpec), so a new knob appears here by itself.
SLOSpec = create_model(
    "SLOSpec", __base__=_Model,
    __doc__="Service-level objectives; a request meets the SLO when TTFT <= ttftMs and TPOT <= tpotMs "
            "(those of its class, when it names one of classes).",
    **_knob_fields("slo"),
    classes=(list[SLOClassSpec], Field(
        default_factory=list, max_length=MAX_SLO_CLASSES,
        description="named SLO classes, each judged by its own TTFT and TPOT (requests name theirs in the "
        "x-goodput-slo-class header; none or an unknown name: ttftMs and tpotMs above); the autoscaler "
        "sizes for each class's own SLO")))
AutoscalingTargets = create_model(
    "AutoscalingTargets", __base__=_Model, __doc__="Signals the autoscaler holds each replica to.",
    **_knob_fields("autoscaling", "targets"))
AutoscalingTuning = create_model(
    "AutoscalingTuning", __base__=_Model,
    __doc__="The autoscaling policy's tuning knobs (goodput.autoscaler.policy); defaults suit most services.",
    **_knob_fields("autoscaling", "tuning"))
AutoscalingSpec = create_model(
    "AutoscalingSpec", __base__=_Model,
    __doc__="Goodput autoscaler settings (read by the autoscaler; the operator only validates them).",
    enabled=(bool, False), **_knob_fields("autoscaling"), targets=_nested(AutoscalingTargets),
    tuning=_nested(AutoscalingTuning))


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SchedulingSpec(_Model):
    """Where worker pods may run (copied into the pod spec)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = Field(None, description="a core/v1 Affinity, passed through")
    priority_class_name: str | None = None


class EnvVar(_Model):
    name: str = Field(min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(None, description="a core/v1 EnvVarSource, passed through")


class PodTemplateOverrides(_Model):
    """Additions to the worker pod."""

    env: list[EnvVar] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    service_account_name: str | None = None


class ProbeSpec(_Model):
    """Probe timing. The startup probe allows ``startupTimeoutSeconds`` for model loading."""

    startup_timeout_seconds: int = Field(600, ge=1, le=7200, description="time allowed for model loading")
    period_seconds: int = Field(5, ge=1, le=300, description="startup and readiness probe period")
    timeout_seconds: int = Field(2, ge=1, le=60)
    liveness_period_seconds: int = Field(10, ge=1, le=300)
    liveness_failure_threshold: int = Field(3, ge=1, le=100)


class InferenceServiceSpec(_Model):
    """Desired state of an InferenceService."""

    model: ModelSource = Field(default_factory=ModelSource, json_schema_extra={"default": {}})
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra={"default": {}})
    resources: ResourceSpec = Field(default_factory=ResourceSpec, json_schema_extra={"default": {}})
    replicas: int = Field(1, ge=0, le=1000, description="worker pods; also the scale subresource")
    slo: SLOSpec = Field(default_factory=SLOSpec, json_schema_extra={"default": {}})
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, json_schema_extra={"default": {}})
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, json_schema_extra={"default": {}})
    pod_template: PodTemplateOverrides = Field(
        default_factory=PodTemplateOverrides, json_schema_extra={"default": {}}
    )
    probes: ProbeSpec = Field(default_factory=ProbeSpec, json_schema_extra={"default": {}})
    disaggregation: DisaggregationSpec = Field(
        default_factory=DisaggregationSpec, json_schema_extra={"default": {}})
    termination_grace_period_seconds: int | None = Field(
        None, ge=1, le=86400,
        description="how long a worker may drain its in-flight streams after SIGTERM (scale-down, "
        "rollout) before it is killed; unset = long enough for maxModelLen tokens at slo.tpotMs "
        "(see resources.termination_grace_seconds)")


# --------------------------------------------------------------------------------------------- status
class _StatusModel(_Model):
    # status is written by the operator and the autoscaler; tolerate fields a newer writer adds
    model_config = ConfigDict(
        alias_generator=AliasGenerator(alias=to_camel), populate_by_name=True, extra="ignore"
    )


ConditionType = Literal["Ready", "Progressing", "Degraded", "ModelNameAccepted"]  # the last: goodput.operator.model_names


class Condition(_StatusModel):
    """One condition, per the Kubernetes API conventions (metav1.Condition fields)."""

    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="CamelCase")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339, when status last changed")
    observed_generation: int | None = None


class AdmissionStatus(_StatusModel):
    """Admission limits currently pushed to every ready worker, and the router's queue bound."""

    max_num_seqs: int | None = None
    max_waiting: int | None = None
    max_waiting_tokens: int | None = Field(
        None, ge=0, description="the smallest prompt-token queue limit pushed (0 = none; "
        "docs/autoscaling.md, rule 5)")
    router_max_queued: int | None = Field(
        None, ge=0, description="bound of the router's fleet queue for this service (beyond it: 429); "
        "unset = the sum of the Ready pods' max_waiting (docs/router-autoscaler-contract.md)")
    updated_at: str | None = None


class AutoscalerDecision(_StatusModel):
    """One decision that changed something (replicas, limits or reason)."""

    time: str
    replicas: int
    max_num_seqs: int | None = None
    max_waiting: int | None = None
    reason: str = ""
    message: str | None = Field(None, description="the numbers behind the decision, one sentence")


MAX_DECISIONS = 20
AutoscalerConditionType = Literal["MetricsAvailable", "ScalingActive", "AbleToScale"]


class AutoscalerCondition(_StatusModel):
    """An autoscaler condition (metav1.Condition fields), as HPA reports AbleToScale/ScalingActive."""

    type: AutoscalerConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="CamelCase")
    message: str | None = None
    last_transition_time: str = Field(description="RFC 3339, when status last changed")


class PoolAutoscalerStatus(_StatusModel):
    """The autoscaler's record of one pool: its recent decisions (newest last, at most
    MAX_DECISIONS), conditions, and the policy state it resumes from."""

    last_scale_time: str | None = None
    last_decision_time: str | None = None
    desired_replicas: int | None = None
    decisions: list[AutoscalerDecision] = Field(default_factory=list, max_length=MAX_DECISIONS)
    conditions: list[AutoscalerCondition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    policy_state: dict[str, Any] | None = Field(
        None, description="the policy's state (windows, last changes): a restarted autoscaler resumes it")


class AutoscalerStatus(PoolAutoscalerStatus):
    """Written only by the autoscaler (the operator never writes it): the record of the workers (the
    decode pool of a disaggregated service) and, under ``prefill``, of the prefill pool."""

    prefill: PoolAutoscalerStatus | None = Field(
        None, description="the prefill pool's record (spec.disaggregation), sized on its own")


class PoolStatus(_StatusModel):
    """One pool's pods (``spec.disaggregation``), from its Deployment."""

    desired_replicas: int = 0
    replicas: int = 0
    ready_replicas: int = 0


class PoolsStatus(_StatusModel):
    """Each pool of a disaggregated service (absent when ``spec.disaggregation`` is off)."""

    prefill: PoolStatus | None = None
    decode: PoolStatus | None = None


class InferenceServiceStatus(_StatusModel):
    """Observed state, written by the operator (and ``autoscaler`` by the autoscaler)."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int = Field(0, description="worker pods that exist (scale subresource statusReplicasPath)")
    ready_replicas: int = 0
    updated_replicas: int = 0
    selector: str | None = Field(None, description="label selector of the pods (scale subresource)")
    url: str | None = Field(None, description="in-cluster URL clients use: the router's (operator "
                            "--router-url; it picks the service by model) or else the Service's")
    pools: PoolsStatus | None = Field(None, description="the prefill and decode pools, when disaggregated")
    admission: AdmissionStatus | None = None
    autoscaler: AutoscalerStatus | None = None


class InferenceService(_Model):
    """A whole object as read from the API server (metadata kept as a plain dict)."""

    model_config = ConfigDict(
        alias_generator=AliasGenerator(alias=to_camel), populate_by_name=True, extra="ignore"
    )
    api_version: Literal["serving.goodput.dev/v1alpha1"] = API_VERSION
    kind: Literal["InferenceService"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceServiceSpec = Field(default_factory=InferenceServiceSpec)
    status: InferenceServiceStatus | None = None


def pool_spec(spec: InferenceServiceSpec, pool: Literal["prefill", "decode"]) -> InferenceServiceSpec:
    """``spec`` as one pool's workers run it: ``spec.engine`` with the pool's engine overrides
    (``spec.disaggregation.<pool>.engine``, the fields set there) applied; the rest unchanged."""
    overrides = getattr(spec.disaggregation, pool).engine.model_dump(exclude_none=True)
    return spec.model_copy(update={"engine": spec.engine.model_copy(update=overrides)})


# ------------------------------------------------------------------------------- semantic validation
class Problem(BaseModel):
    """A spec problem the schema cannot express; becomes Degraded (reason) and a Warning Event."""

    reason: str
    message: str


def _engine_problems(spec: InferenceServiceSpec, where: str = "engine") -> list[Problem]:
    """What the schema cannot check of ``spec.engine`` (values with units, cross-field bounds);
    messages name fields under ``where``."""
    out: list[Problem] = []
    e, name = spec.engine, spec.model.name
    for st in ENGINE_SETTINGS:  # what the schema cannot check: values with units
        value = getattr(e, st.name)
        if st.meta.parse is not None and value is not None:
            try:
                check(st, st.meta.parse(value) if isinstance(value, str) else value)
            except ValueError as exc:
                out.append(Problem(reason="InvalidEngineConfig", message=f"{where}.{to_camel(st.name)}: {exc}"))
    block_size = engine_value(e, "block_size")
    if e.max_num_batched_tokens is not None and e.max_num_batched_tokens < block_size:
        out.append(Problem(reason="InvalidEngineConfig", message=(
            f"{where}.maxNumBatchedTokens ({e.max_num_batched_tokens}) is smaller than "
            f"{where}.blockSize ({block_size})")))
    if e.max_model_len is not None and e.max_model_len < block_size:
        out.append(Problem(reason="InvalidEngineConfig", message=(
            f"{where}.maxModelLen ({e.max_model_len}) is smaller than {where}.blockSize ({block_size})")))
    context = BUNDLED_MODEL_CONTEXT.get(name)
    if e.max_model_len is not None and context is not None and e.max_model_len > context:
        out.append(Problem(reason="InvalidEngineConfig", message=(
            f"{where}.maxModelLen ({e.max_model_len}) exceeds the context length of model {name} "
            f"({context} tokens)")))
    if e.attention_backend == "triton" and spec.resources.gpu == 0:
        out.append(Problem(reason="InvalidEngineConfig", message=(
            f"{where}.attentionBackend triton needs a GPU: set resources.gpu >= 1 or use auto/torch")))
    if e.attention_backend == "cpu" and spec.resources.gpu > 0:
        out.append(Problem(reason="InvalidEngineConfig", message=(
            f"{where}.attentionBackend cpu runs on the CPU, but resources.gpu > 0 gives the worker a GPU: "
            "use auto or triton")))
    return out


def semantic_problems(spec: InferenceServiceSpec) -> list[Problem]:
    """Cross-field checks that the (Kubernetes 1.20, CEL-free) schema cannot express.

    Returns an empty list for a good spec. The operator does not roll out a spec with problems.
    """
    out: list[Problem] = []
    name = spec.model.name
    if name not in BUNDLED_MODELS and not name.endswith(".gguf"):
        out.append(Problem(reason="InvalidModel", message=(
            f"model.name {name!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
            "nor a path ending in .gguf")))
    if name not in BUNDLED_MODELS and name.endswith(".gguf") and not name.startswith("/"):
        out.append(Problem(reason="InvalidModel", message=f"model.name {name!r} must be an absolute path"))
    vol = spec.model.volume
    if vol is not None:
        if (vol.claim_name is None) == (vol.host_path is None):
            out.append(Problem(reason="InvalidModelVolume",
                               message="model.volume needs exactly one of claimName or hostPath"))
        if name.endswith(".gguf") and not name.startswith(vol.mount_path.rstrip("/") + "/"):
            out.append(Problem(reason="InvalidModelVolume", message=(
                f"model.name {name!r} is not under model.volume.mountPath {vol.mount_path!r}")))
    base = _engine_problems(spec)
    out += base
    for pool in ("prefill", "decode") if spec.disaggregation.enabled else ():
        where = f"disaggregation.{pool}.engine"  # the pool's merged settings; each problem said once
        out += [p for p in _engine_problems(pool_spec(spec, pool), where)
                if p.message.replace(where, "engine") not in {b.message for b in base}]
    names = [c.name for c in spec.slo.classes]
    if DEFAULT_SLO_CLASS in names:
        out.append(Problem(reason="InvalidSLO", message=(
            f"slo.classes name {DEFAULT_SLO_CLASS!r} is reserved for the unnamed class (slo.ttftMs, slo.tpotMs)")))
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        out.append(Problem(reason="InvalidSLO", message=f"slo.classes names must be unique, repeated: {', '.join(dup)}"))
    a = spec.autoscaling
    if a.min_replicas > a.max_replicas:
        out.append(Problem(reason="InvalidAutoscaling", message=(
            f"autoscaling.minReplicas ({a.min_replicas}) > autoscaling.maxReplicas ({a.max_replicas})")))
    else:
        try:   # the policy's own consistency checks (e.g. tuning.minNumSeqs <= tuning.maxNumSeqs)
            PolicySpec.from_crd(spec.model_dump(by_alias=True))
        except ValueError as e:
            if not str(e).startswith("slo.classes"):   # said once, above, as InvalidSLO
                out.append(Problem(reason="InvalidAutoscaling", message=str(e)))
    d = spec.disaggregation
    if d.enabled and d.prefill.min_replicas > d.prefill.max_replicas:
        out.append(Problem(reason="InvalidDisaggregation", message=(
            f"disaggregation.prefill.minReplicas ({d.prefill.min_replicas}) > "
            f"disaggregation.prefill.maxReplicas ({d.prefill.max_replicas})")))
    env_names = [v.name for v in spec.pod_template.env]
    if ADMIN_TOKEN_ENV in env_names:
        out.append(Problem(reason="InvalidPodTemplate", message=(
            f"podTemplate.env must not set {ADMIN_TOKEN_ENV} (the operator manages it)")))
    for v in spec.pod_template.env:
        if v.value is not None and v.value_from is not None:
            out.append(Problem(reason="InvalidPodTemplate",
                               message=f"podTemplate.env {v.name!r} sets both value and valueFrom"))
    return out


# The name also names the Service (a DNS-1035 label) and is every child's label value (<= 63 chars);
# the CRD schema restricts metadata.name to exactly this, so the API server refuses other names.
NAME_MAX_LENGTH = 63
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_DNS1035 = re.compile(NAME_PATTERN)


def name_problems(name: str) -> list[Problem]:
    """The InferenceService name also names its Service, which must be a DNS-1035 label (<= 63 chars).

    The CRD refuses such names already; this covers objects stored under an older CRD.
    """
    if len(name) > NAME_MAX_LENGTH or not _DNS1035.match(name):
        return [Problem(reason="InvalidName", message=(
            f"name {name!r} must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter, "
            "at most 63 characters): it also names the Service"))]
    return []
