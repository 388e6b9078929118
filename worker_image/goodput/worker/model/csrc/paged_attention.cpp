// Paged decode attention for CPUs: one query token per sequence reads its keys and values in
// place from the paged cache through its block table (no gather, no padding), with an online
// softmax in float32 (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) and the
// context split across threads when there are fewer (sequence, KV head) pairs than threads
// (flash-decoding's split-K). The CPU analogue of vLLM's paged_attention_v1/v2 kernels.
//
// Layouts (goodput.worker.model.attention.base): q [B, H, D]; caches [num_blocks, block_size,
// KV, D]; block_tables int32 [B, max_blocks]; seq_lens int32 [B]; query head h reads KV head
// h / (H / KV) (grouped-query attention).
#include "fast_math.h"
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

constexpr int kChunk = 64;  // tokens scored before one softmax rescale

inline void to_float(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void to_float(const at::BFloat16* src, float* dst, int n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;  // exact widening
}

using goodput::exp_nonpos;  // fast_math.h

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One (sequence, KV head, split): positions [t0, t1) of the sequence for the g query heads of
// KV head kh. Writes unnormalized acc [g, D], running max m [g] and sum l [g]. DD > 0 fixes the
// head dim at compile time (full unrolling and vectorization of the per-token loops).
template <typename T, int DD>
void decode_unit(const float* qf, const T* kc, const T* vc, const int32_t* table, int64_t t0,
                 int64_t t1, int64_t bs, int64_t KV, int64_t D_, int64_t g, int64_t kh, float* acc,
                 float* m, float* l) {
  const int D = DD > 0 ? DD : static_cast<int>(D_);
  const int64_t row_stride = KV * D;  // elements between consecutive tokens of one KV head
  std::vector<float> buf(static_cast<size_t>(g) * kChunk + D);
  float* s = buf.data();
  float* row = s + g * kChunk;
  for (int64_t j = 0; j < g; ++j) {
    m[j] = -std::numeric_limits<float>::infinity();
    l[j] = 0.f;
  }
  std::fill(acc, acc + g * D, 0.f);
  // walk the context block by block: token t0 + i lives in block table[(t0 + i) / bs]
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, t1 - c0);
    for (int pass = 0; pass < 2; ++pass) {
      // pass 0: scores of the chunk's keys; pass 1: accumulate p·V
      const T* cache = pass == 0 ? kc : vc;
      int64_t i = 0;
      while (i < n) {
        const int64_t t = c0 + i;
        const int64_t blk = table[t / bs], off = t % bs;
        const int64_t run_len = std::min<int64_t>(bs - off, n - i);
        const T* p = cache + ((blk * bs + off) * KV + kh) * D;
        for (int64_t r = 0; r < run_len; ++r, ++i, p += row_stride) {
          to_float(p, row, D);
          if (pass == 0) {
            for (int64_t j = 0; j < g; ++j) s[j * kChunk + i] = dot(qf + j * D, row, D);
          } else {
            for (int64_t j = 0; j < g; ++j) {
              const float w = s[j * kChunk + i];
              float* aj = acc + j * D;
#pragma omp simd
              for (int d = 0; d < D; ++d) aj[d] += w * row[d];
            }
          }
        }
      }
      if (pass == 1) break;
      for (int64_t j = 0; j < g; ++j) {
        float* sj = s + j * kChunk;
        float cm = m[j];
#pragma omp simd reduction(max : cm)
        for (int64_t ii = 0; ii < n; ++ii) cm = std::max(cm, sj[ii]);
        const float alpha = std::exp(m[j] - cm);  // 0 on the first chunk (m = -inf)
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t ii = 0; ii < n; ++ii) {
          sj[ii] = exp_nonpos(sj[ii] - cm);
          sum += sj[ii];
        }
        l[j] = l[j] * alpha + sum;
        m[j] = cm;
        float* aj = acc + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) aj[d] *= alpha;
      }
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // 16 bf16 -> fp32 (exact: shift into the high half)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

constexpr int64_t kPrefetch = 16;  // tokens ahead the K rows are requested

// Request the cache lines of a row of n elements (into L1).
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// 16 lanes of exp_nonpos (same polynomial and range reduction).
inline __m512 exp_nonpos16(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// decode_unit for D = 64 and g <= 8 with the query rows and accumulators in registers: per key one
// 64-wide dot per query row; per value one broadcast-FMA per query row. Same contract as decode_unit.
// G (query heads per KV head) is a template parameter so the j loops unroll and q, a stay in
// registers (indexed by a runtime j they would live on the stack).
template <typename T, int G>
void decode_unit_avx512_d64(const float* qf, const T* kc, const T* vc, const int32_t* table,
                            int64_t t0, int64_t t1, int64_t bs, int64_t KV, int64_t kh,
                            float* acc, float* m, float* l) {
  constexpr int D = 64;
  constexpr int64_t g = G;
  const int64_t row_stride = KV * D;
  alignas(64) float s[G * kChunk];
  __m512 q[G][4], a[G][4];
  for (int64_t j = 0; j < g; ++j) {
    for (int c = 0; c < 4; ++c) {
      q[j][c] = _mm512_loadu_ps(qf + j * D + 16 * c);
      a[j][c] = _mm512_setzero_ps();
    }
    m[j] = -std::numeric_limits<float>::infinity();
    l[j] = 0.f;
  }
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, t1 - c0);
    for (int64_t i = 0; i < n;) {  // scores
      const int64_t t = c0 + i;
      const int64_t blk = table[t / bs], off = t % bs;
      const int64_t run_len = std::min<int64_t>(bs - off, n - i);
      const T* p = kc + ((blk * bs + off) * KV + kh) * D;
      const T* pv = vc + ((blk * bs + off) * KV + kh) * D;
      for (int64_t r = 0; r < run_len; ++r, ++i, p += row_stride, pv += row_stride) {
        // A unit reads D of every KV·D elements of a token: strided rows the hardware prefetcher
        // follows late, so a step whose KV cache comes from memory would wait on every row
        // (measured: 4 GB/s at 8k tokens in one thread). Ask ahead: this token's V row (read after
        // the chunk's scores) and the K row kPrefetch tokens on.
        prefetch_row(pv, D);
        if (t + r + kPrefetch < t1) {
          const int64_t tp = t + r + kPrefetch;
          prefetch_row(kc + ((static_cast<int64_t>(table[tp / bs]) * bs + tp % bs) * KV + kh) * D, D);
        }
        const __m512 k0 = load16(p), k1 = load16(p + 16), k2 = load16(p + 32), k3 = load16(p + 48);
        for (int64_t j = 0; j < g; ++j) {
          __m512 x = _mm512_mul_ps(q[j][0], k0);
          x = _mm512_fmadd_ps(q[j][1], k1, x);
          x = _mm512_fmadd_ps(q[j][2], k2, x);
          x = _mm512_fmadd_ps(q[j][3], k3, x);
          s[j * kChunk + i] = _mm512_reduce_add_ps(x);
        }
      }
    }
    for (int64_t j = 0; j < g; ++j) {  // online softmax: rescale once per chunk
      float* sj = s + j * kChunk;
      __m512 mx = _mm512_set1_ps(m[j]);
      for (int64_t ii = 0; ii < n; ii += 16) {
        const __mmask16 k = n - ii >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - ii)) - 1);
        mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, sj + ii));
      }
      const float cm = _mm512_reduce_max_ps(mx);
      const float alpha = std::exp(m[j] - cm);
      const __m512 cmv = _mm512_set1_ps(cm);
      __m512 sumv = _mm512_setzero_ps();
      for (int64_t ii = 0; ii < n; ii += 16) {
        const __mmask16 k = n - ii >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - ii)) - 1);
        const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sj + ii), cmv));
        _mm512_mask_storeu_ps(sj + ii, k, e);
        sumv = _mm512_mask_add_ps(sumv, k, sumv, e);
      }
      const float sum = _mm512_reduce_add_ps(sumv);
      l[j] = l[j] * alpha + sum;
      m[j] = cm;
      const __m512 al = _mm512_set1_ps(alpha);
      for (int c = 0; c < 4; ++c) a[j][c] = _mm512_mul_ps(a[j][c], al);
    }
    for (int64_t i = 0; i < n;) {  // p·V
      const int64_t t = c0 + i;
      const int64_t blk = table[t / bs], off = t % bs;
      const int64_t run_len = std::min<int64_t>(bs - off, n - i);
      const T* p = vc + ((blk * bs + off) * KV + kh) * D;
      for (int64_t r = 0; r < run_len; ++r, ++i, p += row_stride) {
        const __m512 v0 = load16(p), v1 = load16(p + 16), v2 = load16(p + 32), v3 = load16(p + 48);
        for (int64_t j = 0; j < g; ++j) {
          const __m512 w = _mm512_set1_ps(s[j * kChunk + i]);
          a[j][0] = _mm512_fmadd_ps(w, v0, a[j][0]);
          a[j][1] = _mm512_fmadd_ps(w, v1, a[j][1]);
          a[j][2] = _mm512_fmadd_ps(w, v2, a[j][2]);
          a[j][3] = _mm512_fmadd_ps(w, v3, a[j][3]);
        }
      }
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + j * D + 16 * c, a[j][c]);
}
#endif

}  // namespace

namespace goodput {

template <typename T>
void attention_unit(const AttnArgs<T>& a, int64_t u, float* qf) {
  const int64_t g = a.g, D = a.D, KV = a.KV, splits = a.splits;
  const int64_t b = u / (KV * splits), kh = (u / splits) % KV, sp = u % splits;
  const int64_t L = a.sl[b];
  const int64_t per = (L + splits - 1) / splits;
  const int64_t t0 = sp * per, t1 = std::min(L, t0 + per);
  float* m = a.pm + u * g;
  float* l = a.pl + u * g;
  float* acc = a.pacc + u * g * D;
  if (t0 >= t1) {
    for (int64_t j = 0; j < g; ++j) {
      m[j] = -std::numeric_limits<float>::infinity();
      l[j] = 0.f;
    }
    return;
  }
  for (int64_t j = 0; j < g; ++j) {
    to_float(a.q + b * a.qs0 + (kh * g + j) * a.qs1, qf + j * D, static_cast<int>(D));
    for (int64_t d = 0; d < D; ++d) qf[j * D + d] *= a.scale;
  }
  const int32_t* tb = a.bt + b * a.nbt;
#if defined(__AVX512F__)
  if (D == 64 && g <= 8) {
    switch (g) {
#define GOODPUT_G(n) \
  case n: decode_unit_avx512_d64<T, n>(qf, a.kc, a.vc, tb, t0, t1, a.bs, KV, kh, acc, m, l); break;
      GOODPUT_G(1) GOODPUT_G(2) GOODPUT_G(3) GOODPUT_G(4) GOODPUT_G(5) GOODPUT_G(6) GOODPUT_G(7)
      GOODPUT_G(8)
#undef GOODPUT_G
    }
    return;
  }
#endif
  if (D == 64) {
    decode_unit<T, 64>(qf, a.kc, a.vc, tb, t0, t1, a.bs, KV, D, g, kh, acc, m, l);
  } else if (D == 128) {
    decode_unit<T, 128>(qf, a.kc, a.vc, tb, t0, t1, a.bs, KV, D, g, kh, acc, m, l);
  } else {
    decode_unit<T, 0>(qf, a.kc, a.vc, tb, t0, t1, a.bs, KV, D, g, kh, acc, m, l);
  }
}

// out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the row's splits
template <typename T>
void attention_combine(const AttnArgs<T>& a, int64_t r, float* o, T* out) {
  const int64_t D = a.D, g = a.g, splits = a.splits;
  const int64_t b = r / a.H, h = r % a.H, kh = h / g, j = h % g;
  const int64_t u0 = (b * a.KV + kh) * splits;
  float M = -std::numeric_limits<float>::infinity();
  for (int64_t sp = 0; sp < splits; ++sp) M = std::max(M, a.pm[(u0 + sp) * g + j]);
  std::fill(o, o + D, 0.f);
  float den = 0.f;
  for (int64_t sp = 0; sp < splits; ++sp) {
    const float w = a.pl[(u0 + sp) * g + j] > 0.f ? std::exp(a.pm[(u0 + sp) * g + j] - M) : 0.f;
    den += w * a.pl[(u0 + sp) * g + j];
    const float* acc = a.pacc + ((u0 + sp) * g + j) * D;
    for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  for (int64_t d = 0; d < D; ++d) out[r * D + d] = static_cast<T>(o[d] * inv);
}

template void attention_unit<float>(const AttnArgs<float>&, int64_t, float*);
template void attention_unit<at::BFloat16>(const AttnArgs<at::BFloat16>&, int64_t, float*);
template void attention_combine<float>(const AttnArgs<float>&, int64_t, float*, float*);
template void attention_combine<at::BFloat16>(const AttnArgs<at::BFloat16>&, int64_t, float*, at::BFloat16*);

}  // namespace goodput

namespace {

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, float scale,
         int64_t splits, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KV = k_cache.size(2), g = H / KV;
  // partials per (b, kh, split): acc [g, D], m [g], l [g]
  std::vector<float> pacc(static_cast<size_t>(B * KV * splits * g * D));
  std::vector<float> pm(static_cast<size_t>(B * KV * splits * g));
  std::vector<float> pl(static_cast<size_t>(B * KV * splits * g));
  // q may be a view into the fused QKV output
  const goodput::AttnArgs<T> a{q.data_ptr<T>(), q.stride(0), q.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                               block_tables.data_ptr<int32_t>(), block_tables.size(1), seq_lens.data_ptr<int32_t>(),
                               B, H, D, bs, KV, g, splits, scale, pacc.data(), pm.data(), pl.data()};
  at::parallel_for(0, B * KV * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(static_cast<size_t>(g * D));
    for (int64_t u = begin; u < end; ++u) goodput::attention_unit(a, u, qf.data());
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(static_cast<size_t>(D));
    for (int64_t r = begin; r < end; ++r) goodput::attention_combine(a, r, o.data(), op);
  });
}

}  // namespace

// q [B, H, D]; caches [num_blocks, block_size, KV, D] (same dtype as q: float32 or bfloat16);
// block_tables int32 [B, max_blocks]; seq_lens int32 [B] (>= 0; 0 gives a zero row); splits >= 1
// parts each sequence's context is cut into. Returns [B, H, D] in q's dtype. Block ids and
// lengths are not range-checked here (once per step by the Python caller, not once per layer).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale, int64_t splits) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, H, D] and the caches [num_blocks, block_size, KV, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "contiguous caches, tables and lengths, and q with contiguous head vectors only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && KV > 0 && H % KV == 0, "head_dim mismatch or H not a multiple of KV");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && seq_lens.numel() == B,
              "block_tables [B, max_blocks] and seq_lens [B] must match q's B");
  TORCH_CHECK(splits >= 1, "splits must be >= 1");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());  // contiguous, whatever q's strides
  if (B == 0) return out;
  if (q.scalar_type() == torch::kFloat32) {
    run<float>(q, k_cache, v_cache, block_tables, seq_lens, static_cast<float>(scale), splits, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, static_cast<float>(scale), splits, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

// k_cache[slot] = k[t], v_cache[slot] = v[t] for every row t with slot_mapping[t] >= 0 (negative
// slots are padding). k, v [T, KV, D] with contiguous head vectors (views of the fused QKV
// output); caches [num_blocks, block_size, KV, D] contiguous, k's dtype; slots int64 [T], each
// < num_blocks * block_size (checked).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "k, v must be [T, KV, D] with contiguous [KV, D] rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "caches must be contiguous [num_blocks, block_size, KV, D] matching k");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "k, v and the caches must have one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "slot_mapping must be contiguous int64 [T]");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), nslots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sl = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] < nslots, "slot ", sl[t], " outside the cache");
  const int64_t bytes = row * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < T; ++t) {
    if (sl[t] < 0) continue;
    std::memcpy(kc + sl[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vc + sl[t] * bytes, vp + t * vs, bytes);
  }
}
