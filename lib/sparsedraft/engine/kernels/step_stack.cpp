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
// attention kernel), and the same copies (into the cache, between the layers' and the attention's layouts), so
// every row gets the Python path's bits; the tests hold the two equal.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

// The copies between layouts, as loops of contiguous D-value rows: through ATen (copy_ into a strided slice,
// reshape of a transpose) each took about 6 us from Python, four of them a layer (scratch, in the message of the
// commit that added them).

// buffer [B, KV, slots, D] (rows D contiguous) at slots [start, start + T) = src [B, T, KV, D] (contiguous).
void write_slots(const at::Tensor& buffer, const at::Tensor& src, int64_t start) {
  TORCH_CHECK(src.is_contiguous() && src.dim() == 4 && buffer.dim() == 4 && buffer.stride(3) == 1 &&
                  src.scalar_type() == buffer.scalar_type() && src.size(0) == buffer.size(0) &&
                  src.size(2) == buffer.size(1) && src.size(3) == buffer.size(3),
              "LayerStack writes [B, T, KV, D] rows into [B, KV, slots, D] buffers, got ", src.sizes(), " and ",
              buffer.sizes());
  const int64_t B = src.size(0), T = src.size(1), KV = src.size(2), bytes = src.size(3) * src.element_size();
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(buffer.data_ptr());
  const int64_t e = buffer.element_size(), sb = buffer.stride(0) * e, sh = buffer.stride(1) * e,
                ss = buffer.stride(2) * e;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < KV; ++h)
        std::memcpy(to + b * sb + h * sh + (start + t) * ss, from + ((b * T + t) * KV + h) * bytes, bytes);
}

// Between a step's heads [B, T, H, D] and the attention's rows [B, KV, (H / KV) T, D] (head i of a group, token t:
// row i T + t), both contiguous: to_rows true gathers the rows, false scatters them back.
at::Tensor regroup(const at::Tensor& x, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, bool to_rows) {
  TORCH_CHECK(x.is_contiguous() && x.numel() == B * T * H * D, "LayerStack regroups contiguous heads or rows, got ",
              x.sizes());
  at::Tensor out = to_rows ? at::empty({B, KV, H / KV * T, D}, x.options()) : at::empty({B, T, H * D}, x.options());
  const int64_t g = H / KV, bytes = D * x.element_size();
  const auto* from = static_cast<const char*>(x.data_ptr());
  auto* to = static_cast<char*>(out.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t head = (b * T + t) * H + h, row = (b * KV + h / g) * g * T + h % g * T + t;
        std::memcpy(to + (to_rows ? row : head) * bytes, from + (to_rows ? head : row) * bytes, bytes);
      }
  return out;
}

}  // namespace

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
    const at::Tensor& q = qkv[0];  // [B, T, H, D]
    write_slots(k[i], qkv[1].contiguous(), start);
    write_slots(v[i], qkv[2].contiguous(), start);
    const int64_t b = q.size(0), t = q.size(1), h = q.size(2), d = q.size(3), kv = k[i].size(1);
    const at::Tensor rows = regroup(q.contiguous(), b, t, h, kv, d, true);
    const auto f32 = [](const at::Tensor& a) { return a.to(at::kFloat); };  // as kernels.attend_int8 hands them
    const at::Tensor out =
        kc.empty() ? attend(rows, k[i].slice(2, 0, stop), v[i].slice(2, 0, stop), scale, t, key_rows)
                   : attend_int8(f32(rows).contiguous(), kc[i], f32(ks[i]), vc[i], f32(vs[i]),
                                 f32(k[i].slice(2, n_codes, stop)), f32(v[i].slice(2, n_codes, stop)), scale, t,
                                 key_rows)
                         .to(q.scalar_type());
    x = step_layer_tail(x, regroup(out.contiguous(), b, t, h, kv, d, false), tail_lin[i], tail_norms[i],
                        tail_eps[i]);
    if (next < keep.size() && keep[next] == static_cast<int64_t>(i)) {
      kept.push_back(x);
      ++next;
    }
  }
  kept.push_back(x);
  return kept;
}
