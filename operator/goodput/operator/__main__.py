"""``python -m goodput.operator [--namespace NS ...] [--all-namespaces] [kopf run options]``.

Wraps ``kopf run -m goodput.operator.handlers --standalone`` (``-m``, never a file path: a file path
would put this folder on sys.path and shadow the standard ``operator`` module). With neither
``--namespace`` nor ``--all-namespaces`` it watches all namespaces. Other options pass to ``kopf run``
(e.g. ``--verbose``, ``--liveness http://0.0.0.0:8080/healthz``).
"""

from __future__ import annotations

import sys


def kopf_args(argv: list[str]) -> list[str]:
    """The ``kopf`` command-line arguments for our own arguments ``argv``."""
    args = list(argv)
    if not any(a in ("-n", "--namespace", "-A", "--all-namespaces") or a.startswith("--namespace=")
               for a in args):
        args.append("--all-namespaces")
    if "--peering" not in args and not any(a.startswith("--peering=") for a in args):
        args.append("--standalone")
    return ["run", "-m", "goodput.operator.handlers", *args]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from kopf.cli import main as kopf_main  # kopf is the operator extra

    return kopf_main(args=kopf_args(args), standalone_mode=True) or 0


if __name__ == "__main__":
    raise SystemExit(main())
