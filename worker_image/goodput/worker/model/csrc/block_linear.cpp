// y = x · Wᵀ with W kept in a GGUF file's own 4-bit / 8-bit blocks of 32 weights, for the decode
// steps of a few rows: a memory-bound step then reads 0.625 (Q4_1) or 1.06 (Q8_0) bytes per weight
// instead of bfloat16's 2.
//
// Weights (llama.cpp ggml-quants.c, dequantize_row_q4_1 / _q8_0; block b of a row holds weights
// 32b .. 32b+31): Q4_1 w = d_b·q + m_b (q in 0..15), Q8_0 w = d_b·q (q in -128..127), d_b and m_b
// float16. These are the exact weights a float32 model dequantized from the file holds.
// The sum is taken by linearity, Σ_k x_k w_k = Σ_b d_b·(Σ_j x_j q_j) + m_b·(Σ_j x_j). For bfloat16
// activations the inner sums are AVX-512 BF16 dot products against the codes made bfloat16 by bit
// operations alone: the word 0x4300 | q is bfloat16(128 + q) exactly (exponent 2⁷, the 7 mantissa
// bits hold q), so Σ_j x_j q_j = Σ_j x_j (128 + q_j) − 128·Σ_j x_j and a block contributes
// d_b·dot(x, 128 + q) + (m_b − 128·d_b)·Σx (Q4_0 files: m = −8·d). The products are exact; the
// offset makes the float32 sums larger than the result by ~(128 + 8)/8 ≈ 17 (about 4 of float32's 24
// bits; bfloat16 outputs keep 8). Float32 activations multiply by the exact float32 weights,
// w = d·q + m. Either way only float32 summation order and rounding differ from a float64 sum of
// x·w over the exact weights (error bound in the tests).
//
// Q4 rows are stored "lanes = blocks": a row's blocks form groups — 16 blocks, then the rest
// (nb mod 16) as groups of 8, 4, 2, 1 blocks — and a group of T blocks is T steps of 32 codes,
// one bfloat16 vector each, whose 16 lanes (2 codes each) belong to the group's blocks, 16/T lanes
// per block. A lane's dot-product sum then stays within one block for the whole group, so the
// block scale d_b multiplies once per group (a vector of the group's d) instead of once per block,
// and no broadcast or per-block reduction sits in the inner loop. The activations are permuted the
// same way once per call (a K-element gather shared by every row).
//
// Layout (built by goodput.worker.model.block_linear from the file's blocks):
//   Q4 (kind 0): codes uint8 [N, ceil(nb/2)·32]; global step t (t = g0 + s for step s of the group
//                starting at block g0) is word i = 2l + e (lane l, e in 0..1) of a 32-code vector
//                holding weight 2p + e of block g0 + l/L, p = (l mod L)·T + s, L = 16/T. Groups of
//                T >= 4 store steps in fours, 64 bytes from byte 16·t₀ (t₀ = the first of the four):
//                16-bit word i holds step t₀ + k's code i in bits 4k..4k+3 (a shift and a mask
//                each). Groups of T <= 2 store steps in twos, 32 bytes: byte i = code(t₀, i) |
//                code(t₀ + 1, i) << 4 (a missing last odd step has codes 0). d, m float16 [N, nb].
//   Q8 (kind 1): codes int8 [N, K] in weight order; d float16 [N, nb]; no m.
#include "kernel_api.h"
#include "kernel_inner.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQ41 = 0, kQ80 = 1;

inline float f16_to_f32(const uint8_t* p) {  // IEEE half -> float (exact)
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// a pair of bfloat16 / float32 elements, read through other types' pointers
typedef uint32_t __attribute__((may_alias)) pair16;
typedef uint64_t __attribute__((may_alias)) pair32;

using Rows = goodput::BlockRows;  // one linear in this file's layout (kernel_inner.h)

// The groups of a row of nb blocks, in order: f(g0, T) for T = 16 while 16 blocks remain, then
// T = 8, 4, 2, 1 for the bits of nb mod 16.
template <typename F>
inline void for_groups(int64_t nb, F&& f) {
  int64_t g0 = 0;
  for (; g0 + 16 <= nb; g0 += 16) f(g0, int64_t{16});
  for (int64_t t = 8; t >= 1; t >>= 1)
    if ((nb - g0) & t) {
      f(g0, t);
      g0 += t;
    }
}

// Pair index (within the row: block·16 + pair in block) of lane l at step s of group (g0, T).
inline int64_t pair_of(int64_t g0, int64_t T, int64_t s, int64_t l) {
  const int64_t L = 16 / T;
  return (g0 + l / L) * 16 + (l % L) * T + s;
}

// x's pairs in the codes' step order: out[(g0 + s)·16 + l] = x[pair_of(g0, T, s, l)] (P: one pair
// of elements, uint32 for bfloat16, uint64 for float32).
template <typename P>
void permute_pairs(const P* x, int64_t nb, P* out) {  // P must be declared may_alias
  for_groups(nb, [&](int64_t g0, int64_t T) {
    for (int64_t s = 0; s < T; ++s)
      for (int64_t l = 0; l < 16; ++l) out[(g0 + s) * 16 + l] = x[pair_of(g0, T, s, l)];
  });
}

// Where code i of step t (group (g0, T)) lives: its byte offset in the row and its nibble's shift.
inline void code_at(int64_t g0, int64_t T, int64_t t, int64_t i, int64_t& byte, int& shift) {
  if (T >= 4) {  // fours: word i of 64 bytes, bits 4k..4k+3
    const int64_t k = (t - g0) % 4;
    byte = (t - k) * 16 + 2 * i + k / 2;
    shift = 4 * static_cast<int>(k % 2);
  } else {  // twos: byte i of 32, low / high nibble
    const int64_t k = (t - g0) % 2;
    byte = (t - k) * 16 + i;
    shift = 4 * static_cast<int>(k);
  }
}

inline int q_code(const Rows& w, int64_t n, int64_t k) {  // code of weight (n, k)
  if (w.kind == kQ80) return static_cast<int8_t>(w.codes[n * w.cstride + k]);
  const int64_t b = k / 32, p = (k % 32) / 2, e = k % 2;
  int64_t byte = 0;
  int shift = 0;
  for_groups(w.nb, [&](int64_t g0, int64_t T) {
    if (b >= g0 && b < g0 + T) {
      const int64_t L = 16 / T;
      code_at(g0, T, g0 + p % T, 2 * ((b - g0) * L + p / T) + e, byte, shift);
    }
  });
  return (w.codes[n * w.cstride + byte] >> shift) & 15;
}

// portable rows [n0, n1) of y (any CPU): the same sums, one weight at a time
template <typename T>
void rows_generic(const T* x, int64_t xs, int64_t M, const Rows& w, int64_t n0, int64_t n1, T* y) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t mi = 0; mi < M; ++mi) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.nb; ++b) {
        float sq = 0.f, sx = 0.f;
        for (int64_t i = 0; i < 32; ++i) {
          const float xv = static_cast<float>(x[mi * xs + b * 32 + i]);
          sq += xv * static_cast<float>(q_code(w, n, b * 32 + i));
          sx += xv;
        }
        acc += f16_to_f32(reinterpret_cast<const uint8_t*>(w.d + n * w.nb + b)) * sq;
        if (w.m) acc += f16_to_f32(reinterpret_cast<const uint8_t*>(w.m + n * w.nb + b)) * sx;
      }
      y[mi * w.N + n] = static_cast<T>(acc);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define GOODPUT_BLOCK_LINEAR_AVX512 1

inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// float16 [n] -> float32 lanes 0..n-1 (the rest 0)
inline __m512 halves(const uint16_t* h, int64_t n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), h)); }

inline __m512i iota() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

// log2(16 / T): lane l of a group of T blocks belongs to its block l >> lane_shift(T)
constexpr int lane_shift(int64_t T) { return T == 16 ? 0 : T == 8 ? 1 : T == 4 ? 2 : T == 2 ? 3 : 4; }

// float32 activations, Q4: codes -> float32, w = d·q + m exact (d·q is exact, one rounding in the
// FMA, as the float32 dequantization), one FMA per weight; x permuted to the codes' step order
template <int MT>
inline void row_q4_f32(const float* xp, int64_t K, const Rows& w, int64_t n, float* out) {
  const uint8_t* c = w.codes + n * w.cstride;
  const uint16_t* dh = w.d + n * w.nb;
  const uint16_t* mh = w.m + n * w.nb;
  __m512 acc[MT];
  for (int mi = 0; mi < MT; ++mi) acc[mi] = _mm512_setzero_ps();
  for_groups(w.nb, [&](int64_t g0, int64_t T) {
    const __m512 dg = halves(dh + g0, T), mg = halves(mh + g0, T);
    const __m512i sh = _mm512_set1_epi32(lane_shift(T));
    __m512 de[2], me[2];  // per element of each 16-word half: its block's d and m
    for (int h = 0; h < 2; ++h) {
      const __m512i blk = _mm512_srlv_epi32(_mm512_srli_epi32(_mm512_add_epi32(iota(), _mm512_set1_epi32(16 * h)), 1), sh);
      de[h] = _mm512_permutexvar_ps(blk, dg);
      me[h] = _mm512_permutexvar_ps(blk, mg);
    }
    for (int64_t t = g0; t < g0 + T; ++t) {
      for (int h = 0; h < 2; ++h) {  // codes 16h .. 16h + 15 of step t
        __m512i q;
        if (T >= 4) {
          const int64_t k = (t - g0) % 4;
          q = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (t - k) * 16 + 32 * h)));
          q = _mm512_srlv_epi32(q, _mm512_set1_epi32(static_cast<int>(4 * k)));
        } else {
          const int64_t k = (t - g0) % 2;
          q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (t - k) * 16 + 16 * h)));
          q = _mm512_srlv_epi32(q, _mm512_set1_epi32(static_cast<int>(4 * k)));
        }
        q = _mm512_and_si512(q, _mm512_set1_epi32(15));
        const __m512 wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), de[h], me[h]);
        for (int mi = 0; mi < MT; ++mi) acc[mi] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + mi * K + t * 32 + 16 * h), wv, acc[mi]);
      }
    }
  });
  for (int mi = 0; mi < MT; ++mi) out[mi] = _mm512_reduce_add_ps(acc[mi]);
}

// float32 activations, Q8: w = d·q exact, one FMA per weight
template <int MT>
inline void row_q8_f32(const float* x, int64_t xs, const Rows& w, int64_t n, float* out) {
  const uint8_t* c = w.codes + n * w.cstride;
  __m512 acc[MT];
  for (int mi = 0; mi < MT; ++mi) acc[mi] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(w.d[n * w.nb + b]));
    for (int h = 0; h < 2; ++h) {
      const __m512 wv = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 32 + 16 * h)))), d);
      for (int mi = 0; mi < MT; ++mi) acc[mi] = _mm512_fmadd_ps(_mm512_loadu_ps(x + mi * xs + b * 32 + 16 * h), wv, acc[mi]);
    }
  }
  for (int mi = 0; mi < MT; ++mi) out[mi] = _mm512_reduce_add_ps(acc[mi]);
}

#if defined(__AVX512BF16__)
#define GOODPUT_BLOCK_LINEAR_BF16 1

// One group of T blocks of a Q4 row, bfloat16 activations (x permuted to step order): per lane,
// acc = Σ over the group's steps of the lane's two products x·(128 + q) (vdpbf16ps: exact products,
// float32 sums; four accumulators so consecutive steps do not wait on each other), then
// tot += d_lane · acc + (m_b − 128·d_b) · Σx_b.
template <int MT, int T>
inline __attribute__((always_inline)) void group_q4_bf16(const at::BFloat16* xp, int64_t K, const float* sx, int64_t nb,
                                                         const uint8_t* c, const uint16_t* dh, const uint16_t* mh,
                                                         int64_t g0, __m512 (&tot)[MT]) {
  const __m512i nib = _mm512_set1_epi16(0x000F), b128 = _mm512_set1_epi16(0x4300);  // bfloat16(128)
  __m512 acc[MT][4];
  for (int mi = 0; mi < MT; ++mi)
    for (int j = 0; j < 4; ++j) acc[mi][j] = _mm512_setzero_ps();
  auto step = [&](int s, __m512i code_words) {  // code_words: 0x4300 | q, one step's 32 codes
    for (int mi = 0; mi < MT; ++mi)
      acc[mi][s & 3] = _mm512_dpbf16_ps(acc[mi][s & 3], (__m512bh)_mm512_loadu_si512(xp + mi * K + (g0 + s) * 32),
                                        (__m512bh)code_words);
  };
  if constexpr (T >= 4) {
#pragma GCC unroll 4
    for (int s = 0; s < T; s += 4) {
      const __m512i w = _mm512_loadu_si512(c + (g0 + s) * 16);
      step(s, _mm512_ternarylogic_epi32(w, nib, b128, 0xEA));  // (w & nib) | b128
      step(s + 1, _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), nib, b128, 0xEA));
      step(s + 2, _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), nib, b128, 0xEA));
      step(s + 3, _mm512_or_si512(_mm512_srli_epi16(w, 12), b128));
    }
  } else {
    const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + g0 * 16)));
    step(0, _mm512_ternarylogic_epi32(raw, nib, b128, 0xEA));
    if constexpr (T == 2) step(1, _mm512_or_si512(_mm512_srli_epi16(raw, 4), b128));
  }
  const __m512 dg = halves(dh + g0, T);  // lanes 0..T-1: the group's blocks
  const __m512 mg = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), dg, halves(mh + g0, T));  // m − 128·d
  __m512 dl = dg;
  if constexpr (T < 16) dl = _mm512_permutexvar_ps(_mm512_srli_epi32(iota(), lane_shift(T)), dg);
  for (int mi = 0; mi < MT; ++mi) {
    const __m512 a = _mm512_add_ps(_mm512_add_ps(acc[mi][0], acc[mi][1]), _mm512_add_ps(acc[mi][2], acc[mi][3]));
    tot[mi] = _mm512_fmadd_ps(dl, a, tot[mi]);
    tot[mi] = _mm512_fmadd_ps(mg, _mm512_maskz_loadu_ps(first(T), sx + mi * nb + g0), tot[mi]);
  }
}

template <int MT>
inline void row_q4_bf16(const at::BFloat16* xp, int64_t K, const float* sx, const Rows& w, int64_t n, float* out) {
  const uint8_t* c = w.codes + n * w.cstride;
  const uint16_t* dh = w.d + n * w.nb;
  const uint16_t* mh = w.m + n * w.nb;
  __m512 tot[MT];
  for (int mi = 0; mi < MT; ++mi) tot[mi] = _mm512_setzero_ps();
  for_groups(w.nb, [&](int64_t g0, int64_t T) {
    switch (T) {
      case 16: group_q4_bf16<MT, 16>(xp, K, sx, w.nb, c, dh, mh, g0, tot); break;
      case 8: group_q4_bf16<MT, 8>(xp, K, sx, w.nb, c, dh, mh, g0, tot); break;
      case 4: group_q4_bf16<MT, 4>(xp, K, sx, w.nb, c, dh, mh, g0, tot); break;
      case 2: group_q4_bf16<MT, 2>(xp, K, sx, w.nb, c, dh, mh, g0, tot); break;
      default: group_q4_bf16<MT, 1>(xp, K, sx, w.nb, c, dh, mh, g0, tot); break;
    }
  });
  for (int mi = 0; mi < MT; ++mi) out[mi] = _mm512_reduce_add_ps(tot[mi]);
}

// bfloat16 activations, Q8: int8 codes -> bfloat16 exactly (|q| <= 128 has <= 8 significant bits);
// even/odd blocks in separate sums (two FMA dependency chains)
template <int MT>
inline __attribute__((always_inline)) void q8_block(const at::BFloat16* x, int64_t xs, const uint8_t* c, int64_t b,
                                                    float dscale, __m512 (&a)[MT]) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 32))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 32 + 16))));
  const __m512bh q = _mm512_cvtne2ps_pbh(hi, lo);
  const __m512 d = _mm512_set1_ps(dscale);
  for (int mi = 0; mi < MT; ++mi) {
    const __m512i xv = _mm512_loadu_si512(x + mi * xs + b * 32);
    a[mi] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv, q), d, a[mi]);
  }
}

template <int MT>
inline void row_q8_bf16(const at::BFloat16* x, int64_t xs, const Rows& w, int64_t n, float* out) {
  const uint8_t* c = w.codes + n * w.cstride;
  const uint16_t* dh = w.d + n * w.nb;
  __m512 acc[MT], acc2[MT];
  for (int mi = 0; mi < MT; ++mi) acc[mi] = acc2[mi] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < w.nb; b += 2) {
    q8_block<MT>(x, xs, c, b, _cvtsh_ss(dh[b]), acc);
    q8_block<MT>(x, xs, c, b + 1, _cvtsh_ss(dh[b + 1]), acc2);
  }
  if (b < w.nb) q8_block<MT>(x, xs, c, b, _cvtsh_ss(dh[b]), acc);
  for (int mi = 0; mi < MT; ++mi) out[mi] = _mm512_reduce_add_ps(_mm512_add_ps(acc[mi], acc2[mi]));
}
#endif

#define GOODPUT_MT_SWITCH4(fn, mt, ...) \
  switch (mt) {                         \
    case 1: fn<1>(__VA_ARGS__); break;  \
    case 2: fn<2>(__VA_ARGS__); break;  \
    case 3: fn<3>(__VA_ARGS__); break;  \
    default: fn<4>(__VA_ARGS__); break; \
  }

// rows [n0, n1) of y; x as given (Q8) and xp: x permuted to the codes' step order, [M, K]
// contiguous (Q4)
template <typename T>
void rows_avx512(const T* x, int64_t xs, const T* xp, int64_t M, const float* sx, const Rows& w, int64_t n0, int64_t n1,
                 T* y) {
  constexpr int kTile = 4;  // rows of x per pass over a weight row (it stays in L1)
  float s[kTile];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += kTile) {
      const int64_t mt = std::min<int64_t>(kTile, M - m0);
      if constexpr (std::is_same<T, float>::value) {
        if (w.kind == kQ41) {
          GOODPUT_MT_SWITCH4(row_q4_f32, mt, xp + m0 * w.K, w.K, w, n, s)
        } else {
          GOODPUT_MT_SWITCH4(row_q8_f32, mt, x + m0 * xs, xs, w, n, s)
        }
      } else {
#if defined(GOODPUT_BLOCK_LINEAR_BF16)
        if (w.kind == kQ41) {
          GOODPUT_MT_SWITCH4(row_q4_bf16, mt, xp + m0 * w.K, w.K, sx + m0 * w.nb, w, n, s)
        } else {
          GOODPUT_MT_SWITCH4(row_q8_bf16, mt, x + m0 * xs, xs, w, n, s)
        }
#else
        rows_generic(x + m0 * xs, xs, mt, w, n, n + 1, y + m0 * w.N);
        continue;
#endif
      }
      for (int64_t mi = 0; mi < mt; ++mi) y[(m0 + mi) * w.N + n] = static_cast<T>(s[mi]);
    }
  }
}
#endif

}  // namespace

namespace goodput {

template <typename T>
void block_prepare(const T* xr, int64_t xs, int64_t M, const BlockRows& w, T* xp, float* sx) {
  if (w.m) {
    for (int64_t mi = 0; mi < M; ++mi)
      for (int64_t b = 0; b < w.nb; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < 32; ++i) s += static_cast<float>(xr[mi * xs + b * 32 + i]);
        sx[mi * w.nb + b] = s;
      }
  }
#if defined(GOODPUT_BLOCK_LINEAR_AVX512)
  if (w.kind == kQ41) {  // x in the codes' step order, once for every row
    using P = std::conditional_t<sizeof(T) == 2, pair16, pair32>;
    for (int64_t mi = 0; mi < M; ++mi)
      permute_pairs(reinterpret_cast<const P*>(xr + mi * xs), w.nb, reinterpret_cast<P*>(xp + mi * w.K));
  }
#else
  (void)xp;
#endif
}

template <typename T>
void block_rows(const T* xr, int64_t xs, const T* xp, int64_t M, const float* sx, const BlockRows& w, int64_t n0,
                int64_t n1, T* y) {
#if defined(GOODPUT_BLOCK_LINEAR_AVX512)
  rows_avx512(xr, xs, xp, M, sx, w, n0, n1, y);
#else
  (void)xp;
  (void)sx;
  rows_generic(xr, xs, M, w, n0, n1, y);
#endif
}

template void block_prepare<float>(const float*, int64_t, int64_t, const BlockRows&, float*, float*);
template void block_prepare<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, const BlockRows&, at::BFloat16*,
                                          float*);
template void block_rows<float>(const float*, int64_t, const float*, int64_t, const float*, const BlockRows&, int64_t,
                                int64_t, float*);
template void block_rows<at::BFloat16>(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, const float*,
                                       const BlockRows&, int64_t, int64_t, at::BFloat16*);

}  // namespace goodput

// True when this build has the vectorized path for activations of dtype ("float32" / "bfloat16");
// without it block_linear still runs (portable loops) but is slower than a plain matmul.
bool block_linear_vectorized(std::string dtype) {
#if defined(GOODPUT_BLOCK_LINEAR_AVX512)
  if (dtype == "float32") return true;
#if defined(GOODPUT_BLOCK_LINEAR_BF16)
  if (dtype == "bfloat16") return true;
#endif
#endif
  return false;
}

// x [M, K] float32 or bfloat16 (rows contiguous, any row stride); kind 0 (Q4: codes uint8
// [N, ceil(K/64)·32] in the step order above, d and m float16 [N, K/32]) or 1 (Q8: codes int8 [N, K], d float16
// [N, K/32], m empty). Returns y [M, N] in x's dtype (float32 sums rounded once).
torch::Tensor block_linear(torch::Tensor x, int64_t kind, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(kind == kQ41 || kind == kQ80, "kind must be 0 (Q4) or 1 (Q8)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x must be a 2-D CPU tensor [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % 32 == 0, "K must be a positive multiple of 32");
  const int64_t nb = K / 32;
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.dim() == 2 && d.size(1) == nb,
              "d must be contiguous float16 [N, K/32]");
  const int64_t N = d.size(0);
  const int64_t cstride = kind == kQ41 ? (nb + 1) / 2 * 32 : K;
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.size(0) == N && codes.size(1) == cstride &&
                  codes.element_size() == 1,
              "codes must be contiguous [N, ", cstride, "] bytes");
  if (kind == kQ41) {
    TORCH_CHECK(m.scalar_type() == torch::kFloat16 && m.is_contiguous() && m.sizes() == d.sizes(),
                "m must be contiguous float16 [N, K/32]");
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  Rows w{kind, N, K, nb, cstride, static_cast<const uint8_t*>(codes.data_ptr()),
         reinterpret_cast<const uint16_t*>(d.data_ptr()),
         kind == kQ41 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr};
  // per-block sums of x (the m_b · Σx term), float32 [M, nb]; x in the codes' step order (Q4)
  std::vector<float> sx(static_cast<size_t>(M * nb));
  auto body = [&](const auto* xr, auto* yp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xr)>>;
    const int64_t xs = x.stride(0);
    std::vector<T> xp(kind == kQ41 ? static_cast<size_t>(M * K) : 0);
    goodput::block_prepare(xr, xs, M, w, xp.data(), sx.data());
    // ~32 KB of weights per task: enough work to be worth a thread
    const int64_t grain = std::max<int64_t>(16, 65536 / (K * std::max<int64_t>(M, 1)));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      goodput::block_rows(xr, xs, static_cast<const T*>(xp.data()), M, static_cast<const float*>(sx.data()), w, n0, n1, yp);
    });
  };
  if (x.scalar_type() == torch::kFloat32) {
    body(x.data_ptr<float>(), y.data_ptr<float>());
  } else {
    body(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  }
  return y;
}
