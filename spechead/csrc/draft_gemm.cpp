// Few-row GEMM for draft heads on AVX-512 CPUs: y[m, n] = sum_k x[m, k] * w[n, k], tiles of up to 16 rows.
//
// Why: a draft head multiplies a handful of hidden states (the tree's top_k) against many rows. At
// 10 rows in bf16 that is 10 flops per weight byte; this CPU's bf16 dot-product instruction runs at
// half the rate of fp32 FMAs, so oneDNN's kernel is compute-bound at about 2x the bytes floor. Here
// each 64-byte load of bf16 weights becomes two fp32 vectors with one shift and one mask (the even
// and the odd k of 16 outputs), and 2 FMAs per input row consume them, which keeps the FMA units
// ahead of DRAM. Accumulation is in fp32.
//
// Weight layout (spechead/kernels.py writes it): rows are grouped in blocks of 16 outputs;
//   bf16: [N/16][K/2][16][2]  one 64-byte vector = 16 outputs x 2 consecutive k
//   fp32: [N/16][K][16]       one 64-byte vector = 16 outputs x 1 k
// so a row can still be rewritten in place (NanoSpec's incremental gather) with one strided copy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int kMaxRows = 16;  // rows per tile; more rows are processed in chunks of 16
// Software prefetch distance, in 64-byte vectors per weight stream (2 KB ahead). The hardware prefetcher
// alone left a cold 10-row call at 1.3-1.4x the bytes floor; 32 ahead measured best (8, 64, 128 tried).
constexpr int64_t kPrefetch = 32;
constexpr int64_t kL2Bytes = 1 << 20;  // weight bytes kept in L2 while every 16-row chunk of x passes over them

// M input rows x NB consecutive 16-output blocks. xt is x transposed, [K][ldx] fp32 (M <= ldx columns used).
template <int M, int NB>
void tile(const float* xt, int64_t ldx, const uint16_t* w, int64_t K, float* y, int64_t ldy) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t block = K * kLanes;  // elements per 16-output block
  for (int64_t j = 0; j < K / 2; ++j) {
    __m512 we[NB], wo[NB];
    for (int v = 0; v < NB; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + v * block + (j + kPrefetch) * 2 * kLanes), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(w + v * block + j * 2 * kLanes);
      we[v] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));  // k = 2j: the low half of each pair
      wo[v] = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));   // k = 2j + 1: the high half
    }
    const float* xe = xt + 2 * j * ldx;
    const float* xo = xe + ldx;
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_set1_ps(xe[m]);
      const __m512 b = _mm512_set1_ps(xo[m]);
      for (int v = 0; v < NB; ++v) {
        acc[m][v] = _mm512_fmadd_ps(we[v], a, acc[m][v]);
        acc[m][v] = _mm512_fmadd_ps(wo[v], b, acc[m][v]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NB; ++v) _mm512_storeu_ps(y + m * ldy + v * kLanes, acc[m][v]);
}

template <int M, int NB>
void tile(const float* xt, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t block = K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NB];
    for (int v = 0; v < NB; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + v * block + (k + kPrefetch) * kLanes), _MM_HINT_T0);
      wv[v] = _mm512_loadu_ps(w + v * block + k * kLanes);
    }
    const float* xk = xt + k * ldx;
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_set1_ps(xk[m]);
      for (int v = 0; v < NB; ++v) acc[m][v] = _mm512_fmadd_ps(wv[v], a, acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NB; ++v) _mm512_storeu_ps(y + m * ldy + v * kLanes, acc[m][v]);
}

// Blocks per tile: as many accumulators as fit the 32 vector registers with the weights in flight
// (a bf16 block takes two registers once widened, an fp32 block one).
template <int M, typename W>
constexpr int blocks_per_tile() {
  if constexpr (std::is_same_v<W, uint16_t>) return M <= 3 ? 4 : M <= 6 ? 3 : M <= 12 ? 2 : 1;
  return M <= 4 ? 4 : M <= 7 ? 3 : M <= 13 ? 2 : 1;
}

template <typename W>
using RangeFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t, int64_t);

// Blocks [b0, b1) for M rows: tiles of NB blocks, then single blocks for the remainder.
template <int M, typename W>
void range(const float* xt, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy, int64_t b0, int64_t b1) {
  constexpr int NB = blocks_per_tile<M, W>();
  const int64_t block = K * kLanes;
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) tile<M, NB>(xt, ldx, w + b * block, K, y + b * kLanes, ldy);
  for (; b < b1; ++b) tile<M, 1>(xt, ldx, w + b * block, K, y + b * kLanes, ldy);
}

// range<M> for M = 1..16, indexed by M - 1
template <typename W, int... I>
constexpr std::array<RangeFn<W>, sizeof...(I)> range_table(std::integer_sequence<int, I...>) {
  return {range<I + 1, W>...};
}

// Element i of a bf16 (BF16) or fp32 row as fp32: one value, or 16 from i on.
template <bool BF16>
inline float load1(const void* row, int64_t i) {
  if constexpr (BF16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(row)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<const float*>(row)[i];
  }
}

template <bool BF16>
inline __m512 load16(const void* row, int64_t i) {
  if constexpr (BF16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(row) + i);
  }
}

// Runs `fn` over blocks [b0, b1) for every chunk of up to 16 rows of x, a group of blocks at a time so that
// the group's weights are read from DRAM once and from L2 by the later chunks.
template <typename W>
void run_chunks(const std::array<RangeFn<W>, kMaxRows>& table, const float* xt, int64_t M, const W* w, int64_t K,
                float* y, int64_t ldy, int64_t b0, int64_t b1) {
  const int64_t group = std::max<int64_t>(1, kL2Bytes / (K * kLanes * static_cast<int64_t>(sizeof(W))));
  for (int64_t g0 = b0; g0 < b1; g0 += group) {
    const int64_t g1 = std::min(g0 + group, b1);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mc = std::min<int64_t>(kMaxRows, M - m0);
      table[mc - 1](xt + m0, M, w, K, y + m0 * ldy, ldy, g0, g1);
    }
  }
}

// x [M, K] (any float dtype), w blocked as above; computes the first `blocks` blocks: y [M, blocks * 16] fp32.
at::Tensor draft_linear(const at::Tensor& x, const at::Tensor& w, int64_t blocks) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && w.device().is_cpu(), "draft_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(w.is_contiguous(), "draft_linear: the blocked weight must be contiguous");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 ? (w.dim() == 4 && w.size(2) == kLanes && w.size(3) == 2)
                   : (w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == kLanes),
              "draft_linear: weight must be bf16 [N/16, K/2, 16, 2] or fp32 [N/16, K, 16], got ", w.sizes());
  const int64_t M = x.size(0), K = bf16 ? 2 * w.size(1) : w.size(1);
  TORCH_CHECK(x.size(1) == K, "draft_linear: x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(M >= 1, "draft_linear: x has no rows");
  TORCH_CHECK(blocks >= 0 && blocks <= w.size(0), "draft_linear: blocks out of range");
  // x transposed to [K, M] fp32: every row's input at k adjacent. Done here rather than with tensor ops,
  // each of which costs tens of microseconds when the caches are cold (between two draft calls).
  std::vector<float> xt(static_cast<size_t>(K * M));
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xs = x_bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  for (int64_t m = 0; m < M; ++m) {
    const void* row = static_cast<const char*>(xs.data_ptr()) + m * K * xs.element_size();
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = x_bf16 ? load1<true>(row, k) : load1<false>(row, k);
  }
  at::Tensor y = at::empty({M, blocks * kLanes}, x.options().dtype(at::kFloat));
  const float* px = xt.data();
  float* py = y.data_ptr<float>();
  const int64_t ldy = blocks * kLanes;
  // a task is a run of blocks (64+ outputs); at 10 rows x 4096 that is ~5 MFLOP, well above the fork cost
  constexpr int64_t grain = 4;
  if (bf16) {
    static constexpr auto table = range_table<uint16_t>(std::make_integer_sequence<int, kMaxRows>{});
    const auto* pw = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { run_chunks(table, px, M, pw, K, py, ldy, b0, b1); });
  } else {
    static constexpr auto table = range_table<float>(std::make_integer_sequence<int, kMaxRows>{});
    const float* pw = w.data_ptr<float>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { run_chunks(table, px, M, pw, K, py, ldy, b0, b1); });
  }
  return y;
}

// Top-k of each row of x [R, V] (bf16 or fp32), values descending: one streaming pass per row that
// compares 16 values at a time against the current k-th best and inserts the few that beat it.
// Draft heads and NanoSpec's update need the top few of vocabulary-wide rows; torch.topk and bf16
// reductions run far below the memory speed on the CPU. Equal values keep the lower index first; NaN ranks as -inf.
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
  for (; i + kLanes <= V; i += kLanes) {
    _mm_prefetch(bytes + (i + kPrefetch * kLanes) * elem, _MM_HINT_T0);  // the row streams from DRAM
    const __m512 v = load16<BF16>(row, i);
    __mmask16 hit = filled < k ? __mmask16(0xFFFF) : _mm512_cmp_ps_mask(v, _mm512_set1_ps(thr), _CMP_GT_OQ);
    if (!hit) continue;
    alignas(64) float buf[kLanes];
    _mm512_store_ps(buf, v);
    for (int l = 0; l < kLanes; ++l)
      if (((hit >> l) & 1) && (filled < k || buf[l] > thr)) insert(buf[l], i + l);
  }
  for (; i < V; ++i) {
    const float v = load1<BF16>(row, i);
    if (filled < k || v > thr) insert(v, i);
  }
}

// exp(x) for a vector of x <= 0 (logits minus their row max): 2^n * 2^f with n = round(x log2 e), |f| <= 1/2,
// 2^f by its degree-7 Taylor polynomial (relative error < 1e-8 before float rounding), scalef for 2^n
// (which underflows to 0 gracefully; x is clamped at -150 so -inf gives 0).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-150.0f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  static constexpr float c[] = {1.0f, 0.6931471806f, 0.2402265070f, 0.0555041087f,
                                0.0096181291f, 0.0013333558f, 0.0001540353f, 0.0000152527f};
  __m512 p = _mm512_set1_ps(c[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// log(sum(exp(row - mx))) + mx: the log-softmax normaliser of a row whose maximum is mx.
template <bool BF16>
float row_logsumexp(const void* row, int64_t V, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) acc = _mm512_add_ps(acc, exp_nonpositive(_mm512_sub_ps(load16<BF16>(row, i), m)));
  double sum = _mm512_reduce_add_ps(acc);
  for (; i < V; ++i) sum += std::exp(static_cast<double>(load1<BF16>(row, i)) - mx);
  return mx + static_cast<float>(std::log(sum));
}

// With log_softmax, the values are the entries' log-probabilities under the row's softmax (a draft
// head's scores): one op instead of top-k plus logsumexp, which matters on cold caches.
// With index_map, the indices returned are index_map[i] (a head's row -> token id map), saving one more op.
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
      const float lse = bf16 ? row_logsumexp<true>(row, V, vals[0]) : row_logsumexp<false>(row, V, vals[0]);
      for (int64_t j = 0; j < k; ++j) vals[j] = std::min(vals[j] - lse, 0.0f);
    }
  });
  return {vals, idx};
}

// NanoSpec's set update (nanospec.py, NanoSpecHead._append, is the reference with the same semantics):
// refresh the last-hit round of candidates already in the set (LRU), pick the distinct candidates not
// in it (first occurrence order, drafter-eligible), give them free slots and, under LRU, the slots of
// the least recently hit ids (stable by slot, never one hit this round), and update ids / membership /
// slot map / last-hit in place. Returns (new ids that got a slot, their slots, new ids in all, evicted).
// It is a few hundred scalar steps; as ~30 tensor ops it cost ~0.5 ms per round with cold caches.
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

}  // namespace

TORCH_LIBRARY(spechead, m) {
  m.def("draft_linear(Tensor x, Tensor w, int blocks) -> Tensor");
  m.def("row_topk(Tensor x, int k, bool log_softmax=False, Tensor? index_map=None) -> (Tensor, Tensor)");
  m.def(
      "active_set_add(Tensor cand, Tensor(a!) in_set, Tensor(b!) slot_of, Tensor(c!) ids, Tensor(d!) last_hit, "
      "Tensor? eligible, int n, int n_pin, int round, bool lru) -> (Tensor, Tensor, int, int)");
}
TORCH_LIBRARY_IMPL(spechead, CPU, m) {
  m.impl("draft_linear", draft_linear);
  m.impl("row_topk", row_topk);
  m.impl("active_set_add", active_set_add);
}
