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

#include <atomic>
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

// One request's rows as every layer of one kind (global, or Gemma's sliding window) sees them: their rotary rows,
// each row's visible slots, and the scratch a layer's plan fills (roped queries, scores). decoder_layers makes one
// per request and kind a forward and every layer's plan reuses it. cos / sin [rows, D] contiguous, the request's
// rows [row0, row0 + T); mask [T, start + T - kv_from] or none (causal).
struct AttendRows {
  int64_t T = 0, D = 0, S = 0, lane = 0, start = 0, kv_from = 0;
  const float* cos = nullptr;
  const float* sin = nullptr;
  std::vector<int32_t> seen;  // row t's visible slots in slot order: seen[t * S + c] for c < count[t]
  std::vector<int64_t> count;
  std::vector<float> qr, scores;
  std::vector<float> cmax, csum, cacc;  // per row, head and chunk: the chunk's largest score, sum and weighted values
};
AttendRows attend_rows(const at::Tensor& cos, const at::Tensor& sin, int64_t row0, int64_t T, int64_t lane,
                       int64_t start, const std::optional<at::Tensor>& mask, int64_t kv_from);

// One request's attention in one layer once its queries are roped and its keys and values cached (plan_attend):
// the split of its queries into groups and of its keys' places into chunks, a task being one group over one chunk;
// run_task runs one task, and the last of a group's chunks to finish merges the group's outputs, so a layer can
// spread several requests' tasks over the threads in one parallel loop (run_plans).
struct AttendPlan {
  int64_t T = 0, S = 0, N = 0, KV = 0, D = 0, L = 0, kv_from = 0, start = 0, end = 0;
  int64_t group = 0, padded = 0, per_g = 0, per_task = 0, tasks_per_g = 0, chunk0 = 0, chunks = 1;
  float sc = 0.0f;
  const float* kc = nullptr;
  const float* vc = nullptr;
  const float* pq = nullptr;
  float* po = nullptr;
  const int32_t* seen = nullptr;
  const int64_t* count = nullptr;
  float* scores = nullptr;
  float* cmax = nullptr;
  float* csum = nullptr;
  float* cacc = nullptr;
  int64_t tasks() const { return KV * chunks * tasks_per_g; }
  // left: the plan's per-group counts of chunks still to run (KV * tasks_per_g of them)
  void run_task(int64_t task, std::atomic<int32_t>* left) const;
};

// q [T, N*D] at row stride ldq, k / v [T, KV*D] at row strides ldk / ldv, the caches [lanes, KV, max_len, D]: RoPE, the
// keys and values written at the lane's slots [start, start + T), and the rows' attention planned into po
// [T, N*D]. min_tasks: the fewest tasks the plan should give (smaller tasks where its queries would give fewer).
AttendPlan plan_attend(AttendRows& rows, const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                       int64_t ldv, int64_t N, at::Tensor& k_cache, at::Tensor& v_cache, double scale, float* po,
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
