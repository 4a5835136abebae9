// qlinear: y = x @ W.T with W in 32-value integer blocks (the GGUF file's own Q8_0 / Q4_x values) and x quantized
// per row and per block to int8, the products summed exactly in int32.
//
// Why: a decode step of a quantized checkpoint should cost the bytes of its quantized weights, and a 16-row
// verification should cost about what one row costs. Integer dot products do 4x (vpmaddubsw) to 16x (vpdpbusd on
// 512 bits) the multiply-adds per instruction of fp32 FMA, so the rows of a verification ride along with the bytes
// of one decode step.
//
// The contract, tested for every path the CPU runs (tests/test_qlinear.py): a row's result bits depend on that row
// and the weight alone, not on how many rows share the call, not on the instruction set, not on the thread count.
// It holds by construction:
//   1. each activation row is quantized alone, per 32-value block: amax, d = amax / 127, q = nearest-even(x * (127 /
//      amax)), the block's int32 sum s and d * s (quantize_block: its vector and scalar forms give the same bits);
//   2. a block's dot product is exact in int32 on every path (q4: u4 x s8 pairs never saturate vpmaddubsw's int16,
//      2 * 15 * 127; q8: |w| x sign(a, w) at most 2 * 128 * 127; vpdpbusd accumulates in int32, q8 weights biased
//      by 128 and the bias removed exactly as 128 * s);
//   3. one float epilogue per output in block order, the same operations on every path:
//      acc = fma(float(isum), dw * da, acc), then for q4 acc = fma(mw, da * s, acc);
//   4. vectors run across output columns, threads split the output columns, never K.
//
// Weight layout (kernels/qlinear.py packs it), panels of 16 output columns:
//   data  uint8 [N/16, K/32, B]: per block, 8 groups of 4 consecutive k; a group is 64 bytes = 16 columns x 4 k.
//         q8: B = 512, the 8 groups in order, int8 values. q4: B = 256, 4 chunks of 64 bytes, the low nibble of
//         chunk h holding group h and the high nibble group h + 4, values 0..15.
//   scale float [N/16, K/32, 16] and, for q4, min float [N/16, K/32, 16].
// A group's 64 bytes are one 512-bit vector of 16 int32 lanes of 4 bytes each: what vpdpbusd consumes, and, split in
// halves, two 256-bit vectors for AVX2; AMX's B tile rows have the same layout.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <cstdlib>
#include <string>
#include <vector>

#include "ops.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(SPECHEAD_ISA_AVX512) && defined(__GNUC__)
#define SPECHEAD_VNNI_TARGET __attribute__((target("avx512vnni,avx512bw,avx512f")))
#endif

namespace SPECHEAD_NS {
namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxRows = 8;  // rows the portable path takes a panel at a time
constexpr int64_t kAmxRows = 32;  // calls of at least this many rows take AMX where the OS grants it (measured: below, vpdpbusd is as fast)

// The activation rows of one call, quantized: q [M, K] int8, and per row and block d, the int32 sum s and d * s.
struct QRows {
  int64_t M = 0, K = 0, KB = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
};

// One 32-value block of a row: amax, d = amax / 127, q = nearest-even(x * (127 / amax)), its int32 sum s and d * s.
// The vector form gives the scalar form's bits: a maximum is exact in any order (and, like std::max with the
// running value first, passes over NaN), x * id is one IEEE product a lane, vroundps rounds to nearest-even as
// nearbyint does, and an integer sum is exact in any order.
inline void quantize_block(const float* v, int8_t* q, float& d, int32_t& s) {
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(v + 8 * i), m = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // int32 -> int8 (|n| <= 127: no saturation), the packs' 128-bit lane interleave undone by the permute
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
  s = _mm_cvtsi128_si32(u);
#else
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  d = amax / 127.0f;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  s = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));  // |x * id| <= 127 up to one rounding: it fits
    s += q[i];
  }
#endif
}

QRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QRows a;
  a.M = M, a.K = K, a.KB = K / kBlock;
  a.q.resize(static_cast<size_t>(M * K));
  a.d.resize(static_cast<size_t>(M * a.KB));
  a.ds.resize(a.d.size());
  a.s.resize(a.d.size());
  // rows apart on the threads where there are enough of them (a prefill's hundreds): each row alone, as ever
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < a.KB; ++b) {
        const int64_t j = r * a.KB + b;
        quantize_block(x + r * K + b * kBlock, a.q.data() + r * K + b * kBlock, a.d[j], a.s[j]);
        a.ds[j] = a.d[j] * static_cast<float>(a.s[j]);
      }
  });
  return a;
}

// The value of byte i (column i / 4, k = 4 g + i % 4) of group g in a packed block: q8 a signed byte; q4 the low
// nibble of chunk g for groups 0..3, the high nibble of chunk g - 4 for groups 4..7.
inline int8_t block_value(const uint8_t* blk, bool q4, int g, int i) {
  if (!q4) return static_cast<int8_t>(blk[64 * g + i]);
  return static_cast<int8_t>(g < 4 ? blk[64 * g + i] & 15 : blk[64 * (g - 4) + i] >> 4);
}

// The checks of a packed weight's tensors (the header's layout) for op `op`: whether it is q4, panels, blocks.
struct WeightShape {
  bool q4;
  int64_t panels, blocks;
};

WeightShape check_weight(const char* op, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min) {
  TORCH_CHECK(data.dim() == 3 && data.scalar_type() == at::kByte && data.is_contiguous(), op,
              ": data must be contiguous uint8 [N/16, K/32, bytes]");
  const bool q4 = data.size(2) == 256;
  TORCH_CHECK(q4 || data.size(2) == 512, op, ": a block is 256 (q4) or 512 (q8) bytes, got ", data.size(2));
  const int64_t NP = data.size(0), KB = data.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == NP * KB * 16, op,
              ": scale must be contiguous fp32 [N/16, K/32, 16]");
  TORCH_CHECK(!q4 || (min.scalar_type() == at::kFloat && min.is_contiguous() && min.numel() == NP * KB * 16), op,
              ": a q4 weight needs its min, fp32 [N/16, K/32, 16]");
  return {q4, NP, KB};
}

// ---- the portable path: the definition the vector paths reproduce bit for bit ---------------------------------
template <bool Q4>
void panel_portable(const uint8_t* wd, const float* ws, const float* wm, const QRows& a, int64_t r0, int64_t rows,
                    float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t B = Q4 ? 256 : 512;
  int8_t w[16][kBlock];  // one block, unpacked to [column][k]
  std::vector<float> acc(static_cast<size_t>(rows * 16), 0.0f);
  for (int64_t b = 0; b < a.KB; ++b) {
    const uint8_t* blk = wd + b * B;
    for (int g = 0; g < 8; ++g)
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < 4; ++j) w[c][4 * g + j] = block_value(blk, Q4, g, c * 4 + j);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t j = (r0 + r) * a.KB + b;
      const int8_t* q = a.q.data() + (r0 + r) * a.K + b * kBlock;
      for (int c = 0; c < 16; ++c) {
        int32_t isum = 0;
        for (int k = 0; k < kBlock; ++k) isum += static_cast<int32_t>(w[c][k]) * q[k];
        float& o = acc[r * 16 + c];
        o = std::fma(static_cast<float>(isum), ws[b * 16 + c] * a.d[j], o);
        if (Q4) o = std::fma(wm[b * 16 + c], a.ds[j], o);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[(r0 + r) * ldy + c] = acc[r * 16 + c];
}

#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
// ---- AVX2: vpmaddubsw + vpmaddwd, 8 columns per vector, a panel is two vectors --------------------------------
// Up to kAvx2Rows rows share each weight vector: a block's weights are loaded (q4: unpacked) into registers once,
// then every row's broadcast activation group multiplies them, the rows' sums in registers until the epilogue.
constexpr int kAvx2Rows = 4;

// An empty asm that claims to change v: the compiler must materialize each running sum in its register where it
// stands, rather than reassociate a block's integer adds into a tree of 64 products spilled to the stack.
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

template <bool Q4, int R>
void panel_avx2(const uint8_t* wd, const float* ws, const float* wm, const QRows& a, int64_t r0, float* y,
                int64_t ldy, int64_t cols) {
  constexpr int64_t B = Q4 ? 256 : 512;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int32_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * a.K);
  for (int64_t b = 0; b < a.KB; ++b) {
    const uint8_t* blk = wd + b * B;
    __m256i s[R][2];  // q4: int16 sums (eight groups' u4 x s8 pairs fit: 8 * 2 * 15 * 127 < 32768); q8: int32
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    if (Q4) {
      for (int h = 0; h < 4; ++h) {  // chunk h: groups h (low nibbles) and h + 4 (high nibbles)
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low), lo1 = _mm256_and_si256(v1, low);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m256i qa = _mm256_set1_epi32(q[r][8 * b + h]), qb = _mm256_set1_epi32(q[r][8 * b + h + 4]);
          s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(lo0, qa));
          s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(lo1, qa));
          s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(hi0, qb));
          s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(hi1, qb));
          keep_in_register(s[r][0]), keep_in_register(s[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) s[r][0] = _mm256_madd_epi16(s[r][0], ones), s[r][1] = _mm256_madd_epi16(s[r][1], ones);
    } else {  // |w| x sign(a, w): each pair sum at most 2 * 128 * 127, widened to int32 at once
      for (int g = 0; g < 8; ++g) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < R; ++r) {
          const __m256i qg = _mm256_set1_epi32(q[r][8 * b + g]);
          s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(qg, w0)), ones));
          s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(qg, w1)), ones));
          keep_in_register(s[r][0]), keep_in_register(s[r][1]);
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 dw = _mm256_loadu_ps(ws + b * 16 + 8 * half);
      const __m256 mw = Q4 ? _mm256_loadu_ps(wm + b * 16 + 8 * half) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const int64_t j = (r0 + r) * a.KB + b;
        __m256 o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][half]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[j])), acc[r][half]);
        if (Q4) o = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.ds[j]), o);
        acc[r][half] = o;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    std::copy(out, out + cols, y + (r0 + r) * ldy);
  }
}
#endif

#if defined(SPECHEAD_VNNI_TARGET)
// ---- AVX512-VNNI: vpdpbusd, a panel is one vector of 16 int32 lanes -------------------------------------------
// Up to kVnniRows rows share each block's eight weight vectors (q4: unpacked once, in registers), so a 16-row
// verification reads and unpacks a panel once, not once per eight rows; their sums stay in registers (16 + 8 + a
// few of the 32). A row or two is a chain of dependent vpdpbusd: split in two (even and odd groups, an exact integer
// sum either way) so that the next block's products need not wait on it. The weight stream is prefetched
// kVnniAhead bytes on, the scales and minimums as far in blocks: a decode step reads every panel once, from memory.
constexpr int kVnniRows = 16;
constexpr int64_t kVnniAhead = 2048;

template <bool Q4, int R>
SPECHEAD_VNNI_TARGET void panel_vnni(const uint8_t* wd, const float* ws, const float* wm, const QRows& a, int64_t r0,
                                     float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t B = Q4 ? 256 : 512;
  constexpr bool kSplit = R <= 2;
  const __m512i low = _mm512_set1_epi8(15), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b) {
    const uint8_t* blk = wd + b * B;
    for (int64_t off = 0; off < B; off += 64) prefetch(blk + kVnniAhead + off);
    prefetch(ws + (b + kVnniAhead / B) * 16);
    if (Q4) prefetch(wm + (b + kVnniAhead / B) * 16);
    __m512i w[8];
    if (Q4) {
      for (int h = 0; h < 4; ++h) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * h);
        w[h] = _mm512_and_si512(v, low);
        w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {  // int8 -> uint8 biased by 128, for vpdpbusd's unsigned operand
      for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * g), bias);
    }
    const __m512 dw = _mm512_loadu_ps(ws + b * 16);
    const __m512 mw = Q4 ? _mm512_loadu_ps(wm + b * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t j = (r0 + r) * a.KB + b;
      const int32_t* q4 = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * a.K + b * kBlock);
      // q8: the sum starts at -128 s, which takes the weights' bias back out exactly (a broadcast, not a subtraction)
      __m512i isum = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * a.s[j]);
      if constexpr (kSplit) {
        __m512i odd = _mm512_setzero_si512();
        for (int g = 0; g < 8; g += 2) {
          isum = _mm512_dpbusd_epi32(isum, w[g], _mm512_set1_epi32(q4[g]));
          odd = _mm512_dpbusd_epi32(odd, w[g + 1], _mm512_set1_epi32(q4[g + 1]));
        }
        isum = _mm512_add_epi32(isum, odd);
      } else {
        for (int g = 0; g < 8; ++g) isum = _mm512_dpbusd_epi32(isum, w[g], _mm512_set1_epi32(q4[g]));
      }
      __m512 o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[j])), acc[r]);
      if (Q4) o = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.ds[j]), o);
      acc[r] = o;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == 16) {
      _mm512_storeu_ps(y + (r0 + r) * ldy, acc[r]);
    } else {
      _mm512_mask_storeu_ps(y + (r0 + r) * ldy, static_cast<__mmask16>((1u << cols) - 1), acc[r]);
    }
  }
}

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}
#endif


#if defined(SPECHEAD_VNNI_TARGET)
// ---- AMX: tdpbssd, one tile product per (panel, block) for up to 16 rows ---------------------------------------
// The activations' 32 bytes per row are the A tile, the block's 8 groups of 64 bytes exactly the B tile (16
// columns x 4 k per row, q4 unpacked first), C the int32 block sums of 16 rows x 16 columns: the same exact
// integers as vpdpbusd's, then the same epilogue. The OS must grant the tile state (amx_granted).
#define SPECHEAD_AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512vnni,avx512bw,avx512f")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <bool Q4>
SPECHEAD_AMX_TARGET void panels_amx(const uint8_t* wd, const float* ws, const float* wm, const QRows& a, float* y,
                                    int64_t ldy, int64_t p0, int64_t p1, int64_t n) {
  constexpr int64_t B = Q4 ? 256 : 512;
  const __m512i low = _mm512_set1_epi8(15);
  alignas(64) uint8_t unpacked[512];
  alignas(64) int32_t c[16 * 16];
  for (int64_t r0 = 0; r0 < a.M; r0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, a.M - r0));
    TileConfig cfg;
    cfg.rows[0] = static_cast<uint8_t>(rows), cfg.colsb[0] = 64;  // C: rows x 16 int32
    cfg.rows[1] = static_cast<uint8_t>(rows), cfg.colsb[1] = 32;  // A: rows x 32 int8
    cfg.rows[2] = 8, cfg.colsb[2] = 64;                           // B: 8 groups x (16 columns x 4 k)
    _tile_loadconfig(&cfg);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* pd = wd + p * a.KB * B;
      const float* ps = ws + p * a.KB * 16;
      const float* pm = Q4 ? wm + p * a.KB * 16 : nullptr;
      __m512 acc[16];
      for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < a.KB; ++b) {
        const uint8_t* blk = pd + b * B;
        if (Q4) {
          for (int h = 0; h < 4; ++h) {
            const __m512i v = _mm512_loadu_si512(blk + 64 * h);
            _mm512_store_si512(unpacked + 64 * h, _mm512_and_si512(v, low));
            _mm512_store_si512(unpacked + 64 * (h + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
          }
          blk = unpacked;
        }
        _tile_zero(0);
        _tile_loadd(1, a.q.data() + r0 * a.K + b * kBlock, a.K);
        _tile_loadd(2, blk, 64);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, c, 64);
        const __m512 dw = _mm512_loadu_ps(ps + b * 16);
        const __m512 mw = Q4 ? _mm512_loadu_ps(pm + b * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; ++r) {
          const int64_t j = (r0 + r) * a.KB + b;
          const __m512i isum = _mm512_load_si512(c + 16 * r);
          __m512 o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[j])), acc[r]);
          if (Q4) o = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.ds[j]), o);
          acc[r] = o;
        }
      }
      const int64_t cols = std::min<int64_t>(16, n - p * 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ldy + p * 16, mask, acc[r]);
    }
  }
  _tile_release();
}

// Whether this process may use the tile registers: the CPU has AMX-INT8 and Linux grants the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once); SPECHEAD_AMX=0 declines it.
bool amx_granted() {
  static const bool granted = [] {
    const char* env = std::getenv("SPECHEAD_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    if (!__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("amx-tile")) return false;
#if defined(__linux__)
    constexpr long kReqPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return granted;
}
#endif

using PanelFn = void (*)(const uint8_t*, const float*, const float*, const QRows&, int64_t, float*, int64_t, int64_t);

template <template <bool, int> class Table, bool Q4, size_t... I>
constexpr std::array<PanelFn, sizeof...(I)> make_table(std::index_sequence<I...>) {
  return {Table<Q4, static_cast<int>(I) + 1>::fn...};
}

#if defined(SPECHEAD_VNNI_TARGET)
template <bool Q4, int R>
struct Vnni {
  static constexpr PanelFn fn = panel_vnni<Q4, R>;
};
#endif
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
template <bool Q4, int R>
struct Avx2 {
  static constexpr PanelFn fn = panel_avx2<Q4, R>;
};
#endif

// The tile functions the CPU runs, by rows (1..rows), and how many rows a tile takes; none on the portable path.
struct Tiles {
  const PanelFn* fn;
  int rows;
};

template <bool Q4>
Tiles tiles() {
#if defined(SPECHEAD_VNNI_TARGET)
  static constexpr auto vnni = make_table<Vnni, Q4>(std::make_index_sequence<kVnniRows>{});
  if (cpu_has_vnni()) return {vnni.data(), kVnniRows};
#endif
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
  static constexpr auto avx2 = make_table<Avx2, Q4>(std::make_index_sequence<kAvx2Rows>{});
  return {avx2.data(), kAvx2Rows};
#else
  return {nullptr, kMaxRows};
#endif
}

template <bool Q4>
void run_panels(const uint8_t* wd, const float* ws, const float* wm, const QRows& a, float* y, int64_t N, int64_t p0,
                int64_t p1) {
  constexpr int64_t B = Q4 ? 256 : 512;
  const Tiles table = tiles<Q4>();
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* pd = wd + p * a.KB * B;
    const float* ps = ws + p * a.KB * 16;
    const float* pm = Q4 ? wm + p * a.KB * 16 : nullptr;
    const int64_t cols = std::min<int64_t>(16, N - p * 16);
    float* py = y + p * 16;
    for (int64_t r0 = 0; r0 < a.M; r0 += table.rows) {
      const int64_t rows = std::min<int64_t>(table.rows, a.M - r0);
      if (table.fn != nullptr)
        table.fn[rows - 1](pd, ps, pm, a, r0, py, N, cols);
      else
        panel_portable<Q4>(pd, ps, pm, a, r0, rows, py, N, cols);
    }
  }
}

}  // namespace

const char* qlinear_path() {
#if defined(SPECHEAD_VNNI_TARGET)
  if (amx_granted()) return "amx";
  if (cpu_has_vnni()) return "avx512-vnni";
#endif
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// Rows `ids` of the weight as fp32, scale * q (+ min) per block in that order and rounding, as
// QuantBlocks.dequantize computes them: an embedding lookup on a tied table. One pass over the rows' own bytes,
// where the tensor ops (gather, unpack, cast, scale) cost ~0.3 ms a decode step on the demo's table.
at::Tensor qrows(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min, const at::Tensor& ids,
                 int64_t rows) {
  const auto [q4, NP, KB] = check_weight("qrows", data, scale, min);
  const int64_t K = KB * kBlock, B = data.size(2);
  TORCH_CHECK(rows >= 1 && rows <= NP * 16, "qrows: bad row count");
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({idx.numel(), K}, scale.options());
  const int64_t* pi = idx.data_ptr<int64_t>();
  const uint8_t* wd = data.data_ptr<uint8_t>();
  const float* ws = scale.data_ptr<float>();
  const float* wm = q4 ? min.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  for (int64_t r = 0; r < idx.numel(); ++r) {
    const int64_t id = pi[r];
    TORCH_CHECK(0 <= id && id < rows, "qrows: row ", id, " is out of range for ", rows, " rows");
    const int64_t p = id / 16, c = id % 16;
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* blk = wd + (p * KB + b) * B;
      const float sc = ws[(p * KB + b) * 16 + c], mn = q4 ? wm[(p * KB + b) * 16 + c] : 0.0f;
      float* o = po + r * K + b * kBlock;
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j) {
          const float v = static_cast<float>(block_value(blk, q4, g, c * 4 + j));
          o[4 * g + j] = q4 ? v * sc + mn : v * sc;
        }
    }
  }
  return out.view([&] {
    std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
    shape.push_back(K);
    return shape;
  }());
}

// x [M, K] float rows; data / scale / min as in the header (min empty for q8); y [M, n] fp32, n <= N/16 * 16.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& min,
                   int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "qlinear: x must be a 2-D CPU tensor");
  const auto [q4, NP, KB] = check_weight("qlinear", data, scale, min);
  const int64_t K = KB * kBlock;
  TORCH_CHECK(x.size(1) == K, "qlinear: x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(n >= 1 && n <= NP * 16 && x.size(0) >= 1, "qlinear: bad output width or no rows");
  const at::Tensor xs = x.to(at::kFloat).contiguous();
  const QRows a = quantize_rows(xs.data_ptr<float>(), x.size(0), K);
  at::Tensor y = at::empty({a.M, n}, x.options().dtype(at::kFloat));
  const uint8_t* wd = data.data_ptr<uint8_t>();
  const float* ws = scale.data_ptr<float>();
  const float* wm = q4 ? min.data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
  const int64_t panels = (n + 15) / 16;
  // a task is a run of panels: 4 panels x K = 576 is ~37 KB of q8 weights, well above the fork cost
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
#if defined(SPECHEAD_VNNI_TARGET)
    if (a.M >= kAmxRows && amx_granted()) {
      if (q4)
        panels_amx<true>(wd, ws, wm, a, py, n, p0, p1, n);
      else
        panels_amx<false>(wd, ws, wm, a, py, n, p0, p1, n);
      return;
    }
#endif
    if (q4)
      run_panels<true>(wd, ws, wm, a, py, n, p0, p1);
    else
      run_panels<false>(wd, ws, wm, a, py, n, p0, p1);
  });
  return y;
}

}  // namespace SPECHEAD_NS
