// A decoder layer for a decode or verification step in two calls around the attention, which stays in Python
// (each cache decides what the step attends to):
//   layer_head: n = RMSNorm(x), q, k, v = n W_q^T, n W_k^T, n W_v^T, q and k rotated;
//   layer_tail: h = x + a W_o^T,  y = h + down(silu(gate(m)) * up(m)),  m = RMSNorm(h).
//
// Why: on a 2-core CPU each of a step's ~200 kernel calls pays microseconds of Python around it (module
// calls, attribute lookups, argument checks), about 4 ms of a 13 ms TriForce level-2 step. A layer's seven
// linear layers, two norms, two rotations and four pointwise ops are two calls here.
//
// Exactness: each piece is the call the Python path makes (the few-row linear, the step RMSNorm, ATen's
// silu) or computes what it computes (ATen's add and mul: the float32 sum or product rounded once to the
// dtype), on the same values, so a row gets the Python path's bits: model.py's Block takes whichever applies,
// and the tests hold the two to each other bit for bit.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>

#include <vector>

#include "kernels.h"

namespace {

// lin[i], lin[i + 1], lin[i + 2]: a weight (or int8 codes: [N, K] as they lie, or packed [N4 / 4, K32 / 32, 4, 32]
// for x rounded to int8 too), its bias (empty: none) and its scale per output row (empty: not int8).
at::Tensor project(const at::Tensor& x, const std::vector<at::Tensor>& lin, size_t i) {
  if (lin[i + 2].numel() == 0) return few_rows_linear(x, lin[i], lin[i + 1]);
  return lin[i].dim() == 4 ? rounded_rows_linear(x, lin[i], lin[i + 2], lin[i + 1])
                           : few_rows_linear_int8(x, lin[i], lin[i + 2], lin[i + 1]);
}

// The output features of lin[i]: its rows, or for packed codes (padded to whole groups) its scales.
int64_t outputs(const std::vector<at::Tensor>& lin, size_t i) {
  return lin[i].dim() == 4 ? lin[i + 2].size(0) : lin[i].size(0);
}

// op(a, b) elementwise for a and b of one shape and dtype (float32 or bfloat16): each pair widened to float32,
// combined, and rounded once to the dtype, which is what ATen's add (alpha 1: its multiply by alpha is exact)
// and mul give for finite values (a NaN stays a NaN, its payload float_to_bf16's). Written out because a step's
// few thousand values cost ATen's dispatch more than the arithmetic: an add or mul on 5 x 576 bf16 values took
// 2.7 us from Python; with the copies in step_stack.cpp, about 25 us a layer (scratch, in the message of the
// commit that added this).
template <class Op>
at::Tensor pointwise(const at::Tensor& a_in, const at::Tensor& b_in, Op op) {
  TORCH_CHECK(a_in.sizes() == b_in.sizes() && a_in.scalar_type() == b_in.scalar_type() &&
                  (a_in.scalar_type() == at::kFloat || a_in.scalar_type() == at::kBFloat16),
              "a layer's pointwise ops take two float32 or bfloat16 tensors of one shape, got ", a_in.sizes(), " ",
              a_in.scalar_type(), " and ", b_in.sizes(), " ", b_in.scalar_type());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  at::Tensor out = at::empty(a.sizes(), a.options());
  const int64_t n = a.numel();
  if (a.scalar_type() == at::kFloat) {
    const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
    float* op_ = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) op_[i] = op(ap[i], bp[i]);
  } else {
    const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
    const auto* bp = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
    auto* op_ = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < n; ++i) op_[i] = float_to_bf16(op(bf16_to_float(ap[i]), bf16_to_float(bp[i])));
  }
  return out;
}

at::Tensor add(const at::Tensor& a, const at::Tensor& b) {
  return pointwise(a, b, [](float x, float y) { return x + y; });
}

at::Tensor mul(const at::Tensor& a, const at::Tensor& b) {
  return pointwise(a, b, [](float x, float y) { return x * y; });
}

}  // namespace

// x [B, T, hidden] the layer's input, a [B, T, heads * head_dim] its attention output before o_proj; lin holds
// (weight, bias, scale) for o_proj, gate_proj, up_proj and down_proj in that order.
at::Tensor step_layer_tail(const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& lin,
                           const at::Tensor& norm_weight, double eps) {
  TORCH_CHECK(lin.size() == 12, "layer_tail takes (weight, bias, scale) for o, gate, up and down: 12 tensors, got ",
              lin.size());
  TORCH_CHECK(x.dim() == 3 && a.dim() == 3 && x.size(0) == a.size(0) && x.size(1) == a.size(1),
              "layer_tail takes x [B, T, hidden] and a [B, T, heads * head_dim], got ", x.sizes(), " and ", a.sizes());
  const at::Tensor h = add(x, project(a.contiguous(), lin, 0));
  const at::Tensor n = step_rms_norm(h, norm_weight, eps);
  const at::Tensor gated = mul(at::silu(project(n, lin, 3)), project(n, lin, 6));
  return add(h, project(gated, lin, 9));
}

// x [B, T, hidden] the layer's input; lin holds (weight, bias, scale) for q_proj, k_proj and v_proj; cos, sin
// [B, T, head_dim] the step's rotation. Returns q [B, T, heads, D] and k [B, T, kv_heads, D], both rotated (k
// only where rope_keys), and v [B, T, kv_heads, D].
std::vector<at::Tensor> step_layer_head(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                        const std::vector<at::Tensor>& lin, int64_t heads, const at::Tensor& cos,
                                        const at::Tensor& sin, bool rope_keys) {
  TORCH_CHECK(lin.size() == 9, "layer_head takes (weight, bias, scale) for q, k and v: 9 tensors, got ", lin.size());
  TORCH_CHECK(x.dim() == 3 && heads >= 1 && outputs(lin, 0) % heads == 0,
              "layer_head takes x [B, T, hidden] and a q_proj of heads x head_dim outputs, got ", x.sizes(), " and ",
              outputs(lin, 0), " outputs for ", heads, " heads");
  const int64_t b = x.size(0), t = x.size(1), d = outputs(lin, 0) / heads, kv = outputs(lin, 3) / d;
  const at::Tensor n = step_rms_norm(x.contiguous(), norm_weight, eps);
  const at::Tensor q = step_rope(project(n, lin, 0).view({b, t, heads, d}), cos, sin);
  at::Tensor k = project(n, lin, 3).view({b, t, kv, d});
  if (rope_keys) k = step_rope(k, cos, sin);
  return {q, k, project(n, lin, 6).view({b, t, kv, d})};
}
