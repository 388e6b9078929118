"""Pure: observed children -> the InferenceService status the operator owns.

``compute_status`` is a function of plain data (the Deployment as read from the server, whether the
Service exists, the spec's problems, the previous conditions and a clock value), so it is tested as a
table of named cases. The operator writes the result only when it differs from the current status.

Conditions (Kubernetes API conventions: type, status, reason, message, lastTransitionTime,
observedGeneration; lastTransitionTime changes only when status flips):
  Ready        True when at least one worker is ready and serving (AllReplicasReady /
               MinimumReplicasReady); False otherwise (Creating, NoReplicasReady, ScaledToZero, InvalidSpec).
  Progressing  True while the Deployment is rolling out or scaling (RollingOut, ScalingDown,
               WaitingForReplicas, Creating); False when done (Complete) or stuck (ProgressDeadlineExceeded,
               or the spec's own problem reason).
  Degraded     True for a spec the operator will not roll out (reason from crd.semantic_problems, or
               ChildRefused when the API server refused a child), a worker that crashed and has not been
               ready since (WorkerCrashLoop, message: the worker's last error line) or cannot start
               (WorkerCannotStart; ImagePullFailed when the node has not got its image and cannot pull
               it: message the image and the kubelet's reason) or cannot be placed on any node (Unschedulable, message: the
               scheduler's own, e.g. ``0/1 nodes are available: 1 Insufficient nvidia.com/gpu.``), a stuck rollout (ProgressDeadlineExceeded) or failing pod creation
               (ReplicaFailure); False (AsExpected) otherwise.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from goodput.api.crd import Problem, selector_string
from goodput.api.pods import pod_state
from goodput.operator import resources


def find_condition(conditions: Sequence[dict[str, Any]], ctype: str) -> dict[str, Any] | None:
    """The condition of type ``ctype`` in a conditions list, or None."""
    for c in conditions or ():
        if c.get("type") == ctype:
            return c
    return None


# container waiting reasons (kubelet) after which the container will not start without a change
_CANNOT_START = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
# ... of which these say the node has not got the image and cannot get it (kubelet pkg/kubelet/images:
# ErrImagePull, ImagePullBackOff (between tries), ErrImageNeverPull (imagePullPolicy Never), InvalidImageName)
_IMAGE_PULL = ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName")


def _last_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:1024] if lines else ""


def _image(pod: dict[str, Any], cs: dict[str, Any]) -> str:
    """The image of a container status (the kubelet copies the spec's while the container waits), else the spec's."""
    if cs.get("image"):
        return cs["image"]
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == cs.get("name") and c.get("image"):
            return c["image"]
    return "(unknown)"


def pod_failure(pod: dict[str, Any]) -> Problem | None:
    """Why one worker pod (core/v1 Pod as a dict) is failing, or None when it is not.

    The worker container (``resources.CONTAINER_NAME``) fails when it is not ready and either its
    current or (after a restart) last termination has a non-zero exit code (WorkerCrashLoop), or it
    waits for a reason that needs a change to clear, such as a missing Secret (WorkerCannotStart) or an image
    the node has not got and cannot pull (ImagePullFailed, message: the image, the kubelet's reason and message).
    A pod the scheduler cannot place (condition ``PodScheduled`` False, reason ``Unschedulable``: too few
    ``nvidia.com/gpu``, a ``scheduling.nodeSelector`` no node matches, a taint not tolerated) is
    Unschedulable with the scheduler's message (core/v1 PodCondition; kube-scheduler sets it at each
    failed attempt, so within seconds of the pod's creation).
    A crash is reported until the container is ready again: a restarted worker loading its model is
    still the crash-looping one. The message is the last line of the termination message (the
    worker's own last error line; with ``FallbackToLogsOnError`` the kubelet puts the log tail there),
    then the pod, exit code and kubelet reason; a pod being deleted is never failing.
    """
    meta = pod.get("metadata") or {}
    if pod_state(pod).terminating:
        return None
    scheduled = find_condition((pod.get("status") or {}).get("conditions") or [], "PodScheduled") or {}
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return Problem(reason="Unschedulable", message=(
            f"{scheduled.get('message') or 'no node fits the pod'} "
            f"(worker in pod {meta.get('name')}: PodScheduled=False, Unschedulable)"))
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != resources.CONTAINER_NAME or cs.get("ready"):
            continue
        state, last = cs.get("state") or {}, cs.get("lastState") or {}
        term = state.get("terminated") or (last.get("terminated") if cs.get("restartCount") else None)
        if term and term.get("exitCode"):
            line = _last_line(term.get("message"))
            where = f"worker in pod {meta.get('name')} exited with code {term['exitCode']}"
            if term.get("reason"):
                where += f" ({term['reason']})"
            return Problem(reason="WorkerCrashLoop", message=f"{line} ({where})" if line else where)
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in _IMAGE_PULL:
            return Problem(reason="ImagePullFailed", message=(
                f"image {_image(pod, cs)} cannot be pulled: {waiting['reason']}: "
                f"{waiting.get('message') or 'no message'} (worker in pod {meta.get('name')})"))
        if waiting.get("reason") in _CANNOT_START:
            return Problem(reason="WorkerCannotStart", message=(
                f"{waiting.get('message') or waiting['reason']} (worker in pod {meta.get('name')}: "
                f"{waiting['reason']})"))
    return None


def worker_failure(pods: Sequence[dict[str, Any]]) -> Problem | None:
    """The failure to report for a set of worker pods: that of the first failing pod by name, or None.

    Choosing by name keeps the message (and so the Event) stable while several replicas fail alike.
    """
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name") or ""):
        problem = pod_failure(pod)
        if problem is not None:
            return problem
    return None


def _make(ctype: str, status: bool, reason: str, message: str, generation: int | None,
          previous: Sequence[dict[str, Any]], now: str) -> dict[str, Any]:
    s = "True" if status else "False"
    prev = find_condition(previous, ctype)
    ltt = prev["lastTransitionTime"] if prev and prev.get("status") == s and prev.get(
        "lastTransitionTime") else now
    c = {"type": ctype, "status": s, "reason": reason, "lastTransitionTime": ltt}
    if message:  # omitted when empty: the e2e API server build (1.20) reads "" in custom objects as null
        c["message"] = message
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def compute_status(
    *,
    name: str,
    namespace: str,
    generation: int | None,
    desired_replicas: int,
    deployment: dict[str, Any] | None,
    service_exists: bool,
    problems: Sequence[Problem] = (),
    worker_problem: Problem | None = None,
    previous_conditions: Sequence[dict[str, Any]] = (),
    now: str,
    router_url: str | None = None,
    prefill_desired: int | None = None,
    prefill_deployment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The operator-owned status fields (camelCase) for one InferenceService.

    ``deployment`` is the apps/v1 Deployment as a dict (or None when it does not exist);
    ``now`` is an RFC 3339 timestamp used for conditions whose status changes. ``problems`` are the
    spec's (not rolled out); ``worker_problem`` is ``worker_failure`` of the running pods.
    ``router_url`` (operator ``--router-url``): when set, ``url`` is that URL (the router picks the
    service by the request's ``model``); else the Service's URL once the Service exists, else None.
    ``prefill_desired`` (None: ``spec.disaggregation`` is off) and ``prefill_deployment``: the prefill
    pool's wanted replicas and its Deployment. The pool is reported in ``pools`` and counted in
    Progressing; it does not decide Ready (without prefill pods the decode pods prefill locally,
    which Ready's message then says).
    Returns observedGeneration, conditions, replicas, readyReplicas, updatedReplicas, selector, url,
    pools (None when not disaggregated: a merge patch then removes it).
    Fields owned by others (admission, autoscaler) are not returned.
    """
    dstat = (deployment or {}).get("status") or {}
    dgen = ((deployment or {}).get("metadata") or {}).get("generation")
    total = int(dstat.get("replicas") or 0)
    ready = int(dstat.get("readyReplicas") or 0)
    updated = int(dstat.get("updatedReplicas") or 0)
    dconds = dstat.get("conditions") or []
    rolled = deployment is not None and dgen is not None and int(dstat.get("observedGeneration") or 0) >= dgen
    dprog = find_condition(dconds, "Progressing")
    dfail = find_condition(dconds, "ReplicaFailure")
    stuck = bool(dprog and dprog.get("status") == "False" and dprog.get("reason") == "ProgressDeadlineExceeded")
    failing = bool(dfail and dfail.get("status") == "True")
    prev = previous_conditions

    # Degraded
    if problems:
        degraded = _make("Degraded", True, problems[0].reason, "; ".join(p.message for p in problems),
                         generation, prev, now)
    elif worker_problem is not None:
        degraded = _make("Degraded", True, worker_problem.reason, worker_problem.message, generation, prev, now)
    elif stuck:
        degraded = _make("Degraded", True, "ProgressDeadlineExceeded",
                         (dprog or {}).get("message") or "rollout exceeded its progress deadline",
                         generation, prev, now)
    elif failing:
        degraded = _make("Degraded", True, "ReplicaFailure", (dfail or {}).get("message") or "",
                         generation, prev, now)
    else:
        degraded = _make("Degraded", False, "AsExpected", "", generation, prev, now)

    counts = f"{ready}/{desired_replicas} replicas ready"
    # Progressing
    if problems:
        progressing = _make("Progressing", False, problems[0].reason,
                            "spec not rolled out: see the Degraded condition", generation, prev, now)
    elif deployment is None:
        progressing = _make("Progressing", True, "Creating", "creating the worker Deployment",
                            generation, prev, now)
    elif stuck:
        progressing = _make("Progressing", False, "ProgressDeadlineExceeded",
                            (dprog or {}).get("message") or "", generation, prev, now)
    elif not rolled or updated < desired_replicas or total > updated:
        progressing = _make("Progressing", True, "RollingOut",
                            f"{updated}/{desired_replicas} replicas updated, {total} total", generation, prev, now)
    elif total > desired_replicas:
        progressing = _make("Progressing", True, "ScalingDown", f"{total} replicas, want {desired_replicas}",
                            generation, prev, now)
    elif ready < desired_replicas:
        progressing = _make("Progressing", True, "WaitingForReplicas", counts, generation, prev, now)
    else:
        progressing = _make("Progressing", False, "Complete", counts, generation, prev, now)

    # Ready: can the URL serve a request now?
    if deployment is None:
        reason = problems[0].reason if problems else "Creating"
        readyc = _make("Ready", False, reason, "no worker Deployment", generation, prev, now)
    elif desired_replicas == 0 and ready == 0:
        readyc = _make("Ready", False, "ScaledToZero", "spec.replicas is 0", generation, prev, now)
    elif ready >= 1 and ready >= desired_replicas:
        readyc = _make("Ready", True, "AllReplicasReady", counts, generation, prev, now)
    elif ready >= 1:
        readyc = _make("Ready", True, "MinimumReplicasReady", counts, generation, prev, now)
    else:
        readyc = _make("Ready", False, "NoReplicasReady", counts, generation, prev, now)

    pools = None
    if prefill_desired is not None:
        pstat = (prefill_deployment or {}).get("status") or {}
        pready = int(pstat.get("readyReplicas") or 0)
        pools = {"decode": {"desiredReplicas": desired_replicas, "replicas": total, "readyReplicas": ready},
                 "prefill": {"desiredReplicas": prefill_desired, "replicas": int(pstat.get("replicas") or 0),
                             "readyReplicas": pready}}
        pcounts = f"prefill pool {pready}/{prefill_desired} ready"
        if readyc["status"] == "True":
            readyc = _make("Ready", True, readyc["reason"], f"{counts}; {pcounts}" + (
                " (the decode pods prefill every prompt locally)" if pready == 0 else ""), generation, prev, now)
        if progressing["reason"] == "Complete" and pready < prefill_desired:
            progressing = _make("Progressing", True, "WaitingForPrefillReplicas", pcounts, generation, prev, now)

    return {
        "observedGeneration": generation,
        "conditions": [readyc, progressing, degraded],
        "replicas": total,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "selector": selector_string(name),
        "url": router_url or (resources.service_url(name, namespace) if service_exists else None),
        "pools": pools,
    }


def status_changed(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change ``current`` (only the keys in ``new`` are compared)."""
    current = current or {}
    return any(current.get(k) != v for k, v in new.items())
