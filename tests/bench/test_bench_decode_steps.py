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


def test_breakdown_times_each_kernel_in_its_category_and_restores_them():
    """decode_steps' breakdown swaps the linears, the kernel modules and a native step's stack for
    timing stand-ins that add each call's seconds to its category, and puts the originals back."""
    import time
    import types

    from goodput.bench.decode_steps import _time_kernels

    def slow(value, seconds=0.002):
        def f(*_):
            time.sleep(seconds)
            return value
        return f
    kernels = types.SimpleNamespace(rms_norm=slow("n"), argmax_rows=slow("a"), DecodeStack=object)
    attn = types.SimpleNamespace(paged_decode_attention=slow("p"), write_kv=slow("w"))
    layer = types.SimpleNamespace(qkv=slow("q"), o=slow("o"), gate_up=slow("g"), down=slow("d"))
    stack = types.SimpleNamespace(step=slow("s"), num_layers=30)
    model = types.SimpleNamespace(layers=[layer], lm_head=slow("h"), fused_ops=kernels, _native=(stack, "kv"))
    runner = types.SimpleNamespace(model=model, attention_backend=types.SimpleNamespace(_mod=attn))
    acc: dict = {}
    swapped = _time_kernels(runner, acc)
    assert model.layers[0].qkv() == "q" and model.lm_head() == "h"
    assert model.fused_ops.rms_norm() == "n" and model.fused_ops.argmax_rows() == "a"
    assert model.fused_ops.DecodeStack is object                 # passed through, untimed
    assert runner.attention_backend._mod.paged_decode_attention() == "p"
    assert runner.attention_backend._mod.write_kv() == "w"
    assert model._native[0].step() == "s" and model._native[0].num_layers == 30
    assert set(acc) == {"linears", "layer_ops", "attention", "native"}  # argmax_rows (sampling) is "other"
    assert acc["linears"] >= 0.004 and acc["layer_ops"] >= 0.004 and acc["attention"] >= 0.002
    for obj, attr, cur in reversed(swapped):
        setattr(obj, attr, cur)
    assert model.fused_ops is kernels and model._native[0] is stack and layer.qkv() == "q"
