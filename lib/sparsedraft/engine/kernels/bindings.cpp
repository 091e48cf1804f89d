// The one Python module of the C++ kernels: each kernel lives in its own file, bound here.

#include <ATen/core/Tensor.h>
#include <pybind11/stl.h>  // std::vector<Tensor> arguments
#include <torch/csrc/utils/pybind.h>  // the Tensor <-> Python caster; far lighter than torch/extension.h

#include <vector>

#include "kernels.h"
#include "tiles.h"

// The widest vector instruction set the compiler was allowed to use for these files (what -march
// turned on), so a bench can say which path ran rather than which one the CPU offers.
const char* vector_path() {
#if defined(__AVX512BF16__)
  return "AVX512-BF16";
#elif defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2+FMA";
#elif defined(__AVX2__)
  return "AVX2";
#elif defined(__ARM_NEON)
  return "NEON";
#else
  return "portable";
#endif
}

// 1: bf16 attention and few-row linear run on AMX tiles; 0: not built for them, or turned off; -1: built,
// but the OS refused the tile state.
int64_t tiles() {
#if SPARSEDRAFT_TILES
  if (!tiles_allowed.load()) return 0;
  return tiles_granted() ? 1 : -1;
#else
  return 0;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "GQA decode/verification attention over a KV cache (see decode_attention.cpp)");
  m.def("attend_int8", &attend_int8, "the same over int8 codes (a scale per key) plus a float tail");
  m.attr("chunk") = attend_chunk();
  m.attr("lanes") = attend_lanes();
  m.def("allow_tiles", [](bool allow) { tiles_allowed.store(allow); },
        "let bf16 attention and linear use AMX tiles where built (default) or not");
  m.def("dots", &attend_dots, "1: bf16 attention on AVX512-BF16 dot products (no AMX); 0: not built or off");
  m.def("dots_for", &attend_dots_for, "dots(), and head_dim D a size the dot-product path takes");
  m.def("tiles", &tiles, "1: bf16 attention and few-row linear on AMX tiles; 0: not built or off; -1: refused");
  m.attr("vector_path") = vector_path();
  m.attr("vnni") = rounded_rows_vnni();
  m.attr("pair_from") = linear_pair_from();
  m.attr("linear_rows") = kLinearRows;  // kernels.MAX_LINEAR_ROWS must equal it (tests/test_kernels.py)
  m.def("allow_pairs", [](bool on) { rows_paired.store(on); },
        "AVX2+FMA: run few-row linear steps past pair_from rows two rows at a time (true) or all rows at once");
  m.def("linear", &few_rows_linear, "x W^T (+ b) for 1..16 rows, each weight read once (few_rows_linear.cpp)");
  m.def("linear_int8", &few_rows_linear_int8, "(x Q^T) * scale (+ b) for 1..16 rows over int8 codes Q");
  m.def("linear_rounded", &rounded_rows_linear,
        "(q(x) Q^T) * sx * scale (+ b): x rounded to int8 per row, packed int8 codes Q (rounded_rows_linear.cpp)");
  m.def("rms_norm", &step_rms_norm, "RMSNorm of each row, Hugging Face's order (step_pointwise.cpp)");
  m.def("rope", &step_rope, "rotary embedding of x [..., H, D] by cos, sin [..., D] (step_pointwise.cpp)");
  m.def("layer_head", &step_layer_head, "RMSNorm, q/k/v and RoPE in one call (step_block.cpp)");
  m.def("layer_tail", &step_layer_tail, "o_proj, residual, RMSNorm, gated MLP, residual in one call (step_block.cpp)");
  // module_local: another build of these files (kernels.build_from, an A/B in one process) registers its own
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local(),
                               "a step's decoder stack in one call (step_stack.cpp)")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<double>, std::vector<std::vector<at::Tensor>>,
                          std::vector<at::Tensor>, std::vector<double>, std::vector<std::vector<at::Tensor>>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                          double, bool, int64_t>())
      .def("run", &LayerStack::run,
           "the step's layers over slots [start, stop); the kept layers' outputs, then the last's");
}
