"""InferenceService pydantic API: aliases, refusal of bad input, byte sizes, semantic problems, examples."""


import pytest
import yaml
from pydantic import ValidationError

from goodput.api import crd as api
from goodput.api.crd import InferenceServiceSpec, semantic_problems
from goodput.api.units import parse_bytes

from conftest import REPO

EXAMPLES = sorted((REPO / "crds" / "examples").glob("*.yaml"))


def test_defaults_and_camel_case_round_trip():
    s = InferenceServiceSpec.model_validate({"engine": {"maxNumSeqs": 8, "kvCacheMemory": "64Mi"}})
    assert s.engine.max_num_seqs == 8 and s.engine.block_size is None and s.replicas == 1
    assert api.engine_value(s.engine, "block_size") == 16  # unset: the worker's default
    assert s.model.name == "smollm2" and s.slo.attainment_target == 0.9
    dumped = s.model_dump(by_alias=True, exclude_none=True)
    assert dumped["engine"]["maxNumSeqs"] == 8 and "max_num_seqs" not in dumped["engine"]
    assert InferenceServiceSpec.model_validate(dumped) == s


@pytest.mark.parametrize("bad, field", [
    ({"replicas": -1}, "replicas"),
    ({"engine": {"maxNumSeq": 4}}, "maxNumSeq"),           # unknown field (typo)
    ({"engine": {"maxNumSeqs": "many"}}, "maxNumSeqs"),     # wrong type
    ({"engine": {"dtype": "float64"}}, "dtype"),
    ({"slo": {"attainmentTarget": 1.5}}, "attainmentTarget"),
    ({"slo": {"ttftMs": 0}}, "ttftMs"),
    ({"resources": {"cpu": "two"}}, "cpu"),
    ({"resources": {"gpu": -1}}, "gpu"),
    ({"model": {"name": ""}}, "name"),
    ({"autoscaling": {"scaleToZeroIdleSeconds": -1}}, "scaleToZeroIdleSeconds"),
], ids=["negative-replicas", "unknown-engine-field", "wrong-type", "bad-enum", "ratio-above-1",
        "zero-ttft", "bad-quantity", "negative-gpu", "empty-model", "negative-idle"])
def test_bad_spec_refused_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as ei:
        InferenceServiceSpec.model_validate(bad)
    assert field in str(ei.value)


@pytest.mark.parametrize("text, expected", [
    (0, 0), (1024, 1024), ("1024", 1024), ("512Mi", 512 * 2**20), ("512MiB", 512 * 2**20),
    ("1Gi", 2**30), ("1.5Gi", 3 * 2**29), ("64M", 64_000_000), ("2GB", 2_000_000_000), ("1k", 1000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "1Xi", "-5", "1 G i", True])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


PROBLEM_CASES = {
    "bundled-model-ok": ({}, []),
    "gguf-path-ok": ({"model": {"name": "/models/x.gguf", "volume": {"hostPath": "/srv/m"}}}, []),
    "not-gguf": ({"model": {"name": "/models/x.bin"}}, ["InvalidModel"]),
    "relative-gguf": ({"model": {"name": "x.gguf"}}, ["InvalidModel"]),
    "volume-needs-one-source": ({"model": {"name": "/models/x.gguf", "volume": {}}}, ["InvalidModelVolume"]),
    "gguf-outside-mount": ({"model": {"name": "/data/x.gguf", "volume": {"claimName": "m"}}},
                           ["InvalidModelVolume"]),
    "batched-tokens-below-block": ({"engine": {"maxNumBatchedTokens": 8, "blockSize": 16}},
                                   ["InvalidEngineConfig"]),
    "model-len-below-block": ({"engine": {"maxModelLen": 8}}, ["InvalidEngineConfig"]),
    "model-len-at-context": ({"engine": {"maxModelLen": 8192}}, []),
    "model-len-above-context": ({"engine": {"maxModelLen": 8193}}, ["InvalidEngineConfig"]),
    "gguf-context-unknown-here": ({"model": {"name": "/m/x.gguf"}, "engine": {"maxModelLen": 100000}}, []),
    "bad-kv-size": ({"engine": {"kvCacheMemory": "lots"}}, ["InvalidEngineConfig"]),
    "zero-kv": ({"engine": {"kvCacheMemory": 0}}, ["InvalidEngineConfig"]),
    "triton-without-gpu": ({"engine": {"attentionBackend": "triton"}}, ["InvalidEngineConfig"]),
    "triton-with-gpu": ({"engine": {"attentionBackend": "triton"}, "resources": {"gpu": 1}}, []),
    "min-above-max": ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, ["InvalidAutoscaling"]),
    "admin-token-env": ({"podTemplate": {"env": [{"name": "GOODPUT_ADMIN_TOKEN", "value": "x"}]}},
                        ["InvalidPodTemplate"]),
    "env-both": ({"podTemplate": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]}},
                 ["InvalidPodTemplate"]),
    "two-problems": ({"model": {"name": "m.bin"}, "engine": {"maxNumBatchedTokens": 4}},
                     ["InvalidModel", "InvalidEngineConfig"]),
}


@pytest.mark.parametrize("case", PROBLEM_CASES)
def test_semantic_problems(case):
    spec, reasons = PROBLEM_CASES[case]
    got = semantic_problems(InferenceServiceSpec.model_validate(spec))
    assert [p.reason for p in got] == reasons
    assert all(p.message for p in got)


def test_problem_message_names_the_numbers():
    [p] = semantic_problems(InferenceServiceSpec.model_validate({"engine": {"maxNumBatchedTokens": 8}}))
    assert "maxNumBatchedTokens (8)" in p.message and "blockSize (16)" in p.message


def test_bundled_model_context_is_the_gguf_context_length():
    """The operator's table agrees with the bundled file's own metadata, read with the gguf library."""
    import importlib.util
    import os

    gguf = pytest.importorskip("gguf")
    from goodput.worker.model.gguf_loader import BUNDLED_MODELS

    for name, (pkg, fname) in BUNDLED_MODELS.items():
        spec = importlib.util.find_spec(pkg)
        if spec is None:
            pytest.skip(f"bundled model package {pkg} not installed")
        reader = gguf.GGUFReader(os.path.join(list(spec.submodule_search_locations)[0], fname))
        field = reader.fields["llama.context_length"]
        assert api.BUNDLED_MODEL_CONTEXT[name] == int(field.parts[field.data[0]][0])
    assert set(api.BUNDLED_MODEL_CONTEXT) == set(api.BUNDLED_MODELS) == set(BUNDLED_MODELS)


def test_model_len_problem_names_the_numbers():
    [p] = semantic_problems(InferenceServiceSpec.model_validate({"engine": {"maxModelLen": 9000}}))
    assert p.message == "engine.maxModelLen (9000) exceeds the context length of model smollm2 (8192 tokens)"


@pytest.mark.parametrize("name, ok", [("smollm2", True), ("a", True), ("llama-3-8b", True), ("9lives", False),
                                      ("Upper", False), ("dot.name", False), ("x" * 63, True), ("x" * 64, False)])
def test_name_problems(name, ok):
    assert (api.name_problems(name) == []) is ok


def test_examples_exist():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_valid(path):
    doc = yaml.safe_load(path.read_text())
    obj = api.InferenceService.model_validate(doc)
    assert doc["apiVersion"] == api.API_VERSION and doc["kind"] == api.KIND
    assert semantic_problems(obj.spec) == []
    assert api.name_problems(doc["metadata"]["name"]) == []
    # the example's spec refuses unknown fields: validate the raw spec strictly too
    InferenceServiceSpec.model_validate(doc["spec"])


def test_contract_fields_scale_to_zero_idle_and_router_max_queued():
    s = InferenceServiceSpec.model_validate({})
    assert s.autoscaling.scale_to_zero_idle_seconds == 600  # the contract's default
    s = InferenceServiceSpec.model_validate({"autoscaling": {"minReplicas": 0, "scaleToZeroIdleSeconds": 0}})
    assert s.autoscaling.scale_to_zero_idle_seconds == 0
    st = api.InferenceServiceStatus.model_validate({"admission": {"maxWaiting": 3, "routerMaxQueued": 12}})
    assert st.admission.router_max_queued == 12 and st.admission.max_waiting == 3
    assert api.InferenceServiceStatus.model_validate({"admission": {}}).admission.router_max_queued is None


def test_status_tolerates_fields_written_by_newer_writers():
    st = api.InferenceServiceStatus.model_validate({"replicas": 2, "somethingNew": 1, "conditions": [
        {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "lastTransitionTime": "2026-01-01T00:00:00Z"}]})
    assert st.replicas == 2 and st.conditions[0].status == "True"


@pytest.mark.parametrize("argv, want", [
    ([], ["--all-namespaces", "--standalone"]),
    (["--namespace", "ml"], ["--namespace", "ml", "--standalone"]),
    (["-n", "a", "-n", "b", "--verbose"], ["-n", "a", "-n", "b", "--verbose", "--standalone"]),
    (["--namespace=ml", "--peering=p"], ["--namespace=ml", "--peering=p"]),
])
def test_operator_command_line(argv, want):
    from goodput.operator.__main__ import kopf_args
    assert kopf_args(argv) == ["run", "-m", "goodput.operator.handlers", *want]


@pytest.mark.parametrize("argv, url, rest", [
    ([], None, []),
    (["-n", "a", "--router-url", "http://r.gp.svc:8080"], "http://r.gp.svc:8080", ["-n", "a"]),
    (["--router-url=https://r:1", "--verbose"], "https://r:1", ["--verbose"]),
    (["--router-url", "http://a:1", "--router-url", "http://b:2"], "http://b:2", []),
])
def test_router_url_flag_is_taken_out_of_kopfs_arguments(argv, url, rest):
    from goodput.operator.__main__ import split_router_url
    assert split_router_url(argv) == (url, rest)


@pytest.mark.parametrize("argv", [["--router-url"], ["--router-url", "goodput-router:8080"],
                                  ["--router-url=ftp://x"], ["--router-url", "http://"]])
def test_router_url_flag_refuses_what_is_not_an_http_url(argv):
    from goodput.operator.__main__ import split_router_url
    with pytest.raises(ValueError, match="--router-url"):
        split_router_url(argv)


@pytest.mark.parametrize("argv, want", [
    ([], None),
    (["--all-namespaces"], None),
    (["--namespace", "ml"], ("ml",)),
    (["-n", "a", "--namespace=b", "--verbose", "-n", "a"], ("a", "b")),
    (["--namespace=team-*"], None),        # a glob: kopf must list namespaces to match it
    (["--namespace=!kube-system"], None),  # a negation: likewise
    (["-n", "a", "-A"], None),
])
def test_exact_namespaces_switch_off_namespace_listing_and_claim_leases(argv, want):
    from goodput.operator.__main__ import exact_namespaces
    assert exact_namespaces(argv) == want
