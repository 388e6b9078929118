"""The contract between goodput's deployables: what the worker, the operator, the autoscaler and
the router agree on, declared once (standard library and pydantic only; no I/O, no side effects).

The four deployables never import each other: they meet here (an import-linter independence
contract checks it), and in the worker's torch-free engine configuration
(``goodput.worker.engine.config``), from which the CRD's ``spec.engine`` is derived. The
Kubernetes-client helpers they share live beside this package, in :mod:`goodput.kube`.
"""
