// Fused element-wise ops of a Llama decoder layer for CPUs: each replaces 2-9 small torch ops
// (and as many dispatches and temporaries) with one pass over the rows. Numerics follow Hugging
// Face's LlamaForCausalLM in the tensor dtype T (float32 or bfloat16): every intermediate that
// torch would round to T is rounded to T here too (round to nearest even), so results equal the
// torch ops bit for bit except where a reduction (RMSNorm's mean) or exp (SiLU) is summed or
// evaluated in another order (float32 ulps).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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
// ~88.7 give +inf (n = 128 is the exponent of inf), below ~-87.3 the smallest normal (2^-126·...).
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
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return p * s;
}

// y = w * T(x * rsqrt(mean(x^2) + eps)) with x in float32 (LlamaRMSNorm)
template <typename T>
inline void rms_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) {
    const float v = to_f(x[d]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] = from_f<T>(to_f(w[d]) * q<T>(to_f(x[d]) * r));
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
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) xr[d] = from_f<T>(to_f(xr[d]) + to_f(dr[d]));
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
  const int64_t xs = x.stride(0), half = d / 2;
  auto body = [&](auto* xp, const auto* cp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    over_rows(x.size(0), [&](int64_t t) {
      const T* c = cp + t * 2 * d;
      const T* s = c + d;
      std::vector<float> tmp(static_cast<size_t>(d));
      for (int64_t h = 0; h < n_heads; ++h) {
        T* v = xp + t * xs + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) {
          const float rot = to_f(v[i < half ? i + half : i - half]);
          tmp[i] = q<T>(q<T>(to_f(v[i]) * to_f(c[i])) + q<T>(rot * to_f(s[i])));
        }
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) v[i] = from_f<T>(tmp[i]);
      }
    });
  };
  if (x.scalar_type() == torch::kFloat32) {
    body(x.data_ptr<float>(), cs.data_ptr<float>());
  } else {
    body(x.data_ptr<at::BFloat16>(), cs.data_ptr<at::BFloat16>());
  }
}

// gu [T, 2I] (gate ‖ up) -> T(T(silu(gate)) · up), [T, I]; silu(g) = g / (1 + e^-g) in float32
torch::Tensor silu_mul(torch::Tensor gu) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu must have an even number of columns (gate ‖ up)");
  const int64_t I = gu.size(1) / 2, gs = gu.stride(0);
  auto out = torch::empty({gu.size(0), I}, gu.options());
  auto body = [&](const auto* gp, auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    over_rows(gu.size(0), [&](int64_t r) {
      const T* g = gp + r * gs;
      const T* u = g + I;
      T* o = op + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = to_f(g[i]);
        o[i] = from_f<T>(q<T>(x / (1.f + exp_any(-x))) * to_f(u[i]));
      }
    });
  };
  if (gu.scalar_type() == torch::kFloat32) {
    body(gu.data_ptr<float>(), out.data_ptr<float>());
  } else {
    body(gu.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}
