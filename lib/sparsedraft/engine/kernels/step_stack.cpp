// A decode or verification step's whole decoder stack in one call, where the cache's step is plain: each layer's
// new keys and values written at slots [start, stop) of its buffers, every slot before stop attended causally
// (the first n_codes of them read as int8 codes, for a quantised draft view).
//
// Why: a step makes three kernel calls a layer (layer_head, attend, layer_tail), and the Python between them
// (module calls, the cache's index writes, argument checks) took about 2 ms of a 14 ms bf16 SmolLM2-135M decode on
// a 2-core Zen 4 EPYC, a seventh of the step, however short its context (scratch, in the message of the commit
// that added this file; engine/stack.py says where it runs).
//
// Exactness: the calls the Python path makes, in its order, on the same tensors (the few-row kernels, the
// attention kernel, ATen's copies into the cache), so every row gets the Python path's bits; the tests hold the
// two equal.

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

#include "kernels.h"

LayerStack::LayerStack(std::vector<at::Tensor> head_norms, std::vector<double> head_eps,
                       std::vector<std::vector<at::Tensor>> head_lin, std::vector<at::Tensor> tail_norms,
                       std::vector<double> tail_eps, std::vector<std::vector<at::Tensor>> tail_lin,
                       std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<at::Tensor> kc,
                       std::vector<at::Tensor> ks, std::vector<at::Tensor> vc, std::vector<at::Tensor> vs,
                       int64_t n_codes, int64_t heads, double scale, bool rope_keys, int64_t key_rows)
    : head_norms(std::move(head_norms)), head_eps(std::move(head_eps)), head_lin(std::move(head_lin)),
      tail_norms(std::move(tail_norms)), tail_eps(std::move(tail_eps)), tail_lin(std::move(tail_lin)),
      k(std::move(k)), v(std::move(v)), kc(std::move(kc)), ks(std::move(ks)), vc(std::move(vc)), vs(std::move(vs)),
      n_codes(n_codes), heads(heads), scale(scale), rope_keys(rope_keys), key_rows(key_rows) {
  const size_t n = this->k.size();
  TORCH_CHECK(n >= 1 && this->v.size() == n && this->head_norms.size() == n && this->head_eps.size() == n &&
                  this->head_lin.size() == n && this->tail_norms.size() == n && this->tail_eps.size() == n &&
                  this->tail_lin.size() == n,
              "LayerStack takes one norm, eps, linears and k/v buffer per layer for each half, got ", n, " k buffers");
  const size_t coded = this->kc.size();
  TORCH_CHECK((coded == 0 || coded == n) && this->ks.size() == coded && this->vc.size() == coded &&
                  this->vs.size() == coded && n_codes >= 0 && (coded > 0 || n_codes == 0),
              "LayerStack takes int8 codes and scales for every layer or for none, got ", coded, " for ", n, " layers");
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(this->k[i].dim() == 4 && this->k[i].sizes() == this->v[i].sizes(),
                "LayerStack takes k, v buffers [B, KV, slots, D] of one shape, layer ", i, " has ", this->k[i].sizes(),
                " and ", this->v[i].sizes());
}

// x [B, T, hidden] the step's input; cos, sin its rotation. Returns the outputs of the layers in keep (ascending)
// and then the last layer's.
std::vector<at::Tensor> LayerStack::run(at::Tensor x, int64_t start, int64_t stop, const at::Tensor& cos,
                                        const at::Tensor& sin, const std::vector<int64_t>& keep) const {
  TORCH_CHECK(x.dim() == 3 && stop - start == x.size(1) && start >= n_codes && stop <= k[0].size(2),
              "LayerStack.run takes x [B, T, hidden] and slots [start, start + T) past the ", n_codes,
              " coded ones and within the buffers' ", k[0].size(2), ", got ", x.sizes(), " and [", start, ", ", stop,
              ")");
  std::vector<at::Tensor> kept;
  size_t next = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    const std::vector<at::Tensor> qkv =
        step_layer_head(x, head_norms[i], head_eps[i], head_lin[i], heads, cos, sin, rope_keys);
    const at::Tensor q = qkv[0].transpose(1, 2);  // [B, H, T, D]
    k[i].slice(2, start, stop).copy_(qkv[1].transpose(1, 2));
    v[i].slice(2, start, stop).copy_(qkv[2].transpose(1, 2));
    const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3), kv = k[i].size(1);
    const at::Tensor rows = q.reshape({b, kv, (h / kv) * t, d});
    const auto f32 = [](const at::Tensor& a) { return a.to(at::kFloat); };  // as kernels.attend_int8 hands them
    const at::Tensor out =
        kc.empty() ? attend(rows, k[i].slice(2, 0, stop), v[i].slice(2, 0, stop), scale, t, key_rows)
                   : attend_int8(f32(rows).contiguous(), kc[i], f32(ks[i]), vc[i], f32(vs[i]),
                                 f32(k[i].slice(2, n_codes, stop)), f32(v[i].slice(2, n_codes, stop)), scale, t,
                                 key_rows)
                         .to(q.scalar_type());
    x = step_layer_tail(x, out.reshape({b, h, t, d}).transpose(1, 2).reshape({b, t, h * d}), tail_lin[i],
                        tail_norms[i], tail_eps[i]);
    if (next < keep.size() && keep[next] == static_cast<int64_t>(i)) {
      kept.push_back(x);
      ++next;
    }
  }
  kept.push_back(x);
  return kept;
}
