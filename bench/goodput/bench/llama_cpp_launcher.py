"""Start llama-cpp-python's OpenAI server with llama.cpp's extra CPU buffer types turned off.

Run with the llama venv's python (it imports nothing from goodput):
    ~/.cache/goodput-bench/llama-venv/bin/python bench/goodput/bench/llama_cpp_launcher.py --model X.gguf ...

Why: on this machine's CPU (AMX-capable, inside a VM) a -march=native build routes Q4_1 matmuls
to ggml's AMX extra buffer type, and the first decode segfaults in ggml_backend_amx_mul_mat.
`use_extra_bufts = False` (a llama_model_params field) keeps the weights in the plain CPU buffer,
where the AVX-512 Q4_1 dot-product kernels run; Q4_1 has no other repacked layout, so nothing
else is lost. Set GOODPUT_LLAMA_EXTRA_BUFTS=1 to keep llama.cpp's default.
"""
import os
import runpy
import sys

import llama_cpp.llama_cpp as lc

if os.environ.get("GOODPUT_LLAMA_EXTRA_BUFTS") != "1":
    _default = lc.llama_model_default_params

    def _params():
        p = _default()
        p.use_extra_bufts = False
        return p

    lc.llama_model_default_params = _params

sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
