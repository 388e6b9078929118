"""The metric-name module is importable without side effects (the autoscaler and dashboards use it)."""
import subprocess
import sys


def test_metric_names_import_touches_no_prometheus_registry():
    code = ("import sys; import goodput.api.worker_metrics as m; "
            "assert 'prometheus_client' not in sys.modules, 'imported prometheus_client'; "
            "assert 'torch' not in sys.modules, 'imported torch'; "
            "print(m.REQUESTS_RUNNING)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "goodput_requests_running"


def test_worker_metrics_reexports_the_same_names():
    from goodput.api import worker_metrics as metric_names
    from goodput.worker import metrics
    assert metrics.REQUESTS_SLO_MET is metric_names.REQUESTS_SLO_MET
    assert metrics.VLLM_ALIASES is metric_names.VLLM_ALIASES
