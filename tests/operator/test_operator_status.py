"""status.compute_status as a table of named cases (observed Deployment -> conditions, counts, url)."""

import pytest

from goodput.api.crd import Problem
from goodput.operator.status import compute_status, status_changed

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def dep(gen=2, observed=2, replicas=1, ready=1, updated=1, conds=()):
    return {"metadata": {"generation": gen},
            "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated, "conditions": list(conds)}}


STUCK = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "x" has timed out progressing.'}
QUOTA = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "exceeded quota"}
BAD = Problem(reason="InvalidModel", message="model.name 'x' is not a .gguf")

# name: (desired replicas, deployment, service exists, problems,
#        expected (Ready status, reason), (Progressing status, reason), (Degraded status, reason), counts)
CASES = {
    "no-deployment-yet": (1, None, False, [], ("False", "Creating"), ("True", "Creating"),
                          ("False", "AsExpected"), (0, 0, 0)),
    "pods-starting": (1, dep(ready=0), True, [], ("False", "NoReplicasReady"), ("True", "WaitingForReplicas"),
                      ("False", "AsExpected"), (1, 0, 1)),
    "all-ready": (2, dep(replicas=2, ready=2, updated=2), True, [], ("True", "AllReplicasReady"),
                  ("False", "Complete"), ("False", "AsExpected"), (2, 2, 2)),
    "scaling-up-one-serving": (2, dep(gen=3, observed=3, replicas=2, ready=1, updated=2), True, [],
                               ("True", "MinimumReplicasReady"), ("True", "WaitingForReplicas"),
                               ("False", "AsExpected"), (2, 1, 2)),
    "deployment-not-observed-yet": (1, dep(gen=3, observed=2), True, [], ("True", "AllReplicasReady"),
                                    ("True", "RollingOut"), ("False", "AsExpected"), (1, 1, 1)),
    "rolling-old-pod-still-there": (1, dep(replicas=2, ready=1, updated=1), True, [],
                                    ("True", "AllReplicasReady"), ("True", "RollingOut"),
                                    ("False", "AsExpected"), (2, 1, 1)),
    "scaling-down": (1, dep(replicas=2, ready=2, updated=2), True, [], ("True", "AllReplicasReady"),
                     ("True", "ScalingDown"), ("False", "AsExpected"), (2, 2, 2)),
    "scaled-to-zero": (0, dep(replicas=0, ready=0, updated=0), True, [], ("False", "ScaledToZero"),
                       ("False", "Complete"), ("False", "AsExpected"), (0, 0, 0)),
    "rollout-stuck": (1, dep(replicas=2, ready=1, updated=1, conds=[STUCK]), True, [],
                      ("True", "AllReplicasReady"), ("False", "ProgressDeadlineExceeded"),
                      ("True", "ProgressDeadlineExceeded"), (2, 1, 1)),
    "replica-failure": (1, dep(replicas=0, ready=0, updated=0, conds=[QUOTA]), True, [],
                        ("False", "NoReplicasReady"), ("True", "RollingOut"), ("True", "ReplicaFailure"),
                        (0, 0, 0)),
    "bad-spec-nothing-created": (1, None, False, [BAD], ("False", "InvalidModel"), ("False", "InvalidModel"),
                                 ("True", "InvalidModel"), (0, 0, 0)),
    "bad-spec-old-pods-serve": (1, dep(gen=1, observed=1), True, [BAD], ("True", "AllReplicasReady"),
                                ("False", "InvalidModel"), ("True", "InvalidModel"), (1, 1, 1)),
}


@pytest.mark.parametrize("case", CASES)
def test_compute_status(case):
    desired, d, svc, problems, ready, progressing, degraded, counts = CASES[case]
    st = compute_status(name="tiny", namespace="ns1", generation=4, desired_replicas=desired, deployment=d,
                        service_exists=svc, problems=problems, now=T0)
    got = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    assert got == {"Ready": ready, "Progressing": progressing, "Degraded": degraded}
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == counts
    assert st["observedGeneration"] == 4
    assert all(c["observedGeneration"] == 4 and c["lastTransitionTime"] == T0 for c in st["conditions"])
    assert st["selector"] == "app.kubernetes.io/component=worker,serving.goodput.dev/inferenceservice=tiny"
    assert st["url"] == ("http://tiny.ns1.svc.cluster.local:8000" if svc else None)


@pytest.mark.parametrize("router_url, svc, want", [
    (None, True, "http://tiny.ns1.svc.cluster.local:8000"),
    (None, False, None),
    ("http://goodput-router.gp.svc:8080", True, "http://goodput-router.gp.svc:8080"),
    ("http://goodput-router.gp.svc:8080", False, "http://goodput-router.gp.svc:8080"),
])
def test_url_is_the_routers_when_the_operator_has_one(router_url, svc, want):
    st = compute_status(name="tiny", namespace="ns1", generation=1, desired_replicas=1, deployment=dep(),
                        service_exists=svc, now=T0, router_url=router_url)
    assert st["url"] == want


def test_degraded_message_joins_all_problems():
    p2 = Problem(reason="InvalidEngineConfig", message="maxNumBatchedTokens (8) < blockSize (16)")
    st = compute_status(name="a", namespace="b", generation=1, desired_replicas=1, deployment=None,
                        service_exists=False, problems=[BAD, p2], now=T0)
    [deg] = [c for c in st["conditions"] if c["type"] == "Degraded"]
    assert deg["message"] == "model.name 'x' is not a .gguf; maxNumBatchedTokens (8) < blockSize (16)"


def test_last_transition_time_moves_only_when_status_flips():
    first = compute_status(name="a", namespace="b", generation=1, desired_replicas=1, deployment=dep(ready=0),
                           service_exists=True, now=T0)
    # same statuses later (reason may change): times kept -> an identical status, nothing to write
    again = compute_status(name="a", namespace="b", generation=1, desired_replicas=1, deployment=dep(ready=0),
                           service_exists=True, previous_conditions=first["conditions"], now=T1)
    assert again == first and not status_changed(first, again)
    # the pod becomes ready: Ready and Progressing flip (new time); Degraded stays False (old time)
    ready = compute_status(name="a", namespace="b", generation=1, desired_replicas=1, deployment=dep(),
                           service_exists=True, previous_conditions=first["conditions"], now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0}
    assert status_changed(first, ready)


def test_status_changed_ignores_fields_owned_by_others():
    new = {"replicas": 1, "url": None}
    assert not status_changed({"replicas": 1, "admission": {"maxNumSeqs": 4}}, new)
    assert status_changed(None, new)
    assert status_changed({"replicas": 2}, new)


def test_operator_status_never_carries_the_autoscalers_fields():
    """The operator writes compute_status by merge patch: keys it does not return are left as the
    autoscaler wrote them (status.autoscaler, status.admission)."""
    new = compute_status(name="a", namespace="b", generation=1, desired_replicas=2, deployment=dep(),
                         service_exists=True, now=T0)
    assert not {"autoscaler", "admission"} & set(new)
    current = {**new, "autoscaler": {"desiredReplicas": 2, "policyState": {"caps": {"p": 4}}},
               "admission": {"maxNumSeqs": 4, "maxWaiting": 2}}
    assert not status_changed(current, new)


# ------------------------------------------------------------------ worker pods -> WorkerCrashLoop
LOAD_ERROR = ("INFO loading /m/missing.gguf\n"
              "goodput-worker: the model failed to load: model '/m/missing.gguf' is neither a bundled name "
              "(smollm2) nor a GGUF file\n")
LOAD_LINE = LOAD_ERROR.splitlines()[-1]


def pod(name="w-1", ready=False, restarts=1, state=None, last=None, deleting=False, container="worker"):
    """A worker pod's status as a kubelet reports it (fields of core/v1 ContainerStatus)."""
    meta = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = T0
    cs = {"name": container, "ready": ready, "restartCount": restarts, "state": state or {"running": {}}}
    if last:
        cs["lastState"] = last
    return {"metadata": meta, "status": {"containerStatuses": [cs]}}


BACKOFF = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container"}}
CRASHED = {"terminated": {"exitCode": 1, "reason": "Error", "message": LOAD_ERROR}}
OOM = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
WHERE = "(worker in pod w-1 exited with code 1 (Error))"

POD_CASES = {
    "serving": (pod(restarts=0, ready=True), None),
    "loading-first-time": (pod(restarts=0), None),
    "crash-loop-back-off": (pod(state=BACKOFF, last=CRASHED, restarts=3), ("WorkerCrashLoop", f"{LOAD_LINE} {WHERE}")),
    "restarted-and-loading-again": (pod(last=CRASHED), ("WorkerCrashLoop", f"{LOAD_LINE} {WHERE}")),
    "terminated-now": (pod(restarts=0, state=CRASHED), ("WorkerCrashLoop", f"{LOAD_LINE} {WHERE}")),
    "oom-no-message": (pod(state=BACKOFF, last=OOM),
                       ("WorkerCrashLoop", "worker in pod w-1 exited with code 137 (OOMKilled)")),
    "ready-again-after-a-crash": (pod(ready=True, last=CRASHED), None),
    "clean-exit-is-no-crash": (pod(state=BACKOFF, last={"terminated": {"exitCode": 0, "reason": "Completed"}}),
                               None),
    "being-deleted": (pod(state=BACKOFF, last=CRASHED, deleting=True), None),
    "other-container": (pod(state=BACKOFF, last=CRASHED, container="sidecar"), None),
    "missing-secret": (pod(restarts=0, state={"waiting": {"reason": "CreateContainerConfigError",
                                                          "message": 'secret "x-admin" not found'}}),
                       ("WorkerCannotStart",
                        'secret "x-admin" not found (worker in pod w-1: CreateContainerConfigError)')),
}


def image_waiting(reason, message, image="goodput/worker:nope", in_status=True):
    """A worker pod waiting for an image, as the kubelet reports it (reason and message of pkg/kubelet/images)."""
    p = pod(restarts=0, state={"waiting": {"reason": reason, "message": message}})
    p["spec"] = {"containers": [{"name": "worker", "image": image}]}
    if in_status:
        p["status"]["containerStatuses"][0]["image"] = image
    return p


NEVER_MSG = 'Container image "goodput/worker:nope" is not present with pull policy of Never'
PULL_MSG = ('rpc error: code = Unknown desc = failed to pull and unpack image "docker.io/goodput/worker:nope": '
            'proxyconnect tcp: dial tcp 127.0.0.1:9: connect: connection refused')
POD_CASES.update({
    "image-never-pull": (image_waiting("ErrImageNeverPull", NEVER_MSG), (
        "ImagePullFailed", f"image goodput/worker:nope cannot be pulled: ErrImageNeverPull: {NEVER_MSG} "
                           "(worker in pod w-1)")),
    "image-pull-error": (image_waiting("ErrImagePull", PULL_MSG), (
        "ImagePullFailed", f"image goodput/worker:nope cannot be pulled: ErrImagePull: {PULL_MSG} (worker in pod w-1)")),
    "image-pull-back-off": (image_waiting("ImagePullBackOff", 'Back-off pulling image "goodput/worker:nope"'), (
        "ImagePullFailed", 'image goodput/worker:nope cannot be pulled: ImagePullBackOff: Back-off pulling image '
                           '"goodput/worker:nope" (worker in pod w-1)')),
    "image-from-the-spec": (image_waiting("InvalidImageName", "", image="Bad:Name", in_status=False), (
        "ImagePullFailed", "image Bad:Name cannot be pulled: InvalidImageName: no message (worker in pod w-1)")),
})


def pending(name="w-1", reason="Unschedulable", message=None, deleting=False):
    """A worker pod the scheduler could not place, as kube-scheduler reports it (no container statuses)."""
    meta = {"name": name, **({"deletionTimestamp": T0} if deleting else {})}
    cond = {"type": "PodScheduled", "status": "False", "reason": reason}
    if message is not None:
        cond["message"] = message
    return {"metadata": meta, "status": {"phase": "Pending", "conditions": [cond]}}


GPU_MSG = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
SELECTOR_MSG = "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity."  # 1.20, a nodeSelector
POD_CASES.update({
    "unschedulable-gpus": (pending(message=GPU_MSG), (
        "Unschedulable", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. "
                         "(worker in pod w-1: PodScheduled=False, Unschedulable)")),
    "unschedulable-node-selector": (pending(message=SELECTOR_MSG), (
        "Unschedulable", "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity. "
                         "(worker in pod w-1: PodScheduled=False, Unschedulable)")),
    "unschedulable-without-message": (pending(), (
        "Unschedulable", "no node fits the pod (worker in pod w-1: PodScheduled=False, Unschedulable)")),
    "scheduler-error-is-transient": (pending(reason="SchedulerError", message="etcd timeout"), None),
    "unschedulable-being-deleted": (pending(message=GPU_MSG, deleting=True), None),
    "scheduled-and-loading": ({"metadata": {"name": "w-1"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True"}]}}, None),
})


@pytest.mark.parametrize("case", POD_CASES)
def test_pod_failure(case):
    from goodput.operator.status import pod_failure

    p, want = POD_CASES[case]
    got = pod_failure(p)
    assert (None if got is None else (got.reason, got.message)) == want


def test_worker_failure_reports_the_first_failing_pod_by_name():
    from goodput.operator.status import worker_failure

    pods = [pod("w-c", state=BACKOFF, last=OOM), pod("w-a", ready=True), pod("w-b", state=BACKOFF, last=CRASHED)]
    assert worker_failure(pods).message.endswith("(worker in pod w-b exited with code 1 (Error))")
    assert worker_failure([pod("w-a", ready=True)]) is None and worker_failure([]) is None


def test_worker_problem_is_degraded_and_spec_problems_come_first():
    crash = Problem(reason="WorkerCrashLoop", message="boom (worker in pod w-1 exited with code 1)")
    kw = dict(name="a", namespace="b", generation=1, desired_replicas=1, deployment=dep(ready=0),
              service_exists=True, now=T0)
    st = compute_status(**kw, worker_problem=crash)
    got = {c["type"]: (c["status"], c["reason"], c.get("message")) for c in st["conditions"]}
    assert got["Degraded"] == ("True", "WorkerCrashLoop", crash.message)
    assert got["Ready"][:2] == ("False", "NoReplicasReady")
    st = compute_status(**kw, worker_problem=crash, problems=[BAD])
    assert [c["reason"] for c in st["conditions"] if c["type"] == "Degraded"] == ["InvalidModel"]


def test_unschedulable_worker_is_degraded_while_ready_follows_the_replicas():
    """One replica serving, one the scheduler cannot place: Ready stays True (the URL serves) and
    Degraded names the scheduler's reason."""
    from goodput.operator.status import worker_failure

    problem = worker_failure([pod("w-a", ready=True, restarts=0), pending("w-b", message=GPU_MSG)])
    st = compute_status(name="a", namespace="b", generation=1, desired_replicas=2, deployment=dep(replicas=2, ready=1, updated=2),
                        service_exists=True, now=T0, worker_problem=problem)
    got = {c["type"]: (c["status"], c["reason"], c.get("message")) for c in st["conditions"]}
    assert got["Degraded"] == ("True", "Unschedulable", f"{GPU_MSG} (worker in pod w-b: PodScheduled=False, "
                                                        "Unschedulable)")
    assert got["Ready"][:2] == ("True", "MinimumReplicasReady")
