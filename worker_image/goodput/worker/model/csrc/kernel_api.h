// What the kernel files use of ATen: at::Tensor, at::empty, at::parallel_for and TORCH_CHECK, under the
// torch:: names the files are written with. Not <torch/extension.h>: that header (pybind11 and all of
// libtorch's C++ API) preprocesses to ~3x the lines of these, and each kernel file is compiled once per
// instruction-set level (cpu_kernels.py, the worker image). Only bindings.cpp includes it.
// torch::Tensor is at::Tensor (libtorch's `namespace torch { using namespace at; }`), so the functions
// these files define are the ones bindings.cpp declares.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace torch {
using at::Tensor;
using at::empty;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kBFloat16 = at::kBFloat16;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kLong = at::kLong;
}  // namespace torch
