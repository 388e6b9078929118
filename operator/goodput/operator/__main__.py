"""``python -m goodput.operator [--namespace NS ...] [--all-namespaces] [--router-url URL] [kopf run options]``.

Wraps ``kopf run -m goodput.operator.handlers --standalone`` (``-m``, never a file path: a file path
would put this folder on sys.path and shadow the standard ``operator`` module). With neither
``--namespace`` nor ``--all-namespaces`` it watches all namespaces. ``--router-url URL`` (the
goodput router's Service URL, e.g. ``http://goodput-router.goodput-system.svc:8080``): every
InferenceService's ``status.url`` (and ``kubectl get gisvc``'s URL column) is that URL, where
clients pick the service by ``model``; without it, the service's own Service URL. Other options
pass to ``kopf run`` (e.g. ``--verbose``, ``--liveness http://0.0.0.0:8080/healthz``).

With exact namespace names (``--namespace a --namespace b``) the operator neither lists nor watches
Namespaces or CRDs (so it needs no cluster-wide permission; the CRD must exist when it starts) and
claims each namespace with a Lease (see ``goodput.api.claims``); with globs kopf needs
``namespaces: [list, watch]``.
"""

from __future__ import annotations

import os
import sys

from goodput.operator import resources


def kopf_args(argv: list[str]) -> list[str]:
    """The ``kopf`` command-line arguments for our own arguments ``argv``."""
    args = list(argv)
    if not any(a in ("-n", "--namespace", "-A", "--all-namespaces") or a.startswith("--namespace=")
               for a in args):
        args.append("--all-namespaces")
    if "--peering" not in args and not any(a.startswith("--peering=") for a in args):
        args.append("--standalone")
    return ["run", "-m", "goodput.operator.handlers", *args]


def split_router_url(argv: list[str]) -> tuple[str | None, list[str]]:
    """``(--router-url value or None, the other arguments)``; the last occurrence wins. Raises
    ValueError for a flag without a value or a value that is not an http(s) URL."""
    url, rest, it = None, [], iter(argv)
    for a in it:
        if a == "--router-url":
            url = next(it, None)
            if url is None:
                raise ValueError("--router-url needs a value")
        elif a.startswith("--router-url="):
            url = a.split("=", 1)[1]
        else:
            rest.append(a)
    return (None if url is None else resources.check_router_url(url)), rest


def exact_namespaces(argv: list[str]) -> tuple[str, ...] | None:
    """The namespaces named by ``-n/--namespace`` when every one is an exact name; None for all
    namespaces or when any is a kopf pattern (glob ``*?[``, negation ``!``, or a comma list)."""
    names, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("-A", "--all-namespaces"):
            return None
        if a in ("-n", "--namespace") and i + 1 < len(argv):
            names.append(argv[i + 1])
            i += 2
            continue
        if a.startswith("--namespace="):
            names.append(a.split("=", 1)[1])
        i += 1
    if not names or any(set(n) & set("*?[!,") for n in names):
        return None
    return tuple(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        router_url, args = split_router_url(args)
    except ValueError as e:
        print(f"goodput-operator: {e}", file=sys.stderr)
        return 2
    if router_url is not None:
        os.environ[resources.ROUTER_URL_ENV] = router_url  # read by the handlers (same process)
    from kopf.cli import main as kopf_main  # kopf is the operator extra

    from goodput.operator import handlers  # the module kopf loads by name: the same module object

    handlers.WATCHED_NAMESPACES = exact_namespaces(args)

    return kopf_main(args=kopf_args(args), standalone_mode=True) or 0


if __name__ == "__main__":
    raise SystemExit(main())
