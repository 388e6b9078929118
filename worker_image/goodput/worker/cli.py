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
import signal
import sys
from typing import Any

from goodput.api.settings import add_flags, from_flags, settings
from goodput.worker.engine.config import EngineArgs, in_flag_order


def build_parser() -> argparse.ArgumentParser:
    """``goodput-worker serve``'s parser, one flag per :class:`EngineArgs` setting (help, bounds,
    choices and defaults from the field declarations: ``goodput.api.settings.add_flags``)."""
    p = argparse.ArgumentParser(prog="goodput-worker", description="goodput LLM worker")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a GGUF model over an OpenAI-compatible HTTP API")
    add_flags(serve, in_flag_order(settings(EngineArgs)))
    return p


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The parsed ``serve`` flags as :class:`EngineArgs`."""
    return from_flags(ns, EngineArgs)


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


# Seconds uvicorn keeps an idle HTTP/1.1 connection open (its default is 5). Scrapers reuse one
# pooled connection per pod every period (the autoscaler: 5 s by default, the router: 2 s); a
# keep-alive equal to the period closes it just as the next scrape reuses it ("Server disconnected
# without sending a response"). Longer than any scrape period, like nginx's 75 s.
KEEP_ALIVE_S = 75


def uvicorn_settings(args: EngineArgs, log_level: int) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments of a worker (besides the app)."""
    return {"host": args.host, "port": args.port, "log_level": args.log_level,
            "access_log": log_level <= logging.DEBUG, "timeout_graceful_shutdown": 5,
            "timeout_keep_alive": KEEP_ALIVE_S}


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
    server = _draining_server_class()(uvicorn.Config(app, **uvicorn_settings(args, level)), app.state.server)
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
