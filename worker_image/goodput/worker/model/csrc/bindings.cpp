// Python bindings of goodput's CPU kernels (built by goodput/worker/model/cpu_kernels.py).
#include <torch/extension.h>

#include "decode_step.h"

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t splits);
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, int64_t ctx, torch::Tensor out, double scale);
bool paged_prefill_supported();
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
void rope_(torch::Tensor x, torch::Tensor cs, int64_t n_heads, int64_t d);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor block_linear(torch::Tensor x, int64_t kind, torch::Tensor codes, torch::Tensor d, torch::Tensor m);
bool block_linear_vectorized(std::string dtype);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch tensors only, never Python objects: each runs with the GIL released (the
  // arguments are converted before and the result after), so the server's event loop (streaming,
  // /health, metrics) keeps running during a long prefill-attention or linear call, as it does
  // during torch's own ops.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "paged decode attention over [num_blocks, block_size, KV, D] caches (float32/bfloat16)");
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil,
        "causal paged attention of one sequence's prefill chunk (bfloat16, brgemm tiles) into out");
  m.def("paged_prefill_supported", &paged_prefill_supported,
        "whether this CPU has ATen's packed bfloat16 brgemm (paged_prefill_attention's fast path)");
  m.def("write_kv", &write_kv, nogil, "scatter new K/V rows into the paged caches at slot_mapping (< 0 skipped)");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm(x) * w over rows, Hugging Face Llama numerics");
  m.def("add_rms_norm_", &add_rms_norm_, nogil, "x += delta in place, then RMSNorm(x) * w");
  m.def("rope_", &rope_, nogil, "rotate-half RoPE in place on the first n_heads * d columns");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up for gu = gate || up");
  m.def("argmax_rows", &argmax_rows, nogil, "each row's argmax, torch.max's rule (first index; NaN counts as the maximum)");
  m.def("block_linear", &block_linear, nogil, "x @ W.T with W as a GGUF file's 4-bit (kind 0) / 8-bit (kind 1) blocks of 32 (block_linear.cpp layout)");
  // module_local: each instruction-set level's build is its own module with its own DecodeStack; a
  // process that imports two of them (cpu_kernels --levels) must not register the type twice
  pybind11::class_<goodput::DecodeStack>(m, "DecodeStack", pybind11::module_local(),
                                          "a Llama layer stack for decode rows in one call (decode_step.cpp)")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double, double>())
      .def("step", &goodput::DecodeStack::step, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "one decode step of the whole stack (see decode_step.h)")
      .def_property_readonly("num_layers", &goodput::DecodeStack::num_layers);
  m.def("block_linear_vectorized", &block_linear_vectorized, "whether block_linear has its SIMD path for this dtype");
}
