// The small row-wise operations between a decode step's matmuls: RMSNorm and the rotary embedding.
//
// Why: in a decode step of SmolLM2 each of these is a handful of torch ops on a few hundred values, and
// on a 2-core CPU each torch op costs microseconds of dispatch whatever its size: the Python RMSNorm took
// tens of microseconds for one 576-wide row, as did the rotary embedding per tensor, against a few here
// (python -m sparsedraft.bench.step_ops times both forms and a whole step, docs/results/step-ops.json).
// SiLU-gating stays torch's: its two vectorised ops were as fast as a scalar-exp loop here.
//
// Exactness: every output row is one fixed sequence of operations over its own inputs, whatever the
// number of rows (the build turns off floating-point contraction and never reassociates), so a row of a
// verification step gets the bits it gets in a one-row decode step. The bits differ from torch's ops (a
// different summation order, one rounding instead of several in bfloat16); the model uses these for every
// decode and verification step and torch's ops for prefill chunks and training, as it does the matmuls.
//
// Layouts: rows of the last dimension, all contiguous; float32 or bfloat16, computed in float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"  // the signatures this file defines, checked against the list the others use

namespace {

constexpr int64_t kLanes = 16;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }  // bfloat16: round to nearest even, like torch

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), what, " takes contiguous CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              " takes float32 or bfloat16, got ", x.scalar_type());
}

// y = weight * dtype(x * 1 / sqrt(mean(x^2) + eps)), Hugging Face's order: normalise in float32, round to
// the dtype, then scale by the weight in the dtype. The sum of squares runs in kLanes lanes (lane l sums
// elements l, l + 16, ...), then a fixed tree, so it vectorises without changing with the row count.
template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  const int64_t full = dim - dim % kLanes;
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      T* yr = y + r * dim;
      float lanes[kLanes] = {0};
      for (int64_t k = 0; k < full; k += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = to_float(xr[k + l]);
          lanes[l] += v * v;
        }
      for (int64_t k = full; k < dim; ++k) {
        const float v = to_float(xr[k]);
        lanes[k - full] += v * v;
      }
      for (int64_t half = kLanes / 2; half >= 1; half /= 2)
        for (int64_t l = 0; l < half; ++l) lanes[l] += lanes[l + half];
      const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(dim) + eps);
      for (int64_t k = 0; k < dim; ++k)
        yr[k] = from_float<T>(to_float(w[k]) * to_float(from_float<T>(to_float(xr[k]) * inv)));
    }
  });
}

// x [..., heads * D] rows at positions whose cos/sin are [rows_per_position..., D]: Hugging Face's
// "rotate half" layout, out[d] = x[d] cos[d] - x[d + D/2] sin[d] for d < D/2 and x[d] cos[d] +
// x[d - D/2] sin[d] after, in float32, rounded once. x is [P, H, D] (P positions), cos/sin [P, D].
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* y, int64_t positions, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, positions, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const T* c = cos + p * dim;
      const T* s = sin + p * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (p * heads + h) * dim;
        T* yr = y + (p * heads + h) * dim;
        for (int64_t d = 0; d < half; ++d) {
          const float a = to_float(xr[d]), b = to_float(xr[d + half]);
          yr[d] = from_float<T>(a * to_float(c[d]) - b * to_float(s[d]));
          yr[d + half] = from_float<T>(b * to_float(c[d + half]) + a * to_float(s[d + half]));
        }
      }
    }
  });
}

}  // namespace

at::Tensor step_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "rms_norm takes a contiguous weight [", x.size(-1), "] of x's dtype, got ", weight.sizes(), " ",
              weight.scalar_type());
  auto y = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim == 0 ? 0 : x.numel() / dim;
  if (x.scalar_type() == at::kFloat)
    rms_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, dim, float(eps));
  else
    rms_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, dim,
             float(eps));
  return y;
}

at::Tensor step_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rope");
  check_rows(cos, "rope");
  check_rows(sin, "rope");
  TORCH_CHECK(x.dim() >= 2 && cos.sizes() == sin.sizes() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rope takes x [..., H, D] and cos, sin [..., D] of x's dtype");
  const int64_t dim = x.size(-1), heads = x.size(-2);
  TORCH_CHECK(dim % 2 == 0 && cos.size(-1) == dim && cos.numel() * heads == x.numel(),
              "rope: cos/sin must hold one row of D = ", dim, " per position of x ", x.sizes(), ", got ",
              cos.sizes());
  auto y = at::empty_like(x);
  const int64_t positions = cos.numel() / dim;
  if (x.scalar_type() == at::kFloat)
    rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>(), positions,
              heads, dim);
  else
    rope_rows(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
              y.data_ptr<at::BFloat16>(), positions, heads, dim);
  return y;
}
