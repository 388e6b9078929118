"""``python -m goodput.autoscaler``: the goodput autoscaler's control loop (see ``loop``).

    python -m goodput.autoscaler [--namespace NS ... | --all-namespaces] [--release NS/NAME] [--period 5] [--metrics-port 9091]
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

Overlapping releases (``goodput.api.claims``, ``goodput.autoscaler.claims``): all namespaces, it
skips the namespaces a namespaced release's operator claims; with ``--namespace`` (repeatable), it
stands down in a namespace whose operator Lease is held by another release's operator
(``--release``, ``$GOODPUT_RELEASE``: its own release, which the chart sets).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from dataclasses import dataclass

from goodput.api.claims import RELEASE_ENV
from goodput.api.settings import add_flags, setting, settings

from goodput.autoscaler.lease import LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S


@dataclass(frozen=True)
class AutoscalerSettings:
    """The autoscaler's flags, one declaration each (``goodput.api.settings.setting``)."""

    namespace: list[str] = setting([], "only this namespace (repeatable: one per namespace)", alias="-n",
                                   metavar="NS")
    all_namespaces: bool = setting(False, "every namespace (the default)", alias="-A")
    period: float = setting(5.0, "seconds between reconcile passes", gt=0)
    metrics_port: int = setting(9091, "port of its own /metrics (0 = off)", ge=0, le=65535, metavar="PORT")
    metrics_host: str = setting("0.0.0.0", "address of its own /metrics")
    scrape_timeout: float = setting(2.0, "seconds per pod scrape", gt=0)
    prometheus_url: str | None = setting(
        None, "read the workers' metrics from this Prometheus (PromQL) instead of scraping pods")
    router_namespace: str | None = setting(
        None, "scrape the Ready router pods (label app.kubernetes.io/component=router) in this namespace")
    router_metrics_url: list[str] = setting(
        [], "also scrape this router /metrics URL (repeatable; without Kubernetes discovery)", metavar="URL")
    once: bool = setting(False, "one pass, print the decisions as JSON, exit")
    dry_run: bool = setting(False, "decide and report, but write nothing (no scale, limits, status or Events)")
    leader_elect: bool = setting(
        True, "reconcile only while holding the Lease (--no-leader-elect: always, one replica only)")
    lease_name: str = setting("goodput-autoscaler", "name of the Lease")
    lease_namespace: str = setting("goodput-system", "namespace of the Lease ($POD_NAMESPACE when set)",
                                   env="POD_NAMESPACE")
    lease_duration: float = setting(
        LEASE_DURATION_S, "seconds a standby waits after the holder's last renewal before taking over", gt=0)
    renew_deadline: float = setting(RENEW_DEADLINE_S, "seconds the holder keeps leading without a successful "
                                    "renewal", gt=0)
    retry_period: float = setting(RETRY_PERIOD_S, "seconds between tries to acquire or renew", gt=0)
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    release: str | None = setting(None, "its Helm release, <release namespace>/<release name>: with --namespace, "
                                  "it stands down in a namespace whose operator Lease another release holds",
                                  env=RELEASE_ENV, metavar="NS/NAME")


_SCOPE = ("namespace", "all_namespaces")
_LEASE = ("leader_elect", "lease_name", "lease_namespace", "lease_duration", "renew_deadline", "retry_period")


def build_parser() -> argparse.ArgumentParser:
    """One flag per :class:`AutoscalerSettings` field (``goodput.api.settings.add_flags``);
    ``--namespace`` and ``--all-namespaces`` exclude each other."""
    p = argparse.ArgumentParser(prog="python -m goodput.autoscaler",
                                description="goodput autoscaler: replicas and admission limits from goodput")
    ss = settings(AutoscalerSettings)
    add_flags(p.add_mutually_exclusive_group(), [s for s in ss if s.name in _SCOPE])
    add_flags(p, [s for s in ss if s.name not in _SCOPE + _LEASE])
    add_flags(p.add_argument_group("leader election (coordination.k8s.io Lease; client-go's defaults)"),
              [s for s in ss if s.name in _LEASE])
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
        scaler = Autoscaler(kube, source, http, namespace=ns.namespace or None, period_s=ns.period, metrics=metrics,
                            dry_run=ns.dry_run, routers=routers,
                            # all namespaces: skip those a namespaced release claims (as the operators);
                            # namespaced: stand down where another release's operator holds the Lease
                            claims=NamespaceClaims(kube.operator_lease, namespaced=bool(ns.namespace),
                                                   release=ns.release, notify=kube.lease_event))
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
            ", ".join(ns.namespace) or "all namespaces", ns.period, ns.prometheus_url or "the pods' /metrics")
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
