// Few-row GEMM, row top-k and NanoSpec's set update for the CPU, in one source built once per instruction set:
// -DSPECHEAD_ISA_AVX512 (AVX-512F), -DSPECHEAD_ISA_AVX2 (AVX2 + FMA, every x86-64 since Haswell / Zen 1) or
// neither (portable C++, no intrinsics: the compiler vectorises what it can for whatever CPU it targets).
// Each build registers its ops under its own namespace (SPECHEAD_NS, e.g. spechead_avx2), so one process can
// load and test every build the CPU can run; kernels.py picks the one the library uses.
//
// Why: a draft head multiplies a handful of hidden states (the tree's top_k) against many rows, and a decode
// step or a tree verification is the same shape of product. It should cost the bytes of the weights. Library
// GEMMs do not get there with 1-16 rows (MKL repacks the weight per call; oneDNN's bf16 path is compute-bound
// where the CPU's bf16 dot product is slow or missing). Here bf16 weights are widened to fp32 in registers
// (a shift for the even k, a mask for the odd k of each pair) and consumed by fp32 FMAs; fp32 weights are
// streamed as they are. Accumulation is in fp32, and every output is accumulated in one fixed order whatever
// the number of rows, so a token's logits are bitwise the same in a decode step and in a verification.
//
// Weight layout (kernels.py writes it), the same for every build: rows in blocks of 16 outputs;
//   bf16: [N/16][K/2][16][2]  64 bytes per k-pair = 16 outputs x 2 consecutive k
//   fp32: [N/16][K][16]       64 bytes per k      = 16 outputs x 1 k
// so a row can be rewritten in place (NanoSpec's incremental gather) with one strided copy. A build's vector
// holds W outputs (16 with AVX-512, 8 otherwise); a 16-output block is 16 / W vectors side by side.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
#include <immintrin.h>
#endif

#ifndef SPECHEAD_NS
#error "build with -DSPECHEAD_NS=<op namespace> (kernels.py does)"
#endif
#if defined(SPECHEAD_ISA_AVX512) && !defined(__AVX512F__)
#error "SPECHEAD_ISA_AVX512 needs -mavx512f"
#endif
#if defined(SPECHEAD_ISA_AVX2) && !(defined(__AVX2__) && defined(__FMA__))
#error "SPECHEAD_ISA_AVX2 needs -mavx2 -mfma"
#endif

namespace {

constexpr int kLanes = 16;  // outputs per block of the layout
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float bf16_to_float(uint16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }

inline void prefetch(const void* p, bool far = false) {  // far: into L2 only
#if defined(__GNUC__) || defined(__clang__)
  if (far)
    __builtin_prefetch(p, 0, 2);
  else
    __builtin_prefetch(p, 0, 3);
#else
  (void)p;
  (void)far;
#endif
}

// ---- one vector of W fp32 lanes: the only part that differs between builds ------------------------------------
#if defined(SPECHEAD_ISA_AVX512)
constexpr int W = 16;
constexpr int kRegs = 32;  // vector registers the tiles may fill
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// W bf16 (k, k+1) pairs as 32-bit words -> the even-k and the odd-k values of W outputs
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline Vec vload_bf16(const uint16_t* p) {  // W consecutive bf16 values
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline uint32_t vgt_mask(Vec v, float t) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_GT_OQ); }
// ((l0 + l8) + (l4 + l12)) + ((l2 + l10) + (l6 + l14)) + (the same from l1): GCC's _mm512_reduce_add_ps pairing,
// written out so that every compiler forms it and vsum_many can match it
inline float vsum(Vec v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)));
}
// exp(x) for x <= 0: 2^n * 2^f, n = round(x log2 e), |f| <= 1/2, 2^f by a degree-7 Taylor polynomial (relative
// error < 1e-8 before rounding); scalef applies 2^n and underflows gracefully (x clamped at -150: -inf gives 0)
inline Vec vexp_nonpositive(Vec x) {
  const Vec t = _mm512_mul_ps(_mm512_max_ps(x, vset1(-150.0f)), vset1(1.4426950408889634f));
  const Vec n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec f = _mm512_sub_ps(t, n);
  static constexpr float c[] = {1.0f,          0.6931471806f, 0.2402265070f, 0.0555041087f,
                                0.0096181291f, 0.0013333558f, 0.0001540353f, 0.0000152527f};
  Vec p = vset1(c[7]);
  for (int i = 6; i >= 0; --i) p = vfma(p, f, vset1(c[i]));
  return _mm512_scalef_ps(p, n);
}
#elif defined(SPECHEAD_ISA_AVX2)
constexpr int W = 8;
constexpr int kRegs = 16;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline Vec vload_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline uint32_t vgt_mask(Vec v, float t) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(t), _CMP_GT_OQ)));
}
inline float vsum(Vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
// as above; without scalef, 2^n is built in the exponent bits, so x is clamped at -87 (n >= -126 stays a
// normal number; exp(-87) ~ 1.6e-38 is nothing next to the row maximum's 1)
inline Vec vexp_nonpositive(Vec x) {
  const Vec t = _mm256_mul_ps(_mm256_max_ps(x, vset1(-87.0f)), vset1(1.4426950408889634f));
  const Vec n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec f = _mm256_sub_ps(t, n);
  static constexpr float c[] = {1.0f,          0.6931471806f, 0.2402265070f, 0.0555041087f,
                                0.0096181291f, 0.0013333558f, 0.0001540353f, 0.0000152527f};
  Vec p = vset1(c[7]);
  for (int i = 6; i >= 0; --i) p = vfma(p, f, vset1(c[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#else  // portable: no intrinsics. mul then add (built with -ffp-contract=off), no FMA assumed
constexpr int W = 8;
constexpr int kRegs = 16;
#if defined(__GNUC__) || defined(__clang__)
// the compilers' generic vectors: lowered to whatever SIMD the target has (SSE2, NEON, ...), else to scalars
typedef float Vec __attribute__((vector_size(W * sizeof(float))));
typedef uint32_t VecU __attribute__((vector_size(W * sizeof(uint32_t))));
inline Vec vzero() { return Vec{}; }
inline Vec vset1(float a) { return Vec{} + a; }
inline Vec vfma(Vec a, Vec b, Vec c) { return c + a * b; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline void vstore(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  VecU raw;
  std::memcpy(&raw, p, sizeof raw);
  const VecU e = raw << 16, o = raw & 0xFFFF0000u;
  std::memcpy(&even, &e, sizeof e);
  std::memcpy(&odd, &o, sizeof o);
}
inline float lane(const Vec& v, int l) { return v[l]; }
inline void set_lane(Vec& v, int l, float a) { v[l] = a; }
#else
struct Vec {
  float v[W];
  float operator[](int l) const { return v[l]; }
};
inline Vec vzero() { return Vec{}; }
inline Vec vset1(float a) {
  Vec r;
  for (int l = 0; l < W; ++l) r.v[l] = a;
  return r;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int l = 0; l < W; ++l) c.v[l] = c.v[l] + a.v[l] * b.v[l];
  return c;
}
inline Vec vadd(Vec a, Vec b) {
  for (int l = 0; l < W; ++l) a.v[l] += b.v[l];
  return a;
}
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void vstore(float* p, Vec v) { std::memcpy(p, v.v, sizeof v.v); }
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  uint32_t raw[W];
  std::memcpy(raw, p, sizeof raw);
  for (int l = 0; l < W; ++l) {
    even.v[l] = bits_to_float(raw[l] << 16);
    odd.v[l] = bits_to_float(raw[l] & 0xFFFF0000u);
  }
}
inline float lane(const Vec& v, int l) { return v.v[l]; }
inline void set_lane(Vec& v, int l, float a) { v.v[l] = a; }
#endif
inline Vec vload_bf16(const uint16_t* p) {
  Vec r = vzero();
  for (int l = 0; l < W; ++l) set_lane(r, l, bf16_to_float(p[l]));
  return r;
}
inline uint32_t vgt_mask(Vec v, float t) {
  uint32_t m = 0;
  for (int l = 0; l < W; ++l) m |= static_cast<uint32_t>(lane(v, l) > t) << l;
  return m;
}
inline float vsum(Vec v) {
  float s = 0.0f;
  for (int l = 0; l < W; ++l) s += lane(v, l);
  return s;
}
inline Vec vexp_nonpositive(Vec x) {
  for (int l = 0; l < W; ++l) set_lane(x, l, std::exp(lane(x, l)));
  return x;
}
#endif

constexpr int kVecsPerBlock = kLanes / W;

// out[i] = vsum(a[i]) for i < n, bitwise. AVX2: eight sums at a time, shuffled across the vectors so that each
// keeps vsum's pairing, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), in 19 instructions instead of 48.
inline void vsum_many(const Vec* a, int n, float* out) {
  int i = 0;
#if defined(SPECHEAD_ISA_AVX512)
  // sixteen sums at a time in 47 instructions instead of 128, each keeping vsum's pairing; a tail of more than
  // one sum is padded to sixteen
  const auto sixteen = [](const Vec* b, float* o) {
    Vec c[8];  // [t_0..t_7 of b[p] | of b[p + 8]], t_k = l_k + l_(k+8)
    for (int p = 0; p < 8; ++p)
      c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[p], b[p + 8], 0x44), _mm512_shuffle_f32x4(b[p], b[p + 8], 0xEE));
    Vec e[4];  // [u of b[p], of b[p + 8], of b[p + 4], of b[p + 12]], u_k = t_k + t_(k+4)
    for (int p = 0; p < 4; ++p)
      e[p] = _mm512_add_ps(_mm512_shuffle_f32x4(c[p], c[p + 4], 0x88), _mm512_shuffle_f32x4(c[p], c[p + 4], 0xDD));
    // per 128-bit lane: [u0 + u2 of e0, of e1, u1 + u3 of e0, of e1], then the two added
    const Vec f01 = _mm512_add_ps(_mm512_unpacklo_ps(e[0], e[1]), _mm512_unpackhi_ps(e[0], e[1]));
    const Vec f23 = _mm512_add_ps(_mm512_unpacklo_ps(e[2], e[3]), _mm512_unpackhi_ps(e[2], e[3]));
    const Vec r = _mm512_add_ps(_mm512_shuffle_ps(f01, f23, 0x44), _mm512_shuffle_ps(f01, f23, 0xEE));
    _mm512_storeu_ps(o, _mm512_shuffle_f32x4(r, r, 0xD8));  // lanes b0-3, b8-11, b4-7, b12-15 -> in order
  };
  for (; i + 16 <= n; i += 16) sixteen(a + i, out + i);
  if (n - i > 1) {
    Vec b[16];
    float o[16];
    for (int u = 0; u < 16; ++u) b[u] = i + u < n ? a[i + u] : vzero();
    sixteen(b, o);
    for (; i < n; ++i) out[i] = o[i % 16];
  }
#endif
#if defined(SPECHEAD_ISA_AVX2)
  for (; i + 8 <= n; i += 8) {
    __m256 c[4];  // [s0..s3 of a[p] | s0..s3 of a[p + 4]], s_k = l_k + l_(k+4)
    for (int p = 0; p < 4; ++p)
      c[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[i + p], a[i + p + 4], 0x20),
                           _mm256_permute2f128_ps(a[i + p], a[i + p + 4], 0x31));
    // [s0+s2 of p, of p+1, s1+s3 of p, of p+1 | the same of p+4, p+5] for p = 0 and p = 2
    const __m256 e01 = _mm256_add_ps(_mm256_unpacklo_ps(c[0], c[1]), _mm256_unpackhi_ps(c[0], c[1]));
    const __m256 e23 = _mm256_add_ps(_mm256_unpacklo_ps(c[2], c[3]), _mm256_unpackhi_ps(c[2], c[3]));
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_shuffle_ps(e01, e23, _MM_SHUFFLE(1, 0, 1, 0)),
                                            _mm256_shuffle_ps(e01, e23, _MM_SHUFFLE(3, 2, 3, 2))));
  }
#endif
  for (; i < n; ++i) out[i] = vsum(a[i]);
}

// ---- the few-row GEMM ------------------------------------------------------------------------------------------
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

// ---- row top-k -------------------------------------------------------------------------------------------------
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
    prefetch(bytes + (i + kPrefetch * kLanes) * elem);  // the row streams from DRAM
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

// ---- NanoSpec's set update (scalar code: the same in every build) ---------------------------------------------
// nanospec.py, NanoSpecHead._append, is the reference with the same semantics: refresh the last-hit round of
// candidates already in the set (LRU), pick the distinct candidates not in it (first occurrence order,
// drafter-eligible), give them free slots and, under LRU, the slots of the least recently hit ids (stable by
// slot, never one hit this round), and update ids / membership / slot map / last-hit in place. Returns (new ids
// that got a slot, their slots, new ids in all, evicted). A few hundred scalar steps; as ~30 tensor ops it cost
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

// ---- RMSNorm of a few rows --------------------------------------------------------------------------------------
// y = x / sqrt(mean(x^2) + eps) * w for fp32 rows. A decode step runs 61 of these on 576-wide rows; torch's CPU
// rms_norm is several ops (~12-35 us each call), this is one pass of a few microseconds. Rows are independent and
// each is summed in one fixed order, so a row's result does not depend on how many rows come with it.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be a contiguous 2-D fp32 CPU tensor");
  const int64_t R = x.size(0), D = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.numel() == D && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "rms_norm: w must be a contiguous fp32 vector of ", D, " values");
  at::Tensor y = at::empty_like(x);
  const float* px = x.data_ptr<float>();
  const float* pw = w.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = px + r * D;
    Vec acc = vzero();
    int64_t i = 0;
    for (; i + W <= D; i += W) {
      const Vec v = vload(row + i);
      acc = vfma(v, v, acc);
    }
    double ss = vsum(acc);
    for (; i < D; ++i) ss += static_cast<double>(row[i]) * row[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
    const Vec sv = vset1(scale);
    float* out = py + r * D;
    i = 0;
    for (; i + W <= D; i += W) {
      const Vec v = vload(row + i);
      Vec t = vfma(v, sv, vzero());
      vstore(out + i, vfma(t, vload(pw + i), vzero()));
    }
    for (; i < D; ++i) out[i] = (row[i] * scale) * pw[i];
  }
  return y;
}

// ---- rotary embedding of a few rows ----------------------------------------------------------------------------
// x [T, N, D] (N heads of D values) rotated by position: y = x * cos + rotate_half(x) * sin, rotate_half(x) =
// (-x2, x1) for the halves x1, x2 of each head; cos / sin [T, D]. The same products and sum as the tensor
// version (model.apply_rope), in one pass instead of seven ops; rope_row is one head of one row (attend uses it too).
inline void rope_row(const float* a, const float* c, const float* s, float* o, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) o[i] = a[i] * c[i] + (-a[i + h]) * s[i];
  for (int64_t i = h; i < D; ++i) o[i] = a[i] * c[i] + a[i - h] * s[i];
}

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

// ---- attention of a few query rows over a cache lane ------------------------------------------------------------
// One op for a decode step's or a verification's attention: RoPE on the rows' queries and keys, the keys and
// values stored at slots [start, start+T) of the cache lane, then each query row (and head) attends over the slots
// its mask allows. The library's SDPA spends ~0.26 ms a layer on one query row (9 heads over 600 slots, two
// threads) for work that reads 0.9 MB: a tenth of a step's time; this is its bytes.
// Why it also matters for losslessness: a row's output is computed from the list of slots it may see, in slot
// order, and nothing else: scores, their maximum, the exponentials' sum and the weighted values are each
// accumulated in one fixed order over that list. A tree node sees its committed prefix and its ancestors; were it
// accepted, the decode step at the same position would see the same keys and values (the projections' kernel is
// row-count invariant) in the same order, so verification and decoding give bitwise the same hidden state.
// q [T, N*D], k / v [T, KV*D] (inner stride 1, any row stride: views of the fused projection), cos / sin [T, D],
// k_cache / v_cache [lanes, KV, max_len, D]; mask bool [T, start + T - kv_from] (None: causal). Returns [T, N*D].
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
  for (int u = 0; u < NQ * NS; ++u) out[u] = r[u] * sc;
}

// Keys per score tile for NQ queries: a vsum_many batch of sums (eight with AVX2, sixteen with AVX-512) where the
// registers allow, a divisor of the 64-slot block.
template <int NQ>
constexpr int score_slots() {
#if defined(SPECHEAD_ISA_AVX512)
  return NQ == 1 ? 16 : NQ == 2 ? 8 : 4;
#else
  return NQ == 1 ? 8 : NQ == 2 ? 4 : NQ == 3 ? 3 : 2;
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
    for (int i = 0; i < NQ; ++i)
      for (int u = 0; u < NS; ++u) sq[i][j0[i] + s - s0 + u] = out[i * NS + u];
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
  constexpr int NV = NQ == 1 ? 8 : NQ == 2 ? 4 : 2;
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
constexpr ScoreBlockFn kScoreBlock[4] = {score_block<1>, score_block<2>, score_block<3>, score_block<4>};
constexpr WeighBlockFn kWeighBlock[4] = {weigh_block<1>, weigh_block<2>, weigh_block<3>, weigh_block<4>};

// One request's attention once its queries are roped and its keys and values cached (plan_attend): each row's
// visible slots, the scores' scratch and the split of its queries into tasks; run_task runs one task, so a layer
// can spread several requests' tasks over the threads in one parallel loop.
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

AttendPlan plan_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t lane, int64_t start,
                       const std::optional<at::Tensor>& mask, int64_t kv_from, double scale, float* po,
                       int64_t min_tasks) {
  const int64_t T = q.size(0), D = cos.size(1);
  TORCH_CHECK(D > 0 && D % 2 == 0, "attend: the head size must be even");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->scalar_type() == at::kFloat && t->stride(1) == 1 &&
                    t->size(1) % D == 0 && t->device().is_cpu(),
                "attend: q, k, v must be fp32 [T, heads * ", D, "] CPU rows with unit inner stride");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "attend: cos and sin must be contiguous [T, D] fp32");
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->dim() == 4 && t->size(3) == D && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "attend: the caches must be contiguous fp32 [lanes, kv_heads, max_len, D]");
  const int64_t N = q.size(1) / D, KV = k_cache.size(1), L = k_cache.size(2), end = start + T;
  TORCH_CHECK(k.size(1) == KV * D && v.size(1) == KV * D && v_cache.sizes() == k_cache.sizes(),
              "attend: k / v rows must hold the cache's ", KV, " heads");
  TORCH_CHECK(N % KV == 0, "attend: query heads must be a multiple of key/value heads");
  TORCH_CHECK(0 <= lane && lane < k_cache.size(0) && 0 <= kv_from && kv_from <= start && end <= L,
              "attend: lane or slots out of range");
  const int64_t S = end - kv_from;
  const bool* pm = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == T && mask->size(1) == S &&
                    mask->scalar_type() == at::kBool && mask->is_contiguous(),
                "attend: mask must be a contiguous bool [T, ", S, "]");
    pm = mask->data_ptr<bool>();
  }
  // RoPE and the cache write (keys roped, values as they are), then the queries roped into a scratch
  float* kc = k_cache.data_ptr<float>() + lane * KV * L * D;
  float* vc = v_cache.data_ptr<float>() + lane * KV * L * D;
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < KV; ++g) {
      const int64_t slot = (g * L + start + t) * D;
      rope_row(k.data_ptr<float>() + t * k.stride(0) + g * D, pc + t * D, ps + t * D, kc + slot, D);
      std::memcpy(vc + slot, v.data_ptr<float>() + t * v.stride(0) + g * D, D * sizeof(float));
    }
  AttendPlan pl;
  pl.qr = at::empty({T, N, D}, q.options());
  float* pq = pl.qr.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      rope_row(q.data_ptr<float>() + t * q.stride(0) + n * D, pc + t * D, ps + t * D, pq + (t * N + n) * D, D);
  // each row's visible slots, in slot order
  pl.seen.reset(new int32_t[T * S]);
  pl.count.resize(T);
  int32_t* seen = pl.seen.get();
  int64_t* count = pl.count.data();
  for (int64_t t = 0; t < T; ++t) {
    int64_t c = 0;
    for (int64_t s = 0; s < S; ++s)
      if (pm ? pm[t * S + s] : s <= S - T + t) seen[t * S + c++] = static_cast<int32_t>(kv_from + s);
    TORCH_CHECK(c > 0, "attend: query row ", t, " sees no slot");
    count[t] = c;
  }
  // A task takes up to 8 queries of one key/value head (the rows x heads of its group) and walks the slots in
  // blocks of kAttnBlock: each block's keys, then its values, are read from memory once for all the task's
  // queries and stay in L1 while they use them. The queries that see the whole block (a committed prefix) go
  // through it together, up to four per key and value load; the others (a tree's own slots, a window's edge)
  // one by one over their lists. Both give a query the same arithmetic, which does not depend on its task.
  // Fewer queries a task where there would be fewer than min_tasks (a decode step's 3 x 3 queries on 2 threads).
  const int64_t group = N / KV, padded = (S + W - 1) / W * W, per_g = T * group;
  int64_t per_task = std::min<int64_t>(8, per_g);
  while (per_task > 1 && KV * ((per_g + per_task - 1) / per_task) < min_tasks) per_task = (per_task + 1) / 2;
  const int64_t tasks_per_g = (per_g + per_task - 1) / per_task;
  const float sc = static_cast<float>(scale);
  pl.scores.reset(new float[T * N * padded]);
  pl.T = T, pl.S = S, pl.N = N, pl.KV = KV, pl.D = D, pl.L = L, pl.kv_from = kv_from, pl.end = end;
  pl.group = group, pl.padded = padded, pl.per_g = per_g, pl.per_task = per_task, pl.tasks_per_g = tasks_per_g;
  pl.sc = sc, pl.kc = kc, pl.vc = vc, pl.pq = pq, pl.po = po;
  return pl;
}

void AttendPlan::run_task(int64_t task, std::vector<float>& acc) const {
  const int64_t g = task / tasks_per_g, q0 = task % tasks_per_g * per_task;
  const int64_t nq = std::min(per_task, per_g - q0);
  const float* kh = kc + g * L * D;
  const float* vh = vc + g * L * D;
  int64_t tq[8], cq[8], at[8];  // each query's row, visible-slot count, cursor in its list (walk moves it)
  const int32_t* lq[8];
  float* sq[8];
  const float* qq[8];
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (q0 + i) / group, n = g * group + (q0 + i) % group;
    tq[i] = t, cq[i] = count[t], lq[i] = seen.get() + t * S;
    sq[i] = scores.get() + (t * N + n) * padded;
    qq[i] = pq + (t * N + n) * D;
  }
  // The slots block by block; in each, the queries that see all of it in groups of up to four,
  // group(queries, count, b0, b1, first), then each other query over its part of its list, one(i, j0, j1).
  // Every query's cursor in its list starts at 0 and ends past its last visible slot.
  const bool together = D % W == 0;  // the shared-load path's shapes; else every query on its own
  const auto walk = [&](auto&& group, auto&& one) {
    for (int64_t i = 0; i < nq; ++i) at[i] = 0;
    for (int64_t b0 = kv_from; b0 < end; b0 += kAttnBlock) {
      const int64_t b1 = std::min(b0 + kAttnBlock, end);
      int64_t full[8], nfull = 0, ends[8];
      bool whole[8];
      for (int64_t i = 0; i < nq; ++i) {
        ends[i] = slots_before(lq[i], at[i], cq[i], b1);
        whole[i] = together && ends[i] - at[i] == b1 - b0;
        if (whole[i]) full[nfull++] = i;
      }
      for (int64_t f = 0; f < nfull; f += 4) group(full + f, std::min<int64_t>(4, nfull - f), b0, b1, f == 0);
      for (int64_t i = 0; i < nq; ++i) {
        if (!whole[i]) one(i, at[i], ends[i]);
        at[i] = ends[i];
      }
    }
  };
  // scores; eight slots at once where they fill a group (independent FMA chains), each slot's sum formed as
  // dot() forms it
  walk(
      [&](const int64_t* qs, int64_t m, int64_t b0, int64_t b1, bool first) {
        const float* qp[4];
        float* sp[4];
        int64_t jp[4];
        for (int64_t u = 0; u < m; ++u) qp[u] = qq[qs[u]], sp[u] = sq[qs[u]], jp[u] = at[qs[u]];
        kScoreBlock[m - 1](qp, sp, jp, kh, D, b0, b1, sc, first, end);
      },
      [&](int64_t i, int64_t j, int64_t j1) {
        const int32_t* list = lq[i];
        if (together)
          for (; j + 8 <= j1; j += 8) {
            const float* kr[8];
            for (int u = 0; u < 8; ++u) kr[u] = kh + list[j + u] * D;
            if (i == 0 && j + kAttnAhead + 8 <= cq[i])  // a step streams the lane from memory: rows well ahead
              for (int u = 0; u < 8; ++u) prefetch_floats(kh + list[j + kAttnAhead + u] * D, D);
            score_tile<1, 8>(qq + i, kr, D, sc, sq[i] + j);
          }
        for (; j < j1; ++j) sq[i][j] = dot(qq[i], kh + list[j] * D, D) * sc;
      });
  // softmax weights: exp(score - max), summed in list order
  float inv[8];
  for (int64_t i = 0; i < nq; ++i) {
    float* score = sq[i];
    const int64_t c = cq[i];
    float mx = row_max(score, c);
    for (int64_t j = c; j < padded; ++j) score[j] = mx;  // exp(0) in the padding, never summed
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
      vstore(score + j, vexp_nonpositive(vadd(vload(score + j), neg)));
      for (; j < c; ++j) sum += score[j];
    }
    inv[i] = 1.0f / sum;
  }
  // the weighted values, each output accumulated in slot order
  acc.assign(per_task * D, 0.0f);
  walk(
      [&](const int64_t* qs, int64_t m, int64_t b0, int64_t b1, bool first) {
        const float* pp[4];
        float* ap[4];
        for (int64_t u = 0; u < m; ++u) pp[u] = sq[qs[u]] + at[qs[u]], ap[u] = acc.data() + qs[u] * D;
        kWeighBlock[m - 1](vh, D, b0, b1, pp, ap, first, end);
      },
      [&](int64_t i, int64_t j0, int64_t j1) {
        const int32_t* list = lq[i];
        float* ai = acc.data() + i * D;
        int64_t d = 0;
        for (; d + 8 * W <= D; d += 8 * W) weigh_values<8>(vh + d, D, list, sq[i], j0, j1, ai + d);
        for (; d + 4 * W <= D; d += 4 * W) weigh_values<4>(vh + d, D, list, sq[i], j0, j1, ai + d);
        for (; d + W <= D; d += W) weigh_values<1>(vh + d, D, list, sq[i], j0, j1, ai + d);
        for (; d < D; ++d)  // heads narrower than a vector (small test models)
          for (int64_t j = j0; j < j1; ++j) ai[d] += sq[i][j] * vh[list[j] * D + d];
      });
  for (int64_t i = 0; i < nq; ++i) {
    float* o = po + tq[i] * N * D + (g * group + (q0 + i) % group) * D;
    const float* ai = acc.data() + i * D;
    const Vec iv = vset1(inv[i]);
    int64_t d = 0;
    for (; d + W <= D; d += W) vstore(o + d, vfma(vload(ai + d), iv, vzero()));
    for (; d < D; ++d) o[d] = ai[d] * inv[i];
  }
}

// Every plan's tasks in one parallel loop: a batch of one-row decode steps is many small requests, each too
// small to keep the threads busy on its own.
void run_plans(const std::vector<AttendPlan>& plans) {
  std::vector<int64_t> first(plans.size() + 1, 0);  // plans[p]'s tasks are [first[p], first[p + 1]) of the loop
  for (size_t p = 0; p < plans.size(); ++p) first[p + 1] = first[p] + plans[p].tasks();
  at::parallel_for(0, first.back(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc;
    size_t p = std::upper_bound(first.begin(), first.end(), t0) - first.begin() - 1;
    for (int64_t task = t0; task < t1; ++task) {
      while (task >= first[p + 1]) ++p;
      plans[p].run_task(task - first[p], acc);
    }
  });
}

// A request alone: fewer queries a task, so that it still gives every thread two.
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                 const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t lane, int64_t start,
                 const std::optional<at::Tensor>& mask, int64_t kv_from, double scale, float* po) {
  std::vector<AttendPlan> plans;
  plans.push_back(plan_attend(q, k, v, cos, sin, k_cache, v_cache, lane, start, mask, kv_from, scale, po,
                              2 * at::get_num_threads()));
  run_plans(plans);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                  const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, int64_t lane, int64_t start,
                  const std::optional<at::Tensor>& mask, int64_t kv_from, double scale) {
  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());
  attend_into(q, k, v, cos, sin, k_cache, v_cache, lane, start, mask, kv_from, scale, out.data_ptr<float>());
  return out;
}

// ---- SiLU(gate) * up ----------------------------------------------------------------------------------------------
// gu [R, 2I] (the fused gate / up projection) -> [R, I]. silu(g) = g / (1 + e^-g), computed from e = exp(-|g|) so
// the exponential never overflows: g / (1 + e) for g >= 0, g e / (1 + e) below. One pass instead of three ops;
// the MLP uses it for every fp32 row where the kernels run, so a row's result never depends on the path it took.
inline float silu_from(float g, float e) {  // silu(g) given e = exp(-|g|); both sides computed: a select, no branch
  const float d = 1.0f + e, pos = g / d, neg = (g * e) / d;
  return g >= 0.0f ? pos : neg;
}

inline float silu1_exp(float g) {  // exp(-|g|) as silu_mul's vectors give it, for one value
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
  float buf[W] = {};
  buf[0] = -std::fabs(g);
  vstore(buf, vexp_nonpositive(vload(buf)));
  return buf[0];
#else
  return std::exp(-std::fabs(g));
#endif
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.scalar_type() == at::kFloat && gu.device().is_cpu() &&
                  gu.stride(1) == 1,
              "silu_mul: gu must be fp32 [R, 2I] CPU rows with unit inner stride");
  const int64_t R = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  at::Tensor y = at::empty({R, I}, gu.options().memory_format(at::MemoryFormat::Contiguous));
  const float* pg = gu.data_ptr<float>();
  float* py = y.data_ptr<float>();
  // Per row: the exponentials a vector at a time into a scratch row, then silu_from * up over the row as one
  // branch-free loop the compiler vectorises (both sides of the select are computed; IEEE division and
  // products give every lane what the scalar expression gives). A data-dependent branch per element cost
  // ~5 ns of mispredictions: 3.7 ms of a 16-row forward of the demo target.
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> ev(static_cast<size_t>(I));
    float* e = ev.data();
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = pg + r * ld;
      const float* u = g + I;
      float* o = py + r * I;
      int64_t i = 0;
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
      for (; i + W <= I; i += W) {
        float a[W];
        for (int l = 0; l < W; ++l) a[l] = -std::fabs(g[i + l]);
        vstore(e + i, vexp_nonpositive(vload(a)));
      }
#endif
      for (; i < I; ++i) e[i] = silu1_exp(g[i]);
      for (int64_t j = 0; j < I; ++j) o[j] = silu_from(g[j], e[j]) * u[j];
    }
  });
  return y;
}

// ---- a Llama decoder layer over a few rows ------------------------------------------------------------------------
// What Block.forward does for fp32 rows when the kernels run, as one op: RMSNorm, the fused q/k/v projection,
// attention per request (attend_into), the output projection and residual, RMSNorm, the fused gate/up projection,
// SiLU(gate) * up, the down projection and residual. The same functions in the same order as the module path, so
// the two give bitwise the same rows; what this saves is ~25 Python-level calls a layer (~8 ms of a 45 ms step of
// the demo target on 2 cores). Weights are blocked-layout tensors with their output widths; each request's rows
// [row0, row0 + t) attend over cache lane ``lanes[i]`` from slot ``kv_from[i]``, their keys at ``starts[i]``.
at::Tensor narrow_cols(const at::Tensor& y, int64_t n) { return y.size(1) == n ? y : y.narrow(1, 0, n).contiguous(); }

at::Tensor llama_layer(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                       const at::Tensor& w_qkv, const at::Tensor& w_o, const at::Tensor& w_gu,
                       const at::Tensor& w_down, at::IntArrayRef widths, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, at::IntArrayRef row0,
                       at::IntArrayRef rows, at::IntArrayRef lanes, at::IntArrayRef starts,
                       const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef kv_from, double scale) {
  TORCH_CHECK(widths.size() == 4, "llama_layer: widths = (qkv, o, gate_up, down) output features");
  const size_t P = row0.size();
  TORCH_CHECK(rows.size() == P && lanes.size() == P && starts.size() == P && masks.size() == P &&
                  kv_from.size() == P && P >= 1,
              "llama_layer: one row0 / rows / lane / start / mask / kv_from per request");
  const int64_t D = cos.size(1), KV = k_cache.size(1), d = x.size(1);
  const int64_t nq = widths[0] - 2 * KV * D;
  TORCH_CHECK(nq > 0 && nq % D == 0 && widths[1] == d && widths[3] == d, "llama_layer: widths do not fit the cache");
  const auto blocks = [](int64_t n) { return (n + kLanes - 1) / kLanes; };
  const at::Tensor qkv = narrow_cols(draft_linear(rms_norm(x, ln1, eps), w_qkv, blocks(widths[0])), widths[0]);
  at::Tensor att = at::empty({x.size(0), nq}, x.options());
  // every request's attention planned, then all their tasks in one parallel loop (run_plans)
  std::vector<AttendPlan> plans;
  plans.reserve(P);
  const int64_t min_tasks = P == 1 ? 2 * at::get_num_threads() : 1;
  for (size_t p = 0; p < P; ++p) {
    const at::Tensor part = qkv.narrow(0, row0[p], rows[p]);
    plans.push_back(plan_attend(part.narrow(1, 0, nq), part.narrow(1, nq, KV * D),
                                part.narrow(1, nq + KV * D, KV * D), cos.narrow(0, row0[p], rows[p]).contiguous(),
                                sin.narrow(0, row0[p], rows[p]).contiguous(), k_cache, v_cache, lanes[p], starts[p],
                                masks.get(p), kv_from[p], scale, att.data_ptr<float>() + row0[p] * nq, min_tasks));
  }
  run_plans(plans);
  const at::Tensor h = x + narrow_cols(draft_linear(att, w_o, blocks(d)), d);
  const at::Tensor gu = narrow_cols(draft_linear(rms_norm(h, ln2, eps), w_gu, blocks(widths[2])), widths[2]);
  return h + narrow_cols(draft_linear(silu_mul(gu), w_down, blocks(d)), d);
}

int64_t vector_lanes() { return W; }

}  // namespace

// SPECHEAD_NS is a macro: these wrappers expand it before TORCH_LIBRARY pastes it into names
#define SPECHEAD_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define SPECHEAD_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

SPECHEAD_LIBRARY(SPECHEAD_NS, m) {
  m.def("draft_linear(Tensor x, Tensor w, int blocks) -> Tensor");
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
      "llama_layer(Tensor x, Tensor ln1, Tensor ln2, float eps, Tensor w_qkv, Tensor w_o, Tensor w_gu, Tensor w_down, "
      "int[] widths, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int[] row0, int[] rows, "
      "int[] lanes, int[] starts, Tensor?[] masks, int[] kv_from, float scale) -> Tensor");
  m.def("vector_lanes() -> int", vector_lanes);
}
SPECHEAD_LIBRARY_IMPL(SPECHEAD_NS, CPU, m) {
  m.impl("draft_linear", draft_linear);
  m.impl("row_topk", row_topk);
  m.impl("active_set_add", active_set_add);
  m.impl("rms_norm", rms_norm);
  m.impl("rope", rope);
  m.impl("attend", attend);
  m.impl("silu_mul", silu_mul);
  m.impl("llama_layer", llama_layer);
}
