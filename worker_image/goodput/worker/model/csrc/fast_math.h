// Small float32 math shared by the attention kernels (paged_attention.cpp, paged_prefill.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace goodput {

// e^x for x <= 0 (x = -inf gives ~0) as 2^(x·log2 e) = 2^n · 2^f with a degree-6 polynomial for 2^f
// on [0, 1) (relative error < 2e-7, float32's own rounding); branch-free, so the loops over it vectorize.
inline float exp_nonpos(float x) {
  float t = std::max(x * 1.44269504088896341f, -126.f);
  const float n = std::floor(t);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace goodput
