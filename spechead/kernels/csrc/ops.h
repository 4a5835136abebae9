// The ops of one build, declared for the registration (register.cpp) and for the fused layer (layer.cpp), which
// calls the others: draft_linear (gemm.cpp), row_topk and active_set_add (topk.cpp), rope and attend with the
// attention plan a layer batches over requests (attention.cpp), rms_norm, silu_mul and decoder_layers (layer.cpp).
#pragma once

// ATen's tensor type and the two factory ops the kernels call, not all of ATen/ATen.h, which would add a few
// seconds to the compile of every source that includes this
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "simd.h"

namespace SPECHEAD_NS {

// gemm.cpp
at::Tensor draft_linear(const at::Tensor& x, const at::Tensor& w, int64_t blocks);

// qgemm.cpp: the integer block GEMM and the path it takes on this CPU (avx512-vnni, avx2, portable)
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min,
                   int64_t n);
const char* qlinear_path();
at::Tensor qrows(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min, const at::Tensor& ids,
                 int64_t rows);

// A projection's weight as decoder_layers takes it: one blocked fp32 / bf16 tensor (draft_linear) or a quantized
// weight's data, scale and min (qlinear); y [M, n].
at::Tensor project(const at::Tensor& x, at::TensorList w, int64_t n);

// topk.cpp
std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& x, int64_t k, bool log_softmax,
                                            const std::optional<at::Tensor>& index_map);
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> active_set_add(
    const at::Tensor& cand, at::Tensor& in_set, at::Tensor& slot_of, at::Tensor& ids, at::Tensor& last_hit,
    const std::optional<at::Tensor>& eligible, int64_t n, int64_t n_pin, int64_t round, bool lru);

// attention.cpp
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                  const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t lane, int64_t start,
                  const std::optional<at::Tensor>& mask, int64_t kv_from, double scale);

// One request's attention once its queries are roped and its keys and values cached (plan_attend): each row's
// visible slots, the scores' scratch and the split of its queries into tasks; run_task runs one task, so a layer
// can spread several requests' tasks over the threads in one parallel loop (run_plans).
struct AttendPlan {
  int64_t T = 0, S = 0, N = 0, KV = 0, D = 0, L = 0, kv_from = 0, end = 0;
  int64_t group = 0, padded = 0, per_g = 0, per_task = 0, tasks_per_g = 0;
  float sc = 0.0f;
  const float* kc = nullptr;
  const float* vc = nullptr;
  const float* pq = nullptr;
  float* po = nullptr;
  at::Tensor qr;
  std::unique_ptr<int32_t[]> seen;
  std::vector<int64_t> count;
  std::unique_ptr<float[]> scores;
  int64_t tasks() const { return KV * tasks_per_g; }
  void run_task(int64_t task, std::vector<float>& acc) const;
};

// q [T, N*D], k / v [T, KV*D] (inner stride 1, any row stride), cos / sin [T, D], the caches [lanes, KV, max_len,
// D]; writes the lane's slots [start, start + T) and plans the rows' attention into po [T, N*D]. min_tasks: the
// fewest tasks the plan should give (smaller tasks where its queries would give fewer).
AttendPlan plan_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t lane, int64_t start,
                       const std::optional<at::Tensor>& mask, int64_t kv_from, double scale, float* po,
                       int64_t min_tasks);
void run_plans(const std::vector<AttendPlan>& plans);

// layer.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
std::vector<at::Tensor> decoder_layers(const at::Tensor& x, at::TensorList layers, int64_t per_weight, double eps,
                                       at::IntArrayRef widths, bool gelu, at::IntArrayRef local, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& local_cos,
                                       const at::Tensor& local_sin, at::IntArrayRef row0, at::IntArrayRef rows,
                                       at::IntArrayRef lanes, at::IntArrayRef starts,
                                       const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef kv_from,
                                       const c10::List<std::optional<at::Tensor>>& local_masks,
                                       at::IntArrayRef local_kv_from, double scale, at::IntArrayRef keep);

}  // namespace SPECHEAD_NS
