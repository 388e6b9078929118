"""`python -m goodput.autoscaler` flags (the interface's CLI): defaults, exclusive scope, bad values."""
import pytest

from goodput.autoscaler.__main__ import build_parser


def test_defaults_match_the_interface():
    ns = build_parser().parse_args([])
    assert (ns.namespace, ns.all_namespaces, ns.period, ns.metrics_port, ns.metrics_host, ns.scrape_timeout,
            ns.prometheus_url, ns.once, ns.dry_run) == (None, False, 5.0, 9091, "0.0.0.0", 2.0, None, False, False)


def test_every_flag():
    ns = build_parser().parse_args(["--namespace", "prod", "--period", "2.5", "--metrics-port", "0",
                                    "--metrics-host", "127.0.0.1", "--scrape-timeout", "0.5",
                                    "--prometheus-url", "http://prom:9090", "--once", "--dry-run"])
    assert (ns.namespace, ns.period, ns.metrics_port, ns.metrics_host, ns.scrape_timeout, ns.prometheus_url,
            ns.once, ns.dry_run) == ("prod", 2.5, 0, "127.0.0.1", 0.5, "http://prom:9090", True, True)


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
