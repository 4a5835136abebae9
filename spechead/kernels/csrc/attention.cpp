// rope: the rotary embedding of a few rows; attend: RoPE, the cache write and the attention of a few query rows
// over a cache lane, as one op; and attend_rows / plan_attend / run_plans, with which the fused layer (layer.cpp)
// works out each request's rows once a forward and runs several requests' attention in one parallel loop.
//
// One op for a decode step's or a verification's attention: RoPE on the rows' queries and keys, the keys and
// values stored at slots [start, start+T) of the cache lane, then each query row (and head) attends over the slots
// its mask allows. The library's SDPA spends ~0.26 ms a layer on one query row (9 heads over 600 slots, two
// threads) for work that reads 0.9 MB: a tenth of a step's time; this is its bytes.
//
// Row-count property, and why it matters for losslessness: a row's output is computed from the list of slots it
// may see, in slot order, and nothing else. The list is cut into chunks of kAttnChunk places, a key's place being
// the position it has once the row's tokens are committed: its slot in the committed prefix (slots below the
// call's first, `start`), else `start` plus its rank among the row's keys from the call's own slots (a tree node's
// ancestors, which take consecutive slots when accepted). In each chunk the scores, their maximum, the
// exponentials' sum and the weighted values are accumulated in one fixed order, and the chunks are merged in order
// (flash-decoding's split, at boundaries that belong to the row's keys, not to the call). Whatever rows, requests,
// tasks and threads share the call, a row gets the same bits. A tree node sees its committed prefix and its
// ancestors; were it accepted, the decode step at the same position would see the same keys and values (the
// projections' kernel is row-count invariant) at the same places, in the same order, so verification and decoding
// give bitwise the same hidden state.
//
// Why chunks: a decode step has a few queries per key/value head (the demo's 3 x 3, Gemma 3's 4 x 1) for two
// threads. Split by query, tasks of one head each read its keys and values; split by chunk, each byte of the cache
// is read from memory once and the threads share the stream. (Cut at slots instead of places, a tree node whose
// ancestors straddle a boundary would merge other chunks than its decode step: a different rounding.)
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "ops.h"

namespace SPECHEAD_NS {
namespace {

// One head of one row rotated by position: o = a * cos + rotate_half(a) * sin, rotate_half(a) = (-a2, a1) for the
// halves a1, a2 of the head. The same products and sum as the tensor version (model.apply_rope).
inline void rope_row(const float* a, const float* c, const float* s, float* o, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) o[i] = a[i] * c[i] + (-a[i + h]) * s[i];
  for (int64_t i = h; i < D; ++i) o[i] = a[i] * c[i] + a[i - h] * s[i];
}

inline float dot(const float* a, const float* b, int64_t D) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + W <= D; i += W) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

// The largest of x[0:n]: eight independent running maxima (one chain of n dependent maxes was 5 % of a 16-row
// call). A maximum is exact whatever the order, so this is the same value a scan gives.
inline float row_max(const float* x, int64_t n) {
  float m[8];
  std::fill(m, m + 8, -std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) m[u] = std::max(m[u], x[j + u]);
  for (; j < n; ++j) m[0] = std::max(m[0], x[j]);
  return *std::max_element(m, m + 8);
}

// Every 64-byte cache line of n floats from p (a key or value row of 64 floats is four lines: prefetching its first
// line alone left attention waiting on the other three when the cache lane streams from memory).
inline void prefetch_floats(const float* p, int64_t n) {
  for (int64_t off = 0; off < n; off += 16) prefetch(p + off);
}

// The end of the run of list[from, count) below `slot`: the visible slots of one 64-slot block (the list is sorted).
inline int64_t slots_before(const int32_t* list, int64_t from, int64_t count, int64_t slot) {
  return std::lower_bound(list + from, list + count, static_cast<int32_t>(slot)) - list;
}

constexpr int64_t kAttnAhead = 64;  // slots: ~100 ns of DRAM latency at a few ns a slot, with room
constexpr int64_t kAttnBlock = 64;  // slots whose keys (16 KB at 64 fp32 values a head), then values, sit in L1
constexpr int64_t kAttnChunk = 256;  // places: a row's list is attended in chunks of these, merged in order
constexpr int64_t kTaskQueries = 16;  // queries of one key/value head a task takes at most

// a[0 : NB*W] += p[j] * v[list[j]] for j in [j0, j1), in order, the accumulators in registers meanwhile
template <int NB>
inline void weigh_values(const float* v, int64_t D, const int32_t* list, const float* p, int64_t j0, int64_t j1,
                         float* a) {
  Vec r[NB];
  for (int u = 0; u < NB; ++u) r[u] = vload(a + u * W);
  for (int64_t j = j0; j < j1; ++j) {
    const float* row = v + list[j] * D;
    if (j + kAttnAhead < j1) prefetch_floats(v + list[j + kAttnAhead] * D, NB * W);
    const Vec pj = vset1(p[j]);
    for (int u = 0; u < NB; ++u) r[u] = vfma(pj, vload(row + u * W), r[u]);
  }
  for (int u = 0; u < NB; ++u) vstore(a + u * W, r[u]);
}

// Scores of NQ queries against NS key rows that all of them see: out[i * NS + s] = dot(q_i, k_s) * sc, each sum
// formed as dot() forms it (W-lane FMA chains over d, then vsum), so a score does not depend on the path that
// computed it. Each key vector is loaded once for the NQ queries, and the sums are reduced eight at a time.
template <int NQ, int NS>
inline void score_tile(const float* const* qp, const float* const* kp, int64_t D, float sc, float* out) {
  Vec a[NQ * NS];
  for (int u = 0; u < NQ * NS; ++u) a[u] = vzero();
  for (int64_t d = 0; d < D; d += W) {
    Vec kv[NS];
    for (int s = 0; s < NS; ++s) kv[s] = vload(kp[s] + d);
    for (int i = 0; i < NQ; ++i) {
      const Vec qd = vload(qp[i] + d);
      for (int s = 0; s < NS; ++s) a[i * NS + s] = vfma(qd, kv[s], a[i * NS + s]);
    }
  }
  float r[NQ * NS];
  vsum_many(a, NQ * NS, r);
  int u = 0;  // scaled a vector at a time: each lane the one IEEE product the scalar tail forms
  for (; u + W <= NQ * NS; u += W) vstore(out + u, vmul(vload(r + u), vset1(sc)));
  for (; u < NQ * NS; ++u) out[u] = r[u] * sc;
}

// Keys per score tile for NQ queries: a vsum_many batch of sums (eight with AVX2, sixteen with AVX-512) where the
// registers allow, a divisor of the 64-slot block.
template <int NQ>
constexpr int score_slots() {
#if defined(SPECHEAD_ISA_AVX512)
  return NQ == 1 ? 16 : NQ == 2 ? 8 : 4;
#else
  return NQ == 1 ? 8 : NQ == 2 ? 4 : 2;
#endif
}

// NQ queries that all see slots [s0, s1) of a block: sq[i][j0[i] + s - s0] = their scores against those keys.
// With `pf`, the keys kAttnAhead slots on (below `end`) are prefetched: a decode step streams the lane.
template <int NQ>
void score_block(const float* const* qp, float* const* sq, const int64_t* j0, const float* kh, int64_t D,
                 int64_t s0, int64_t s1, float sc, bool pf, int64_t end) {
  constexpr int NS = score_slots<NQ>();
  float out[NQ * NS];
  int64_t s = s0;
  for (; s + NS <= s1; s += NS) {
    const float* kp[NS];
    for (int u = 0; u < NS; ++u) kp[u] = kh + (s + u) * D;
    if (pf)
      for (int u = 0; u < NS; ++u)
        if (s + u + kAttnAhead < end) prefetch_floats(kh + (s + u + kAttnAhead) * D, D);
    score_tile<NQ, NS>(qp, kp, D, sc, out);
    for (int i = 0; i < NQ; ++i) std::memcpy(sq[i] + j0[i] + s - s0, out + i * NS, NS * sizeof(float));
  }
  for (; s < s1; ++s) {
    const float* kp[1] = {kh + s * D};
    score_tile<NQ, 1>(qp, kp, D, sc, out);
    for (int i = 0; i < NQ; ++i) sq[i][j0[i] + s - s0] = out[i];
  }
}

// acc_i[d : d + NV W] += p_i[s - s0] * v[s][d : d + NV W] for s in [s0, s1), in order, for NQ queries that all
// see those slots: each value vector is loaded once for all of them; every output is the chain weigh_values forms.
template <int NQ, int NV>
inline void weigh_chunk(const float* vh, int64_t D, int64_t d, int64_t s0, int64_t s1, const float* const* p,
                        float* const* acc, bool pf, int64_t end) {
  Vec r[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int u = 0; u < NV; ++u) r[i][u] = vload(acc[i] + d + u * W);
  for (int64_t s = s0; s < s1; ++s) {
    const float* row = vh + s * D + d;
    if (pf && s + kAttnAhead < end) prefetch_floats(vh + (s + kAttnAhead) * D, D);
    Vec v[NV];
    for (int u = 0; u < NV; ++u) v[u] = vload(row + u * W);
    for (int i = 0; i < NQ; ++i) {
      const Vec pj = vset1(p[i][s - s0]);
      for (int u = 0; u < NV; ++u) r[i][u] = vfma(pj, v[u], r[i][u]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int u = 0; u < NV; ++u) vstore(acc[i] + d + u * W, r[i][u]);
}

// The weighted values of slots [s0, s1) for NQ queries that all see them, D % W == 0: chunks of the head that
// give eight independent accumulators (an FMA's latency covered), the first chunk prefetching the rows ahead.
template <int NQ>
void weigh_block(const float* vh, int64_t D, int64_t s0, int64_t s1, const float* const* p, float* const* acc,
                 bool pf, int64_t end) {
  constexpr int NV = NQ == 1 ? 8 : kRegs / 2 / NQ;  // NQ x NV sums in half the registers
  int64_t d = 0;
  for (; d + NV * W <= D; d += NV * W) weigh_chunk<NQ, NV>(vh, D, d, s0, s1, p, acc, pf && d == 0, end);
  if constexpr (NV > 4)  // heads narrower than eight vectors (AVX-512's 64-wide heads are four)
    for (; d + 4 * W <= D; d += 4 * W) weigh_chunk<NQ, 4>(vh, D, d, s0, s1, p, acc, pf && d == 0, end);
  if constexpr (NV > 2)
    for (; d + 2 * W <= D; d += 2 * W) weigh_chunk<NQ, 2>(vh, D, d, s0, s1, p, acc, pf && d == 0, end);
  for (; d < D; d += W) weigh_chunk<NQ, 1>(vh, D, d, s0, s1, p, acc, pf && d == 0, end);
}

using ScoreBlockFn = void (*)(const float* const*, float* const*, const int64_t*, const float*, int64_t, int64_t,
                              int64_t, float, bool, int64_t);
using WeighBlockFn = void (*)(const float*, int64_t, int64_t, int64_t, const float* const*, float* const*, bool,
                              int64_t);
// by m / 2 for a group of m = 1, 2 or 4 queries (walk gives no group of three)
constexpr ScoreBlockFn kScoreBlock[3] = {score_block<1>, score_block<2>, score_block<4>};
constexpr WeighBlockFn kWeighBlock[3] = {weigh_block<1>, weigh_block<2>, weigh_block<4>};

// The caches' checks against one layer's rows: fp32 [lanes, KV, max_len, D] each, k / v rows of KV heads, query
// heads a multiple of KV, the lane and slots in range.
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const AttendRows& r, int64_t N) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == r.D && k_cache.scalar_type() == at::kFloat &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "attend: the caches must be contiguous fp32 [lanes, kv_heads, max_len, ", r.D, "]");
  TORCH_CHECK(N % k_cache.size(1) == 0, "attend: query heads must be a multiple of key/value heads");
  TORCH_CHECK(r.lane < k_cache.size(0) && r.start + r.T <= k_cache.size(2), "attend: lane or slots out of range");
}

// Each row's visible slots of [kv_from, kv_from + S), in slot order: seen[t * S + c] for c < count[t].
void list_visible(const bool* pm, int64_t T, int64_t S, int64_t kv_from, int32_t* seen, int64_t* count) {
  for (int64_t t = 0; t < T; ++t) {
    int64_t c = 0;
    for (int64_t s = 0; s < S; ++s)
      if (pm ? pm[t * S + s] : s <= S - T + t) seen[t * S + c++] = static_cast<int32_t>(kv_from + s);
    TORCH_CHECK(c > 0, "attend: query row ", t, " sees no slot");
    count[t] = c;
  }
}

// How many of a row's keys (its list of count slots, the first `own` of them below `start`) have a place below p:
// a prefix key's place is its slot, the k-th key from the call's own slots has place start + k.
inline int64_t keys_before(const int32_t* list, int64_t count, int64_t own, int64_t start, int64_t p) {
  return p <= start ? slots_before(list, 0, own, p) : own + std::min(count - own, p - start);
}

// One task's queries, up to kTaskQueries of key/value head g, over chunk c of places [p0, p1): each one's row, head,
// list of visible slots and the part of it in the chunk [first, last), its row of scores and roped query, its
// chunk's results (largest score, sum, weighted values), and its cursor in its list (walk moves it). [lo, hi): the
// slots the task's keys lie in.
struct Task {
  const AttendPlan& pl;
  int64_t g = 0, c = 0, nq = 0, p0 = 0, p1 = 0, lo = 0, hi = 0;
  const float* kh = nullptr;  // the head's keys and values in the cache lane
  const float* vh = nullptr;
  bool together = false;  // D % W == 0: the shared-load path's shapes; else every query on its own
  int64_t row[kTaskQueries], head[kTaskQueries], first[kTaskQueries], last[kTaskQueries], at[kTaskQueries];
  const int32_t* list[kTaskQueries];
  float* score[kTaskQueries];
  float* cmax[kTaskQueries];
  float* csum[kTaskQueries];
  float* cacc[kTaskQueries];
  const float* q[kTaskQueries];

  Task(const AttendPlan& plan, int64_t task) : pl(plan) {
    const int64_t sub = task % pl.tasks_per_g;
    c = task / pl.tasks_per_g % pl.chunks;
    g = task / (pl.tasks_per_g * pl.chunks);
    p0 = std::max(pl.kv_from, (pl.chunk0 + c) * kAttnChunk);
    p1 = std::min(pl.end, (pl.chunk0 + c + 1) * kAttnChunk);
    lo = pl.end, hi = pl.kv_from;
    const int64_t q0 = sub * pl.per_task;
    nq = std::min(pl.per_task, pl.per_g - q0);
    kh = pl.kc + g * pl.L * pl.D;
    vh = pl.vc + g * pl.L * pl.D;
    together = pl.D % W == 0;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t t = (q0 + i) / pl.group, n = g * pl.group + (q0 + i) % pl.group;
      const int64_t k = (t * pl.N + n) * pl.chunks + c;
      row[i] = t, head[i] = n, list[i] = pl.seen + t * pl.S;
      const int64_t own = slots_before(list[i], 0, pl.count[t], pl.start);
      first[i] = keys_before(list[i], pl.count[t], own, pl.start, p0);
      last[i] = keys_before(list[i], pl.count[t], own, pl.start, p1);
      if (first[i] < last[i]) {
        lo = std::min<int64_t>(lo, list[i][first[i]]);
        hi = std::max<int64_t>(hi, list[i][last[i] - 1] + 1);
      }
      score[i] = pl.scores + (t * pl.N + n) * pl.padded;
      cmax[i] = pl.cmax + k, csum[i] = pl.csum + k, cacc[i] = pl.cacc + k * pl.D;
      q[i] = pl.pq + (t * pl.N + n) * pl.D;
    }
  }
};

// The task's first kAttnAhead rows of keys or values: the walk prefetches that far ahead of itself, so without
// this a task would wait on memory for the first half of its chunk.
void prefetch_start(const Task& t, const float* rows) {
  for (int64_t s = t.lo; s < std::min(t.lo + kAttnAhead, t.hi); ++s) prefetch_floats(rows + s * t.pl.D, t.pl.D);
}

// The task's slots block by block; in each, the queries that see all of it in groups of up to four (three as two
// and one: a group of three spills a register), group(queries, count, b0, b1, first), then each other query over
// its part of its list, one(i, j0, j1). Every query's cursor starts at its first key in the chunk and ends past its
// last; the blocks only choose between two paths that give a query the same arithmetic.
template <typename Group, typename One>
void walk(Task& t, Group&& group, One&& one) {
  for (int64_t i = 0; i < t.nq; ++i) t.at[i] = t.first[i];
  for (int64_t b0 = t.lo; b0 < t.hi; b0 += kAttnBlock) {
    const int64_t b1 = std::min(b0 + kAttnBlock, t.hi);
    int64_t full[kTaskQueries], nfull = 0, ends[kTaskQueries];
    bool whole[kTaskQueries];
    for (int64_t i = 0; i < t.nq; ++i) {
      ends[i] = slots_before(t.list[i], t.at[i], t.last[i], b1);
      whole[i] = t.together && ends[i] - t.at[i] == b1 - b0;
      if (whole[i]) full[nfull++] = i;
    }
    for (int64_t f = 0; f < nfull;) {
      const int64_t m = nfull - f == 3 ? 2 : std::min<int64_t>(4, nfull - f);
      group(full + f, m, b0, b1, f == 0);
      f += m;
    }
    for (int64_t i = 0; i < t.nq; ++i) {
      if (!whole[i]) one(i, t.at[i], ends[i]);
      t.at[i] = ends[i];
    }
  }
}

// The task's scores; eight slots at once where they fill a group (independent FMA chains), each slot's sum formed
// as dot() forms it.
void score_task(Task& t) {
  const int64_t D = t.pl.D, end = t.hi;
  const float sc = t.pl.sc;
  prefetch_start(t, t.kh);
  walk(
      t,
      [&](const int64_t* qs, int64_t m, int64_t b0, int64_t b1, bool first) {
        const float* qp[4];
        float* sp[4];
        int64_t jp[4];
        for (int64_t u = 0; u < m; ++u) qp[u] = t.q[qs[u]], sp[u] = t.score[qs[u]], jp[u] = t.at[qs[u]];
        kScoreBlock[m / 2](qp, sp, jp, t.kh, D, b0, b1, sc, first, end);
      },
      [&](int64_t i, int64_t j, int64_t j1) {
        const int32_t* list = t.list[i];
        if (t.together)
          for (; j + 8 <= j1; j += 8) {
            const float* kr[8];
            for (int u = 0; u < 8; ++u) kr[u] = t.kh + list[j + u] * D;
            if (i == 0 && j + kAttnAhead + 8 <= t.last[i])  // a step streams the lane from memory: rows well ahead
              for (int u = 0; u < 8; ++u) prefetch_floats(t.kh + list[j + kAttnAhead + u] * D, D);
            score_tile<1, 8>(t.q + i, kr, D, sc, t.score[i] + j);
          }
        for (; j < j1; ++j) t.score[i][j] = dot(t.q[i], t.kh + list[j] * D, D) * sc;
      });
}

// Each query's scores in the chunk turned into weights in place: exp(score - max), summed in list order from the
// chunk's first slot; the chunk's largest score and sum kept for the merge (-inf and 0 where the query sees none
// of it). The last few weights take the same vector exp in a buffer: past the chunk's part of the row, the next
// chunk's task may be writing.
void softmax_task(const Task& t) {
  for (int64_t i = 0; i < t.nq; ++i) {
    const int64_t c = t.last[i] - t.first[i];
    if (c == 0) {
      *t.cmax[i] = -std::numeric_limits<float>::infinity(), *t.csum[i] = 0.0f;
      continue;
    }
    float* score = t.score[i] + t.first[i];
    const float mx = row_max(score, c);
    Vec vs = vzero();
    const Vec neg = vset1(-mx);
    int64_t j = 0;
    for (; j + W <= c; j += W) {
      const Vec e = vexp_nonpositive(vadd(vload(score + j), neg));
      vstore(score + j, e);
      vs = vadd(vs, e);
    }
    float sum = vsum(vs);
    if (j < c) {
      float tail[W];
      std::fill(tail, tail + W, mx);
      std::copy(score + j, score + c, tail);
      vstore(tail, vexp_nonpositive(vadd(vload(tail), neg)));
      for (int64_t u = 0; j < c; ++j, ++u) sum += score[j] = tail[u];
    }
    *t.cmax[i] = mx, *t.csum[i] = sum;
  }
}

// Each query's weighted values over the chunk into its cacc, accumulated in slot order.
void weigh_task(Task& t) {
  const int64_t D = t.pl.D, end = t.hi;
  const float* vh = t.vh;
  prefetch_start(t, vh);
  for (int64_t i = 0; i < t.nq; ++i) std::fill(t.cacc[i], t.cacc[i] + D, 0.0f);
  walk(
      t,
      [&](const int64_t* qs, int64_t m, int64_t b0, int64_t b1, bool first) {
        const float* pp[4];
        float* ap[4];
        for (int64_t u = 0; u < m; ++u) pp[u] = t.score[qs[u]] + t.at[qs[u]], ap[u] = t.cacc[qs[u]];
        kWeighBlock[m / 2](vh, D, b0, b1, pp, ap, first, end);
      },
      [&](int64_t i, int64_t j0, int64_t j1) {
        const int32_t* list = t.list[i];
        const float* p = t.score[i];
        float* ai = t.cacc[i];
        int64_t d = 0;
        for (; d + 8 * W <= D; d += 8 * W) weigh_values<8>(vh + d, D, list, p, j0, j1, ai + d);
        for (; d + 4 * W <= D; d += 4 * W) weigh_values<4>(vh + d, D, list, p, j0, j1, ai + d);
        for (; d + W <= D; d += W) weigh_values<1>(vh + d, D, list, p, j0, j1, ai + d);
        for (; d < D; ++d)  // heads narrower than a vector (small test models)
          for (int64_t j = j0; j < j1; ++j) ai[d] += p[j] * vh[list[j] * D + d];
      });
}

// One query's output from its chunks in slot order: with m the largest chunk maximum and e_c = exp(m_c - m),
// o = (sum_c e_c acc_c) / (sum_c e_c sum_c). A single chunk gives e = 1, o = acc / sum: the unsplit form's bits.
void merge_chunks(const AttendPlan& pl, int64_t t, int64_t n) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t D = pl.D, C = pl.chunks, k = (t * pl.N + n) * C;
  const float* cm = pl.cmax + k;
  const float* cs = pl.csum + k;
  const float* ca = pl.cacc + k * D;
  float mx = kNone;
  for (int64_t c = 0; c < C; ++c) mx = std::max(mx, cm[c]);
  thread_local std::vector<float> e;
  e.assign((C + W - 1) / W * W, kNone);
  for (int64_t c = 0; c < C; ++c)
    if (cs[c] > 0.0f) e[c] = cm[c] - mx;
  for (size_t c = 0; c < e.size(); c += W) vstore(e.data() + c, vexp_nonpositive(vload(e.data() + c)));
  float sum = 0.0f;
  for (int64_t c = 0; c < C; ++c)
    if (cs[c] > 0.0f) sum += cs[c] * e[c];
  const float inv = 1.0f / sum;
  float* o = pl.po + (t * pl.N + n) * D;
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    Vec a = vzero();
    for (int64_t c = 0; c < C; ++c)
      if (cs[c] > 0.0f) a = vfma(vset1(e[c]), vload(ca + c * D + d), a);
    vstore(o + d, vfma(a, vset1(inv), vzero()));
  }
  for (; d < D; ++d) {
    float a = 0.0f;
    for (int64_t c = 0; c < C; ++c)
      if (cs[c] > 0.0f) a += e[c] * ca[c * D + d];
    o[d] = a * inv;
  }
}

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rope: x must be a contiguous [T, N, D] fp32 CPU tensor");
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "rope: the head size must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "rope: cos and sin must be contiguous [T, D] fp32");
  at::Tensor y = at::empty_like(x);
  const float* px = x.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) rope_row(px + (t * N + n) * D, pc + t * D, ps + t * D, py + (t * N + n) * D, D);
  return y;
}

AttendRows attend_rows(const at::Tensor& cos, const at::Tensor& sin, int64_t row0, int64_t T, int64_t lane,
                       int64_t start, const std::optional<at::Tensor>& mask, int64_t kv_from) {
  const int64_t D = cos.size(-1);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(1) == D && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->device().is_cpu(),
                "attend: cos and sin must be contiguous [rows, D] fp32");
  TORCH_CHECK(D > 0 && D % 2 == 0, "attend: the head size must be even");
  TORCH_CHECK(T >= 1 && 0 <= row0 && row0 + T <= cos.size(0) && sin.size(0) == cos.size(0),
              "attend: rows out of range of cos and sin");
  TORCH_CHECK(0 <= lane && 0 <= kv_from && kv_from <= start, "attend: lane or slots out of range");
  AttendRows r;
  r.T = T, r.D = D, r.S = start + T - kv_from, r.lane = lane, r.start = start, r.kv_from = kv_from;
  r.cos = cos.data_ptr<float>() + row0 * D, r.sin = sin.data_ptr<float>() + row0 * D;
  const bool* pm = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == T && mask->size(1) == r.S &&
                    mask->scalar_type() == at::kBool && mask->is_contiguous(),
                "attend: mask must be a contiguous bool [T, ", r.S, "]");
    pm = mask->data_ptr<bool>();
  }
  r.seen.resize(T * r.S);
  r.count.resize(T);
  list_visible(pm, T, r.S, kv_from, r.seen.data(), r.count.data());
  return r;
}

AttendPlan plan_attend(AttendRows& r, const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                       int64_t ldv, int64_t N, at::Tensor& k_cache, at::Tensor& v_cache, double scale, float* po,
                       int64_t min_tasks) {
  check_caches(k_cache, v_cache, r, N);
  const int64_t T = r.T, D = r.D, KV = k_cache.size(1), L = k_cache.size(2), S = r.S;
  // RoPE and the cache write (keys roped, values as they are), then the queries roped into the rows' scratch
  float* kc = k_cache.data_ptr<float>() + r.lane * KV * L * D;
  float* vc = v_cache.data_ptr<float>() + r.lane * KV * L * D;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < KV; ++g) {
      const int64_t slot = (g * L + r.start + t) * D;
      rope_row(k + t * ldk + g * D, r.cos + t * D, r.sin + t * D, kc + slot, D);
      std::memcpy(vc + slot, v + t * ldv + g * D, D * sizeof(float));
    }
  r.qr.resize(T * N * D);
  float* pq = r.qr.data();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      rope_row(q + t * ldq + n * D, r.cos + t * D, r.sin + t * D, pq + (t * N + n) * D, D);
  // A task takes up to kTaskQueries queries of one key/value head (the rows x heads of its group) over one chunk of
  // slots and walks the chunk in blocks of kAttnBlock: each block's keys, then its values, are read from memory once
  // for all the task's queries and stay in L1 while they use them. The queries that see the whole block (a committed
  // prefix) go through it together, up to four per key and value load; the others (a tree's own slots, a window's
  // edge) one by one over their lists. Both give a query the same arithmetic, which does not depend on its task.
  // Fewer queries a task where there would be fewer than min_tasks (a short context's one chunk).
  const int64_t group = N / KV, padded = (S + W - 1) / W * W, per_g = T * group;
  const int64_t chunk0 = r.kv_from / kAttnChunk, chunks = (r.start + T - 1) / kAttnChunk - chunk0 + 1;
  int64_t per_task = std::min<int64_t>(kTaskQueries, per_g);
  while (per_task > 1 && KV * chunks * ((per_g + per_task - 1) / per_task) < min_tasks) per_task = (per_task + 1) / 2;
  r.scores.resize(T * N * padded);
  r.cmax.resize(T * N * chunks);
  r.csum.resize(T * N * chunks);
  r.cacc.resize(T * N * chunks * D);
  AttendPlan pl;
  pl.T = T, pl.S = S, pl.N = N, pl.KV = KV, pl.D = D, pl.L = L, pl.kv_from = r.kv_from, pl.start = r.start;
  pl.end = r.start + T;
  pl.group = group, pl.padded = padded, pl.per_g = per_g, pl.per_task = per_task;
  pl.tasks_per_g = (per_g + per_task - 1) / per_task, pl.chunk0 = chunk0, pl.chunks = chunks;
  pl.sc = static_cast<float>(scale), pl.kc = kc, pl.vc = vc, pl.pq = pq, pl.po = po;
  pl.seen = r.seen.data(), pl.count = r.count.data(), pl.scores = r.scores.data();
  pl.cmax = r.cmax.data(), pl.csum = r.csum.data(), pl.cacc = r.cacc.data();
  return pl;
}

void AttendPlan::run_task(int64_t task, std::atomic<int32_t>* left) const {
  Task t(*this, task);
  score_task(t);
  softmax_task(t);
  weigh_task(t);
  // the last of a query group's chunks merges the group (acq_rel: the other chunks' results are visible to it)
  const int64_t g = task / (tasks_per_g * chunks) * tasks_per_g + task % tasks_per_g;
  if (left[g].fetch_sub(1, std::memory_order_acq_rel) == 1)
    for (int64_t i = 0; i < t.nq; ++i) merge_chunks(*this, t.row[i], t.head[i]);
}

// Every plan's tasks in one parallel loop, handed out one at a time in order (chunks and groups differ in size; a
// batch of one-row decode steps is many small requests, each too small to keep the threads busy on its own).
void run_plans(const std::vector<AttendPlan>& plans) {
  std::vector<int64_t> first(plans.size() + 1, 0);   // plans[p]'s tasks are [first[p], first[p + 1]) of the loop
  std::vector<int64_t> groups(plans.size() + 1, 0);  // and its groups' counters [groups[p], groups[p + 1])
  for (size_t p = 0; p < plans.size(); ++p) {
    first[p + 1] = first[p] + plans[p].tasks();
    groups[p + 1] = groups[p] + plans[p].KV * plans[p].tasks_per_g;
  }
  std::unique_ptr<std::atomic<int32_t>[]> left(new std::atomic<int32_t>[groups.back()]);
  for (size_t p = 0; p < plans.size(); ++p)
    for (int64_t i = groups[p]; i < groups[p + 1]; ++i) left[i].store(static_cast<int32_t>(plans[p].chunks));
  std::atomic<int64_t> next{0};
  const int64_t total = first.back();
  at::parallel_for(0, std::min<int64_t>(total, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t task = next.fetch_add(1); task < total; task = next.fetch_add(1)) {
      const size_t p = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      plans[p].run_task(task - first[p], left.get() + groups[p]);
    }
  });
}

// One request alone: its queries split finer where that still gives every thread two tasks.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                  const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t lane, int64_t start,
                  const std::optional<at::Tensor>& mask, int64_t kv_from, double scale) {
  const int64_t T = q.size(0), D = cos.size(-1);
  TORCH_CHECK(D > 0 && cos.dim() == 2 && cos.size(0) == T, "attend: cos and sin must be [T, D] for q's T rows");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->scalar_type() == at::kFloat && t->stride(1) == 1 &&
                    t->size(1) % D == 0 && t->device().is_cpu(),
                "attend: q, k, v must be fp32 [T, heads * ", D, "] CPU rows with unit inner stride");
  TORCH_CHECK(k.size(1) == v.size(1) && k_cache.dim() == 4 && k.size(1) == k_cache.size(1) * D,
              "attend: k / v rows must hold the cache's key/value heads");
  AttendRows rows = attend_rows(cos, sin, 0, T, lane, start, mask, kv_from);
  at::Tensor out = at::empty({T, q.size(1)}, q.options());
  std::vector<AttendPlan> plans;
  plans.push_back(plan_attend(rows, q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0),
                              v.data_ptr<float>(), v.stride(0), q.size(1) / D, k_cache, v_cache, scale,
                              out.data_ptr<float>(), 2 * at::get_num_threads()));
  run_plans(plans);
  return out;
}

}  // namespace SPECHEAD_NS
