"""The generated CRD: committed file up to date, structural-schema rules, subresources, columns."""


import pytest
import yaml
from pydantic import BaseModel, Field

from goodput.api import crd as api
from goodput.operator import crdgen


@pytest.fixture(scope="module")
def crd():
    return crdgen.build_crd()


@pytest.fixture(scope="module")
def version(crd):
    [v] = crd["spec"]["versions"]
    return v


def _walk(node, path="$"):
    yield path, node
    for k, v in (node.get("properties") or {}).items():
        yield from _walk(v, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def test_committed_crd_is_up_to_date():
    assert crdgen.main(["--check"]) == 0, "run: python -m goodput.operator.crdgen"


def test_check_detects_a_stale_file(tmp_path, capsys):
    out = tmp_path / "crd.yaml"
    assert crdgen.main(["--output", str(out), "--check"]) == 1  # missing
    assert crdgen.main(["--output", str(out)]) == 0
    assert crdgen.main(["--output", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("minimum: 0", "minimum: 1", 1))
    assert crdgen.main(["--output", str(out), "--check"]) == 1
    assert "stale" in capsys.readouterr().err


def test_rendered_yaml_parses_back_to_the_same_object(crd):
    assert yaml.safe_load(crdgen.render()) == crd


def test_schema_is_structural(version):
    root = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "$ref" not in node and "title" not in node and "$defs" not in node, path
        assert "anyOf" not in node and "oneOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string") or \
            node.get("x-kubernetes-preserve-unknown-fields"), path
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, path
        assert node.get("default", 0) is not None and node.get("default") != "", path


def test_schema_carries_defaults_bounds_enums_nullable(version):
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    p = spec["properties"]
    eng = p["engine"]["properties"]
    assert spec["default"] == {} and p["engine"]["default"] == {}
    assert eng["blockSize"] == {"nullable": True, "maximum": 256, "minimum": 1, "type": "integer",
                                "description": "--block-size: tokens per KV block (PagedAttention; "
                                               "Kwon et al., SOSP 2023)"}
    assert eng["enablePrefixCaching"]["default"] is True and eng["vllmMetricAliases"]["default"] is False
    assert eng["maxNumSeqs"]["nullable"] is True and eng["maxNumSeqs"]["minimum"] == 1
    assert eng["dtype"]["enum"] == ["float32", "bfloat16"] and eng["dtype"]["nullable"] is True
    assert eng["kvCacheMemory"]["x-kubernetes-int-or-string"] is True and "type" not in eng["kvCacheMemory"]
    assert p["replicas"]["minimum"] == 0 and p["replicas"]["default"] == 1
    assert p["slo"]["properties"]["ttftMs"]["exclusiveMinimum"] is True
    assert p["slo"]["properties"]["attainmentTarget"]["maximum"] == 1
    assert p["scheduling"]["properties"]["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert p["scheduling"]["properties"]["nodeSelector"]["additionalProperties"] == {"type": "string"}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-type"] == "map"
    assert status["conditions"]["items"]["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert status["autoscaler"]["properties"]["decisions"]["maxItems"] == api.MAX_DECISIONS
    idle = p["autoscaling"]["properties"]["scaleToZeroIdleSeconds"]
    assert (idle["type"], idle["minimum"], idle["default"]) == ("integer", 0, 600)
    rmq = status["admission"]["properties"]["routerMaxQueued"]
    assert (rmq["type"], rmq["minimum"], rmq["nullable"]) == ("integer", 0, True)


def test_names_subresources_columns(crd, version):
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == "inferenceservices.serving.goodput.dev"
    assert names["kind"] == "InferenceService" and "isvc" not in names["shortNames"]
    assert names["shortNames"] == ["gisvc"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    for want in ("Ready", "Replicas", "Model", "URL", "Age"):
        assert want in cols
    assert "x-kubernetes-validations" not in crdgen.render()  # Kubernetes 1.20: no CEL


class _Inner(BaseModel):
    a: int = Field(3, gt=0)


class _Outer(BaseModel):
    inner: _Inner | None = None
    size: int | str | None = None
    tags: dict[str, str] = {}
    free: dict = {}


class _Bad(BaseModel):
    x: int | list[int]


def test_to_structural_rewrites():
    raw = _Outer.model_json_schema()
    s = crdgen.to_structural(raw, raw["$defs"])
    inner = s["properties"]["inner"]
    assert inner["nullable"] is True and inner["type"] == "object"
    assert inner["properties"]["a"] == {"default": 3, "minimum": 0, "exclusiveMinimum": True, "type": "integer"}
    assert s["properties"]["size"] == {"nullable": True, "x-kubernetes-int-or-string": True}
    assert s["properties"]["tags"]["additionalProperties"] == {"type": "string"}
    assert s["properties"]["free"]["x-kubernetes-preserve-unknown-fields"] is True


def test_to_structural_refuses_unions_it_cannot_express():
    raw = _Bad.model_json_schema()
    with pytest.raises(crdgen.SchemaError, match="x"):
        crdgen.to_structural(raw, raw.get("$defs", {}))
