// Paged prefill attention for CPUs: one sequence's chunk of n new query tokens (absolute positions
// [ctx, ctx + n)) attends causally to its keys and values [0, ctx + n), read through its block table
// from the paged cache. Tiled as FlashAttention-2 (Dao 2023): per (KV head, tile of query tokens),
// the scores of one block of keys at a time, an online softmax in float32 (Milakov & Gimelshein
// 2018) and the output accumulated in float32; blocks past a tile's last position are skipped.
//
// The two matmuls of a tile (S = Q·Kᵀ and O += P·V, bfloat16 in, float32 out) run on ATen's
// brgemm micro-kernel (at::native::cpublas, oneDNN's AMX / AVX-512 BF16 code), as torch's own CPU
// flash attention does. Its B operands are in VNNI layout (row pairs interleaved): once per call,
// each KV head's keys (transposed) and values are packed block by block straight from the cache
// pages, so nothing is gathered into a contiguous copy first. Grouped-query attention: the g query
// heads of one KV head are extra rows of the same tile (rows ordered token-major, g per token), so
// each packed key/value block is read by all of them.
//
// Layouts (goodput.worker.model.attention.base): q, out [n, H, D] (token stride free, head
// vectors contiguous); caches [num_blocks, block_size, KV, D] bfloat16; block_table int32 [nb].
#include "fast_math.h"
#include "kernel_api.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

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

// Tile sizes, measured (SmolLM2's 3 KV heads x 3 query heads, d 64, a 512-token chunk after 7,488 cached
// tokens, one thread): query tiles of 32 to 128 tokens and key blocks of 256 to 1,024 all within
// noise (~25 ms); brgemm calls of fewer rows (32 or 64, S and P in L1) 20-60 % slower (per-call cost).
constexpr int64_t kQT = 64;   // query tokens per tile (brgemm M = kQT · g rows)
constexpr int64_t kKT = 512;  // keys per packed block (N of Q·Kᵀ, K of P·V)
constexpr int64_t kPad = 32;  // a block's key count is padded to this (zero keys, masked scores)

using goodput::exp_nonpos;  // fast_math.h

// float32 -> bfloat16 bits, round to nearest even (finite inputs)
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// One row of a score block: with m_old the row's running max (scaled scores), sets
// mx = max(s[0..lim)) and returns m_new = max(m_old, scale · mx); writes p[c] = bf16(e^(scale·s[c] − m_new))
// for c < lim and 0 for c in [lim, np); sum = Σ e (float32, before rounding).
inline float exp_row(const float* s, uint16_t* p, int64_t lim, int64_t np, float scale, float m_old, float& mx,
                     float& sum) {
#if defined(__AVX512F__)
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmx = ninf, vmx1 = ninf, vmx2 = ninf, vmx3 = ninf;  // four chains: vmaxps latency, not throughput
  int64_t c = 0;
  for (; c + 64 <= lim; c += 64) {
    vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + c));
    vmx1 = _mm512_max_ps(vmx1, _mm512_loadu_ps(s + c + 16));
    vmx2 = _mm512_max_ps(vmx2, _mm512_loadu_ps(s + c + 32));
    vmx3 = _mm512_max_ps(vmx3, _mm512_loadu_ps(s + c + 48));
  }
  vmx = _mm512_max_ps(_mm512_max_ps(vmx, vmx1), _mm512_max_ps(vmx2, vmx3));
  for (; c + 16 <= lim; c += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + c));
  if (c < lim) vmx = _mm512_max_ps(vmx, _mm512_mask_loadu_ps(ninf, (__mmask16)((1u << (lim - c)) - 1), s + c));
  mx = _mm512_reduce_max_ps(vmx);
  const float m_new = std::max(m_old, mx * scale);
  // in base 2: e^(scale·s − m) = 2^(s·(scale·log2 e) − m·log2 e) = 2^n · 2^f, n = floor, f in [0, 1)
  const float l2e = 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(scale * l2e), vm = _mm512_set1_ps(m_new * l2e), lo = _mm512_set1_ps(-126.f);
  const __m512 c0 = _mm512_set1_ps(1.0f), c1 = _mm512_set1_ps(6.931472028550421e-1f),
               c2 = _mm512_set1_ps(2.402264791363012e-1f), c3 = _mm512_set1_ps(5.550332471162809e-2f),
               c4 = _mm512_set1_ps(9.618437357674640e-3f), c5 = _mm512_set1_ps(1.339887440266574e-3f),
               c6 = _mm512_set1_ps(1.535336188319500e-4f);
  __m512 vsum = _mm512_setzero_ps();
  for (c = 0; c < lim; c += 16) {
    const __mmask16 k = lim - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (lim - c)) - 1);
    const __m512 t = _mm512_max_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + c), vc, vm), lo);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 q = _mm512_fmadd_ps(c6, f, c5);
    q = _mm512_fmadd_ps(q, f, c4);
    q = _mm512_fmadd_ps(q, f, c3);
    q = _mm512_fmadd_ps(q, f, c2);
    q = _mm512_fmadd_ps(q, f, c1);
    q = _mm512_fmadd_ps(q, f, c0);
    const __m512 e = _mm512_maskz_scalef_ps(k, q, n);  // q · 2^n
    vsum = _mm512_add_ps(vsum, e);
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), (__m256i)_mm512_cvtneps_pbh(e));  // nearest even
#else
    // round to nearest even bf16 (e finite, >= 0)
    const __m512i b = _mm512_castps_si512(e);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), _mm512_cvtepi32_epi16(r));
#endif
  }
  sum = _mm512_reduce_add_ps(vsum);
  if (c < np) std::memset(p + c, 0, (np - c) * 2);
  return m_new;
#else
  mx = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < lim; ++c) mx = std::max(mx, s[c]);
  const float m_new = std::max(m_old, mx * scale);
  sum = 0.f;
  for (int64_t c = 0; c < lim; ++c) {
    const float e = exp_nonpos(s[c] * scale - m_new);
    sum += e;
    p[c] = to_bf16(e);
  }
  for (int64_t c = lim; c < np; ++c) p[c] = 0;
  return m_new;
#endif
}

}  // namespace

bool paged_prefill_supported() { return at::native::cpublas::could_pack(at::kBFloat16); }

// out [n, H, D] = causal attention of q [n, H, D] (positions ctx + i) over the sequence's cached
// keys/values [0, ctx + n); scores scaled by `scale`, softmax and accumulation in float32.
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, int64_t ctx, torch::Tensor out, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [n, H, D], heads contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "out must be [n, H, D] like q, heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [num_blocks, block_size, KV, D]");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
                  v_cache.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "paged_prefill_attention is bfloat16 only");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 1 && block_table.is_contiguous(),
              "block_table must be contiguous int32 [nb]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t nblk = k_cache.size(0), bs = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 2 == 0, "head dim of q and caches must match (and be even)");
  TORCH_CHECK(KV > 0 && H % KV == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(scale > 0, "scale must be positive");
  const int64_t S = ctx + n;
  TORCH_CHECK(ctx >= 0 && S <= block_table.size(0) * bs, "ctx + n beyond the block table");
  if (n == 0) return;
  const int32_t* bt = block_table.data_ptr<int32_t>();
  for (int64_t i = 0, e = (S + bs - 1) / bs; i < e; ++i)
    TORCH_CHECK(bt[i] >= 0 && bt[i] < nblk, "block id ", bt[i], " outside the pool");
  const int64_t g = H / KV, nkb = (S + kKT - 1) / kKT;
  const float fscale = static_cast<float>(scale);

  // 1. pack: per (KV head, key block), Kᵀ as uint32 [D/2][Np] (bf16 pairs along D) and V as
  //    bf16 [Np/2][D][2]; Np = the block's keys rounded up to kPad, padding zero
  auto packed = torch::empty({2, KV * nkb * kKT * D}, k_cache.options());
  uint16_t* kp_all = reinterpret_cast<uint16_t*>(packed.data_ptr());
  uint16_t* vp_all = kp_all + KV * nkb * kKT * D;
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto token_row = [&](const uint16_t* cache, int64_t t, int64_t kh) {
    return cache + ((static_cast<int64_t>(bt[t / bs]) * bs + t % bs) * KV + kh) * D;
  };
  at::parallel_for(0, KV * nkb, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t kh = u / nkb, b = u % nkb, t0 = b * kKT, nk = std::min(kKT, S - t0);
      const int64_t np = (nk + kPad - 1) / kPad * kPad, half = D / 2;
      uint32_t* kp = reinterpret_cast<uint32_t*>(kp_all + u * kKT * D);
      uint16_t* vp = vp_all + u * kKT * D;
      int64_t j = 0;
#if defined(__AVX512F__)
      if (half <= 64) {  // 16 tokens' rows copied together, then each pair column gathered into its packed row
        alignas(64) uint32_t tmp[16 * 64];
        const __m512i cols = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(half)));
        for (; j + 16 <= nk; j += 16) {
          for (int64_t t = 0; t < 16; ++t) std::memcpy(tmp + t * half, token_row(kc, t0 + j + t, kh), half * 4);
          for (int64_t i = 0; i < half; ++i)
            _mm512_storeu_si512(kp + i * np + j, _mm512_i32gather_epi32(cols, tmp + i, 4));
        }
      }
#endif
      for (; j < nk; ++j) {
        const uint32_t* kr = reinterpret_cast<const uint32_t*>(token_row(kc, t0 + j, kh));
        for (int64_t i = 0; i < half; ++i) kp[i * np + j] = kr[i];
      }
      j = 0;
#if defined(__AVX512BW__)
      if (D % 32 == 0) {  // a token pair's rows interleaved 32 elements at a time
        alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
        const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
        for (; j + 2 <= nk; j += 2) {
          const uint16_t* a = token_row(vc, t0 + j, kh);
          const uint16_t* b = token_row(vc, t0 + j + 1, kh);
          uint16_t* vo = vp + (j / 2) * D * 2;
          for (int64_t d = 0; d < D; d += 32) {
            const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
            _mm512_storeu_si512(vo + 2 * d, _mm512_permutex2var_epi16(x, ilo, y));
            _mm512_storeu_si512(vo + 2 * d + 32, _mm512_permutex2var_epi16(x, ihi, y));
          }
        }
      }
#endif
      for (; j < nk; ++j) {
        const uint16_t* vr = token_row(vc, t0 + j, kh);
        uint16_t* vo = vp + (j / 2) * D * 2 + (j % 2);
        for (int64_t d = 0; d < D; ++d) vo[2 * d] = vr[d];
      }
      for (int64_t j = nk; j < np; ++j) {
        for (int64_t i = 0; i < half; ++i) kp[i * np + j] = 0;
        uint16_t* vo = vp + (j / 2) * D * 2 + (j % 2);
        for (int64_t d = 0; d < D; ++d) vo[2 * d] = 0;
      }
    }
  });

  // 2. attention: per (KV head, tile of kQT query tokens), the tile's g·kQT rows (token-major)
  const int64_t ntiles = (n + kQT - 1) / kQT, Mmax = kQT * g;
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t qs = q.stride(0), os = out.stride(0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, KV * ntiles, 1, [&](int64_t u0, int64_t u1) {
    std::vector<uint16_t> qbuf(Mmax * D), pbuf(Mmax * kKT);
    std::vector<float> sbuf(Mmax * kKT), acc(Mmax * D), m(Mmax), l(Mmax);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t kh = u / ntiles, q0 = (u % ntiles) * kQT, q1 = std::min(n, q0 + kQT), M = (q1 - q0) * g;
      for (int64_t t = q0; t < q1; ++t)
        for (int64_t j = 0; j < g; ++j)
          std::memcpy(&qbuf[((t - q0) * g + j) * D], qd + t * qs + (kh * g + j) * D, D * 2);
      std::fill(acc.begin(), acc.begin() + M * D, 0.f);
      std::fill(m.begin(), m.begin() + M, neg_inf);
      std::fill(l.begin(), l.begin() + M, 0.f);
      const int64_t last = ctx + q1 - 1;  // the tile's last position: keys beyond it are masked for all rows
      for (int64_t b = 0; b * kKT <= last; ++b) {
        const int64_t t0 = b * kKT, nk = std::min(kKT, S - t0), ld = (nk + kPad - 1) / kPad * kPad;
        // the block's keys up to the tile's last position (the diagonal block: not the masked rest)
        const int64_t np = (std::min(nk, last - t0 + 1) + kPad - 1) / kPad * kPad;
        const uint16_t* kp = kp_all + (kh * nkb + b) * kKT * D;
        const uint16_t* vp = vp_all + (kh * nkb + b) * kKT * D;
        at::native::cpublas::brgemm(M, np, D, D, ld, kKT, false, reinterpret_cast<const at::BFloat16*>(qbuf.data()),
                                    reinterpret_cast<const at::BFloat16*>(kp), sbuf.data());
        for (int64_t r = 0; r < M; ++r) {
          const float* s = &sbuf[r * kKT];
          uint16_t* p = &pbuf[r * kKT];
          const int64_t pos = ctx + q0 + r / g;
          const int64_t lim = std::min(nk, pos - t0 + 1);  // keys [t0, t0 + lim) visible to this row
          if (lim <= 0) {
            std::memset(p, 0, np * 2);
            continue;
          }
          float mx, sum;
          const float m_new = exp_row(s, p, lim, np, fscale, m[r], mx, sum);
          const float alpha = exp_nonpos(m[r] - m_new);
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
          if (alpha != 1.f) {
            float* a = &acc[r * D];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
          }
        }
        at::native::cpublas::brgemm(M, D, np, kKT, D, D, true, reinterpret_cast<const at::BFloat16*>(pbuf.data()),
                                    reinterpret_cast<const at::BFloat16*>(vp), acc.data());
      }
      for (int64_t r = 0; r < M; ++r) {
        const int64_t t = q0 + r / g, j = r % g;
        const float inv = 1.f / l[r];
        uint16_t* o = od + t * os + (kh * g + j) * D;
        const float* a = &acc[r * D];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = to_bf16(a[d] * inv);
      }
    }
    at::native::cpublas::brgemm_release();
  });
}
