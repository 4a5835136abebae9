// The registration of one build's ops under its own namespace (SPECHEAD_NS, e.g. spechead_avx2), so that one
// process can load and test every build the CPU runs; spechead/kernels/__init__.py compiles the sources of
// this folder once per instruction set and picks the build the library uses.
#include <torch/library.h>

#include <string>

#include "ops.h"

namespace SPECHEAD_NS {
namespace {

int64_t vector_lanes() { return W; }
std::string qlinear_path_name() { return qlinear_path(); }

}  // namespace
}  // namespace SPECHEAD_NS

// SPECHEAD_NS is a macro: these wrappers expand it before TORCH_LIBRARY pastes it into names
#define SPECHEAD_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define SPECHEAD_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

SPECHEAD_LIBRARY(SPECHEAD_NS, m) {
  m.def("draft_linear(Tensor x, Tensor w, int blocks) -> Tensor");
  m.def("qlinear(Tensor x, Tensor data, Tensor scale, Tensor min, int n) -> Tensor");
  m.def("qlinear_path() -> str", SPECHEAD_NS::qlinear_path_name);
  m.def("qrows(Tensor data, Tensor scale, Tensor min, Tensor ids, int rows) -> Tensor");
  m.def("row_topk(Tensor x, int k, bool log_softmax=False, Tensor? index_map=None) -> (Tensor, Tensor)");
  m.def(
      "active_set_add(Tensor cand, Tensor(a!) in_set, Tensor(b!) slot_of, Tensor(c!) ids, Tensor(d!) last_hit, "
      "Tensor? eligible, int n, int n_pin, int round, bool lru) -> (Tensor, Tensor, int, int)");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "int lane, int start, Tensor? mask, int kv_from, float scale) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def(
      "decoder_layers(Tensor x, Tensor(a!)[] layers, int per_weight, float eps, int[] widths, bool gelu, int[] local, "
      "Tensor cos, Tensor sin, Tensor local_cos, Tensor local_sin, int[] row0, int[] rows, int[] lanes, int[] starts, "
      "Tensor?[] masks, int[] kv_from, Tensor?[] local_masks, int[] local_kv_from, float scale, int[] keep) "
      "-> Tensor[]");
  m.def("vector_lanes() -> int", SPECHEAD_NS::vector_lanes);
}
SPECHEAD_LIBRARY_IMPL(SPECHEAD_NS, CPU, m) {
  m.impl("draft_linear", SPECHEAD_NS::draft_linear);
  m.impl("qlinear", SPECHEAD_NS::qlinear);
  m.impl("qrows", SPECHEAD_NS::qrows);
  m.impl("row_topk", SPECHEAD_NS::row_topk);
  m.impl("active_set_add", SPECHEAD_NS::active_set_add);
  m.impl("rms_norm", SPECHEAD_NS::rms_norm);
  m.impl("rope", SPECHEAD_NS::rope);
  m.impl("attend", SPECHEAD_NS::attend);
  m.impl("silu_mul", SPECHEAD_NS::silu_mul);
  m.impl("decoder_layers", SPECHEAD_NS::decoder_layers);
}
