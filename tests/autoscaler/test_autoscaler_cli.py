"""`python -m goodput.autoscaler` flags (the interface's CLI): defaults, exclusive scope, bad values."""
import pytest

from goodput.autoscaler.__main__ import build_parser


def test_defaults_match_the_interface():
    ns = build_parser().parse_args([])
    assert (ns.namespace, ns.all_namespaces, ns.period, ns.metrics_port, ns.metrics_host, ns.scrape_timeout,
            ns.prometheus_url, ns.once, ns.dry_run, ns.release) == ([], False, 5.0, 9091, "0.0.0.0", 2.0, None, False,
                                                                  False, None)


def test_every_flag():
    ns = build_parser().parse_args(["--namespace", "prod", "--period", "2.5", "--metrics-port", "0",
                                    "--metrics-host", "127.0.0.1", "--scrape-timeout", "0.5",
                                    "--prometheus-url", "http://prom:9090", "--once", "--dry-run",
                                    "--release", "gp-system/gp"])
    assert (ns.namespace, ns.period, ns.metrics_port, ns.metrics_host, ns.scrape_timeout, ns.prometheus_url,
            ns.once, ns.dry_run, ns.release) == (["prod"], 2.5, 0, "127.0.0.1", 0.5, "http://prom:9090", True, True,
                                                 "gp-system/gp")


def test_every_namespace_given_is_kept():
    """The chart passes one --namespace per watched namespace: each one is decided (not only the last)."""
    assert build_parser().parse_args(["--namespace=a", "-n", "b", "--namespace", "c"]).namespace == ["a", "b", "c"]


def test_the_release_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("GOODPUT_RELEASE", "team-a/gp2")
    assert build_parser().parse_args([]).release == "team-a/gp2"


@pytest.mark.parametrize("argv, message", [
    (["--namespace", "a", "--all-namespaces"], "not allowed with argument"),
    (["--period", "0"], "expected a number > 0"),
    (["--scrape-timeout", "soon"], "expected a number"),
    (["--metrics-port", "70000"], "expected a port in 0-65535"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
