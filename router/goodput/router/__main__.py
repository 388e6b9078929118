"""``python -m goodput.router`` (``goodput-router``): the request router.

    python -m goodput.router --port 8080 --static smollm2=http://127.0.0.1:8001,http://127.0.0.1:8002
    python -m goodput.router --port 8080 --kubernetes [discovery flags]

Static mode: one ``--static MODEL=URL,URL,...`` per model (repeatable). ``--kubernetes``: the
InferenceService/pod watch of ``goodput.router.discovery_k8s`` (its own flags). Every flag is a
setting declaration (``goodput.api.settings.setting``): the fields of :class:`ProcessSettings`,
:class:`goodput.router.app.RouterSettings` and, prefixed ``--picker-``, of
:class:`goodput.router.picker.PickConfig`; a new setting is one new field.
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

from goodput.api.settings import add_flags, from_flags, setting, settings

from goodput.router.app import RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery, parse_static
from goodput.router.picker import PickConfig


@dataclass(frozen=True)
class ProcessSettings:
    """Where the router listens and where it finds its pods (the other flags: :class:`RouterSettings`,
    :class:`PickConfig`, and with ``--kubernetes`` the discovery's)."""

    host: str = setting("127.0.0.1", "listen address")
    port: int = setting(8080, "listen port", ge=0, le=65535)
    log_level: str = setting("warning", "uvicorn / router log level")
    static: list[str] = setting([], "a model and its pods' base URLs (repeatable); static discovery",
                                metavar="MODEL=URL,URL,...")
    kubernetes: bool = setting(False, "discover InferenceServices and their pods from the Kubernetes API")


def _want_kubernetes(argv: list[str]) -> bool:
    return "--kubernetes" in argv


def build_parser(kubernetes: bool = False) -> argparse.ArgumentParser:
    """The flags of every setting declaration: :class:`ProcessSettings`, :class:`RouterSettings`,
    :class:`PickConfig` (prefixed ``--picker-``) and, with ``kubernetes``, the discovery's."""
    p = argparse.ArgumentParser(prog="goodput-router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, settings(ProcessSettings))
    add_flags(p, settings(RouterSettings))
    add_flags(p, settings(PickConfig), prefix="picker-")
    if kubernetes:
        from goodput.router import discovery_k8s
        add_flags(p.add_argument_group("Kubernetes discovery (--kubernetes)"),
                  settings(discovery_k8s.DiscoverySettings))
    return p


def parse(argv: list[str] | None = None):
    """argv → (args, settings, pick config, discovery). Exits 2 with a message on bad flags."""
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser(_want_kubernetes(argv))
    args = p.parse_args(argv)
    try:
        settings_ = from_flags(args, RouterSettings)
        pick_cfg = from_flags(args, PickConfig, prefix="picker-")
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
        discovery = StaticDiscovery(args.static, startup_timeout_s=settings_.hold_timeout_s,
                                    period_s=settings_.scrape_period_s)
        try:
            discovery.services()
        except ValueError as e:
            p.error(str(e))
    return args, settings_, pick_cfg, discovery


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
