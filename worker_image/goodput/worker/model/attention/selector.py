"""Choose the attention backend: ``--attention-backend {auto,torch,cpu,triton}``.

``auto`` = Triton on CUDA devices (when triton imports); on CPU the ``cpu`` backend (C++ paged
decode kernel, built on first use) when it builds here, else the torch reference.
``torch`` = the pure-torch reference (SDPA over gathered blocks) on any device.
``triton`` on a CPU device needs Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported); it is meant for tests, not for serving.
"""
from __future__ import annotations

import importlib.util
import os

import torch
from goodput.worker.model.attention.base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")


def triton_available() -> bool:
    """True when the ``triton`` package is installed (``pip install goodput[triton]``)."""
    return importlib.util.find_spec("triton") is not None


def _torch_backend() -> AttentionBackend:
    from goodput.worker.model.attention.torch_ref import TorchReferenceBackend
    return TorchReferenceBackend()


def _cpu_backend() -> AttentionBackend:
    from goodput.worker.model.attention.cpu_backend import CpuPagedBackend
    return CpuPagedBackend()


def cpu_kernels_available() -> bool:
    from goodput.worker.model import cpu_kernels
    return cpu_kernels.available()


def _triton_backend() -> AttentionBackend:
    from goodput.worker.model.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend()


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Return the attention backend for ``name`` on ``device``.

    name: "auto" | "torch" | "cpu" | "triton". device: a torch.device or its string ("cpu", "cuda:0").
    Raises ValueError for an unknown name; when "cpu" is asked for on another device or its C++
    kernel cannot be built here; or when "triton" is asked for but cannot run: triton is not
    installed, or the device is not CUDA and ``TRITON_INTERPRET=1`` is not set.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "torch":
        return _torch_backend()
    if name == "auto":
        if device.type == "cuda" and triton_available():
            return _triton_backend()
        if device.type == "cpu" and cpu_kernels_available():
            return _cpu_backend()
        return _torch_backend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU; got device {device}")
        if not cpu_kernels_available():
            from goodput.worker.model import cpu_kernels
            raise ValueError("attention backend 'cpu' needs its C++ kernel, which could not be built here "
                             f"({cpu_kernels.load_error() or 'GOODPUT_CPU_KERNELS=0'}); use 'torch'")
        return _cpu_backend()
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
