// The one Python module of the C++ kernels: each kernel lives in its own file, bound here.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // the Tensor <-> Python caster; far lighter than torch/extension.h

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, double scale, int64_t T);
int64_t attend_chunk();
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "GQA decode/verification attention over a KV cache (see decode_attention.cpp)");
  m.attr("chunk") = attend_chunk();
  m.def("linear", &few_rows_linear, "x W^T (+ b) for 1..16 rows, each weight read once (few_rows_linear.cpp)");
}
