"""Torch (and Triton) side of the worker: GGUF loader, Llama model, attention, sampler, runner."""
