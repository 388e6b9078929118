// The native decode step: a Llama layer stack for B decode rows (one new token each) in one call —
// per layer RMSNorm, fused QKV, RoPE, KV write into the paged cache, paged decode attention, output
// projection, residual add + RMSNorm, fused gate-up, SiLU·up, down projection, residual add + the
// next RMSNorm — for every layer, inside one OpenMP parallel region whose threads meet at barriers
// between the phases (no fork/join per operator, no return to Python between layers).
//
// It computes what llama.py's fused per-operator path computes, with the same inner loops
// (kernel_inner.h: block_linear.cpp's rows, paged_attention.cpp's units and combine, layer_ops.cpp's
// rows) on the same inputs, so its results equal that path's bit for bit: a linear's output row n is
// one function of (x, row n) whichever thread computes it, an attention unit one function of its
// (sequence, KV head, split), and the element-wise rows are the same calls.
//
// Work split per phase (nt threads, thread t): a linear's output rows in nt contiguous ranges; the
// attention units (sequence, KV head, split) in nt ranges, and with one split each unit's thread
// also combines its heads' output rows (no barrier between); RoPE and the KV write by sequence in a
// phase of their own, or, when every row is its own sequence and one unit holds each (sequence, KV
// head), inside that unit (its query heads, its key head); the residual adds, norms and SiLU·up
// (B rows: a few µs) by every thread on its own copy of the residual stream and activations,
// cheaper than a barrier. Barriers per layer: after QKV, [RoPE + KV write,] attention, [the splits'
// combine,] the output projection, gate-up and down: 5 for one-row decodes.
#include "decode_step.h"

#include "kernel_api.h"
#include "kernel_inner.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <type_traits>

namespace goodput {

namespace {

BlockRows block_rows_of(const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& m, int64_t kind,
                        int64_t K_expected, int64_t N_expected, const char* what) {
  TORCH_CHECK(kind == 0 || kind == 1, what, ": kind must be 0 (Q4) or 1 (Q8)");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.dim() == 2 && d.size(0) == N_expected &&
                  d.size(1) * 32 == K_expected,
              what, ": d must be contiguous float16 [", N_expected, ", ", K_expected / 32, "]");
  const int64_t nb = K_expected / 32;
  const int64_t cstride = kind == 0 ? (nb + 1) / 2 * 32 : K_expected;
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.size(0) == N_expected && codes.size(1) == cstride &&
                  codes.element_size() == 1,
              what, ": codes must be contiguous [", N_expected, ", ", cstride, "] bytes");
  if (kind == 0) {
    TORCH_CHECK(m.scalar_type() == torch::kFloat16 && m.is_contiguous() && m.sizes() == d.sizes(), what,
                ": m must be contiguous float16 like d");
  }
  return BlockRows{kind, N_expected, K_expected, nb, cstride, static_cast<const uint8_t*>(codes.data_ptr()),
                   reinterpret_cast<const uint16_t*>(d.data_ptr()),
                   kind == 0 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr};
}

// [a, b): thread t's share of n items in nt contiguous ranges, a multiple of `align` long
inline void share(int64_t n, int64_t align, int t, int nt, int64_t& a, int64_t& b) {
  const int64_t per = ((n + nt - 1) / nt + align - 1) / align * align;
  a = std::min<int64_t>(n, t * per);
  b = std::min<int64_t>(n, a + per);
}

}  // namespace

struct DecodeStack::State {
  template <typename T>
  void run(T* x, const T* cs, const int64_t* slots, const int32_t* tables, int64_t nbt, const int32_t* lens,
           int64_t B, int64_t splits, bool one_row_per_seq, T* h, double* phase_ns);

  std::vector<torch::Tensor> keep_;  // every tensor whose memory the pointers below read
  std::vector<BlockRows> lin_;       // 4·L linears
  std::vector<const void*> norm_;    // 2·L + 1
  std::vector<void*> kc_, vc_;       // L
  at::ScalarType dtype_;
  int64_t L_, D_, H_, KV_, d_, I_, qkv_n_, nslots_, block_size_, max_k_;
  float eps_, scale_;
  std::vector<float> fbuf_;          // float scratch (attention partials, per-thread sums)
  std::vector<uint8_t> tbuf_;        // dtype-T scratch (activations, per-thread permuted inputs)
};

DecodeStack::~DecodeStack() = default;

int64_t DecodeStack::num_layers() const { return s_->L_; }

DecodeStack::DecodeStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> codes,
                         std::vector<torch::Tensor> d, std::vector<torch::Tensor> m, std::vector<int64_t> kinds,
                         std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, int64_t n_heads,
                         int64_t n_kv, int64_t head_dim, double eps, double scale) : s_(std::make_unique<State>()) {
  State& S = *s_;
  S.L_ = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(S.L_ > 0 && v_caches.size() == k_caches.size(), "need one K and one V cache per layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * S.L_ + 1, "norms: 2 per layer and the final one");
  TORCH_CHECK(static_cast<int64_t>(codes.size()) == 4 * S.L_ && d.size() == codes.size() && m.size() == codes.size() &&
                  kinds.size() == codes.size(),
              "codes, d, m, kinds: 4 linears per layer (qkv, o, gate_up, down)");
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0 && head_dim > 0 && head_dim % 2 == 0,
              "need n_heads a multiple of n_kv and an even head_dim");
  S.dtype_ = norms[0].scalar_type();
  TORCH_CHECK(S.dtype_ == torch::kFloat32 || S.dtype_ == torch::kBFloat16, "the model's dtype must be float32 or bfloat16");
  S.D_ = norms[0].numel();
  S.H_ = n_heads, S.KV_ = n_kv, S.d_ = head_dim;
  S.qkv_n_ = (S.H_ + 2 * S.KV_) * S.d_;
  S.I_ = d[2].size(0) / 2;
  TORCH_CHECK(S.D_ % 32 == 0 && (S.H_ * S.d_) % 32 == 0 && S.I_ % 32 == 0, "widths must be multiples of 32");
  S.eps_ = static_cast<float>(eps), S.scale_ = static_cast<float>(scale);
  for (auto& t : norms) {
    TORCH_CHECK(t.is_contiguous() && t.numel() == S.D_ && t.scalar_type() == S.dtype_, "norms must be contiguous [D]");
    S.norm_.push_back(t.data_ptr());
    S.keep_.push_back(t);
  }
  const int64_t shapes[4][2] = {{S.qkv_n_, S.D_}, {S.D_, S.H_ * S.d_}, {2 * S.I_, S.D_}, {S.D_, S.I_}};  // {N, K}
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  for (int64_t i = 0; i < 4 * S.L_; ++i) {
    S.lin_.push_back(block_rows_of(codes[i], d[i], m[i], kinds[i], shapes[i % 4][1], shapes[i % 4][0], names[i % 4]));
    S.keep_.insert(S.keep_.end(), {codes[i], d[i], m[i]});
  }
  S.max_k_ = std::max({S.D_, S.H_ * S.d_, S.I_});
  for (int64_t l = 0; l < S.L_; ++l) {
    const auto &k = k_caches[l], &v = v_caches[l];
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dim() == 4 && v.sizes() == k.sizes() &&
                    k.size(2) == S.KV_ && k.size(3) == S.d_ && k.scalar_type() == S.dtype_ && v.scalar_type() == S.dtype_,
                "caches must be contiguous [num_blocks, block_size, n_kv, head_dim] in the model's dtype");
    TORCH_CHECK(l == 0 || k.sizes() == k_caches[0].sizes(), "every layer's cache must have one shape");
    S.kc_.push_back(k.data_ptr());
    S.vc_.push_back(v.data_ptr());
    S.keep_.insert(S.keep_.end(), {k, v});
  }
  S.block_size_ = k_caches[0].size(1);
  S.nslots_ = k_caches[0].size(0) * S.block_size_;
}

void DecodeStack::step(torch::Tensor x, torch::Tensor cs, torch::Tensor slots, torch::Tensor tables,
                       torch::Tensor lens, int64_t splits, bool one_row_per_seq, torch::Tensor h_out,
                       torch::Tensor phase_ns) {
  State& S = *s_;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == S.D_ && x.scalar_type() == S.dtype_,
              "x must be contiguous [B, D] in the model's dtype");
  const int64_t B = x.size(0);
  TORCH_CHECK(B > 0, "need at least one row");
  TORCH_CHECK(h_out.sizes() == x.sizes() && h_out.is_contiguous() && h_out.scalar_type() == S.dtype_,
              "h_out must be contiguous like x");
  TORCH_CHECK(cs.is_contiguous() && cs.dim() == 3 && cs.size(0) == B && cs.size(1) == 2 && cs.size(2) == S.d_ &&
                  cs.scalar_type() == S.dtype_,
              "cs must be contiguous [B, 2, head_dim] in the model's dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == B,
              "slots must be contiguous int64 [B]");
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == B && lens.scalar_type() == torch::kInt32 && lens.is_contiguous() &&
                  lens.numel() == B,
              "tables must be contiguous int32 [B, nbt] and lens int32 [B]");
  TORCH_CHECK(splits >= 1, "splits must be >= 1");
  TORCH_CHECK(!phase_ns.defined() || phase_ns.numel() == 0 ||
                  (phase_ns.scalar_type() == at::kDouble && phase_ns.is_contiguous() && phase_ns.numel() == 3),
              "phase_ns must be empty or contiguous float64 [3]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sl[b] < S.nslots_, "slot ", sl[b], " outside the cache");
    TORCH_CHECK(ln[b] >= 0 && ln[b] <= tables.size(1) * S.block_size_, "length ", ln[b], " outside the block table");
  }
  double* pn = phase_ns.defined() && phase_ns.numel() == 3 ? phase_ns.data_ptr<double>() : nullptr;
  if (S.dtype_ == torch::kFloat32) {
    S.run<float>(x.data_ptr<float>(), cs.data_ptr<float>(), sl, tables.data_ptr<int32_t>(), tables.size(1), ln, B, splits,
                 one_row_per_seq, h_out.data_ptr<float>(), pn);
  } else {
    S.run<at::BFloat16>(x.data_ptr<at::BFloat16>(), cs.data_ptr<at::BFloat16>(), sl, tables.data_ptr<int32_t>(),
                      tables.size(1), ln, B, splits, one_row_per_seq, h_out.data_ptr<at::BFloat16>(), pn);
  }
}

template <typename T>
void DecodeStack::State::run(T* x, const T* cs, const int64_t* slots, const int32_t* tables, int64_t nbt, const int32_t* lens,
                             int64_t B, int64_t splits, bool one_row_per_seq, T* h, double* phase_ns) {
  const int nt = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  const int64_t D = D_, H = H_, KV = KV_, d = d_, I = I_, g = H / KV, Hd = H * d, QN = qkv_n_;
  const int64_t units = B * KV * splits, nbmax = max_k_ / 32;
  // RoPE and the KV write inside each attention unit (no phase of their own) when a unit's
  // sequence has no other row in the step and one unit holds each (sequence, KV head)
  const bool rope_in_unit = one_row_per_seq && splits == 1;
  // scratch, grown once to the largest step seen: shared activations, then per-thread ones
  const int64_t t_shared = B * (QN + Hd + D + 2 * I), t_thread = B * (max_k_ + I + 2 * D);
  const int64_t f_shared = units * g * (d + 2), f_thread = B * nbmax + g * d + 2 * d;
  if (static_cast<int64_t>(tbuf_.size()) < (t_shared + nt * t_thread) * static_cast<int64_t>(sizeof(T)))
    tbuf_.resize((t_shared + nt * t_thread) * sizeof(T));
  if (static_cast<int64_t>(fbuf_.size()) < f_shared + nt * f_thread) fbuf_.resize(f_shared + nt * f_thread);
  T* qkv = reinterpret_cast<T*>(tbuf_.data());
  T* attn = qkv + B * QN;
  T* proj = attn + B * Hd;  // o and down projections' outputs
  T* gu = proj + B * D;
  float* pacc = fbuf_.data();
  float* pm = pacc + units * g * d;
  float* pl = pm + units * g;
  const T* const* norms = reinterpret_cast<const T* const*>(norm_.data());
  const int64_t kv_row = KV * d;

#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    // this thread's own: permuted linear input, silu(gate)·up, residual stream and normed rows —
    // every thread computes the element-wise rows itself (B·D each: cheaper than a barrier), so
    // the values are the same in every thread and only the shared buffers above need barriers
    T* xp = reinterpret_cast<T*>(tbuf_.data()) + t_shared + t * t_thread;
    T* act = xp + B * max_k_;
    T* xs = act + B * I;
    T* hs = xs + B * D;
    float* sx = fbuf_.data() + f_shared + t * f_thread;
    float* qf = sx + B * nbmax;
    float* orow = qf + g * d;
    float* tmp = orow + d;
    using clock = std::chrono::steady_clock;
    const bool timed = phase_ns != nullptr && t == 0;
    auto mark = clock::now();
    auto lap = [&](int phase) {  // thread 0: time since the last lap into phase_ns[phase]
      if (!timed) return;
      const auto now = clock::now();
      phase_ns[phase] += std::chrono::duration<double, std::nano>(now - mark).count();
      mark = now;
    };
    // y [B, N] (row stride N) = in [B, K] · Wᵀ, this thread's output rows
    auto linear = [&](const BlockRows& w, const T* in, T* y) {
      block_prepare(in, w.K, B, w, xp, sx);
      int64_t n0, n1;
      share(w.N, 16, t, n, n0, n1);
      if (n0 < n1) block_rows(in, w.K, static_cast<const T*>(xp), B, static_cast<const float*>(sx), w, n0, n1, y);
    };
    // RoPE on `heads` heads from head h0 of row r, in place in qkv
    auto rope = [&](int64_t r, int64_t h0, int64_t heads) { rope_row_(qkv + r * QN + h0 * d, cs + r * 2 * d, heads, d, tmp); };
    auto write_kv = [&](int64_t l, int64_t r, int64_t kh, int64_t heads) {  // heads kh.. of row r's new K, V
      if (slots[r] < 0) return;
      const int64_t at = slots[r] * kv_row + kh * d;
      std::memcpy(static_cast<T*>(kc_[l]) + at, qkv + r * QN + Hd + kh * d, heads * d * sizeof(T));
      std::memcpy(static_cast<T*>(vc_[l]) + at, qkv + r * QN + Hd + kv_row + kh * d, heads * d * sizeof(T));
    };

    std::memcpy(xs, x, B * D * sizeof(T));
    for (int64_t r = 0; r < B; ++r) rms_norm_row(xs + r * D, norms[0], hs + r * D, D, eps_);
    lap(2);
    for (int64_t l = 0; l < L_; ++l) {
      const BlockRows* w = lin_.data() + 4 * l;
      linear(w[0], hs, qkv);
#pragma omp barrier
      lap(0);
      if (!rope_in_unit) {  // RoPE on the query and key heads, then the new K and V rows into the cache
        for (int64_t r = t; r < B; r += n) {
          rope(r, 0, H + KV);
          write_kv(l, r, 0, KV);
        }
#pragma omp barrier
        lap(2);
      }
      const AttnArgs<T> a{qkv, QN, d, static_cast<const T*>(kc_[l]), static_cast<const T*>(vc_[l]), tables, nbt, lens,
                          B, H, d, block_size_, KV, g, splits, scale_, pacc, pm, pl};
      int64_t u0, u1;
      share(units, 1, t, n, u0, u1);
      for (int64_t u = u0; u < u1; ++u) {
        if (rope_in_unit) {  // unit u = (row b, KV head kh): its g query heads, its key head, its K and V
          const int64_t b = u / KV, kh = u % KV;
          rope(b, kh * g, g);
          rope(b, H + kh, 1);
          write_kv(l, b, kh, 1);
        }
        attention_unit(a, u, qf);
        if (splits == 1)  // unit u = (b, kh): its g heads' rows need no other unit
          for (int64_t j = 0; j < g; ++j) attention_combine(a, (u / KV) * H + (u % KV) * g + j, orow, attn);
      }
      if (splits > 1) {
#pragma omp barrier
        int64_t r0, r1;
        share(B * H, 1, t, n, r0, r1);
        for (int64_t r = r0; r < r1; ++r) attention_combine(a, r, orow, attn);
      }
#pragma omp barrier
      lap(1);
      linear(w[1], attn, proj);
#pragma omp barrier
      lap(0);
      for (int64_t r = 0; r < B; ++r) {
        add_row_(xs + r * D, proj + r * D, D);
        rms_norm_row(xs + r * D, norms[2 * l + 1], hs + r * D, D, eps_);
      }
      lap(2);
      linear(w[2], hs, gu);
#pragma omp barrier
      lap(0);
      for (int64_t r = 0; r < B; ++r) silu_mul_row(gu + r * 2 * I, gu + r * 2 * I + I, act + r * I, I);
      lap(2);
      linear(w[3], act, proj);
#pragma omp barrier
      lap(0);
      for (int64_t r = 0; r < B; ++r) {
        add_row_(xs + r * D, proj + r * D, D);
        rms_norm_row(xs + r * D, norms[2 * l + 2], hs + r * D, D, eps_);  // the next layer's attn_norm, or the final
      }
      lap(2);
    }
    if (t == 0) {
      std::memcpy(x, xs, B * D * sizeof(T));
      std::memcpy(h, hs, B * D * sizeof(T));
    }
  }
}

template void DecodeStack::State::run<float>(float*, const float*, const int64_t*, const int32_t*, int64_t,
                                             const int32_t*, int64_t, int64_t, bool, float*, double*);
template void DecodeStack::State::run<at::BFloat16>(at::BFloat16*, const at::BFloat16*, const int64_t*, const int32_t*,
                                                    int64_t, const int32_t*, int64_t, int64_t, bool, at::BFloat16*,
                                                    double*);

}  // namespace goodput
