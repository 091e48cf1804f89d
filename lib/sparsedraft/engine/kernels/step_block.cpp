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
// silu, mul and add), on the same values, so a row gets the Python path's bits: model.py's Block takes
// whichever applies, and the tests hold the two to each other bit for bit.

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
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

}  // namespace

// x [B, T, hidden] the layer's input, a [B, T, heads * head_dim] its attention output before o_proj; lin holds
// (weight, bias, scale) for o_proj, gate_proj, up_proj and down_proj in that order.
at::Tensor step_layer_tail(const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& lin,
                           const at::Tensor& norm_weight, double eps) {
  TORCH_CHECK(lin.size() == 12, "layer_tail takes (weight, bias, scale) for o, gate, up and down: 12 tensors, got ",
              lin.size());
  TORCH_CHECK(x.dim() == 3 && a.dim() == 3 && x.size(0) == a.size(0) && x.size(1) == a.size(1),
              "layer_tail takes x [B, T, hidden] and a [B, T, heads * head_dim], got ", x.sizes(), " and ", a.sizes());
  const at::Tensor h = at::add(x, project(a.contiguous(), lin, 0));
  const at::Tensor n = step_rms_norm(h, norm_weight, eps);
  const at::Tensor gated = at::mul(at::silu(project(n, lin, 3)), project(n, lin, 6));
  return at::add(h, project(gated, lin, 9));
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
