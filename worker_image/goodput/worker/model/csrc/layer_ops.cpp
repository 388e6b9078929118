// Fused element-wise ops of a Llama decoder layer for CPUs: each replaces 2-9 small torch ops
// (and as many dispatches and temporaries) with one pass over the rows. Numerics follow Hugging
// Face's LlamaForCausalLM in the tensor dtype T (float32 or bfloat16): every intermediate that
// torch would round to T is rounded to T here too (round to nearest even), so results equal the
// torch ops bit for bit except where a reduction (RMSNorm's mean) or exp (SiLU) is summed or
// evaluated in another order (float32 ulps).
#include "kernel_api.h"
#include "kernel_inner.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// T(v): identity for float; float -> bfloat16 round to nearest even (c10's rule, NaN kept NaN).
template <typename T>
inline T from_f(float v);
template <>
inline float from_f<float>(float v) { return v; }
template <>
inline at::BFloat16 from_f<at::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : u + 0x7fffu + ((u >> 16) & 1u);
  at::BFloat16 b;
  b.x = static_cast<uint16_t>(r >> 16);
  return b;
}

// round a float to T and back (the value torch holds after an op in dtype T)
template <typename T>
inline float q(float v) { return to_f(from_f<T>(v)); }

// e^x, branch-free (vectorizable), Cephes' expf: x = n·ln2 + r with |r| <= ln2/2 (ln2 split in two
// so n·ln2 is exact), e^r by a degree-7 polynomial, times 2^n; relative error ~1e-7. Inputs above
// ~88.72 give +inf, below ~-87.3 the smallest normal (2^-126·...).
inline float exp_any(float x) {
  x = x < -87.33f ? -87.33f : (x > 88.8f ? 88.8f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^n for n in [-126, 128] as 2^min(n, 127) · (1 or 2): 2^128 itself is no float, yet
  // e^88.5 = p · 2^128 is (exact power-of-two products, so no other result changes)
  const float n1 = std::min(n, 127.f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n1) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return (p * s) * (n - n1 + 1.f);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 lanes of exp_any with the same operations in the same order (mul and add kept separate, as
// the scalar code is compiled without FMA contraction), so each lane equals exp_any bit for bit.
inline __m512 exp_any16(__m512 x) {
  // clamp as exp_any does; min/max return their second operand for a NaN, so NaN stays NaN
  x = _mm512_max_ps(_mm512_set1_ps(-87.33f), _mm512_min_ps(_mm512_set1_ps(88.8f), x));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.f));
  // n is integral, so round-to-nearest conversion equals the scalar truncating cast
  const __m512 n1 = _mm512_min_ps(n, _mm512_set1_ps(127.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n1), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(e)),
                       _mm512_add_ps(_mm512_sub_ps(n, n1), _mm512_set1_ps(1.f)));
}

// 16 lanes of from_f<bfloat16> as uint32 holding the bf16 bits in the high half (NaN -> 0x7fc0).
inline __m512i bf16_round_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

inline __m512 load16m(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16m(const at::BFloat16* p, __mmask16 k) {  // exact widening
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// q<T> on 16 lanes: the value T holds after rounding
inline __m512 round16(__m512 v, float*) { return v; }
inline __m512 round16(__m512 v, at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_round_bits(v), _mm512_set1_epi32(int(0xffff0000u))));
}
inline void store16m(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
inline void store16m(at::BFloat16* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16)));
}
#define GOODPUT_LAYER_OPS_AVX512 1
#endif

// y = w * T(x * rsqrt(mean(x^2) + eps)) with x in float32 (LlamaRMSNorm)
template <typename T>
inline void rms_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  // the sum of squares as the compiler vectorizes this loop: its order is the one the model's
  // end-to-end comparisons with the torch path were measured with (any order is a few ulps)
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) {
    const float v = to_f(x[d]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  int64_t d = 0;
#if defined(GOODPUT_LAYER_OPS_AVX512)
  const __m512 rv = _mm512_set1_ps(r);  // 16 lanes at a time (masked tail), the loop below's operations
  for (; d < D; d += 16) {
    const __mmask16 k = D - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1u);
    const __m512 n = round16(_mm512_mul_ps(load16m(x + d, k), rv), static_cast<T*>(nullptr));
    store16m(y + d, _mm512_mul_ps(load16m(w + d, k), n), k);
  }
#endif
  for (; d < D; ++d) y[d] = from_f<T>(to_f(w[d]) * q<T>(to_f(x[d]) * r));
}

// x[d] = T(x[d] + delta[d]) (torch's add_ in dtype T)
template <typename T>
inline void add_row(T* x, const T* delta, int64_t D) {
#if defined(GOODPUT_LAYER_OPS_AVX512)
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 k = D - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1u);
    store16m(x + d, _mm512_add_ps(load16m(x + d, k), load16m(delta + d, k)), k);
  }
#else
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) x[d] = from_f<T>(to_f(x[d]) + to_f(delta[d]));
#endif
}

// One head of rotate-half RoPE in place: v[i] <- T(T(v[i]·c[i]) + T(rot(v)[i]·s[i])), i < d,
// rot(v) = (v[half..d), v[0..half)); tmp holds d floats.
template <typename T>
inline void rope_head(T* v, const T* c, const T* s, int64_t d, float* tmp) {
  const int64_t half = d / 2;
  int64_t i = 0;
#if defined(GOODPUT_LAYER_OPS_AVX512)
  if (half % 16 == 0) {
    for (; i < half; i += 16) {  // lanes i.. of each half; both halves read before either is written
      const __m512 lo = load16m(v + i, 0xFFFF), hi = load16m(v + half + i, 0xFFFF);
      const __m512 a = _mm512_add_ps(round16(_mm512_mul_ps(lo, load16m(c + i, 0xFFFF)), static_cast<T*>(nullptr)),
                                     round16(_mm512_mul_ps(hi, load16m(s + i, 0xFFFF)), static_cast<T*>(nullptr)));
      const __m512 b = _mm512_add_ps(
          round16(_mm512_mul_ps(hi, load16m(c + half + i, 0xFFFF)), static_cast<T*>(nullptr)),
          round16(_mm512_mul_ps(lo, load16m(s + half + i, 0xFFFF)), static_cast<T*>(nullptr)));
      store16m(v + i, a, 0xFFFF);
      store16m(v + half + i, b, 0xFFFF);
    }
    return;
  }
#endif
  for (; i < d; ++i) {
    const float rot = to_f(v[i < half ? i + half : i - half]);
    tmp[i] = q<T>(q<T>(to_f(v[i]) * to_f(c[i])) + q<T>(rot * to_f(s[i])));
  }
  for (i = 0; i < d; ++i) v[i] = from_f<T>(tmp[i]);
}

template <typename F>
void over_rows(int64_t rows, F&& f) {
  // a row is ~1 µs of work: threads only pay off for a few rows each
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f(r);
  });
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name,
              " must be a 2-D CPU tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
}

}  // namespace

// x [T, D], w [D] -> RMSNorm(x) · w, [T, D] (contiguous)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type() && w.numel() == x.size(1),
              "w must be contiguous [D] in x's dtype");
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t D = x.size(1), xs = x.stride(0);
  auto body = [&](const auto* xp, const auto* wp, auto* yp) {
    over_rows(x.size(0), [&](int64_t r) { rms_row(xp + r * xs, wp, yp + r * D, D, static_cast<float>(eps)); });
  };
  if (x.scalar_type() == torch::kFloat32) {
    body(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>());
  } else {
    body(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  }
  return y;
}

// x += delta (in place, rounded to the dtype as torch's add_), then return RMSNorm(x) · w.
// x, delta [T, D]; w [D].
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "delta must match x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type() && w.numel() == x.size(1),
              "w must be contiguous [D] in x's dtype");
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t D = x.size(1), xs = x.stride(0), ds = delta.stride(0);
  auto body = [&](auto* xp, const auto* dp, const auto* wp, auto* yp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    over_rows(x.size(0), [&](int64_t r) {
      T* xr = xp + r * xs;
      const T* dr = dp + r * ds;
      add_row(xr, dr, D);
      rms_row(xr, wp, yp + r * D, D, static_cast<float>(eps));
    });
  };
  if (x.scalar_type() == torch::kFloat32) {
    body(x.data_ptr<float>(), delta.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>());
  } else {
    body(x.data_ptr<at::BFloat16>(), delta.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
         y.data_ptr<at::BFloat16>());
  }
  return y;
}

// Rotate-half RoPE in place on the first n_heads·d columns of each row of x [T, >= n_heads·d]
// (the fused QKV output: query then key heads): per head, with cs [T, 2, d] = (cos‖cos,
// -sin‖sin) in x's dtype, x <- T(T(x·cos) + T(rot(x)·sin)), rot(x) = (x2, x1) — the roundings of
// `qk = qk * cos; qk += rot * sin` in the model's torch path.
void rope_(torch::Tensor x, torch::Tensor cs, int64_t n_heads, int64_t d) {
  check_rows(x, "x");
  TORCH_CHECK(cs.is_contiguous() && cs.dim() == 3 && cs.size(0) == x.size(0) && cs.size(1) == 2 &&
                  cs.size(2) == d && cs.scalar_type() == x.scalar_type(),
              "cs must be contiguous [T, 2, d] in x's dtype");
  TORCH_CHECK(d % 2 == 0 && n_heads * d <= x.size(1), "need even d and n_heads * d <= x.size(1)");
  const int64_t xs = x.stride(0);
  auto body = [&](auto* xp, const auto* cp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    over_rows(x.size(0), [&](int64_t t) {
      const T* c = cp + t * 2 * d;
      const T* s = c + d;
      std::vector<float> tmp(static_cast<size_t>(d));
      for (int64_t h = 0; h < n_heads; ++h) rope_head(xp + t * xs + h * d, c, s, d, tmp.data());
    });
  };
  if (x.scalar_type() == torch::kFloat32) {
    body(x.data_ptr<float>(), cs.data_ptr<float>());
  } else {
    body(x.data_ptr<at::BFloat16>(), cs.data_ptr<at::BFloat16>());
  }
}

namespace {


// one row of silu_mul: o[i] = T(T(silu(g[i])) · u[i]), i < n
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#if defined(GOODPUT_LAYER_OPS_AVX512)
  // 16 lanes at a time (a masked tail): the same operations as the scalar loop below, lane by lane
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512 x = load16m(g + i, k);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u))));
    const __m512 e = exp_any16(neg);
    const __m512 s = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), static_cast<T*>(nullptr));
    store16m(o + i, _mm512_mul_ps(s, load16m(u + i, k)), k);
  }
#endif
  for (; i < n; ++i) {
    const float x = to_f(g[i]);
    o[i] = from_f<T>(q<T>(x / (1.f + exp_any(-x))) * to_f(u[i]));
  }
}

}  // namespace

// gu [T, 2I] (gate ‖ up) -> T(T(silu(gate)) · up), [T, I]; silu(g) = g / (1 + e^-g) in float32
torch::Tensor silu_mul(torch::Tensor gu) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu must have an even number of columns (gate ‖ up)");
  const int64_t I = gu.size(1) / 2, gs = gu.stride(0);
  auto out = torch::empty({gu.size(0), I}, gu.options());
  auto body = [&](const auto* gp, auto* op) {
    over_rows(gu.size(0), [&](int64_t r) { silu_mul_row(gp + r * gs, gp + r * gs + I, op + r * I, I); });
  };
  if (gu.scalar_type() == torch::kFloat32) {
    body(gu.data_ptr<float>(), out.data_ptr<float>());
  } else {
    body(gu.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}

namespace {

// The first index of a row's maximum, torch.max's rule: NaN counts as the maximum (the first NaN
// wins), among equal maxima the first index.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(GOODPUT_LAYER_OPS_AVX512)
  // per lane the best value and its first index (a strictly greater value replaces it), then the
  // smallest index among the lanes that hold the overall maximum
  __m512 bv = _mm512_set1_ps(best);
  __m512i bi = _mm512_setzero_si512(), idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; i < n; i += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512 v = load16m(x + i, k);
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
    if (nan) return i + __builtin_ctz(nan);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(k, v, bv, _CMP_GT_OQ);
    bv = _mm512_mask_mov_ps(bv, gt, v);
    bi = _mm512_mask_mov_epi32(bi, gt, idx);
  }
  best = _mm512_reduce_max_ps(bv);
  const __mmask16 at = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at, bi);
#else
  int64_t best_i = 0;
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    if (v != v) return i;
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  return best_i;
#endif
}

}  // namespace

// x [T, V] float32 or bfloat16 (rows contiguous) -> int64 [T]: each row's argmax as torch.max
// returns it (first index among equal maxima; a NaN, the first one, counts as the maximum).
// Greedy sampling without a float32 copy of the logits.
torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "x must have 1 to 2^31 - 1 columns");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t V = x.size(1), xs = x.stride(0);
  auto body = [&](const auto* xp) { over_rows(x.size(0), [&](int64_t r) { op[r] = argmax_row(xp + r * xs, V); }); };
  if (x.scalar_type() == torch::kFloat32) {
    body(x.data_ptr<float>());
  } else {
    body(x.data_ptr<at::BFloat16>());
  }
  return out;
}

namespace goodput {

template <typename T>
void rms_norm_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  rms_row(x, w, y, D, eps);
}
template <typename T>
void add_row_(T* x, const T* delta, int64_t D) {
  add_row(x, delta, D);
}
template <typename T>
void rope_row_(T* x, const T* cs, int64_t n_heads, int64_t d, float* tmp) {
  for (int64_t h = 0; h < n_heads; ++h) rope_head(x + h * d, cs, cs + d, d, tmp);
}
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  ::silu_mul_row(g, u, o, n);
}

#define GOODPUT_LAYER_ROW_OPS(T)                                                      \
  template void rms_norm_row<T>(const T*, const T*, T*, int64_t, float);            \
  template void add_row_<T>(T*, const T*, int64_t);                                  \
  template void rope_row_<T>(T*, const T*, int64_t, int64_t, float*);                \
  template void silu_mul_row<T>(const T*, const T*, T*, int64_t);
GOODPUT_LAYER_ROW_OPS(float)
GOODPUT_LAYER_ROW_OPS(at::BFloat16)
#undef GOODPUT_LAYER_ROW_OPS

}  // namespace goodput
