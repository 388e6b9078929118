"""`goodput-worker serve` flags: every flag users rely on exists, sizes and ports parse,
and the flags are generated from the setting declarations (one per EngineArgs field)."""
from __future__ import annotations

import pytest
from goodput.worker.cli import build_parser, engine_args_from
from goodput.api.settings import settings
from goodput.api.units import parse_bytes
from goodput.worker.engine.config import EngineArgs

# The public flag names (docs/worker.md, operator), spelled as users type them.
PUBLIC_FLAGS = [
    "--model", "--host", "--port", "--dtype", "--kv-cache-memory", "--block-size", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--max-waiting", "--no-enable-prefix-caching",
    "--slo-ttft-ms", "--slo-tpot-ms", "--vllm-metric-aliases", "--attention-backend", "--slo-class",
]


def test_every_public_flag_exists():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {s for a in serve._actions for s in a.option_strings}
    assert [f for f in PUBLIC_FLAGS if f not in known] == []


@pytest.mark.parametrize("text,expected", [
    ("1073741824", 1 << 30), ("512MiB", 512 << 20), ("512Mi", 512 << 20), ("1GiB", 1 << 30),
    ("1Gi", 1 << 30), ("2G", 2_000_000_000), ("2GB", 2_000_000_000), ("64KiB", 65536), ("1k", 1000),
    ("1.5GiB", 3 << 29), ("0", 0), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "12XB", "one GiB", "MiB", "1 G i", True, -5])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("argv", [["--kv-cache-memory", "0"], ["--kv-cache-memory", "lots"],
                                  ["--max-num-seqs", "0"], ["--block-size", "257"], ["--dtype", "float16"],
                                  ["--slo-ttft-ms", "0"], ["--slo-ttft-ms", "nan"], ["--num-threads", "1.5"]])
def test_bad_values_are_usage_errors_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_one_flag_per_setting_with_its_default():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    by_dest = {a.dest: a for a in serve._actions if a.option_strings}
    assert set(by_dest) - {"help"} == {s.name for s in settings(EngineArgs)}
    defaults = EngineArgs()
    for s in settings(EngineArgs):
        assert by_dest[s.name].default == getattr(defaults, s.name), s.name
        assert s.meta.help in by_dest[s.name].help


def test_engine_args_validate_at_construction():
    for bad in ({"max_num_seqs": 0}, {"dtype": "float16"}, {"kv_cache_memory": "1Gi"},
                {"enable_prefix_caching": 1}, {"port": 70000}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineArgs(**bad)


@pytest.mark.parametrize("port", ["0", "65536", "99999", "http"])
def test_bad_port_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err


def test_flags_reach_the_engine_args():
    ns = build_parser().parse_args([
        "serve", "--model", "smollm2", "--kv-cache-memory", "2MiB", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "32", "--no-enable-prefix-caching", "--dtype", "float32",
        "--scheduling-policy", "static"])
    a = engine_args_from(ns)
    assert (a.kv_cache_memory, a.max_num_seqs, a.max_num_batched_tokens) == (2 << 20, 3, 32)
    assert (a.enable_prefix_caching, a.dtype, a.scheduling_policy) == (False, "float32", "static")
