// y = x · Wᵀ with W kept in a GGUF file's own 4-bit / 8-bit blocks of 32 weights, for the decode
// steps of a few rows: a memory-bound step then reads 0.625 (Q4_1) or 1.06 (Q8_0) bytes per weight
// instead of bfloat16's 2.
//
// Weights (llama.cpp ggml-quants.c, dequantize_row_q4_1 / _q8_0; block b of a row holds weights
// 32b .. 32b+31): Q4_1 w = d_b·q + m_b (q in 0..15), Q8_0 w = d_b·q (q in -128..127), d_b and m_b
// float16. These are the exact weights a float32 model dequantized from the file holds.
// The sum is taken by linearity, Σ_k x_k w_k = Σ_b d_b·(Σ_j x_j q_j) + m_b·(Σ_j x_j): the codes q
// are small integers, exact in bfloat16, so for bfloat16 activations the inner sums are AVX-512 BF16
// dot products of exact products (no per-weight dequantization: two table lookups expand 64 codes),
// scaled by d_b in float32; float32 activations multiply by the exact float32 weights. Either way
// the products are exact and only float32 summation order and rounding differ from a float64 sum
// of x·w over the exact weights (error bound in the tests).
//
// Layout (built by goodput.worker.model.block_linear from the file's blocks):
//   Q4 (kind 0): codes uint8 [N, ceil(nb/2)·32] — blocks paired, byte i of pair p is
//                q(2p, i) | q(2p+1, i) << 4 (a missing last odd block has q = 0);
//                d, m float16 [N, nb] (Q4_0 files: m = -8·d, exact).
//   Q8 (kind 1): codes int8 [N, K]; d float16 [N, nb]; no m.
#include <torch/extension.h>

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

struct Rows {  // one linear in this file's layout
  int64_t kind, N, K, nb, cstride;  // cstride: code bytes per row
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;  // null for Q8
};

inline int q_code(const Rows& w, int64_t n, int64_t k) {  // code of weight (n, k)
  const int64_t b = k / 32, i = k % 32;
  if (w.kind == kQ41) {
    const uint8_t byte = w.codes[n * w.cstride + (b / 2) * 32 + i];
    return b % 2 == 0 ? (byte & 15) : (byte >> 4);
  }
  return static_cast<int8_t>(w.codes[n * w.cstride + k]);
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

// float16 row [nb] -> float32 buffer
inline void halves_to_f32(const uint16_t* h, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 k = first(nb - b);
    _mm512_mask_storeu_ps(out + b, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + b)));
  }
}

// Σ_b m_b · sx[b] over a row (the m_b·Σx term of Q4_1)
inline float m_term(const uint16_t* mh, const float* sx, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 k = first(nb - b);
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mh + b)), _mm512_maskz_loadu_ps(k, sx + b), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// float32 activations: codes -> float32 (exact), w = d·q (+ m) exact, one FMA per weight
template <int MT>
inline void row_f32(const float* x, int64_t xs, const Rows& w, int64_t n, float* dbuf, float* mbuf, float* out) {
  halves_to_f32(w.d + n * w.nb, w.nb, dbuf);
  if (w.m) halves_to_f32(w.m + n * w.nb, w.nb, mbuf);
  const uint8_t* c = w.codes + n * w.cstride;
  __m512 acc[MT];
  for (int mi = 0; mi < MT; ++mi) acc[mi] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    __m512 lo, hi;
    const __m512 d = _mm512_set1_ps(dbuf[b]);
    if (w.kind == kQ41) {
      const __m128i nib = _mm_set1_epi8(15);
      __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (b / 2) * 32));
      __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (b / 2) * 32 + 16));
      if (b % 2) {
        q0 = _mm_srli_epi16(q0, 4);
        q1 = _mm_srli_epi16(q1, 4);
      }
      const __m512 m = _mm512_set1_ps(mbuf[b]);
      lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q0, nib))), d, m);
      hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q1, nib))), d, m);
    } else {
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 32)))), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 32 + 16)))), d);
    }
    for (int mi = 0; mi < MT; ++mi) {
      const float* xb = x + mi * xs + b * 32;
      acc[mi] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), lo, acc[mi]);
      acc[mi] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), hi, acc[mi]);
    }
  }
  for (int mi = 0; mi < MT; ++mi) out[mi] = _mm512_reduce_add_ps(acc[mi]);
}

#if defined(__AVX512BF16__)
#define GOODPUT_BLOCK_LINEAR_BF16 1

// words i = bfloat16(i mod 16): the table two vpermw lookups expand 4-bit codes with (vpermw reads
// index bits 4..0, so bit 4 of an unmasked nibble pair selects the same value)
inline __m512i code_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    t[i] = static_cast<uint16_t>(u >> 16);  // small integers are exact in bfloat16
  }
  return _mm512_load_si512(t);
}

// bfloat16 activations, Q4: acc_m += d_b · dot(x_m block b, q block b); then + Σ_b m_b·sx_m[b].
// Even and odd blocks sum into separate registers: two FMA dependency chains instead of one (at one
// row of x the chain's latency, not the arithmetic, would bound the loop).
template <int MT>
inline void row_q4_bf16(const at::BFloat16* x, int64_t xs, const float* sx, int64_t sxs, const Rows& w, int64_t n,
                        __m512i table, float* dbuf, float* out) {
  halves_to_f32(w.d + n * w.nb, w.nb, dbuf);
  const uint8_t* c = w.codes + n * w.cstride;
  __m512 acc[MT], acc2[MT];
  for (int mi = 0; mi < MT; ++mi) acc[mi] = acc2[mi] = _mm512_setzero_ps();
  const int64_t nb = w.nb;
  for (int64_t b = 0; b < nb; b += 2) {
    const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b * 16)));
    const __m512bh qa = (__m512bh)_mm512_permutexvar_epi16(raw, table);  // low nibbles: block b
    const __m512 da = _mm512_set1_ps(dbuf[b]);
    for (int mi = 0; mi < MT; ++mi) {
      const __m512i xv = _mm512_loadu_si512(x + mi * xs + b * 32);
      acc[mi] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv, qa), da, acc[mi]);
    }
    if (b + 1 < nb) {
      const __m512bh qb = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), table);  // block b + 1
      const __m512 db = _mm512_set1_ps(dbuf[b + 1]);
      for (int mi = 0; mi < MT; ++mi) {
        const __m512i xv = _mm512_loadu_si512(x + mi * xs + (b + 1) * 32);
        acc2[mi] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv, qb), db, acc2[mi]);
      }
    }
  }
  for (int mi = 0; mi < MT; ++mi)
    out[mi] = _mm512_reduce_add_ps(_mm512_add_ps(acc[mi], acc2[mi])) + m_term(w.m + n * nb, sx + mi * sxs, nb);
}

// bfloat16 activations, Q8: int8 codes -> bfloat16 exactly (|q| <= 128 has <= 8 significant bits);
// even/odd blocks in separate sums as above
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
inline void row_q8_bf16(const at::BFloat16* x, int64_t xs, const Rows& w, int64_t n, float* dbuf, float* out) {
  halves_to_f32(w.d + n * w.nb, w.nb, dbuf);
  const uint8_t* c = w.codes + n * w.cstride;
  __m512 acc[MT], acc2[MT];
  for (int mi = 0; mi < MT; ++mi) acc[mi] = acc2[mi] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < w.nb; b += 2) {
    q8_block<MT>(x, xs, c, b, dbuf[b], acc);
    q8_block<MT>(x, xs, c, b + 1, dbuf[b + 1], acc2);
  }
  if (b < w.nb) q8_block<MT>(x, xs, c, b, dbuf[b], acc);
  for (int mi = 0; mi < MT; ++mi) out[mi] = _mm512_reduce_add_ps(_mm512_add_ps(acc[mi], acc2[mi]));
}
#endif

#define GOODPUT_MT_SWITCH(fn, mt, ...)   \
  switch (mt) {                          \
    case 1: fn<1>(__VA_ARGS__); break;   \
    case 2: fn<2>(__VA_ARGS__); break;   \
    case 3: fn<3>(__VA_ARGS__); break;   \
    case 4: fn<4>(__VA_ARGS__); break;   \
    case 5: fn<5>(__VA_ARGS__); break;   \
    case 6: fn<6>(__VA_ARGS__); break;   \
    case 7: fn<7>(__VA_ARGS__); break;   \
    default: fn<8>(__VA_ARGS__); break;  \
  }

template <typename T>
void rows_avx512(const T* x, int64_t xs, int64_t M, const float* sx, const Rows& w, int64_t n0, int64_t n1, T* y) {
  std::vector<float> dbuf(w.nb + 16), mbuf(w.nb + 16);
  float s[8];
#if defined(GOODPUT_BLOCK_LINEAR_BF16)
  const __m512i table = code_table();
#endif
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {  // 8 rows of x per pass over the row (it stays in L1)
      const int64_t mt = std::min<int64_t>(8, M - m0);
      if constexpr (std::is_same<T, float>::value) {
        GOODPUT_MT_SWITCH(row_f32, mt, x + m0 * xs, xs, w, n, dbuf.data(), mbuf.data(), s)
      } else {
#if defined(GOODPUT_BLOCK_LINEAR_BF16)
        if (w.kind == kQ41) {
          GOODPUT_MT_SWITCH(row_q4_bf16, mt, x + m0 * xs, xs, sx + m0 * w.nb, w.nb, w, n, table, dbuf.data(), s)
        } else {
          GOODPUT_MT_SWITCH(row_q8_bf16, mt, x + m0 * xs, xs, w, n, dbuf.data(), s)
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
// [N, ceil(K/64)·32], d and m float16 [N, K/32]) or 1 (Q8: codes int8 [N, K], d float16
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
  // per-block sums of x (the m_b · Σx term), float32 [M, nb]
  std::vector<float> sx(static_cast<size_t>(M * nb));
  auto body = [&](const auto* xp, auto* yp) {
    if (w.m) {
      for (int64_t mi = 0; mi < M; ++mi)
        for (int64_t b = 0; b < nb; ++b) {
          float s = 0.f;
          for (int64_t i = 0; i < 32; ++i) s += static_cast<float>(xp[mi * x.stride(0) + b * 32 + i]);
          sx[mi * nb + b] = s;
        }
    }
    // ~32 KB of weights per task: enough work to be worth a thread
    const int64_t grain = std::max<int64_t>(16, 65536 / (K * std::max<int64_t>(M, 1)));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#if defined(GOODPUT_BLOCK_LINEAR_AVX512)
      rows_avx512(xp, x.stride(0), M, sx.data(), w, n0, n1, yp);
#else
      rows_generic(xp, x.stride(0), M, w, n0, n1, yp);
#endif
    });
  };
  if (x.scalar_type() == torch::kFloat32) {
    body(x.data_ptr<float>(), y.data_ptr<float>());
  } else {
    body(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  }
  return y;
}
