"""Pure builders: spec -> worker flags, Deployment, Service, PDB, Secret; the write-or-not comparison."""

import base64
import copy

import pytest
from kubernetes.utils import parse_quantity

from goodput.operator import resources as r
from goodput.api import crd
from goodput.api.crd import InferenceServiceSpec

BASE = ["serve", "--model", "smollm2", "--host", "0.0.0.0", "--port", "8000"]
SLO = ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"]

ARGS_CASES = {
    "defaults": ({}, BASE + SLO),
    "every-engine-flag": (
        {"model": {"revision": "r1", "servedModelName": "tiny"},
         "engine": {"dtype": "float32", "kvCacheMemory": "16Mi", "blockSize": 32, "maxNumSeqs": 4,
                    "maxNumBatchedTokens": 256, "maxModelLen": 512, "maxWaiting": 10,
                    "enablePrefixCaching": False, "vllmMetricAliases": True, "schedulingPolicy": "static",
                    "attentionBackend": "torch", "logLevel": "warning", "extraArgs": ["--device", "cpu"]},
         "slo": {"ttftMs": 250.5, "tpotMs": 20}},
        ["serve", "--model", "smollm2", "--served-model-name", "tiny", "--revision", "r1",
         "--host", "0.0.0.0", "--port", "8000", "--block-size", "32", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "256", "--max-waiting", "10", "--no-enable-prefix-caching",
         "--scheduling-policy", "static", "--dtype", "float32", "--kv-cache-memory", str(16 * 2**20),
         "--max-model-len", "512", "--attention-backend", "torch", "--slo-ttft-ms", "250.5",
         "--slo-tpot-ms", "20", "--vllm-metric-aliases", "--log-level", "warning", "--device", "cpu"]),
    "kv-bytes-int": ({"engine": {"kvCacheMemory": 1000000}},
                     BASE + ["--kv-cache-memory", "1000000"] + SLO),
    "gguf-path": ({"model": {"name": "/models/m.gguf"}},
                  ["serve", "--model", "/models/m.gguf", "--host", "0.0.0.0", "--port", "8000"] + SLO),
}


@pytest.mark.parametrize("case", ARGS_CASES)
def test_worker_args(case):
    spec, want = ARGS_CASES[case]
    assert r.worker_args(InferenceServiceSpec.model_validate(spec)) == want


# Every worker setting the CRD carries, set to a value that differs from the worker's default.
EVERY_FIELD = {
    "model": {"name": "/models/m.gguf", "revision": "r7", "servedModelName": "served"},
    "engine": {"dtype": "float32", "device": "cpu", "quantization": "int4", "kvCacheMemory": "48Mi",
               "blockSize": 32,
               "maxNumSeqs": 5, "maxNumBatchedTokens": 96, "maxModelLen": 700, "maxWaiting": 0, "maxWaitingTokens": 12000,
               "enablePrefixCaching": False, "vllmMetricAliases": True, "schedulingPolicy": "static",
               "attentionBackend": "torch", "numThreads": 3, "logLevel": "debug", "maxStopStrings": 4,
               "maxStopStringChars": 50, "maxStopTokenIds": 6, "maxRequestBodyBytes": "1Mi",
               "speculativeMode": "adaptive", "numSpeculativeTokens": 3, "promptLookupMax": 5,
               "promptLookupMin": 3, "speculativeMaxRunning": 6},
    "slo": {"ttftMs": 123.25, "tpotMs": 7,
            "classes": [{"name": "batch", "ttftMs": 5000, "tpotMs": 200.5}, {"name": "chat", "ttftMs": 300, "tpotMs": 40}]},
}


def test_worker_args_parse_back_to_what_the_spec_asked_for():
    """The contract between operator and worker: the generated arguments are accepted by the
    worker's own parser and give exactly the values of the spec, for every setting the CRD has."""
    from goodput.worker.cli import build_parser, engine_args_from
    from goodput.api.settings import settings
    from goodput.worker.engine.config import EngineArgs

    spec = InferenceServiceSpec.model_validate(EVERY_FIELD)
    ns = build_parser().parse_args(r.worker_args(spec))
    a = engine_args_from(ns)
    want = {"model": "/models/m.gguf", "revision": "r7", "served_model_name": "served", "host": "0.0.0.0",
            "port": 8000, "dtype": "float32", "device": "cpu", "quantization": "int4",
            "kv_cache_memory": 48 * 2**20,
            "block_size": 32, "max_num_seqs": 5, "max_num_batched_tokens": 96, "max_model_len": 700,
            "max_waiting": 0, "max_waiting_tokens": 12000, "enable_prefix_caching": False, "vllm_metric_aliases": True,
            "scheduling_policy": "static", "attention_backend": "torch", "num_threads": 3,
            "log_level": "debug", "slo_ttft_ms": 123.25, "slo_tpot_ms": 7.0,
            "slo_classes": ["batch:5000:200.5", "chat:300:40"], "max_stop_strings": 4,
            "max_stop_string_chars": 50, "max_stop_token_ids": 6, "max_request_body_bytes": 2**20,
            "speculative_mode": "adaptive", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
            "prompt_lookup_min": 3, "speculative_max_running": 6}
    carried = {s.name for s in settings(EngineArgs) if s.meta.crd is not None} | {"host", "port"}
    assert carried == set(want), "a setting the CRD carries is missing from this test"
    assert {name: getattr(a, name) for name in want} == want
    for name, value in want.items():  # each differs from the default, so the flag really travelled
        assert name == "port" or value != getattr(EngineArgs(), name), name  # 8000: the worker port


def test_every_engine_field_is_a_worker_setting_and_back():
    from goodput.api.settings import settings
    from goodput.worker.engine.config import EngineArgs
    crd_engine = set(InferenceServiceSpec.model_validate({}).engine.model_dump()) - {
        "image", "image_pull_policy", "extra_args"}
    assert crd_engine == {s.name for s in settings(EngineArgs) if s.meta.crd == "engine"}


def _dep(spec=None, **kw):
    owner = r.owner_reference("tiny", "uid-1")
    return r.deployment("tiny", "ns1", InferenceServiceSpec.model_validate(spec or {}), owner)


def test_deployment_shape():
    d = _dep({"replicas": 3, "resources": {"gpu": 2, "cpu": "500m", "memory": "2Gi"},
              "probes": {"startupTimeoutSeconds": 300, "periodSeconds": 5}})
    assert d["metadata"]["ownerReferences"] == [{
        "apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService", "name": "tiny",
        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    spec = d["spec"]
    assert spec["replicas"] == 3
    tmpl = spec["template"]
    # the selector must select the template's pods
    assert spec["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    [c] = tmpl["spec"]["containers"]
    assert c["command"] == ["goodput-worker"] and c["args"][:2] == ["serve", "--model"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    # startup: 300 s budget at 5 s period -> 60 failures allowed
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 300
    assert c["resources"] == {"limits": {"memory": "2Gi", "nvidia.com/gpu": "2"},
                              "requests": {"cpu": "500m", "memory": "2Gi", "nvidia.com/gpu": "2"}}
    assert c["env"][0] == {"name": "GOODPUT_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "tiny-admin", "key": "token"}}}
    ann = tmpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert ann["prometheus.io/path"] == "/metrics" and len(ann[r.ANNOTATION_SPEC_HASH]) == 16
    assert spec["progressDeadlineSeconds"] == 360
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_scheduling_volume_and_overrides_reach_the_pod():
    d = _dep({"model": {"name": "/m/x.gguf", "volume": {"claimName": "models", "mountPath": "/m"}},
              "scheduling": {"nodeSelector": {"gpu": "h100"},
                             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                             "affinity": {"nodeAffinity": {"x": 1}}, "priorityClassName": "high"},
              "podTemplate": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                              "labels": {"team": "a", crd.LABEL_ISVC: "hijack"}, "annotations": {"a": "b"},
                              "serviceAccountName": "sa"}})
    pod = d["spec"]["template"]
    ps = pod["spec"]
    assert ps["nodeSelector"] == {"gpu": "h100"}
    assert ps["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert ps["affinity"] == {"nodeAffinity": {"x": 1}} and ps["priorityClassName"] == "high"
    assert ps["serviceAccountName"] == "sa"
    assert ps["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                             {"name": "tmp", "emptyDir": {}}]
    assert ps["containers"][0]["volumeMounts"] == [{"name": "model", "mountPath": "/m", "readOnly": True},
                                                   {"name": "tmp", "mountPath": "/tmp"}]
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in ps["containers"][0]["env"]
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["labels"][crd.LABEL_ISVC] == "tiny"  # the selector label cannot be overridden
    assert pod["metadata"]["annotations"]["a"] == "b"


def test_worker_runs_non_root_on_a_read_only_root_with_tmp_writable():
    ps = _dep({})["spec"]["template"]["spec"]
    (c,) = ps["containers"]
    assert c["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert ps["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


def test_spec_hash_moves_with_the_template_not_with_replicas():
    a = _dep({"engine": {"maxNumSeqs": 4}})
    b = _dep({"engine": {"maxNumSeqs": 8}})
    c = _dep({"engine": {"maxNumSeqs": 4}, "replicas": 5})
    h = lambda d: d["metadata"]["annotations"][r.ANNOTATION_SPEC_HASH]
    th = lambda d: d["spec"]["template"]["metadata"]["annotations"][r.ANNOTATION_SPEC_HASH]
    assert h(a) != h(b) and th(a) != th(b)
    assert h(a) == h(c) and th(a) == th(c)
    assert _dep({"engine": {"maxNumSeqs": 4}}) == a  # deterministic


def test_service_pdb_secret():
    s = r.service("tiny", "ns1")
    assert s["spec"]["type"] == "ClusterIP"
    assert s["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert s["spec"]["selector"] == crd.selector_labels("tiny")
    for v in ("policy/v1", "policy/v1beta1"):
        p = r.pod_disruption_budget("tiny", "ns1", v)
        assert p["apiVersion"] == v and p["spec"]["maxUnavailable"] == 1
        assert p["spec"]["selector"]["matchLabels"] == crd.selector_labels("tiny")
    with pytest.raises(ValueError, match="policy/v2"):
        r.pod_disruption_budget("tiny", "ns1", "policy/v2")
    sec = r.admin_secret("tiny", "ns1", "s3cret")
    assert sec["metadata"]["name"] == "tiny-admin"
    assert base64.b64decode(sec["data"]["token"]) == b"s3cret"
    with pytest.raises(ValueError):
        r.admin_secret("tiny", "ns1", "")
    assert crd.selector_string("tiny") == "app.kubernetes.io/component=worker,serving.goodput.dev/inferenceservice=tiny"
    assert r.service_url("tiny", "ns1") == "http://tiny.ns1.svc.cluster.local:8000"


# hashes from `printf %s NAME | sha256sum | cut -c1-8`, lengths counted by hand
A63 = "a" * 63
B58 = "b" * 47 + "-" + "c" * 10
CHILD_NAME_CASES = {
    "short": ("tiny", "admin", "tiny-admin"),
    "fits-exactly-63": ("x" * 57, "admin", "x" * 57 + "-admin"),
    "63-chars": (A63, "admin", "a" * 48 + "-7d3e74a0-admin"),
    "59-chars": ("svc-with-a-rather-long-name-for-the-admin-secret-test-12345", "admin",
                 "svc-with-a-rather-long-name-for-the-admin-secret-c986fda8-admin"),
    "cut-ends-in-dash": (B58, "admin", "b" * 47 + "-b212494e-admin"),
}


@pytest.mark.parametrize("case", CHILD_NAME_CASES)
def test_child_name(case):
    name, suffix, want = CHILD_NAME_CASES[case]
    got = crd.child_name(name, suffix)
    assert got == want and len(got) <= 63


def test_child_name_refuses_a_suffix_without_room():
    with pytest.raises(ValueError, match="no room"):
        crd.child_name(A63, "s" * 53)


def test_long_names_give_valid_labels_and_child_names():
    """At 63 characters every label value is the owner's name and every child name fits a DNS label."""
    spec = InferenceServiceSpec()
    objs = r.children(A63, "ns1", "u", spec) + [r.admin_secret(A63, "ns1", "t")]
    for o in objs:
        assert len(o["metadata"]["name"]) <= 63
        assert o["metadata"]["labels"][crd.LABEL_ISVC] == A63
        assert all(len(v) <= 63 for v in o["metadata"]["labels"].values())
    assert objs[-1]["metadata"]["name"] == "a" * 48 + "-7d3e74a0-admin"
    env = objs[0]["spec"]["template"]["spec"]["containers"][0]["env"][0]
    assert env["valueFrom"]["secretKeyRef"]["name"] == objs[-1]["metadata"]["name"]


def test_children_are_all_owned():
    kids = r.children("tiny", "ns1", "uid-9", InferenceServiceSpec(), "policy/v1beta1")
    assert [k["kind"] for k in kids] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert all(k["metadata"]["ownerReferences"][0]["uid"] == "uid-9" for k in kids)


def _as_server_returns(obj):
    """What the API server hands back: our fields plus defaults, status and bookkeeping."""
    o = copy.deepcopy(obj)
    o["metadata"].update(resourceVersion="42", uid="child-uid", generation=1,
                         creationTimestamp="2026-01-01T00:00:00Z")
    o["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    if o["kind"] == "Deployment":
        c = o["spec"]["template"]["spec"]["containers"][0]
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        c["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
        o["spec"]["template"]["spec"].update(restartPolicy="Always", dnsPolicy="ClusterFirst", schedulerName="x")
        o["status"] = {"replicas": 1}
    if o["kind"] == "Service":
        o["spec"].update(clusterIP="10.0.0.7", clusterIPs=["10.0.0.7"], sessionAffinity="None")
    return o


COMPARE_CASES = {
    "server-defaults-only": (lambda o: None, False),
    "replicas-scaled-by-hand": (lambda o: o["spec"].__setitem__("replicas", 7), True),
    "image-edited-by-hand": (lambda o: o["spec"]["template"]["spec"]["containers"][0].__setitem__("image", "x"), True),
    "arg-removed-by-hand": (lambda o: o["spec"]["template"]["spec"]["containers"][0]["args"].pop(), True),
    "our-label-removed": (lambda o: o["metadata"]["labels"].pop("app.kubernetes.io/managed-by"), True),
    "foreign-label-added": (lambda o: o["metadata"]["labels"].__setitem__("x", "y"), False),
    "hash-annotation-stale": (lambda o: o["metadata"]["annotations"].__setitem__(r.ANNOTATION_SPEC_HASH, "0"), True),
    "cpu-canonicalised": (lambda o: o["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
                          .__setitem__("cpu", "500m"), False),
    "cpu-changed": (lambda o: o["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
                    .__setitem__("cpu", "600m"), True),
}


@pytest.mark.parametrize("case", COMPARE_CASES)
def test_needs_update(case):
    edit, want = COMPARE_CASES[case]
    desired = _dep({"resources": {"cpu": "0.5"}})
    actual = _as_server_returns(desired)
    edit(actual)
    assert r.needs_update(desired, actual, parse_quantity) is want


def test_spec_change_needs_update_even_when_a_field_is_removed():
    with_sel = _dep({"scheduling": {"nodeSelector": {"a": "b"}}})
    without = _dep({})
    # the old object still has the nodeSelector: a subset test alone would call this up to date
    assert r.is_subset(without["spec"]["template"]["spec"],
                       _as_server_returns(with_sel)["spec"]["template"]["spec"])
    assert r.needs_update(without, _as_server_returns(with_sel), parse_quantity)


def test_replacement_keeps_what_others_own():
    desired = r.service("tiny", "ns1")
    actual = _as_server_returns(desired)
    actual["metadata"]["annotations"]["other"] = "keep"
    body = r.replacement(desired, actual)
    assert body["metadata"]["resourceVersion"] == "42"
    assert body["metadata"]["annotations"]["other"] == "keep"
    assert body["spec"]["clusterIP"] == "10.0.0.7" and body["spec"]["clusterIPs"] == ["10.0.0.7"]
    assert body["metadata"]["annotations"][r.ANNOTATION_SPEC_HASH] == desired["metadata"]["annotations"][
        r.ANNOTATION_SPEC_HASH]


# (desired as the user spelled it, what kube-apiserver 1.20.2 stored for it in a Deployment's pod
# template: `kubectl create --dry-run=server` of a Deployment with requests cpu and memory = desired)
SERVER_SPELLINGS = [("0.5", "500m"), ("0.0001", "1m"), ("0.0000000001", "1m"), ("0.0005", "1m"),
                    ("1.0001", "1001m"), ("1.5m", "2m"), ("0.1m", "1m"), ("1.5Gi", "1536Mi"), ("1000m", "1"),
                    ("2", "2"), ("99999999999Ti", "9223372036854775807"),
                    ("9999999999999999999", "9999999999999999999"), ("123456789.123456789", "123456789124m")]


@pytest.mark.parametrize("desired, stored", SERVER_SPELLINGS)
def test_same_quantity_as_the_server_stores_it(desired, stored):
    assert r.same_quantity(desired, stored, parse_quantity)


@pytest.mark.parametrize("desired, other", [("0.0001", "100u"), ("100m", "101m"), ("1Gi", "1G"),
                                            ("99999999999Ti", "99999999999Ti"), ("1", "http"),
                                            ("9999999999999999999", "9223372036854775807")])
def test_different_quantities_differ(desired, other):
    assert not r.same_quantity(desired, other, parse_quantity)


@pytest.mark.parametrize("cpu, memory", [(d, m) for (d, _), (m, _) in zip(SERVER_SPELLINGS, SERVER_SPELLINGS[::-1])])
def test_no_update_whatever_the_quantity_spelling(cpu, memory):
    stored = dict(SERVER_SPELLINGS)
    desired = _dep({"resources": {"cpu": cpu, "memory": memory}})
    actual = _as_server_returns(desired)
    c = actual["spec"]["template"]["spec"]["containers"][0]["resources"]
    c["requests"].update(cpu=stored[cpu], memory=stored[memory])
    c["limits"]["memory"] = stored[memory]
    assert not r.needs_update(desired, actual, parse_quantity)


def test_quantities_compare_by_value_only_inside_requests_and_limits():
    desired = _dep({"engine": {"maxNumSeqs": 500}})
    actual = _as_server_returns(desired)
    args = actual["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("500")] = "0.5k"  # an argument is a string, not a quantity
    assert r.needs_update(desired, actual, parse_quantity)


# terminationGracePeriodSeconds: the drain budget (hand-computed: ceil((ttft + L * tpot) / 1000 ms) + 5 s)
GRACE_CASES = {
    "defaults: 8192-token context at 100 ms TPOT": ({}, 826),          # 1 s + 819.2 s -> 821 + 5
    "maxModelLen 512": ({"engine": {"maxModelLen": 512}}, 58),        # 1 + 51.2 -> 53 + 5
    "tight SLO": ({"engine": {"maxModelLen": 2048}, "slo": {"ttftMs": 200, "tpotMs": 20}}, 47),  # 0.2+40.96 -> 42 + 5
    "explicit wins": ({"engine": {"maxModelLen": 512}, "terminationGracePeriodSeconds": 7}, 7),
}


@pytest.mark.parametrize("case", GRACE_CASES)
def test_termination_grace_period_on_the_pod(case):
    spec, want = GRACE_CASES[case]
    pod = _dep(spec)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == want


def test_termination_grace_period_bounds_refused():
    import pydantic
    for bad in (0, -1, 86401):
        with pytest.raises(pydantic.ValidationError, match="termination_grace_period_seconds|terminationGracePeriodSeconds"):
            InferenceServiceSpec.model_validate({"terminationGracePeriodSeconds": bad})
