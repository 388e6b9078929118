"""``goodput-worker serve``: start an OpenAI-compatible worker (uvicorn runs the FastAPI app).

Example (the bundled SmolLM2-135M-Instruct on this machine's CPU)::

    goodput-worker serve --model smollm2 --host 127.0.0.1 --port 8000

Flag names follow vLLM's where they mean the same (``--max-num-seqs``, ``--max-model-len``,
``--block-size`` ...), so operators' habits carry over. ``python -m goodput.worker serve ...``
is the same command.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Callable

from goodput.worker.engine_args import EngineArgs

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512MiB"``, ``"1GiB"``, ``"1.5G"`` -> bytes (KiB/MiB/GiB powers of 1024,
    K/M/G powers of 1000, as Kubernetes quantities). ArgumentTypeError on anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a number with a unit such as 512MiB, 1GiB, 2G")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (hi None = unbounded), else a usage error."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in {lo}-{hi}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {v}")
        return v
    return parse


_port = _int_in(1, 65535)
_positive_int = _int_in(1)
_non_negative_int = _int_in(0)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="goodput-worker", description="goodput LLM worker")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a GGUF model over an OpenAI-compatible HTTP API",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", default="smollm2", help="'smollm2' (bundled) or a path to a llama-arch .gguf")
    s.add_argument("--served-model-name", default=None,
                   help="name in /v1/models, requests and metrics (default: --model, without .gguf)")
    s.add_argument("--revision", default=None,
                   help="model revision for the prefix-cache identity (default: a hash of the GGUF)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    s.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"),
                   help="KV cache budget in bytes; suffixes KiB/MiB/GiB or K/M/G (e.g. 512MiB)")
    s.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    s.add_argument("--max-num-seqs", type=_positive_int, default=64, help="most requests running at once")
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=512,
                   help="token budget of one step (decodes + prefill chunks)")
    s.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    s.add_argument("--max-waiting", type=_non_negative_int, default=256,
                   help="waiting-queue limit; beyond it requests get 429 with Retry-After")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes")
    s.add_argument("--scheduling-policy", choices=("continuous", "static"), default="continuous",
                   help="static admits a new cohort only when the whole batch finished (a baseline)")
    s.add_argument("--slo-ttft-ms", type=_positive_float, default=None,
                   help="TTFT SLO for goodput_requests_slo_met_total (ms)")
    s.add_argument("--slo-tpot-ms", type=_positive_float, default=None,
                   help="TPOT SLO for goodput_requests_slo_met_total (ms)")
    s.add_argument("--vllm-metric-aliases", action="store_true",
                   help="also export vLLM's metric names (vllm:num_requests_running, ...)")
    s.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto",
                   help="auto: triton on CUDA, the torch reference on CPU")
    s.add_argument("--num-threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is best on an oversubscribed CPU)")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model, served_model_name=ns.served_model_name, revision=ns.revision, dtype=ns.dtype,
        device=ns.device, kv_cache_memory=ns.kv_cache_memory, block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len, max_waiting=ns.max_waiting,
        enable_prefix_caching=ns.enable_prefix_caching, scheduling_policy=ns.scheduling_policy,
        slo_ttft_ms=ns.slo_ttft_ms, slo_tpot_ms=ns.slo_tpot_ms,
        vllm_metric_aliases=ns.vllm_metric_aliases, attention_backend=ns.attention_backend,
        num_threads=ns.num_threads)


# Kubernetes mounts a file at the container's terminationMessagePath (default /dev/termination-log) and
# shows its content as the container's last termination message; this variable overrides the path
# (for runtimes without that mount, such as the e2e test kubelet).
TERMINATION_MESSAGE_ENV = "GOODPUT_TERMINATION_MESSAGE_PATH"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
TERMINATION_MESSAGE_MAX_BYTES = 4096  # what the kubelet reads of it


def write_termination_message(message: str) -> None:
    """Write a fatal error line where Kubernetes reads a container's termination message.

    The path is ``$GOODPUT_TERMINATION_MESSAGE_PATH``, else ``/dev/termination-log`` when it exists
    (never created outside a container). Best effort: an unwritable path is ignored.
    """
    path = os.environ.get(TERMINATION_MESSAGE_ENV) or (
        DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message.encode("utf-8")[-TERMINATION_MESSAGE_MAX_BYTES:].decode("utf-8", "ignore"))
    except OSError:
        pass


def _draining_server_class():
    """``uvicorn.Server`` whose first SIGTERM drains instead of stopping (see server/app.py).

    SIGTERM #1: ``ServerState.start_drain()``; the main loop (ticks every 0.1 s) exits once the
    last in-flight generate request finished, then uvicorn shuts down as usual and the process
    exits 0. A second SIGTERM, or SIGINT, stops at once as plain uvicorn does.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, state) -> None:
            super().__init__(config)
            self.state = state

        def handle_exit(self, sig: int, frame) -> None:
            if sig == signal.SIGTERM and not self.state.draining and not self.should_exit:
                self.state.start_drain()
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.state.drained and not self.should_exit:
                logging.getLogger("goodput.worker.server").info("drained: no request in flight; exiting")
                self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer


def main(argv: list[str] | None = None) -> int:
    """Run ``goodput-worker``; a fatal start-up error is also written as the termination message."""
    try:
        return _main(argv)
    except Exception as exc:
        write_termination_message(f"goodput-worker: {type(exc).__name__}: {exc}\n")
        raise


def _main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    level = getattr(logging, ns.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = engine_args_from(ns)

    import uvicorn
    from goodput.worker.server.app import create_app

    server: uvicorn.Server | None = None

    def stop_on_load_failure(exc: BaseException) -> None:
        # A worker that cannot load its model exits non-zero (the pod shows the error and backs
        # off) instead of serving 503 forever.
        if server is not None:
            server.should_exit = True

    app = create_app(args, on_load_failure=stop_on_load_failure)
    server = _draining_server_class()(uvicorn.Config(
        app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=level <= logging.DEBUG,
        timeout_graceful_shutdown=5), app.state.server)
    server.run()
    error = app.state.server.load_error
    if error is not None:
        line = f"goodput-worker: the model failed to load: {error}"
        print(line, file=sys.stderr)
        write_termination_message(line + "\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
