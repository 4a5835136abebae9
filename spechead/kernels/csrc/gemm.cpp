// draft_linear: the few-row GEMM, y = x @ W.T for a handful of rows of x against a weight in a blocked layout.
//
// Why: a draft head multiplies a handful of hidden states (the tree's top_k) against many rows, and a decode
// step or a tree verification is the same shape of product. It should cost the bytes of the weights. Library
// GEMMs do not get there with 1-16 rows (MKL repacks the weight per call; oneDNN's bf16 path is compute-bound
// where the CPU's bf16 dot product is slow or missing). Here bf16 weights are widened to fp32 in registers
// (a shift for the even k, a mask for the odd k of each pair) and consumed by fp32 FMAs; fp32 weights are
// streamed as they are.
//
// Row-count property: accumulation is in fp32, and every output is accumulated in one fixed order (one chain of
// FMAs over k) whatever the number of rows, so a row's result bits do not depend on how many rows share the call
// and a token's logits are bitwise the same in a decode step and in a verification.
//
// Weight layout (kernels/linear.py writes it), the same for every build: rows in blocks of 16 outputs;
//   bf16: [N/16][K/2][16][2]  64 bytes per k-pair = 16 outputs x 2 consecutive k
//   fp32: [N/16][K][16]       64 bytes per k      = 16 outputs x 1 k
// so a row can be rewritten in place (NanoSpec's incremental gather) with one strided copy. A build's vector
// holds W outputs (16 with AVX-512, 8 otherwise); a 16-output block is 16 / W vectors side by side.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"

namespace SPECHEAD_NS {
namespace {

// Weight type -> vector registers one vector of weights takes in flight (bf16: even + odd) and broadcasts per k step.
template <typename T>
constexpr int weight_regs() {
  return std::is_same_v<T, uint16_t> ? 2 : 1;
}

#if defined(SPECHEAD_ISA_AVX512)
// The most rows a 2-vector tile takes with AVX-512 (vecs_per_tile); chunk_rows splits larger products at it.
template <typename T>
constexpr int two_vector_rows() {
  return std::is_same_v<T, uint16_t> ? 12 : 13;
}
#endif

// Vectors per tile for M rows: as many accumulators as fit the registers with the weights in flight, at most 4.
template <int M, typename T>
constexpr int vecs_per_tile() {
#if defined(SPECHEAD_ISA_AVX512)
  // measured on the AVX-512 machine (the formula below would take one more vector at 4, 7 and 13 rows)
  if constexpr (std::is_same_v<T, uint16_t>) return M <= 3 ? 4 : M <= 6 ? 3 : M <= two_vector_rows<T>() ? 2 : 1;
  return M <= 4 ? 4 : M <= 7 ? 3 : M <= two_vector_rows<T>() ? 2 : 1;
#else
  constexpr int wr = weight_regs<T>();
  for (int nv = 4; nv > 1; --nv)
    if (M * nv + wr * nv + wr + 1 <= kRegs) return nv;
  return 1;
#endif
}

// Rows one tile takes before its accumulators would spill.
template <typename T>
constexpr int max_tile_rows() {
  int m = 16;
  while (m > 1 && m + 2 * weight_regs<T>() + 1 > kRegs) --m;
  return m;
}

// Rows per chunk for an M-row product: more rows are split into equal chunks of at most this many. With 16 vector
// registers, fp32 chunks of 6 rows (tiles of 6 rows x 2 vectors: 12 FMAs per 6 broadcasts) beat one tile of up to
// 13 rows x 1 vector (one FMA per broadcast): 85 % against 61 % of the FMA peak with weights in L1, and 0.81-0.93x
// the time of 8-16 row products streamed from DRAM; bf16 chunks of 4 rows (2-vector tiles) measured even with the
// old chunks of up to 11 (AMD EPYC Zen 3, AVX2, 2 threads; results/bench/zen3/README.md). With 32 registers, one
// chunk up to the rows a 2-vector tile holds (13 fp32, 12 bf16), then chunks of at most that: 16 rows (2 x 8)
// took 0.87x the time of one 16-row x 1-vector tile in fp32 over the demo target's weights, 0.95x in bf16, 64 rows
// 0.91x / 0.93x; chunks of 8 lost at 24 rows, of 6 or 4 at 16 rows in bf16 (1.19x / 1.33x) (Intel Xeon with
// AVX-512 and AMX, 2 threads, `results/bench/zen3/kernel_compare.py --isa avx512`).
template <typename T>
constexpr int64_t chunk_rows() {
#if defined(SPECHEAD_ISA_AVX512)
  return two_vector_rows<T>();
#else
  return std::is_same_v<T, float> ? 6 : 4;  // 16 registers
#endif
}

// Software prefetch distance in k steps (64 bytes of a block each): 2 KB ahead. The hardware prefetcher alone
// left a cold 10-row call at 1.3-1.4x the bytes floor on the AVX-512 machine; 32 measured best (8-128 tried).
constexpr int64_t kPrefetch = 32;
// Several row chunks go over the weights a panel of this many k steps at a time (4 KB of a block), every chunk
// while the panel is in L1; the chunks after the first prefetch the next panel into L2, so DRAM keeps streaming
// while they compute.
constexpr int64_t kPanel = 64;
constexpr int64_t kPanelBlocks = 2;  // blocks per panel group: up to 4 vectors of 8 lanes side by side

// M input rows x NV vectors of consecutive outputs starting at vector u0, over k steps [j0, j1). xt is x
// transposed: [K][ldx] fp32. Vector u covers outputs [u W, u W + W): block u / kVecsPerBlock, lanes
// (u % kVecsPerBlock) W on; its weights for step j (a k-pair in bf16, one k in fp32) are 64 bytes after those of
// step j - 1. From j0 > 0 the accumulators continue from y (a stored fp32 is reloaded exactly, so every output
// is still one fixed chain of FMAs over k). Prefetch: pf steps ahead into L1, or with `far` into L2.
template <int M, int NV, typename T>
void tile(const float* xt, int64_t ldx, const T* w, int64_t K, int64_t u0, float* y, int64_t ldy, int64_t j0,
          int64_t j1, int64_t pf, bool far) {
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  constexpr int64_t step = bf16 ? 2 * kLanes : kLanes;  // elements of T per k step of a block
  const int64_t block = K * kLanes;
  const T* p[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t u = u0 + v;
    p[v] = w + (u / kVecsPerBlock) * block + (u % kVecsPerBlock) * W * (bf16 ? 2 : 1);
  }
  Vec acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = j0 ? vload(y + m * ldy + (u0 + v) * W) : vzero();
  for (int64_t j = j0; j < j1; ++j) {
    if constexpr (bf16) {
      Vec we[NV], wo[NV];
      for (int v = 0; v < NV; ++v) {
        prefetch(p[v] + (j + pf) * step, far);
        vload_pairs(p[v] + j * step, we[v], wo[v]);
      }
      const float* xe = xt + 2 * j * ldx;
      const float* xo = xe + ldx;
      for (int m = 0; m < M; ++m) {
        const Vec a = vset1(xe[m]), b = vset1(xo[m]);
        for (int v = 0; v < NV; ++v) acc[m][v] = vfma(wo[v], b, vfma(we[v], a, acc[m][v]));
      }
    } else {
      Vec wv[NV];
      for (int v = 0; v < NV; ++v) {
        prefetch(p[v] + (j + pf) * step, far);
        wv[v] = vload(p[v] + j * step);
      }
      const float* xk = xt + j * ldx;
      for (int m = 0; m < M; ++m) {
        const Vec a = vset1(xk[m]);
        for (int v = 0; v < NV; ++v) acc[m][v] = vfma(wv[v], a, acc[m][v]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) vstore(y + m * ldy + (u0 + v) * W, acc[m][v]);
}

template <typename T>
using RangeFn = void (*)(const float*, int64_t, const T*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, bool);

// Vectors [u0, u1) for M rows over k steps [j0, j1): tiles of NV vectors, then single vectors for the remainder.
template <int M, typename T>
void range(const float* xt, int64_t ldx, const T* w, int64_t K, float* y, int64_t ldy, int64_t u0, int64_t u1,
           int64_t j0, int64_t j1, int64_t pf, bool far) {
  constexpr int NV = vecs_per_tile<M, T>();
  int64_t u = u0;
  for (; u + NV <= u1; u += NV) tile<M, NV>(xt, ldx, w, K, u, y, ldy, j0, j1, pf, far);
  for (; u < u1; ++u) tile<M, 1>(xt, ldx, w, K, u, y, ldy, j0, j1, pf, far);
}

template <typename T, int... I>
constexpr std::array<RangeFn<T>, sizeof...(I)> range_table(std::integer_sequence<int, I...>) {
  return {range<I + 1, T>...};  // range<M> at index M - 1
}

// Blocks [b0, b1) for all M rows. One chunk: each tile runs over all of K. Several chunks of equal size (at most
// chunk_rows): a group of kPanelBlocks blocks and kPanel k steps at a time, every chunk over that panel, so the
// weights come from DRAM once and from L1 for the later chunks, which prefetch the next panel meanwhile.
template <typename T>
void run_chunks(const float* xt, int64_t M, const T* w, int64_t K, float* y, int64_t ldy, int64_t b0, int64_t b1) {
  static constexpr auto table = range_table<T>(std::make_integer_sequence<int, max_tile_rows<T>()>{});
  const int64_t cr = chunk_rows<T>();
  const int64_t chunks = (M + cr - 1) / cr, rows = (M + chunks - 1) / chunks;
  const int64_t steps = std::is_same_v<T, uint16_t> ? K / 2 : K;
  if (chunks == 1) {
    table[M - 1](xt, M, w, K, y, ldy, b0 * kVecsPerBlock, b1 * kVecsPerBlock, 0, steps, kPrefetch, false);
    return;
  }
  for (int64_t g0 = b0; g0 < b1; g0 += kPanelBlocks) {
    const int64_t u0 = g0 * kVecsPerBlock, u1 = std::min(g0 + kPanelBlocks, b1) * kVecsPerBlock;
    for (int64_t j0 = 0; j0 < steps; j0 += kPanel) {
      const int64_t j1 = std::min(j0 + kPanel, steps);
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t mc = std::min<int64_t>(rows, M - m0);
        const bool first = m0 == 0;
        table[mc - 1](xt + m0, M, w, K, y + m0 * ldy, ldy, u0, u1, j0, j1, first ? kPrefetch : kPanel, !first);
      }
    }
  }
}

}  // namespace

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
    if (x_bf16) {
      const auto* row = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>()) + m * K;
      for (int64_t k = 0; k < K; ++k) xt[k * M + m] = bf16_to_float(row[k]);
    } else {
      const float* row = xs.data_ptr<float>() + m * K;
      for (int64_t k = 0; k < K; ++k) xt[k * M + m] = row[k];
    }
  }
  at::Tensor y = at::empty({M, blocks * kLanes}, x.options().dtype(at::kFloat));
  const float* px = xt.data();
  float* py = y.data_ptr<float>();
  const int64_t ldy = blocks * kLanes;
  // a task is a run of blocks (64+ outputs); at 10 rows x 4096 that is ~5 MFLOP, well above the fork cost
  constexpr int64_t grain = 4;
  if (bf16) {
    const auto* pw = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { run_chunks(px, M, pw, K, py, ldy, b0, b1); });
  } else {
    const float* pw = w.data_ptr<float>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { run_chunks(px, M, pw, K, py, ldy, b0, b1); });
  }
  return y;
}

}  // namespace SPECHEAD_NS
