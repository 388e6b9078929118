"""The autoscaling policy's spec: every knob the goodput autoscaler holds a fleet to, declared once.

:class:`PolicySpec` is what ``goodput.autoscaler.policy.decide`` reads; the operator's CRD
(``goodput.api.crd``: ``spec.slo`` and ``spec.autoscaling``) and :meth:`PolicySpec.from_crd` derive
from the same field declarations (:func:`knobs`), so a new knob is one new field here. The rules
the knobs tune are explained in ``goodput.autoscaler.policy``. Standard library only.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from goodput.api.settings import Setting, check, setting, settings


# ------------------------------------------------------------------------------------------ knobs
@dataclass(frozen=True)
class KnobField:
    """One knob in CRD terms: ``name`` (PolicySpec field), ``type`` (int or float), ``default``
    (policy units), ``path`` (camelCase keys under ``.spec``), ``crd_type`` and ``crd_default`` (CRD
    units), ``meta`` (its :class:`~goodput.api.settings.Setting`)."""

    name: str
    type: type
    default: Any
    path: tuple[str, ...]
    crd_type: type
    crd_default: Any
    meta: Setting


def knobs() -> list[KnobField]:
    """Every :class:`PolicySpec` knob in declaration order (what the CRD and ``from_crd`` derive
    from)."""
    out = []
    for s in settings(PolicySpec):
        crd_type = s.meta.crd_type or s.type
        out.append(KnobField(s.name, s.type, s.default, tuple(s.meta.crd.split(".")), crd_type,
                             crd_type(round(s.default / s.meta.unit, 9)), s.meta))
    return out


# ------------------------------------------------------------------------------------ SLO classes
DEFAULT_SLO_CLASS = "default"   # the class of a request naming none (or an unknown one): spec.slo's own
MAX_SLO_CLASSES = 8             # named classes per service (a bounded metric label set)
SLO_CLASS_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SLO_CLASS_MAX_LENGTH = 63
SLO_CLASS_HEADER = "x-goodput-slo-class"   # how a request names its class (router and worker)
SLO_CLASS_LABEL = "slo_class"              # the metric label of the worker's per-class counters
_CLASS_NAME = re.compile(SLO_CLASS_PATTERN)


@dataclass(frozen=True)
class SloClass:
    """One named SLO class (``spec.slo.classes[]``): a request of class ``name`` meets its SLO when
    TTFT <= ``ttft_s`` and TPOT <= ``tpot_s`` (seconds). ``name``: a DNS label (lowercase letters,
    digits, '-'; at most 63 characters), not ``default`` (the unnamed class, ``spec.slo.ttftMs`` /
    ``tpotMs``). Raises ValueError naming the field on a bad name or a time that is not > 0."""

    name: str
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or len(self.name) > SLO_CLASS_MAX_LENGTH \
                or not _CLASS_NAME.match(self.name):
            raise ValueError(f"slo.classes name {self.name!r} must be a DNS label (lowercase letters, digits, "
                             f"'-'; at most {SLO_CLASS_MAX_LENGTH} characters)")
        if self.name == DEFAULT_SLO_CLASS:
            raise ValueError(f"slo.classes name {DEFAULT_SLO_CLASS!r} is reserved for the unnamed class "
                             "(slo.ttftMs, slo.tpotMs)")
        for what, v in (("ttftMs", self.ttft_s), ("tpotMs", self.tpot_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"slo.classes[{self.name}].{what} must be a number > 0, got {v!r}")

    @classmethod
    def from_crd(cls, d: Mapping[str, Any]) -> "SloClass":
        """From one ``spec.slo.classes[]`` item, ``{name, ttftMs, tpotMs}`` (milliseconds). Raises
        ValueError naming the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"slo.classes items must be objects {{name, ttftMs, tpotMs}}, got {d!r}")
        for key in ("name", "ttftMs", "tpotMs"):
            if d.get(key) is None:
                raise ValueError(f"slo.classes[{d.get('name', '?')}].{key} must be set")
        try:
            return cls(d["name"], float(d["ttftMs"]) / 1000.0, float(d["tpotMs"]) / 1000.0)
        except (TypeError, ValueError) as e:
            if isinstance(e, ValueError) and str(e).startswith("slo.classes"):
                raise
            raise ValueError(f"slo.classes[{d.get('name')}]: ttftMs and tpotMs must be numbers, got "
                             f"{d.get('ttftMs')!r}, {d.get('tpotMs')!r}") from None

    def flag(self) -> str:
        """The worker's ``--slo-class`` value: ``NAME:TTFT_MS:TPOT_MS`` (:func:`parse_slo_class`)."""
        return slo_class_flag(self.name, round(self.ttft_s * 1000, 9), round(self.tpot_s * 1000, 9))


def slo_class_flag(name: str, ttft_ms: float, tpot_ms: float) -> str:
    """``NAME:TTFT_MS:TPOT_MS``, the numbers as short as they parse back exactly (5000.0 -> 5000)."""
    num = lambda x: str(int(x)) if float(x).is_integer() else repr(float(x))  # noqa: E731
    return f"{name}:{num(ttft_ms)}:{num(tpot_ms)}"


def parse_slo_class(text: str) -> SloClass:
    """``NAME:TTFT_MS:TPOT_MS`` (the worker's ``--slo-class``, e.g. ``batch:5000:200``) -> SloClass.
    Raises ValueError saying what is expected."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"an SLO class is NAME:TTFT_MS:TPOT_MS (e.g. batch:5000:200), got {text!r}")
    try:
        ttft, tpot = float(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(f"an SLO class is NAME:TTFT_MS:TPOT_MS with numbers in milliseconds, got {text!r}") from None
    return SloClass(parts[0], ttft / 1000.0, tpot / 1000.0)


def check_slo_classes(classes: tuple[SloClass, ...] | list[SloClass]) -> None:
    """At most :data:`MAX_SLO_CLASSES`, names unique. Raises ValueError naming the problem."""
    if len(classes) > MAX_SLO_CLASSES:
        raise ValueError(f"slo.classes holds at most {MAX_SLO_CLASSES} classes, got {len(classes)}")
    names = [c.name for c in classes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"slo.classes names must be unique, repeated: {', '.join(dup)}")


def class_of(name: str | None, known: Mapping[str, Any] | tuple[SloClass, ...]) -> str:
    """The class a request is judged in: ``name`` when it is a declared class, else
    :data:`DEFAULT_SLO_CLASS` (no header, or a name the service does not declare: never an error)."""
    names = known if isinstance(known, Mapping) else {c.name for c in known}
    return name if name and name in names else DEFAULT_SLO_CLASS


def slo_ranks(default_ttft_s: float | None, classes: tuple[SloClass, ...] | list[SloClass]) -> dict[str, int]:
    """Each class's queue band (the worker's ``Request.slo_rank``, the router's priority band): the
    number of distinct TTFT targets, among the declared classes and the default class, that are
    tighter than the class's own. :data:`DEFAULT_SLO_CLASS` is the default class (``spec.slo.ttftMs``;
    None, no TTFT declared: rank 0, it never waits behind a named class). Without named classes
    every rank is 0 (first-come first-served).

    Why TTFT: a request waiting in a queue spends its TTFT budget and nothing else; the class with
    the least budget goes first, a looser one fills the capacity left (and is guaranteed progress by
    the scheduler's aging, ``goodput.worker.engine.scheduler.waiting_band``). Classes with equal TTFT
    share a band whatever their TPOT (the step they decode in is the same).
    """
    ttfts = {DEFAULT_SLO_CLASS: default_ttft_s}
    ttfts.update((c.name, c.ttft_s) for c in classes)
    distinct = sorted({t for t in ttfts.values() if t is not None})
    return {name: 0 if t is None else sum(1 for d in distinct if d < t) for name, t in ttfts.items()}


def rank_of(name: str | None, ranks: Mapping[str, int]) -> int:
    """The queue band of a request naming class ``name`` (:func:`slo_ranks`; an unknown or missing
    name is the default class, as in :func:`class_of`)."""
    return ranks.get(class_of(name, ranks), ranks.get(DEFAULT_SLO_CLASS, 0))


# ------------------------------------------------------------------------------------------ spec


@dataclass(frozen=True)
class PolicySpec:
    """What the policy holds the fleet to: every field is a knob (help text beside it). Times in
    seconds, ratios in 0..1. Raises ValueError on a value out of its knob's bounds or inconsistent
    bounds (min > max)."""

    min_replicas: int = setting(1, "fewest worker pods (0: scale to zero when idle, with a router)",
                                crd="autoscaling.minReplicas", ge=0, le=1000)
    max_replicas: int = setting(4, "most worker pods", crd="autoscaling.maxReplicas", ge=1, le=1000)
    slo_ttft_s: float = setting(1.0, "time-to-first-token target, milliseconds", crd="slo.ttftMs",
                                unit=0.001, gt=0)
    slo_tpot_s: float = setting(0.1, "time-per-output-token target, milliseconds", crd="slo.tpotMs",
                                unit=0.001, gt=0)
    attainment_target: float = setting(0.9, "wanted fraction of requests meeting both",
                                       crd="slo.attainmentTarget", ge=0, le=1)
    scale_up_window_s: float = setting(30.0, "evidence window before scaling up",
                                       crd="autoscaling.scaleUpWindowSeconds", crd_type=int, ge=0, le=3600)
    stabilization_window_s: float = setting(300.0, "scale down only after this long below target",
                                            crd="autoscaling.stabilizationWindowSeconds", crd_type=int,
                                            ge=0, le=86400)
    scale_to_zero_idle_s: float = setting(600.0, "with minReplicas 0 and a router: seconds with nothing "
                                          "offered, held, queued or in flight before scaling to zero "
                                          "(docs/router-autoscaler-contract.md)",
                                          crd="autoscaling.scaleToZeroIdleSeconds", crd_type=int, ge=0)
    kv_target: float = setting(0.8, "KV cache usage ratio above which to scale up",
                               crd="autoscaling.targets.kvCacheUsage", ge=0, le=1)
    queue_target: int = setting(4, "waiting requests per replica above which to scale up",
                                crd="autoscaling.targets.queueDepth", ge=0)
    tolerance: float = setting(0.1, "relative band within which replicas do not move (rule 9)", ge=0, le=1,
                               crd="autoscaling.tuning.tolerance")
    max_scale_up_step: int = setting(4, "replicas one decision may add at least (up to doubling)", ge=1,
                                     crd="autoscaling.tuning.maxScaleUpStep")
    max_scale_down_step: int = setting(1, "replicas one decision may remove", ge=1,
                                       crd="autoscaling.tuning.maxScaleDownStep")
    target_utilization: float = setting(0.85, "fraction of a replica's batch the sizing plans to fill",
                                        gt=0, le=1, crd="autoscaling.tuning.targetUtilization")
    panic_ratio: float = setting(2.0, "a recommendation this many times the replicas skips the scale-up "
                                 "window", gt=0, crd="autoscaling.tuning.panicRatio")
    model_load_s: float = setting(60.0, "expected seconds from pod creation to Ready until one is measured",
                                  ge=0, crd="autoscaling.tuning.modelLoadSeconds")
    min_num_seqs: int = setting(1, "lower bound of the tuned max_num_seqs", ge=1,
                                crd="autoscaling.tuning.minNumSeqs")
    max_num_seqs: int = setting(256, "upper bound of the tuned max_num_seqs (engine.maxNumSeqs raises it)",
                                ge=1, crd="autoscaling.tuning.maxNumSeqs")
    min_waiting: int = setting(1, "lower bound of the max_waiting limit", ge=0,
                               crd="autoscaling.tuning.minWaiting")
    max_waiting: int = setting(1024, "upper bound of the max_waiting limit", ge=0,
                               crd="autoscaling.tuning.maxWaiting")
    queue_slack: float = setting(2.0, "how far past the TTFT-bound queue the limit loosens when nothing "
                                 "loads (rule 5)", ge=1, crd="autoscaling.tuning.queueSlack")
    token_queue_scale: float = setting(
        1.25, "the prompt-token queue bound (rule 5) in units of TTFT SLO x the capacity estimate, which errs "
              "low (a pod idle between steps measures less than a full step); 0 turns the token bound off",
        ge=0, le=4, crd="autoscaling.tuning.tokenQueueScale")
    batch_increase: float = setting(0.125, "additive batch growth, fraction of the cap (rule 2)", gt=0,
                                    crd="autoscaling.tuning.batchIncrease")
    batch_fast_increase: float = setting(1.5, "multiplicative batch growth far from the TPOT SLO (rule 2)",
                                         ge=1, crd="autoscaling.tuning.batchFastIncrease")
    batch_decrease: float = setting(0.75, "multiplicative batch cut on a TPOT miss or preemption (rule 2)",
                                    gt=0, le=1, crd="autoscaling.tuning.batchDecrease")
    tpot_margin: float = setting(0.8, "fraction of the TPOT SLO the batch grows under (rule 2)", gt=0, le=1,
                                 crd="autoscaling.tuning.tpotMargin")
    tpot_fast_margin: float = setting(0.5, "fraction of the TPOT SLO the batch grows fast under (rule 2)",
                                      gt=0, le=1, crd="autoscaling.tuning.tpotFastMargin")
    forecast_alpha: float = setting(0.3, "Holt level smoothing per 5 s (rule 11)", gt=0, le=1,
                                    crd="autoscaling.tuning.forecastAlpha")
    forecast_beta: float = setting(0.1, "Holt trend smoothing per 5 s (rule 11)", ge=0, le=1,
                                   crd="autoscaling.tuning.forecastBeta")
    length_alpha: float = setting(0.05, "smoothing per 5 s of the mean prompt and output tokens per request "
                                  "(rule 11)", gt=0, le=1, crd="autoscaling.tuning.lengthAlpha")
    explore_ratio: float = setting(1.75, "a scale-down may raise the work per replica to this many times "
                                   "the most served within the SLO (rule 7)", ge=1,
                                   crd="autoscaling.tuning.exploreRatio")
    idle_utilization: float = setting(0.3, "below this Little's-law utilization a smaller fleet counts as "
                                      "carrying the load without proof (rule 7)", ge=0, le=1,
                                      crd="autoscaling.tuning.idleUtilization")
    floor_release: float = setting(0.75, "below the learned floor only when the work per replica there is "
                                   "under this fraction of the work that failed (rule 7)", gt=0, le=1,
                                   crd="autoscaling.tuning.floorRelease")
    floor_quiet_s: float = setting(1800.0, "seconds without a new failure before the learned floor drops "
                                   "one replica (rule 7)", ge=0, crd="autoscaling.tuning.floorQuietSeconds")
    token_utilization: float = setting(0.8, "fraction of a replica's measured token throughput (its capacity "
                                       "estimate) a scale-down may plan to fill (rule 14)", gt=0, le=1,
                                       crd="autoscaling.tuning.tokenUtilization")
    capacity_margin_sd: float = setting(2.0, "a scale-down keeps this many standard deviations of the capacity "
                                        "estimate as margin (rule 14)", ge=0,
                                        crd="autoscaling.tuning.capacityMarginSd")
    headroom_window_s: float = setting(1800.0, "seconds of offered work whose peak-to-mean ratio over one "
                                       "model load sizes the spike headroom (rule 15; 0: off)", ge=0,
                                       crd="autoscaling.tuning.headroomWindowSeconds")
    # the named SLO classes (spec.slo.classes; not a knob: a list of objects): each request is judged
    # by its own class's TTFT/TPOT, the default class by slo_ttft_s / slo_tpot_s
    slo_classes: tuple[SloClass, ...] = field(default=())
    # the pool is a disaggregated service's prefill pool (set by the autoscaler loop's pool_policy;
    # not a knob): it is sized by prompt tokens (rule 18)
    prefill_pool: bool = field(default=False)

    def __post_init__(self) -> None:
        for s in settings(PolicySpec):
            check(s, getattr(self, s.name), name=f"{s.name} ({s.meta.crd})")
        if not isinstance(self.slo_classes, tuple) or not all(isinstance(c, SloClass) for c in self.slo_classes):
            raise ValueError("slo_classes must be a tuple of SloClass")
        check_slo_classes(self.slo_classes)
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"need min_replicas <= max_replicas, got {self.min_replicas}..{self.max_replicas}")
        if self.min_num_seqs > self.max_num_seqs:
            raise ValueError(f"need min_num_seqs <= max_num_seqs, got {self.min_num_seqs}..{self.max_num_seqs}")
        if self.min_waiting > self.max_waiting:
            raise ValueError(f"need min_waiting <= max_waiting, got {self.min_waiting}..{self.max_waiting}")

    @classmethod
    def from_crd(cls, spec: Mapping[str, Any]) -> "PolicySpec":
        """Build from an InferenceService ``.spec`` (camelCase dict as the API server returns it;
        absent fields take the knobs' defaults; ``engine.maxNumSeqs`` raises the upper bound of
        the tuned batch). Raises ValueError on values out of bounds or inconsistent."""
        kw: dict[str, Any] = {}
        for k in knobs():
            node: Any = spec
            for key in k.path:
                node = node.get(key) if isinstance(node, Mapping) else None
            if node is not None:
                try:
                    v = float(node) * k.meta.unit
                except (TypeError, ValueError):
                    raise ValueError(f"{'.'.join(k.path)} must be a number, got {node!r}") from None
                kw[k.name] = int(round(v)) if k.type is int else v
        engine = spec.get("engine") or {}
        if engine.get("maxNumSeqs"):
            kw["max_num_seqs"] = max(int(engine["maxNumSeqs"]), kw.get("max_num_seqs", cls.max_num_seqs))
        classes = (spec.get("slo") or {}).get("classes") if isinstance(spec.get("slo"), Mapping) else None
        if classes:
            if not isinstance(classes, list):
                raise ValueError(f"slo.classes must be a list, got {classes!r}")
            kw["slo_classes"] = tuple(SloClass.from_crd(c) for c in classes)
        return cls(**kw)

    def class_slos(self) -> dict[str, tuple[float, float]]:
        """Class name -> (TTFT, TPOT) in seconds: :data:`DEFAULT_SLO_CLASS` (``slo_ttft_s``,
        ``slo_tpot_s``) first, then the named classes in declaration order."""
        out = {DEFAULT_SLO_CLASS: (self.slo_ttft_s, self.slo_tpot_s)}
        out.update((c.name, (c.ttft_s, c.tpot_s)) for c in self.slo_classes)
        return out


__all__ = ["KnobField", "knobs", "PolicySpec", "SloClass", "parse_slo_class", "slo_class_flag", "check_slo_classes", "class_of",
           "slo_ranks", "rank_of",
           "DEFAULT_SLO_CLASS", "MAX_SLO_CLASSES", "SLO_CLASS_PATTERN", "SLO_CLASS_MAX_LENGTH", "SLO_CLASS_HEADER", "SLO_CLASS_LABEL"]
