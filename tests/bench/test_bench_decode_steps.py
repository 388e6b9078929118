"""decode_steps.py's profiling helper (pure: a fake runner, no model)."""
from __future__ import annotations


def test_profile_lists_the_cpp_kernels_by_name_and_restores_them():
    """decode_steps swaps the C++ kernel module for a traced stand-in while profiling, so the
    kernels show up as goodput::<name> instead of as time outside torch ops."""
    import types

    import torch
    from goodput.bench.decode_steps import _trace_kernels
    from torch.profiler import ProfilerActivity, profile
    kernels = types.SimpleNamespace(rms_norm=lambda x: x * 2)
    runner = types.SimpleNamespace(model=types.SimpleNamespace(fused_ops=kernels),
                                   attention_backend=types.SimpleNamespace(_mod=None))
    swapped = _trace_kernels(runner)
    assert len(swapped) == 1  # a backend without kernels is left alone
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert torch.equal(runner.model.fused_ops.rms_norm(torch.ones(3)), torch.full((3,), 2.0))
    assert "goodput::rms_norm" in {e.key for e in prof.key_averages()}
    for obj, attr, mod in swapped:
        setattr(obj, attr, mod)
    assert runner.model.fused_ops is kernels
