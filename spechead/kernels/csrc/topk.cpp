// row_topk: the top-k of a few vocabulary-wide rows in one streaming pass, optionally fused with the row's
// log-softmax and a row -> id map; active_set_add: NanoSpec's active-set update as one op.
//
// Row-count property: each row's top-k and log-softmax normaliser are computed from that row alone, in one fixed
// order, so a row's result bits do not depend on how many rows share the call.
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "ops.h"

namespace SPECHEAD_NS {
namespace {

constexpr int64_t kAhead = 512;  // values prefetched ahead of the scan: the rows stream from DRAM

template <bool BF16>
inline float load1(const void* row, int64_t i) {
  if constexpr (BF16) return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
  return static_cast<const float*>(row)[i];
}
template <bool BF16>
inline Vec loadv(const void* row, int64_t i) {
  if constexpr (BF16) return vload_bf16(static_cast<const uint16_t*>(row) + i);
  return vload(static_cast<const float*>(row) + i);
}

// Top-k of each row of x [R, V] (bf16 or fp32), values descending: one streaming pass per row that compares W
// values at a time against the current k-th best and inserts the few that beat it. Draft heads and NanoSpec's
// update need the top few of vocabulary-wide rows; torch.topk and bf16 reductions run far below the memory speed
// on the CPU. Equal values keep the lower index first; NaN ranks as -inf.
template <bool BF16>
void topk_row(const void* row, int64_t V, int64_t k, float* vals, int64_t* idx) {
  int64_t filled = 0;
  float thr = -std::numeric_limits<float>::infinity();
  auto insert = [&](float v, int64_t i) {
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();  // NaN ranks lowest
    int64_t p = filled < k ? filled++ : k - 1;
    while (p > 0 && vals[p - 1] < v) {
      vals[p] = vals[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    vals[p] = v;
    idx[p] = i;
    if (filled == k) thr = vals[k - 1];
  };
  const char* bytes = static_cast<const char*>(row);
  constexpr int64_t elem = BF16 ? 2 : 4;
  int64_t i = 0;
  for (; i + W <= V; i += W) {
    prefetch(bytes + (i + kAhead) * elem);
    const Vec v = loadv<BF16>(row, i);
    const uint32_t hit = filled < k ? (1u << W) - 1 : vgt_mask(v, thr);
    if (!hit) continue;
    alignas(64) float buf[W];
    vstore(buf, v);
    for (int l = 0; l < W; ++l)
      if (((hit >> l) & 1) && (filled < k || buf[l] > thr)) insert(buf[l], i + l);
  }
  for (; i < V; ++i) {
    const float v = load1<BF16>(row, i);
    if (filled < k || v > thr) insert(v, i);
  }
}

// log(sum(exp(row - mx))) + mx: the log-softmax normaliser of a row whose maximum is mx.
template <bool BF16>
double row_logsumexp(const void* row, int64_t V, float mx) {
  const Vec m = vset1(mx), neg = vset1(-1.0f);
  constexpr int64_t kFlush = 64 * W;  // fp32 lanes sum this many values, then a double takes them (error ~1e-7)
  double sum = 0.0;
  int64_t i = 0;
  while (i + W <= V) {
    Vec acc = vzero();
    for (const int64_t end = std::min(V, i + kFlush); i + W <= end; i += W)
      acc = vadd(acc, vexp_nonpositive(vfma(m, neg, loadv<BF16>(row, i))));
    sum += vsum(acc);
  }
  for (; i < V; ++i) sum += std::exp(static_cast<double>(load1<BF16>(row, i)) - mx);
  return mx + std::log(sum);  // in double: the log-probabilities then round once
}

}  // namespace

// With log_softmax, the values are the entries' log-probabilities under the row's softmax (a draft head's
// scores): one op instead of top-k plus logsumexp, which matters on cold caches. With index_map, the indices
// returned are index_map[i] (a head's row -> token id map), saving one more op.
std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& x, int64_t k, bool log_softmax,
                                            const std::optional<at::Tensor>& index_map) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.is_contiguous(), "row_topk: x must be a contiguous 2-D CPU tensor");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "row_topk: x must be bf16 or fp32");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "row_topk: k must be in [1, ", V, "], got ", k);
  at::Tensor vals = at::empty({R, k}, x.options().dtype(at::kFloat));
  at::Tensor idx = at::empty({R, k}, x.options().dtype(at::kLong));
  const int64_t* map = nullptr;
  if (index_map.has_value()) {
    const at::Tensor& m = *index_map;
    TORCH_CHECK(m.dim() == 1 && m.scalar_type() == at::kLong && m.is_contiguous() && m.device().is_cpu() &&
                    m.numel() >= V,
                "row_topk: index_map must be a contiguous int64 CPU vector with at least ", V, " entries");
    map = m.data_ptr<int64_t>();
  }
  const auto* base = static_cast<const char*>(x.data_ptr());
  const int64_t stride = V * x.element_size();
  float* pv = vals.data_ptr<float>();
  int64_t* pi = idx.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const void* row = base + r * stride;
      float* vals = pv + r * k;
      int64_t* idx = pi + r * k;
      bf16 ? topk_row<true>(row, V, k, vals, idx) : topk_row<false>(row, V, k, vals, idx);
      if (map != nullptr)
        for (int64_t j = 0; j < k; ++j) idx[j] = map[idx[j]];
      if (!log_softmax) continue;
      const double lse = bf16 ? row_logsumexp<true>(row, V, vals[0]) : row_logsumexp<false>(row, V, vals[0]);
      for (int64_t j = 0; j < k; ++j) vals[j] = static_cast<float>(std::min(vals[j] - lse, 0.0));
    }
  });
  return {vals, idx};
}

// NanoSpec's set update (scalar code: the same in every build).
// nanospec.py, NanoSpecHead._append, is the reference with the same semantics: refresh the last-hit round of
// candidates already in the set (LRU), pick the distinct candidates not in it (first occurrence order,
// drafter-eligible), give them free slots and, under LRU, the slots of the least recently hit ids (stable by
// slot, never one hit this round), and update ids / membership / slot map / last-hit in place. Returns (new ids
// that got a slot, their slots, new ids in all, evicted). A few hundred scalar steps; as ~30 tensor ops it costs
// ~0.5 ms per round with cold caches.
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> active_set_add(
    const at::Tensor& cand, at::Tensor& in_set, at::Tensor& slot_of, at::Tensor& ids, at::Tensor& last_hit,
    const std::optional<at::Tensor>& eligible, int64_t n, int64_t n_pin, int64_t round, bool lru) {
  auto cpu_vec = [](const at::Tensor& t, at::ScalarType type) {
    return t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() && t.scalar_type() == type;
  };
  TORCH_CHECK(cpu_vec(cand, at::kLong) && cpu_vec(slot_of, at::kLong) && cpu_vec(ids, at::kLong) &&
                  cpu_vec(last_hit, at::kLong) && cpu_vec(in_set, at::kBool),
              "active_set_add: state must be contiguous CPU vectors (int64, bool for the mask)");
  const int64_t V = in_set.numel(), w_max = ids.numel();
  TORCH_CHECK(slot_of.numel() == V && last_hit.numel() == w_max + 1 && 0 <= n_pin && n_pin <= n && n <= w_max,
              "active_set_add: inconsistent state sizes");
  const bool* ok = nullptr;
  if (eligible.has_value()) {
    TORCH_CHECK(cpu_vec(*eligible, at::kBool) && eligible->numel() == V, "active_set_add: bad eligible mask");
    ok = eligible->data_ptr<bool>();
  }
  const int64_t* c = cand.data_ptr<int64_t>();
  bool* member = in_set.data_ptr<bool>();
  int64_t* slot = slot_of.data_ptr<int64_t>();
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* hit = last_hit.data_ptr<int64_t>();
  const int64_t m = cand.numel();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(c[i] >= 0 && c[i] < V, "active_set_add: candidate id out of range");
  if (lru)
    for (int64_t i = 0; i < m; ++i)
      if (slot[c[i]] >= 0) hit[slot[c[i]]] = round;
  // distinct fresh candidates, first occurrence first (in_set doubles as the "seen" mark, undone below)
  std::vector<int64_t> fresh;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = c[i];
    if (member[t] || (ok != nullptr && !ok[t])) continue;
    member[t] = true;
    fresh.push_back(t);
  }
  for (int64_t t : fresh) member[t] = false;
  const int64_t k = static_cast<int64_t>(fresh.size()), room = w_max - n;
  std::vector<int64_t> slots;
  for (int64_t s = n; s < n + std::min(k, room); ++s) slots.push_back(s);
  int64_t evicted = 0;
  if (k > room && lru) {
    std::vector<int64_t> order(n - n_pin);
    for (int64_t i = 0; i < n - n_pin; ++i) order[i] = n_pin + i;
    const int64_t need = std::min<int64_t>(k - room, n - n_pin);
    std::partial_sort(order.begin(), order.begin() + need, order.end(), [&](int64_t a, int64_t b) {
      return hit[a] != hit[b] ? hit[a] < hit[b] : a < b;  // least recently hit, then lowest slot
    });
    for (int64_t i = 0; i < need; ++i) {
      const int64_t v = order[i];
      if (hit[v] >= round) continue;  // hit this round: kept
      member[id[v]] = false;
      slot[id[v]] = -1;
      slots.push_back(v);
      ++evicted;
    }
  }
  const int64_t placed = static_cast<int64_t>(slots.size());
  at::Tensor new_ids = at::empty({placed}, cand.options());
  at::Tensor new_slots = at::empty({placed}, cand.options());
  for (int64_t i = 0; i < placed; ++i) {
    const int64_t t = fresh[i], s = slots[i];
    id[s] = t;
    member[t] = true;
    slot[t] = s;
    hit[s] = round;
    new_ids.data_ptr<int64_t>()[i] = t;
    new_slots.data_ptr<int64_t>()[i] = s;
  }
  return {new_ids, new_slots, k, evicted};
}

}  // namespace SPECHEAD_NS
