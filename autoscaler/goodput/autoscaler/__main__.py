"""``python -m goodput.autoscaler``: the goodput autoscaler's control loop (see ``loop``).

    python -m goodput.autoscaler [--namespace NS | --all-namespaces] [--period 5] [--metrics-port 9091]
        [--metrics-host 0.0.0.0] [--scrape-timeout 2] [--prometheus-url URL] [--once] [--dry-run]
        [--router-namespace NS] [--router-metrics-url URL ...]
        [--no-leader-elect] [--lease-name goodput-autoscaler] [--lease-namespace NS]
        [--lease-duration 15] [--renew-deadline 10] [--retry-period 2] [--log-level info]

Credentials: in-cluster ServiceAccount, else KUBECONFIG / ~/.kube/config. ``--once`` runs one pass,
prints the decisions as JSON and exits (0; 1 when a pass could not list InferenceServices).
``--dry-run`` decides and reports (log, its own metrics, ``--once`` output) but writes nothing:
no scaling, no limits, no status, no Events — to watch what it would do next to another autoscaler.
SIGTERM/SIGINT stop it after the current pass (and release the Lease).

Leader election (on by default; ``lease``): every replica is a candidate for the Lease
``--lease-name`` in ``--lease-namespace`` (default ``$POD_NAMESPACE``, else goodput-system); only
the holder reconciles, a standby takes over within ``--lease-duration`` seconds of the holder's
last renewal. ``--once`` and ``--dry-run`` write nothing and do not take part.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from goodput.autoscaler.lease import LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0-65535 (0 = no metrics server), got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m goodput.autoscaler",
                                description="goodput autoscaler: replicas and admission limits from goodput",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--namespace", "-n", default=None, help="only this namespace")
    where.add_argument("--all-namespaces", "-A", action="store_true", help="every namespace (the default)")
    p.add_argument("--period", type=_positive, default=5.0, help="seconds between reconcile passes")
    p.add_argument("--metrics-port", type=_port, default=9091, help="port of its own /metrics (0 = off)")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address of its own /metrics")
    p.add_argument("--scrape-timeout", type=_positive, default=2.0, help="seconds per pod scrape")
    p.add_argument("--prometheus-url", default=None,
                   help="read the workers' metrics from this Prometheus (PromQL) instead of scraping pods")
    p.add_argument("--router-namespace", default=None,
                   help="scrape the Ready router pods (label app.kubernetes.io/component=router) in this namespace")
    p.add_argument("--router-metrics-url", action="append", default=[], metavar="URL",
                   help="also scrape this router /metrics URL (repeatable; without Kubernetes discovery)")
    p.add_argument("--once", action="store_true", help="one pass, print the decisions as JSON, exit")
    p.add_argument("--dry-run", action="store_true",
                   help="decide and report, but write nothing (no scale, limits, status or Events)")
    le = p.add_argument_group("leader election (coordination.k8s.io Lease; client-go's defaults)")
    le.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True,
                    help="reconcile only while holding the Lease (--no-leader-elect: always, one replica only)")
    le.add_argument("--lease-name", default="goodput-autoscaler", help="name of the Lease")
    le.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE") or "goodput-system",
                    help="namespace of the Lease (default: $POD_NAMESPACE, else goodput-system)")
    le.add_argument("--lease-duration", type=_positive, default=LEASE_DURATION_S,
                    help="seconds a standby waits after the holder's last renewal before taking over")
    le.add_argument("--renew-deadline", type=_positive, default=RENEW_DEADLINE_S,
                    help="seconds the holder keeps leading without a successful renewal")
    le.add_argument("--retry-period", type=_positive, default=RETRY_PERIOD_S,
                    help="seconds between tries to acquire or renew")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


async def _main(ns: argparse.Namespace) -> int:
    import httpx

    from goodput.autoscaler.loop import Autoscaler, DirectScraper, Kube
    from goodput.autoscaler.metrics import AutoscalerMetrics

    metrics = AutoscalerMetrics()
    if ns.metrics_port and not ns.once:
        from prometheus_client import start_http_server
        start_http_server(ns.metrics_port, addr=ns.metrics_host, registry=metrics.registry)
    async with httpx.AsyncClient(timeout=ns.scrape_timeout) as http:
        if ns.prometheus_url:
            from goodput.autoscaler.promql import PrometheusSource
            source = PrometheusSource(http, ns.prometheus_url, timeout_s=ns.scrape_timeout)
        else:
            source = DirectScraper(http, ns.scrape_timeout)
        kube = Kube()
        routers = None
        if ns.router_namespace or ns.router_metrics_url:
            from goodput.autoscaler.loop import RouterScraper
            routers = RouterScraper(http, ns.scrape_timeout, ns.router_metrics_url,
                                    kube if ns.router_namespace else None, ns.router_namespace)
        from goodput.autoscaler.claims import NamespaceClaims
        scaler = Autoscaler(kube, source, http, namespace=ns.namespace, period_s=ns.period, metrics=metrics,
                            dry_run=ns.dry_run, routers=routers,
                            # all namespaces: skip those a namespaced release claims (as the operators)
                            claims=None if ns.namespace else NamespaceClaims(kube.operator_lease))
        if ns.once:
            try:
                decisions = await scaler.tick()
            except Exception as e:  # noqa: BLE001
                print(f"autoscaler: {e}", file=sys.stderr)
                return 1
            print(json.dumps({f"{k[0]}/{k[1]}": {"replicas": d.replicas, "reason": d.reason, "message": d.message,
                                                   "limits": {p: [v.max_num_seqs, v.max_waiting]
                                                              for p, v in d.limits.items()}}
                              for k, d in decisions.items()}, indent=2))
            return 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        logging.getLogger("goodput.autoscaler").info(
            "autoscaling InferenceServices in %s every %.3g s (metrics from %s)",
            ns.namespace or "all namespaces", ns.period, ns.prometheus_url or "the pods' /metrics")
        if not ns.leader_elect or ns.dry_run:
            await scaler.run(stop)
            return 0
        from goodput.autoscaler.lease import LeaderElector, LeaseAPI
        elector = LeaderElector(LeaseAPI(kube.api_client), ns.lease_namespace, ns.lease_name,
                                lease_duration_s=ns.lease_duration, renew_deadline_s=ns.renew_deadline,
                                retry_period_s=ns.retry_period)
        logging.getLogger("goodput.autoscaler").info("leader election: lease %s/%s as %s", ns.lease_namespace,
                                                     ns.lease_name, elector.me)
        await asyncio.to_thread(elector.try_once)   # a lone instance leads from its first pass
        await asyncio.gather(elector.run(stop), scaler.run(stop, leading=elector.is_leader))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not 0 < ns.retry_period < ns.renew_deadline < ns.lease_duration:
        parser.error("need --retry-period < --renew-deadline < --lease-duration")
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(_main(ns))


if __name__ == "__main__":
    raise SystemExit(main())
