// The kernels' inner loops as plain functions over raw pointers, shared by the per-operator entry
// points (block_linear.cpp, paged_attention.cpp, layer_ops.cpp: each calls these under its own
// at::parallel_for) and by the native decode step (decode_step.cpp: one parallel region for the
// whole layer stack). Defined in those files and instantiated there for float and at::BFloat16;
// no threading inside any of them.
#pragma once

#include "kernel_api.h"

#include <cstdint>

namespace goodput {

// One linear in block_linear.cpp's layout: kind 0 (Q4 codes in step order, d and m float16
// [N, nb]) or 1 (Q8: int8 codes [N, K], d float16 [N, nb], m null); cstride code bytes per row.
struct BlockRows {
  int64_t kind, N, K, nb, cstride;
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;
};

// What block_rows reads besides x for M rows of x [M, K] (row stride xs): sx float32 [M, nb], the
// per-block sums of x (Q4 only), and xp [M, K], x in the codes' step order (Q4 with the AVX-512
// path only). Either may be left untouched when unused.
template <typename T>
void block_prepare(const T* x, int64_t xs, int64_t M, const BlockRows& w, T* xp, float* sx);

// Rows [n0, n1) of y [M, N] = x · Wᵀ (float32 sums rounded once to T), after block_prepare.
template <typename T>
void block_rows(const T* x, int64_t xs, const T* xp, int64_t M, const float* sx, const BlockRows& w, int64_t n0,
                int64_t n1, T* y);

// Paged decode attention (paged_attention.cpp) of B query rows q [B, H, D] (strides qs0, qs1; head
// vectors contiguous) over caches [num_blocks, bs, KV, D]; block tables int32 [B, nbt], lengths
// int32 [B]; each (sequence, KV head) cut into `splits` parts. Partials per unit u = (b·KV + kh)·
// splits + sp: pacc [g, D], pm [g], pl [g] (float32, caller-owned, B·KV·splits units).
template <typename T>
struct AttnArgs {
  const T* q;
  int64_t qs0, qs1;
  const T* kc;
  const T* vc;
  const int32_t* bt;
  int64_t nbt;
  const int32_t* sl;
  int64_t B, H, D, bs, KV, g, splits;
  float scale;
  float* pacc;
  float* pm;
  float* pl;
};

// One unit's partials; qf: g·D floats of scratch.
template <typename T>
void attention_unit(const AttnArgs<T>& a, int64_t u, float* qf);

// Output row r = b·H + h of out [B·H, D] from its units' partials; o: D floats of scratch.
template <typename T>
void attention_combine(const AttnArgs<T>& a, int64_t r, float* o, T* out);

// Layer ops (layer_ops.cpp) on one row, the roundings of the torch path in dtype T:
// y = RMSNorm(x)·w over D; x += delta over D; rotate-half RoPE in place on the first n_heads·d
// columns of x with c = cs row [2, d] (tmp: d floats); o = silu(g)·u over n.
template <typename T>
void rms_norm_row(const T* x, const T* w, T* y, int64_t D, float eps);
template <typename T>
void add_row_(T* x, const T* delta, int64_t D);
template <typename T>
void rope_row_(T* x, const T* cs, int64_t n_heads, int64_t d, float* tmp);
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n);

}  // namespace goodput
