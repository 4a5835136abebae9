// The SIMD layer every kernel source builds on: one vector of W fp32 lanes and its operations, in one of three
// versions chosen by the build's flags: -DSPECHEAD_ISA_AVX512 (AVX-512F, W = 16), -DSPECHEAD_ISA_AVX2 (AVX2 +
// FMA, every x86-64 since Haswell / Zen 1, W = 8) or neither (portable C++, no intrinsics: the compiler's vector
// types, lowered to whatever SIMD the target has, W = 8). The kernels are written once against these functions.
// Within a build, every operation is one fixed sequence of instructions: vsum_many gives vsum's bits exactly,
// so a sum does not depend on which of the two formed it.
//
// Everything lives in namespace SPECHEAD_NS (the build's op namespace, e.g. spechead_avx2), so the builds for
// several instruction sets can share one process without sharing a symbol.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
#include <immintrin.h>
#endif

#ifndef SPECHEAD_NS
#error "build with -DSPECHEAD_NS=<op namespace> (spechead/kernels/__init__.py does)"
#endif
#if defined(SPECHEAD_ISA_AVX512) && !defined(__AVX512F__)
#error "SPECHEAD_ISA_AVX512 needs -mavx512f"
#endif
#if defined(SPECHEAD_ISA_AVX2) && !(defined(__AVX2__) && defined(__FMA__))
#error "SPECHEAD_ISA_AVX2 needs -mavx2 -mfma"
#endif

namespace SPECHEAD_NS {

constexpr int kLanes = 16;  // outputs per block of the GEMM's weight layout: 64 bytes of fp32
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
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vneg_abs(Vec v) { return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }
// pos where v >= 0, neg elsewhere (NaN included): the lanes of `v >= 0 ? pos : neg`
inline Vec vselect_nonneg(Vec v, Vec pos, Vec neg) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ), neg, pos);
}
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
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vneg_abs(Vec v) { return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))); }
inline Vec vselect_nonneg(Vec v, Vec pos, Vec neg) {
  return _mm256_blendv_ps(neg, pos, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
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
inline Vec vmul(Vec a, Vec b) { return a * b; }
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
inline Vec vmul(Vec a, Vec b) {
  for (int l = 0; l < W; ++l) a.v[l] *= b.v[l];
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

}  // namespace SPECHEAD_NS
