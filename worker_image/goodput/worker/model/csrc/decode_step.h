// The native decode step (decode_step.cpp): a Llama layer stack for decode rows (one new token per
// row) in one call and one parallel region. Declared here for bindings.cpp.
#pragma once

// Only ATen's Tensor here: bindings.cpp includes this beside <torch/extension.h>, whose torch::
// names kernel_api.h would redeclare; the state lives in decode_step.cpp (DecodeStack::State).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace goodput {

class DecodeStack {
 public:
  // norms: 2·L + 1 tensors [D] in the model's dtype (attn_norm, ffn_norm per layer, then the final
  // norm); per linear, layer-major in the order qkv, o, gate_up, down (4·L): codes, d, m (m empty
  // for 8-bit) and kind as block_linear takes them; k_caches, v_caches: L tensors
  // [num_blocks, block_size, n_kv, head_dim] in the model's dtype. Shapes are checked here; the
  // tensors are kept alive by this object.
  DecodeStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> codes, std::vector<at::Tensor> d,
              std::vector<at::Tensor> m, std::vector<int64_t> kinds, std::vector<at::Tensor> k_caches,
              std::vector<at::Tensor> v_caches, int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps,
              double scale);

  // One decode step of B rows (see decode_step.cpp): x [B, D] the embedded tokens (the residual
  // stream, updated in place), cs [B, 2, head_dim] RoPE rows, slots int64 [B] (< 0: not written),
  // tables int32 [B, nbt] and lens int32 [B] (block ids checked by the caller), splits >= 1;
  // one_row_per_seq: no two rows are positions of one sequence (no drafted rows: a row then reads
  // no other row's new K/V, and RoPE and the KV write can run inside its attention units); writes
  // h_out [B, D] = RMSNorm(final x)·final norm. phase_ns: empty, or float64 [3] to which the
  // calling thread adds its nanoseconds in linears, attention and layer ops (barrier waits included).
  void step(at::Tensor x, at::Tensor cs, at::Tensor slots, at::Tensor tables, at::Tensor lens,
            int64_t splits, bool one_row_per_seq, at::Tensor h_out, at::Tensor phase_ns);

  ~DecodeStack();
  DecodeStack(const DecodeStack&) = delete;
  DecodeStack& operator=(const DecodeStack&) = delete;

  int64_t num_layers() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace goodput
