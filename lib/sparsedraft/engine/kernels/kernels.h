// What each kernel file defines for the others: bindings.cpp binds them all, step_block.cpp calls the
// linear, norm and rotation kernels directly. One list, so a signature is written once.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

// bf16 <-> float32 one value at a time, for every file: widening is exact; narrowing rounds to nearest even, as
// torch does for finite values (a NaN stays a quiet NaN; torch's own scalar and vector conversions disagree on
// which one).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Outputs [n0, n1) of each of the m rows of a linear kernel's float32 sums y [m][n]: bias (float32, may be null)
// added after the sum, then, where out is given, rounded once into bf16. The linear kernels call it on the
// outputs each thread has just written, inside their parallel region, where one thread did it after the
// region, from a zero-filled buffer, while the other waited (scratch, in the message of the commit that added
// this).
inline void finish_outputs(float* y, int64_t m, int64_t n, int64_t n0, int64_t n1, const float* bias,
                           uint16_t* out) {
  for (int64_t r = 0; r < m; ++r) {
    float* row = y + r * n;
    if (bias != nullptr)
      for (int64_t i = n0; i < n1; ++i) row[i] += bias[i];
    if (out != nullptr)
      for (int64_t i = n0; i < n1; ++i) out[r * n + i] = float_to_bf16(row[i]);
  }
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, double scale, int64_t T,
                  int64_t key_rows);
at::Tensor attend_int8(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& vc,
                       const at::Tensor& vs, const at::Tensor& kt, const at::Tensor& vt, double scale, int64_t T,
                       int64_t key_rows);
int64_t attend_chunk();
int64_t attend_lanes();
int64_t attend_dots();  // 1: bf16 attention runs on AVX512-BF16 dot products (built without AMX, allowed)
int64_t attend_dots_for(int64_t D);  // 1: and bf16 attention with head_dim D takes them (the kernel's own rule)
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);
at::Tensor few_rows_linear_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& bias);
int64_t linear_pair_from();
at::Tensor rounded_rows_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                               const at::Tensor& bias);
bool rounded_rows_vnni();  // whether rounded_rows_linear runs on VNNI's int8 dot products in this build
at::Tensor step_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor step_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
std::vector<at::Tensor> step_layer_head(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                        const std::vector<at::Tensor>& lin, int64_t heads, const at::Tensor& cos,
                                        const at::Tensor& sin, bool rope_keys);
at::Tensor step_layer_tail(const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& lin,
                           const at::Tensor& norm_weight, double eps);

// A step's decoder stack in one call (step_stack.cpp): per layer the norms, eps and (weight, bias, scale) lists that
// step_layer_head and step_layer_tail take, and the cache's k, v buffers [B, KV, slots, D]; for a view whose first
// n_codes slots are int8 codes (attend_int8), per layer its key and value codes [B, KV, n_codes, D] and scales
// [B, KV, n_codes] (empty lists: none).
struct LayerStack {
  std::vector<at::Tensor> head_norms;
  std::vector<double> head_eps;
  std::vector<std::vector<at::Tensor>> head_lin;
  std::vector<at::Tensor> tail_norms;
  std::vector<double> tail_eps;
  std::vector<std::vector<at::Tensor>> tail_lin;
  std::vector<at::Tensor> k, v, kc, ks, vc, vs;
  int64_t n_codes;
  int64_t heads;
  double scale;
  bool rope_keys;
  int64_t key_rows;
  LayerStack(std::vector<at::Tensor> head_norms, std::vector<double> head_eps,
             std::vector<std::vector<at::Tensor>> head_lin, std::vector<at::Tensor> tail_norms,
             std::vector<double> tail_eps, std::vector<std::vector<at::Tensor>> tail_lin, std::vector<at::Tensor> k,
             std::vector<at::Tensor> v, std::vector<at::Tensor> kc, std::vector<at::Tensor> ks,
             std::vector<at::Tensor> vc, std::vector<at::Tensor> vs, int64_t n_codes, int64_t heads, double scale,
             bool rope_keys, int64_t key_rows);
  std::vector<at::Tensor> run(at::Tensor x, int64_t start, int64_t stop, const at::Tensor& cos, const at::Tensor& sin,
                              const std::vector<int64_t>& keep) const;
};

// Rows a few-row linear step takes (a decode or verification step's rows), whatever its weights: the float and
// int8 kernels (few_rows_linear.cpp) and the rounded-x one (rounded_rows_linear.cpp). Python's
// kernels.MAX_LINEAR_ROWS is this number.
constexpr int64_t kLinearRows = 16;

// Whether an AVX2+FMA build runs few-row linear steps of more than 8 rows two rows at a time (avx2_paired) or
// all rows at once; the bits are the same, the speed depends on the machine, so Python measures it once and
// sets this (kernels.use_pairs). Other builds ignore it.
inline std::atomic<bool> rows_paired{true};
