"""``python -m goodput.router``: flags → settings, picker config and discovery."""
import pytest
from goodput.router.__main__ import parse
from goodput.router.discovery_static import StaticDiscovery


def test_static_flags_become_settings_and_discovery():
    args, settings, cfg, disc = parse(["--static", "a=http://127.0.0.1:1,http://127.0.0.1:2", "--static",
                                       "b=http://127.0.0.1:3", "--hold-timeout", "7", "--scrape-period", "0.5",
                                       "--max-body-bytes", "1000", "--picker-eps", "none",
                                       "--picker-chunk-size", "64"])
    assert isinstance(disc, StaticDiscovery)
    assert [(i.model, [p.url for p in pods]) for i, pods in disc.services()] == [
        ("a", ["http://127.0.0.1:1", "http://127.0.0.1:2"]), ("b", ["http://127.0.0.1:3"])]
    assert (settings.hold_timeout_s, settings.scrape_period_s, settings.max_body_bytes) == (7.0, 0.5, 1000)
    assert (disc.startup_timeout_s, disc.period_s) == (7.0, 0.5)
    assert (cfg.eps, cfg.chunk_size) == (None, 64)


@pytest.mark.parametrize("argv", [
    [],                                                          # no discovery
    ["--static", "a=http://127.0.0.1:1", "--kubernetes"],        # both
    ["--static", "a"],                                           # no URL
    ["--static", "a=127.0.0.1:1"],                               # not a URL
    ["--static", "a=http://x:1", "--static", "a=http://y:1"],    # a model twice
    ["--static", "a=http://x:1", "--picker-chunk-size", "0"],    # bad picker knob
    ["--static", "a=http://x:1", "--outlier-consecutive-failures", "0"],  # bad outlier knob
    ["--static", "a=http://x:1", "--outlier-base-ejection", "60", "--outlier-max-ejection", "30"],
    ["--static", "a=http://x:1", "--header-timeout", "0"],
])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err
