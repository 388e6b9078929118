"""Choose the attention backend: ``--attention-backend {auto,torch,triton}``.

``auto`` = Triton on CUDA devices (when triton imports), the torch reference elsewhere.
``triton`` on a CPU device needs Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported); it is meant for tests, not for serving.
"""
from __future__ import annotations

import importlib.util
import os

import torch
from goodput.worker.model.attention.base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def triton_available() -> bool:
    """True when the ``triton`` package is installed (``pip install goodput[triton]``)."""
    return importlib.util.find_spec("triton") is not None


def _torch_backend() -> AttentionBackend:
    from goodput.worker.model.attention.torch_ref import TorchReferenceBackend
    return TorchReferenceBackend()


def _triton_backend() -> AttentionBackend:
    from goodput.worker.model.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend()


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Return the attention backend for ``name`` on ``device``.

    name: "auto" | "torch" | "triton". device: a torch.device or its string ("cpu", "cuda:0").
    Raises ValueError for an unknown name, or when "triton" is asked for but cannot run: triton
    is not installed, or the device is not CUDA and ``TRITON_INTERPRET=1`` is not set.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "torch":
        return _torch_backend()
    if name == "auto":
        if device.type == "cuda" and triton_available():
            return _triton_backend()
        return _torch_backend()
    if not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package "
                         "(install the 'triton' extra: pip install 'goodput[triton]')")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' runs on CUDA devices; got device {device}. "
                         "Use --attention-backend torch (or auto) on CPU; tests may set "
                         "TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter")
    backend = _triton_backend()
    from goodput.worker.model.attention import triton_ops
    if device.type != "cuda" and not triton_ops.is_interpreted():
        raise ValueError("TRITON_INTERPRET=1 was set after triton's kernels were built in this "
                         "process; set it before importing goodput's model modules")
    return backend
