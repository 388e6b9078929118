"""``python -m goodput.router`` (``goodput-router``): the request router.

    python -m goodput.router --port 8080 --static smollm2=http://127.0.0.1:8001,http://127.0.0.1:8002
    python -m goodput.router --port 8080 --kubernetes [discovery flags]

Static mode: one ``--static MODEL=URL,URL,...`` per model (repeatable). ``--kubernetes``: the
InferenceService/pod watch of ``goodput.router.discovery_k8s`` (its own flags). The other flags
are the fields of :class:`goodput.router.app.RouterSettings` and, prefixed ``--picker-``, of
:class:`goodput.router.picker.PickConfig`.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from goodput.router.app import RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery, parse_static
from goodput.router.picker import PickConfig


def _eps(v: str) -> float | None:
    return None if v.lower() == "none" else float(v)


def _bool(v: str) -> bool:
    return v.lower() in ("1", "true", "yes", "on")


_PICKER_TYPES = {"eps": _eps, "respect_limits": _bool}


def _want_kubernetes(argv: list[str]) -> bool:
    return "--kubernetes" in argv


def build_parser(kubernetes: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="goodput-router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=8080, help="listen port")
    p.add_argument("--log-level", default="warning", help="uvicorn / router log level")
    p.add_argument("--static", action="append", default=[], metavar="MODEL=URL,URL,...",
                   help="a model and its pods' base URLs (repeatable); static discovery")
    p.add_argument("--kubernetes", action="store_true",
                   help="discover InferenceServices and their pods from the Kubernetes API")
    for f in dataclasses.fields(RouterSettings):
        p.add_argument(f.metadata["flag"], dest=f.name, type=type(f.default), default=f.default,
                       help=f"{f.metadata['help']} (default {f.default})")
    for f in dataclasses.fields(PickConfig):
        p.add_argument("--picker-" + f.name.replace("_", "-"), dest="picker_" + f.name, default=f.default,
                       type=_PICKER_TYPES.get(f.name, type(f.default)),
                       help=f"PickConfig.{f.name}, see goodput.router.picker (default {f.default})")
    if kubernetes:
        from goodput.router import discovery_k8s
        discovery_k8s.add_arguments(p)
    return p


def parse(argv: list[str] | None = None):
    """argv → (args, settings, pick config, discovery). Exits 2 with a message on bad flags."""
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser(_want_kubernetes(argv))
    args = p.parse_args(argv)
    settings = RouterSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RouterSettings)})
    try:
        pick_cfg = PickConfig(**{f.name: getattr(args, "picker_" + f.name) for f in dataclasses.fields(PickConfig)})
        settings.outlier_config()
        if settings.header_timeout_s <= 0 or settings.body_timeout_s <= 0:
            raise ValueError("--header-timeout and --body-timeout must be > 0")
    except ValueError as e:
        p.error(str(e))
    if args.kubernetes == bool(args.static):
        p.error("give --static MODEL=URL,... (repeatable) or --kubernetes")
    if args.kubernetes:
        from goodput.router import discovery_k8s
        discovery = discovery_k8s.from_args(args)
    else:
        try:
            for spec in args.static:
                parse_static(spec)
        except ValueError as e:
            p.error(str(e))
        discovery = StaticDiscovery(args.static, startup_timeout_s=settings.hold_timeout_s,
                                    period_s=settings.scrape_period_s)
        try:
            discovery.services()
        except ValueError as e:
            p.error(str(e))
    return args, settings, pick_cfg, discovery


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from goodput.router.serve import protocol_class
    args, settings, pick_cfg, discovery = parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(discovery, settings, pick_cfg=pick_cfg)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                http=protocol_class(settings.header_timeout_s),
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
