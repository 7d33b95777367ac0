// Attention over a token-slot KV pool, CPU (C++ / OpenMP through ATen's parallel_for).
//
// Data in: q [Nq, Hq, D] fp32 (already validated by lamina.kernels), the pool
// k [S, Hkv, D] / v [S, Hkv, Dv] (fp32 or bf16), or int8 rows k [S, Hkv, D + 4] /
// v [S, Hkv, Dv + 4] (each head's codes, then its fp32 scale: kernels/quant.py; keys'
// channel scales are already folded into q), and a ragged slot table in CSR form:
// request b owns queries cu_q[b]..cu_q[b+1] and keys slots[cu_k[b]..cu_k[b+1]],
// key j sitting at absolute position k_pos0[b] + j. Query n sits at q_pos[n].
// Data out: o [Nq, Hq, Dv] fp32 and lse [Nq, Hq] fp32 (natural log, -inf if empty).
//
// Keys are read in place from their slots (no gathered copy), in blocks of BK with
// an online softmax. With AVX2
// the GQA query rows of a kv head share every K/V load; elsewhere plain loops run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "lamina_ext.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int BK = 64;         // keys per online-softmax block
constexpr int QT = 16;        // queries per work item (prefill tiling)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float to_f32(float x) { return x; }
inline float to_f32(int8_t x) { return static_cast<float>(x); }
// An int8 row's head: D codes, then the head's fp32 scale (unaligned: memcpy).
inline float head_scale(const int8_t* head, int64_t D) {
  float s;
  std::memcpy(&s, head + D, 4);
  return s;
}
inline float to_f32(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// exp(x) for x <= 0, branch-free so loops over it vectorise; 0 below -87.
inline float exp_neg(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return x < -87.0f ? 0.0f : p * two_n;
}

// Prefetches the next key block's pool rows (after a work item's last block, the next
// item's first block), whole rows in slot order, a few lines per call, spread over the
// current block's score and value passes. Scattered slots defeat the hardware
// prefetcher, so without this each row's first misses stall the FMAs; all at once (one
// burst per block) measured no gain, nor did a burst per row, nor slicing rows across
// passes. Into L2 (T1), not L1: on the Zen 4 EPYC here T1 took 13-36% off the decode
// kernel from DRAM against T0 in paired runs (likely the L1's few miss buffers
// throttling T0 prefetches); on an AVX2 VM before, it measured the same as T0. It costs
// ~15 ns/token when the KV is already in cache.
struct RowPrefetcher {
  const char* rows[BK];  // each row's first line
  int64_t nl[BK];  // lines each row touches (an int8 row of 204 B starts anywhere: 4 or 5)
  int64_t n = 0, r = 0, l = 0;
  void reset() { n = 0; r = 0; l = 0; }
  void add(const void* row, int64_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(row), first = a & ~uintptr_t(63);
    rows[n] = reinterpret_cast<const char*>(first);
    nl[n++] = int64_t((a + bytes - 1 - first) / 64 + 1);
  }
  inline void step(int64_t k) {
#if defined(__AVX2__) && defined(__FMA__)
    for (; k > 0 && r < n; --k) {
      _mm_prefetch(rows[r] + 64 * l, _MM_HINT_T1);
      if (++l == nl[r]) { l = 0; ++r; }
    }
#endif
  }
};

// ---- Inner blocks. A key block's rows are addressed through pointer arrays
// (kr[j] / vr[j] = that key's row in the pool), padded to a multiple of 8.

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kSimd = true;
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {  // 8 int8 codes -> 8 floats (dequantized in registers)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// Eight accumulators -> one vector holding their eight horizontal sums.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                       _mm256_permute2f128_ps(t0, t1, 0x31));
}
// out[0..8) = q . k_j for 8 keys; 8 independent FMA chains.
template <typename T>
inline void scores8(const float* q, const T* const* k, int64_t off, int64_t D, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0;
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    a0 = _mm256_fmadd_ps(qv, load8(k[0] + off + c), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k[1] + off + c), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k[2] + off + c), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k[3] + off + c), a3);
    a4 = _mm256_fmadd_ps(qv, load8(k[4] + off + c), a4);
    a5 = _mm256_fmadd_ps(qv, load8(k[5] + off + c), a5);
    a6 = _mm256_fmadd_ps(qv, load8(k[6] + off + c), a6);
    a7 = _mm256_fmadd_ps(qv, load8(k[7] + off + c), a7);
  }
  _mm256_storeu_ps(out, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
}
// acc[0..8*NC) += sum_j p[j] * v_j[off..off+8*NC); accumulators stay in registers.
template <typename T, int NC>
inline void pv_cols(float* acc, const float* p, const T* const* v, int64_t off, int64_t n) {
  __m256 a[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const T* vj = v[j] + off;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(pj, load8(vj + 8 * c), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
// GQA: RG query rows (stride D) share each key load; 4 keys x RG rows accumulators.
// s rows have stride BK; n % 4 == 0.
template <typename T, int RG>
inline void scores_group(const float* q, int64_t D, const T* const* k, int64_t off,
                         int64_t n, float* s) {
  for (int64_t j = 0; j < n; j += 4) {
    __m256 acc[RG][4];
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm256_setzero_ps();
    const T* kp[4] = {k[j] + off, k[j + 1] + off, k[j + 2] + off, k[j + 3] + off};
    for (int64_t c = 0; c < D; c += 8) {
      __m256 qv[RG];
#pragma GCC unroll 4
      for (int g = 0; g < RG; ++g) qv[g] = _mm256_loadu_ps(q + g * D + c);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 kv = load8(kp[u] + c);
#pragma GCC unroll 4
        for (int g = 0; g < RG; ++g) acc[g][u] = _mm256_fmadd_ps(qv[g], kv, acc[g][u]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
      _mm_storeu_ps(s + g * BK + j, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
}
// Vector widths for the value passes: 8 floats (AVX2) or 16 (AVX-512).
struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T> static V loadT(const T* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
};
// GQA: RG rows (acc stride Dv, p stride BK) share each value load; 4 vectors of
// columns a pass (32 with AVX2, 64 with AVX-512).
template <typename A, typename T, int RG>
inline void pv_group(float* acc, int64_t Dv, const float* p, const T* const* v, int64_t off,
                     int64_t n, RowPrefetcher* pf, int64_t pf_step) {
  using V = typename A::V;
  constexpr int W = A::W;
  for (int64_t c0 = 0; c0 < Dv; c0 += 4 * W) {
    V a[RG][4];
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) a[g][u] = A::load(acc + g * Dv + c0 + W * u);
    for (int64_t j = 0; j < n; ++j) {
      pf->step(pf_step);
      const T* vj = v[j] + off + c0;
      V pb[RG];
#pragma GCC unroll 4
      for (int g = 0; g < RG; ++g) pb[g] = A::set1(p[g * BK + j]);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const V vv = A::loadT(vj + W * u);
#pragma GCC unroll 4
        for (int g = 0; g < RG; ++g) a[g][u] = A::fma(pb[g], vv, a[g][u]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) A::store(acc + g * Dv + c0 + W * u, a[g][u]);
  }
}
// AVX-512: value passes of 64 columns (one per row group at Dv = 64, not two), and for
// bf16 pools with bf16-exact queries the scores as bf16 pair dot products (vdpbf16ps:
// the same products as the fp32 path, exact in fp32, summed in another order).
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int PV_COLS = 64;
struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V loadT(const float* p) { return load(p); }
  static V loadT(const int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static V loadT(const at::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
};
#else
constexpr int PV_COLS = 32;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kDpBf16 = true;
inline __m256 fold(__m512 a) {  // 16 lanes -> 8 (pairwise sums)
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
// GQA: RG bf16 query rows (stride D) against 4 keys at a time; s rows stride BK, times mul.
template <int RG>
inline void scores_dp(const at::BFloat16* qb, int64_t D, const at::BFloat16* const* k,
                      int64_t off, int64_t n, float mul, float* s) {
  const __m128 m = _mm_set1_ps(mul);
  for (int64_t j = 0; j < n; j += 4) {
    __m512 acc[RG][4];
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_setzero_ps();
    const at::BFloat16* kp[4] = {k[j] + off, k[j + 1] + off, k[j + 2] + off, k[j + 3] + off};
    for (int64_t c = 0; c < D; c += 32) {
      __m512bh qv[RG];
#pragma GCC unroll 4
      for (int g = 0; g < RG; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qb + g * D + c);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kp[u] + c);
#pragma GCC unroll 4
        for (int g = 0; g < RG; ++g) acc[g][u] = _mm512_dpbf16_ps(acc[g][u], qv[g], kv);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
      _mm_storeu_ps(s + g * BK + j, _mm_mul_ps(m, hsum4(fold(acc[g][0]), fold(acc[g][1]),
                                                       fold(acc[g][2]), fold(acc[g][3]))));
  }
}
// Scores of one kv head's `rep` rows, bf16 queries (D % 32 == 0, n % 4 == 0).
inline void head_scores_dp(const at::BFloat16* qb, int64_t D, int64_t rep,
                           const at::BFloat16* const* k, int64_t off, int64_t n, float mul,
                           float* s) {
  int64_t g = 0;
  for (; g + 3 <= rep; g += 3) scores_dp<3>(qb + g * D, D, k, off, n, mul, s + g * BK);
  if (rep - g == 2) scores_dp<2>(qb + g * D, D, k, off, n, mul, s + g * BK);
  if (rep - g == 1) scores_dp<1>(qb + g * D, D, k, off, n, mul, s + g * BK);
}
#else
constexpr bool kDpBf16 = false;
#endif
// int8 pools: scores as int16 x int16 dot products (vpdpwssd) of the query rounded to
// int16 (per row: q ~= q16 * qsc, |error| <= qsc / 2, ~1.5e-5 of the row's largest
// entry) and the keys' int8 codes widened to int16, summed exactly in int32. Half the
// instructions of widening the codes to fp32 and FMA-ing them.
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kVnni = true;
// Four keys' int32 accumulators -> their four totals, transposed as they are summed
// (14 instructions for the four, not a fold and a horizontal add each).
inline __m128i sum4_i32(const __m512i* a) {
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]),
                                       _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]),
                                       _mm512_unpackhi_epi32(a[2], a[3]));
  // each 128-bit lane: [key 0, key 1, key 2, key 3] partial sums
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23),
                                     _mm512_unpackhi_epi64(t01, t23));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
// GQA: RG int16 query rows (stride D) against 4 keys at a time; s row g times qsc[g]
// and each key row's scale (its head's last 4 bytes).
template <int RG>
inline void scores_i8(const int16_t* q16, int64_t D, const int8_t* const* k, int64_t off,
                      int64_t n, const float* qsc, float* s) {
  for (int64_t j = 0; j < n; j += 4) {
    __m512i acc[RG][4];
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_setzero_si512();
    const int8_t* kp[4] = {k[j] + off, k[j + 1] + off, k[j + 2] + off, k[j + 3] + off};
    const __m128 ks = _mm_setr_ps(head_scale(kp[0], D), head_scale(kp[1], D),
                                  head_scale(kp[2], D), head_scale(kp[3], D));
    for (int64_t c = 0; c < D; c += 32) {
      __m512i qv[RG];
#pragma GCC unroll 4
      for (int g = 0; g < RG; ++g) qv[g] = _mm512_loadu_si512(q16 + g * D + c);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512i kv = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp[u] + c)));
#pragma GCC unroll 4
        for (int g = 0; g < RG; ++g) acc[g][u] = _mm512_dpwssd_epi32(acc[g][u], qv[g], kv);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
      _mm_storeu_ps(s + g * BK + j, _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(qsc[g]), ks),
                                               _mm_cvtepi32_ps(sum4_i32(acc[g]))));
  }
}
// Scores of one kv head's `rep` rows over int8 codes (D % 32 == 0, n % 4 == 0).
inline void head_scores_i8(const int16_t* q16, int64_t D, int64_t rep,
                           const int8_t* const* k, int64_t off, int64_t n, const float* qsc,
                           float* s) {
  int64_t g = 0;
  for (; g + 3 <= rep; g += 3) scores_i8<3>(q16 + g * D, D, k, off, n, qsc + g, s + g * BK);
  if (rep - g == 2) scores_i8<2>(q16 + g * D, D, k, off, n, qsc + g, s + g * BK);
  if (rep - g == 1) scores_i8<1>(q16 + g * D, D, k, off, n, qsc + g, s + g * BK);
}
// int8 pools, value pass: acc rows += p' . codes with p' = p * each row's value scale,
// as int16 x int16 products summed in int32 (vpdpwssd). Each row's p' over the block
// is rounded to int16 against its largest entry (|error| <= 1.5e-5 of it); two keys'
// codes are interleaved so one instruction takes a column of both: (v_j[c], v_j+1[c])
// . (p'_j, p'_j+1). The int32 sums (<= 32767 * 127 * BK, no overflow) come back to
// column order and into the fp32 accumulators once per block.
template <int RG>
inline void pv_i8(float* acc, int64_t Dv, const float* p, const float* vsc,
                  const int8_t* const* v, int64_t off, int64_t n, RowPrefetcher* pf,
                  int64_t pf_step) {
  // p' rows as int16, two keys to an int32 (little-endian: key 2jp in the low half)
  alignas(64) int16_t p16[RG][BK + 16];
  alignas(64) float pv[BK + 16];
  float ps[RG];
  const int64_t np = (n + 1) / 2;
  for (int g = 0; g < RG; ++g) {
    const float* pg = p + g * BK;
    __m512 mv = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {  // the tail reads past n: masked to zeros
      const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pg + j),
                                     _mm512_maskz_loadu_ps(m, vsc + j));
      _mm512_store_ps(pv + j, x);
      mv = _mm512_max_ps(mv, x);
    }
    const float mx = _mm512_reduce_max_ps(mv);
    ps[g] = mx / 32767.f;
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
    for (int64_t j = 0; j < n; j += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(pv + j), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&p16[g][j]), _mm512_cvtsepi32_epi16(q));
    }
    p16[g][n] = 0;  // an odd count's last pair: key n counts zero
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
    __m512i a[RG][4];
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) a[g][u] = _mm512_setzero_si512();
    for (int64_t jp = 0; jp < np; ++jp) {
      pf->step(2 * pf_step);  // the next block's rows, as the float passes do
      const int8_t* v0 = v[2 * jp] + off + c0;
      const __m512i x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0)));
      const __m512i x1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 32)));
      __m512i y0 = _mm512_setzero_si512(), y1 = y0;
      if (2 * jp + 1 < n) {
        const int8_t* v1 = v[2 * jp + 1] + off + c0;
        y0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1)));
        y1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 32)));
      }
      const __m512i w[4] = {_mm512_unpacklo_epi16(x0, y0), _mm512_unpackhi_epi16(x0, y0),
                            _mm512_unpacklo_epi16(x1, y1), _mm512_unpackhi_epi16(x1, y1)};
#pragma GCC unroll 4
      for (int g = 0; g < RG; ++g) {
        int32_t pr;
        std::memcpy(&pr, &p16[g][2 * jp], 4);
        const __m512i pp = _mm512_set1_epi32(pr);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) a[g][u] = _mm512_dpwssd_epi32(a[g][u], w[u], pp);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < RG; ++g) {
      const __m512 sc = _mm512_set1_ps(ps[g]);
      float* o = acc + g * Dv + c0;
      for (int h = 0; h < 2; ++h) {  // columns 32h..32h+31 from w[2h] (lo) and w[2h+1]
        const __m512i c_lo = _mm512_permutex2var_epi32(a[g][2 * h], lo_idx, a[g][2 * h + 1]);
        const __m512i c_hi = _mm512_permutex2var_epi32(a[g][2 * h], hi_idx, a[g][2 * h + 1]);
        _mm512_storeu_ps(o + 32 * h, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c_lo), sc,
                                                     _mm512_loadu_ps(o + 32 * h)));
        _mm512_storeu_ps(o + 32 * h + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c_hi), sc,
                                                          _mm512_loadu_ps(o + 32 * h + 16)));
      }
    }
  }
}
// The value pass of one kv head's `rep` rows over int8 codes (Dv % 64 == 0).
inline void head_pv_i8(float* acc, int64_t Dv, int64_t rep, const float* p, const float* vsc,
                       const int8_t* const* v, int64_t off, int64_t n, RowPrefetcher* pf,
                       int64_t pf_step) {
  int64_t g = 0;
  for (; g + 3 <= rep; g += 3)
    pv_i8<3>(acc + g * Dv, Dv, p + g * BK, vsc, v, off, n, pf, pf_step);
  if (rep - g == 2) pv_i8<2>(acc + g * Dv, Dv, p + g * BK, vsc, v, off, n, pf, pf_step);
  if (rep - g == 1) pv_i8<1>(acc + g * Dv, Dv, p + g * BK, vsc, v, off, n, pf, pf_step);
}
#else
constexpr bool kVnni = false;
#endif
#else
constexpr bool kSimd = false;
constexpr bool kVnni = false;
constexpr bool kDpBf16 = false;
constexpr int PV_COLS = 32;
#endif

// s[j - j0] = q . k_j for j in [j0, j1) (j1 - j0 a multiple of 8 on the SIMD path).
template <typename T>
inline void block_scores(const float* q, const T* const* k, int64_t off, int64_t D,
                         int64_t n, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t j = 0; j < n; j += 8) scores8(q, k + j, off, D, s + j);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* kj = k[j] + off;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; ++d) acc += q[d] * to_f32(kj[d]);
    s[j] = acc;
  }
}

// acc[0..Dv) += sum_j p[j] * v_j[off..off+Dv) over j in [0, n).
template <typename T>
inline void block_pv(float* acc, const float* p, const T* const* v, int64_t off, int64_t Dv,
                     int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (Dv % 8 == 0) {
    int64_t c = 0;
    for (; c + 64 <= Dv; c += 64) pv_cols<T, 8>(acc + c, p, v, off + c, n);
    if (c + 32 <= Dv) { pv_cols<T, 4>(acc + c, p, v, off + c, n); c += 32; }
    if (c + 16 <= Dv) { pv_cols<T, 2>(acc + c, p, v, off + c, n); c += 16; }
    if (c + 8 <= Dv) pv_cols<T, 1>(acc + c, p, v, off + c, n);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v[j] + off;
    const float pj = p[j];
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) acc[d] += pj * to_f32(vj[d]);
  }
}

// Scores for the `rep` consecutive rows of one kv head: s rows stride BK.
template <typename T>
inline void head_scores(const float* q, int64_t D, int64_t rep, const T* const* k,
                        int64_t off, int64_t n, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && rep > 1) {
    int64_t g = 0;
    for (; g + 3 <= rep; g += 3) scores_group<T, 3>(q + g * D, D, k, off, n, s + g * BK);
    if (rep - g == 2) scores_group<T, 2>(q + g * D, D, k, off, n, s + g * BK);
    if (rep - g == 1) block_scores<T>(q + g * D, k, off, D, n, s + g * BK);
    return;
  }
#endif
  for (int64_t g = 0; g < rep; ++g) block_scores<T>(q + g * D, k, off, D, n, s + g * BK);
}

// acc rows (stride Dv) += p rows (stride BK) . v, for one kv head's `rep` rows.
template <typename T>
inline void head_pv(float* acc, int64_t Dv, int64_t rep, const float* p, const T* const* v,
                    int64_t off, int64_t n, RowPrefetcher* pf, int64_t pf_step) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512BW__)
  if (Dv % 64 == 0) {
    int64_t g = 0;
    for (; g + 3 <= rep; g += 3) pv_group<Avx512, T, 3>(acc + g * Dv, Dv, p + g * BK, v, off, n, pf, pf_step);
    if (rep - g == 2) pv_group<Avx512, T, 2>(acc + g * Dv, Dv, p + g * BK, v, off, n, pf, pf_step);
    if (rep - g == 1) pv_group<Avx512, T, 1>(acc + g * Dv, Dv, p + g * BK, v, off, n, pf, pf_step);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (Dv % 32 == 0 && rep > 1) {
    int64_t g = 0;
    for (; g + 3 <= rep; g += 3) pv_group<Avx2, T, 3>(acc + g * Dv, Dv, p + g * BK, v, off, n, pf, pf_step);
    if (rep - g == 2) pv_group<Avx2, T, 2>(acc + g * Dv, Dv, p + g * BK, v, off, n, pf, pf_step);
    if (rep - g == 1) block_pv<T>(acc + g * Dv, p + g * BK, v, off, Dv, n);
    return;
  }
#endif
  for (int64_t g = 0; g < rep; ++g) block_pv<T>(acc + g * Dv, p + g * BK, v, off, Dv, n);
}

inline float range_max(const float* x, int64_t a0, int64_t a1) {
  float mb = NEG_INF;
  int64_t j = a0;
#if defined(__AVX2__) && defined(__FMA__)
  if (a1 - a0 >= 8) {
    __m256 mv = _mm256_loadu_ps(x + j);
    for (j += 8; j + 8 <= a1; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
    alignas(32) float t[8];
    _mm256_store_ps(t, mv);
    for (float v : t) mb = std::max(mb, v);
  }
#endif
  for (; j < a1; ++j) mb = std::max(mb, x[j]);
  return mb;
}

struct Args {
  const float* q; const int32_t* q_pos; const int32_t* cu_q;
  const int32_t* slots; const int32_t* cu_k; const int32_t* k_pos0;
  const float* sinks;  // [Hq] or nullptr
  float* o; float* lse;
  int64_t Hq, Hkv, D, Dv, k_stride, v_stride;  // strides in elements, per slot
  int64_t k_hs, v_hs;  // per kv head within a row: D / Dv, or D + 4 / Dv + 4 for int8
  float scale, softcap; int64_t window;
  bool q_bf16;  // q's values are exact in bf16 (it came as bf16): bf16 pair dots may run
};

// int8 keys: scores so far are q . codes; times each key row's head scale.
template <typename T>
inline void scale_scores(const Args& a, const T* const* kr, int64_t nb, int64_t nq, float* s) {
  const int64_t rep = a.Hq / a.Hkv;
  float sc[BK];
  for (int64_t h = 0; h < a.Hkv; ++h) {
    for (int64_t j = 0; j < nb; ++j)
      sc[j] = head_scale(reinterpret_cast<const int8_t*>(kr[j]) + h * a.k_hs, a.D);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < rep; ++g) {
        float* sr = &s[(i * a.Hq + h * rep + g) * BK];
        for (int64_t j = 0; j < nb; ++j) sr[j] *= sc[j];
      }
  }
}

// One work item: request b, queries [n0, n1), all heads. next_slots / next_n: the next
// work item's keys (its first block is prefetched during this item's last one), or 0 keys.
template <typename T>
void attend_tile(const Args& a, const T* K, const T* V, int64_t b, int64_t n0, int64_t n1,
                 const int32_t* next_slots, int64_t next_n) {
  const int64_t Hq = a.Hq, Hkv = a.Hkv, D = a.D, Dv = a.Dv;
  const int64_t rep = Hq / Hkv, nq = n1 - n0, rows = nq * Hq;
  const int32_t* slots = a.slots + a.cu_k[b];
  const int64_t nk = a.cu_k[b + 1] - a.cu_k[b], pos0 = a.k_pos0[b];

  // Key range [lo, hi) each query may see: causal plus optional window.
  int64_t lo[QT], hi[QT], lo_all = nk, hi_all = 0;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t qp = a.q_pos[n0 + i];
    int64_t h = std::min<int64_t>(nk, qp - pos0 + 1), l = 0;
    if (a.window > 0) l = std::max<int64_t>(0, qp - a.window + 1 - pos0);
    h = std::max<int64_t>(h, 0); l = std::min(l, h);
    lo[i] = l; hi[i] = h;
    if (l < h) { lo_all = std::min(lo_all, l); hi_all = std::max(hi_all, h); }
  }

  // Pre-scaled queries (scale folded in unless softcap needs the raw score).
  const float qmul = a.softcap > 0.f ? 1.f : a.scale;
  // per-thread scratch, reused across work items: qs [rows, D], acc [rows, Dv],
  // s [rows, BK], m / l [rows], qb [rows, D] bf16
  thread_local std::vector<float> scratch;
  const bool dp = kDpBf16 && std::is_same<T, at::BFloat16>::value && a.q_bf16 && D % 32 == 0;
  const int64_t nqb = dp ? rows * D : 0;
  const bool i8 = kVnni && std::is_same<T, int8_t>::value && D % 32 == 0;
  const int64_t nq16 = i8 ? rows * D : 0;  // int16 queries (and a scale per row)
  scratch.resize(rows * (D + Dv + BK + 2) + (nqb + 1) / 2 + (nq16 + 1) / 2 + (i8 ? rows : 0));
  float* qs = scratch.data();
  float* acc = qs + rows * D;
  float* s = acc + rows * Dv;
  float* m = s + rows * BK;
  float* l = m + rows;
  auto* qb = reinterpret_cast<at::BFloat16*>(l + rows);
  std::fill(acc, acc + rows * Dv, 0.f);
  std::fill(m, m + rows, NEG_INF);
  std::fill(l, l + rows, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = a.q[(n0 * Hq + r) * D + d] * qmul;
  // bf16 pools, bf16-exact q: scores as bf16 pair dots over the unscaled q, times qmul
  for (int64_t i = 0; i < nqb; ++i) qb[i] = at::BFloat16(a.q[n0 * Hq * D + i]);
  // int8 pools: each row's pre-scaled q as int16 codes times one float
  auto* q16 = reinterpret_cast<int16_t*>(qb + nqb + (nqb & 1));
  float* qsc = reinterpret_cast<float*>(q16 + nq16 + (nq16 & 1));
  for (int64_t r = 0; i8 && r < rows; ++r) {
    float mx = 0.f;
    for (int64_t d = 0; d < D; ++d) mx = std::max(mx, std::fabs(qs[r * D + d]));
    const float sc = mx > 0.f ? mx / 32767.f : 1.f;
    for (int64_t d = 0; d < D; ++d)
      q16[r * D + d] = static_cast<int16_t>(std::lrintf(qs[r * D + d] / sc));
    qsc[r] = sc;
  }

  const T* kr[BK];
  const T* vr[BK];
  const int64_t kbytes = Hkv * a.k_hs * int64_t(sizeof(T));
  const int64_t vbytes = Hkv * a.v_hs * int64_t(sizeof(T));
  const int64_t klines = (kbytes + 63) / 64, vlines = (vbytes + 63) / 64;
  // V passes per block: one per (kv head, pv_group call, PV_COLS columns); head_pv
  // makes rep / 3 calls of 3 rows, plus one for the 2 rows left (with AVX-512 for 1 too).
  const int64_t calls = rep / 3 + (rep % 3 == 2 || (PV_COLS == 64 && rep % 3 == 1));
  const int64_t vpasses = std::max<int64_t>(1, Hkv * calls * ((Dv + PV_COLS - 1) / PV_COLS));
  RowPrefetcher pfk, pfv;
  for (int64_t j0 = lo_all; j0 < hi_all; j0 += BK) {
    const int64_t j1 = std::min<int64_t>(j0 + BK, hi_all), nb = j1 - j0;
    pfk.reset(); pfv.reset();
    // the next block's rows; after the last block, the next item's first (from its
    // first key: a guess that is exact for decode without a window)
    const int32_t* ps = j1 < hi_all ? slots + j1 : next_slots;
    const int64_t pn = std::min<int64_t>(BK, j1 < hi_all ? hi_all - j1 : next_n);
    for (int64_t j = 0; j < pn; ++j) {
      pfk.add(K + ps[j] * a.k_stride, kbytes);
      pfv.add(V + ps[j] * a.v_stride, vbytes);
    }
    const int64_t kstep = (8 * klines + Hkv * nq - 1) / (Hkv * nq);
    const int64_t vstep = (vlines + vpasses - 1) / vpasses;
    const int64_t nb8 = kSimd ? (nb + 7) / 8 * 8 : nb;  // padded with the last key
    for (int64_t j = 0; j < nb8; ++j) {
      const int64_t slot = slots[std::min(j0 + j, j1 - 1)];
      kr[j] = K + slot * a.k_stride;
      vr[j] = V + slot * a.v_stride;
    }
    // Scores, 8 keys at a time across all heads, so a key's K row is used at once.
    for (int64_t jg = 0; jg < nb8; jg += 8) {
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t r = i * Hq + h * rep;
          pfk.step(kstep);
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
          if constexpr (std::is_same<T, at::BFloat16>::value) {
            if (dp) {
              head_scores_dp(&qb[r * D], D, rep, kr + jg, h * a.k_hs, std::min<int64_t>(8, nb8 - jg),
                             qmul, &s[r * BK + jg]);
              continue;
            }
          }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
          if constexpr (std::is_same<T, int8_t>::value) {
            if (i8) {
              head_scores_i8(&q16[r * D], D, rep, kr + jg, h * a.k_hs,
                             std::min<int64_t>(8, nb8 - jg), &qsc[r], &s[r * BK + jg]);
              continue;
            }
          }
#endif
          head_scores<T>(&qs[r * D], D, rep, kr + jg, h * a.k_hs, std::min<int64_t>(8, nb8 - jg),
                         &s[r * BK + jg]);
        }
    }
    if constexpr (std::is_same<T, int8_t>::value)
      if (!i8) scale_scores(a, kr, nb, nq, s);  // the VNNI scores took the key scales
    // Online softmax update per row; p overwrites s (0 outside the row's range).
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t a0 = std::max(lo[i], j0) - j0, a1 = std::min(hi[i], j1) - j0;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* sr = &s[(i * Hq + hq) * BK];
        if (a0 >= a1) { std::fill(sr, sr + nb, 0.f); continue; }
        if (a.softcap > 0.f) {
          const float c = a.softcap, inv = a.scale / a.softcap;
          for (int64_t j = a0; j < a1; ++j) sr[j] = c * std::tanh(sr[j] * inv);
        }
        const float mb = range_max(sr, a0, a1);
        const int64_t r = i * Hq + hq;
        const float mn = std::max(m[r], mb);
        const float alpha = m[r] == NEG_INF ? 0.f : std::exp(m[r] - mn);
        float sum = 0.f;
        for (int64_t j = 0; j < a0; ++j) sr[j] = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = a0; j < a1; ++j) { sr[j] = exp_neg(sr[j] - mn); sum += sr[j]; }
        for (int64_t j = a1; j < nb; ++j) sr[j] = 0.f;
        l[r] = l[r] * alpha + sum;
        m[r] = mn;
        if (alpha != 1.f) {
          float* ar = &acc[r * Dv];
          for (int64_t d = 0; d < Dv; ++d) ar[d] *= alpha;
        }
      }
    }
    // Values: acc[row] += p[row][j] * v[slot_j, head(row)].
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t a0 = std::max(lo[i], j0) - j0, a1 = std::min(hi[i], j1) - j0;
        if (a0 >= a1) continue;
        const int64_t r = i * Hq + h * rep;
        if constexpr (std::is_same<T, int8_t>::value) {  // p * each value row's scale
          float vsc[BK];
          for (int64_t j = a0; j < a1; ++j) vsc[j] = head_scale(vr[j] + h * a.v_hs, Dv);
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
          if (i8 && Dv % 64 == 0) {
            head_pv_i8(&acc[r * Dv], Dv, rep, &s[r * BK + a0], vsc + a0, vr + a0, h * a.v_hs,
                       a1 - a0, &pfv, vstep);
            continue;
          }
#endif
          for (int64_t g = 0; g < rep; ++g)
            for (int64_t j = a0; j < a1; ++j) s[(r + g) * BK + j] *= vsc[j];
        }
        head_pv<T>(&acc[r * Dv], Dv, rep, &s[r * BK + a0], vr + a0, h * a.v_hs, a1 - a0, &pfv,
                   vstep);
      }
  }
  // Finish: sinks join the denominator only; empty rows give 0 and lse -inf.
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t r = i * Hq + hq;
      float mr = m[r], lr = l[r];
      if (a.sinks) {
        const float sk = a.sinks[hq], mn = std::max(mr, sk);
        lr = (mr == NEG_INF ? 0.f : lr * std::exp(mr - mn)) + std::exp(sk - mn);
        if (mr != NEG_INF) {
          const float f = std::exp(mr - mn);
          for (int64_t d = 0; d < Dv; ++d) acc[r * Dv + d] *= f;
        }
        mr = mn;
      }
      float* out = a.o + ((n0 + i) * Hq + hq) * Dv;
      const float inv = lr > 0.f ? 1.f / lr : 0.f;
      for (int64_t d = 0; d < Dv; ++d) out[d] = acc[r * Dv + d] * inv;
      a.lse[(n0 + i) * Hq + hq] = lr > 0.f ? mr + std::log(lr) : NEG_INF;
    }
}

template <typename T>
void run(const Args& a, const T* K, const T* V, int64_t B) {
  // Work items: (request, query tile). Decode has one query per request.
  std::vector<int64_t> item_b, item_n0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = a.cu_q[b]; n < a.cu_q[b + 1]; n += QT) { item_b.push_back(b); item_n0.push_back(n); }
  at::parallel_for(0, int64_t(item_b.size()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = item_b[w], n0 = item_n0[w];
      const bool more = w + 1 < w1;  // this thread has a next item
      const int64_t b2 = more ? item_b[w + 1] : b;
      attend_tile<T>(a, K, V, b, n0, std::min<int64_t>(n0 + QT, a.cu_q[b + 1]),
                     a.slots + a.cu_k[b2], more ? a.cu_k[b2 + 1] - a.cu_k[b2] : 0);
    }
  });
}

}  // namespace

// Shapes and dtypes are checked in Python (lamina.kernels.validate); the TORCH_CHECKs
// below only guard the assumptions this file itself relies on.
std::vector<at::Tensor> slot_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                       at::Tensor cu_q, at::Tensor q_pos, at::Tensor slots,
                                       at::Tensor cu_k, at::Tensor k_pos0, double scale,
                                       int64_t window, double softcap,
                                       c10::optional<at::Tensor> sinks, bool q_bf16) {
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == at::kFloat, "q must be contiguous fp32");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1 &&
              k_pool.stride(1) == k_pool.size(2) && v_pool.stride(1) == v_pool.size(2),
              "pool rows must be contiguous [Hkv, D] per slot");
  for (const auto& t : {cu_q, q_pos, slots, cu_k, k_pos0})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kInt, "index tensors must be int32");
  const bool i8 = k_pool.scalar_type() == at::kChar;
  const int64_t Nq = q.size(0), Hq = q.size(1), Dv = v_pool.size(2) - (i8 ? 4 : 0);
  TORCH_CHECK(k_pool.size(2) - (i8 ? 4 : 0) == q.size(2), "q and k_pool head dims differ");
  auto o = at::empty({Nq, Hq, Dv}, q.options());
  auto lse = at::empty({Nq, Hq}, q.options());
  at::Tensor sk;
  if (sinks.has_value()) sk = sinks->contiguous().to(at::kFloat);
  Args a{q.data_ptr<float>(), q_pos.data_ptr<int32_t>(), cu_q.data_ptr<int32_t>(),
         slots.data_ptr<int32_t>(), cu_k.data_ptr<int32_t>(), k_pos0.data_ptr<int32_t>(),
         sinks.has_value() ? sk.data_ptr<float>() : nullptr, o.data_ptr<float>(),
         lse.data_ptr<float>(), Hq, k_pool.size(1), q.size(2), Dv,
         k_pool.stride(0), v_pool.stride(0), k_pool.size(2), v_pool.size(2), float(scale),
         float(softcap), window, q_bf16 && !i8};
  const int64_t B = cu_q.size(0) - 1;
  if (k_pool.scalar_type() == at::kFloat)
    run<float>(a, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), B);
  else if (k_pool.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(a, k_pool.data_ptr<at::BFloat16>(),
                                v_pool.data_ptr<at::BFloat16>(), B);
  else if (i8)
    run<int8_t>(a, k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(), B);
  else
    TORCH_CHECK(false, "KV pool dtype must be float32, bfloat16 or int8");
  return {o, lse};
}

// Streaming read of a whole tensor (sum of its floats), for the read-bandwidth baseline.
double read_sum(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  return at::parallel_reduce(0, n, 1 << 16, 0.0, [&](int64_t i0, int64_t i1, double init) {
    float acc[16] = {0};
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16)
#pragma omp simd
      for (int u = 0; u < 16; ++u) acc[u] += p[i + u];
    double s = init;
    for (int u = 0; u < 16; ++u) s += acc[u];
    for (; i < i1; ++i) s += p[i];
    return s;
  }, std::plus<double>());
}

// Reads every K and V row the slot list names, in order, and nothing else: the ceiling
// for any kernel that must read those rows (the attention benchmark's baseline).
double read_rows(at::Tensor k, at::Tensor v, at::Tensor slots) {
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat && slots.scalar_type() == at::kInt,
              "read_rows wants contiguous fp32 pools and int32 slots");
  const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  const int32_t* s = slots.data_ptr<int32_t>();
  const int64_t n = slots.numel(), rk = k.stride(0), rv = v.stride(0);
  return at::parallel_reduce(0, n, 256, 0.0, [&](int64_t j0, int64_t j1, double init) {
    float acc[8] = {0};
    for (int64_t j = j0; j < j1; ++j) {
      const float* kr = K + int64_t(s[j]) * rk;
      const float* vr = V + int64_t(s[j]) * rv;
      for (int64_t d = 0; d + 8 <= rk; d += 8)
#pragma omp simd
        for (int u = 0; u < 8; ++u) acc[u] += kr[d + u];
      for (int64_t d = 0; d + 8 <= rv; d += 8)
#pragma omp simd
        for (int u = 0; u < 8; ++u) acc[u] += vr[d + u];
    }
    double t = init;
    for (float x : acc) t += x;
    return t;
  }, std::plus<double>());
}

namespace {

// slot_scores over key rows of type T (float, or int8 codes with each head's fp32 scale
// after its D codes: `hs` = D + 4 bytes a head).
template <typename T>
void score_slots(const float* Q, const T* K, const int32_t* s, int64_t c, int64_t rk,
                 int64_t hs, int64_t hkv, int64_t g, int64_t d, float sc, float cap,
                 float* O) {
  const int64_t blocks = (c + BK - 1) / BK, row_bytes = hkv * hs * int64_t(sizeof(T));
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sb(g * BK);  // one kv head's scores, rows stride BK
    const T* kr[BK];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * BK, n = std::min<int64_t>(BK, c - j0);
      for (int64_t j = 0; j < BK; ++j)  // a short block repeats its last row
        kr[j] = K + int64_t(s[j0 + std::min(j, n - 1)]) * rk;
      if (b + 1 < b1)
        for (int64_t j = j0 + BK; j < std::min(c, j0 + 2 * BK); ++j) {
          const char* r = reinterpret_cast<const char*>(K + int64_t(s[j]) * rk);
          for (int64_t x = 0; x < row_bytes; x += 64) __builtin_prefetch(r + x, 0, 2);
        }
      for (int64_t h = 0; h < hkv; ++h) {
        head_scores<T>(Q + h * g * d, d, g, kr, h * hs, BK, sb.data());
        for (int64_t r = 0; r < g; ++r) {
          float* o = O + (h * g + r) * c + j0;
          for (int64_t j = 0; j < n; ++j) {
            float x = sb[r * BK + j] * sc;
            if constexpr (std::is_same_v<T, int8_t>)
              x *= head_scale(reinterpret_cast<const int8_t*>(kr[j]) + h * hs, d);
            o[j] = cap > 0 ? cap * std::tanh(x / cap) : x;
          }
        }
      }
    }
  });
}

}  // namespace

// Logits of one query against the keys at `slots` (topk's rescoring, memory/sparsity.py):
// q [Hq, D] fp32, k [S, Hkv, D] fp32 rows or [S, Hkv, D + 4] int8 rows (codes, then the
// head's scale; q then already times the keys' channel scales), any row stride, slots
// int32 [c] -> [Hq, c] fp32 = scale * q . k (soft-capped when softcap > 0), query head h
// against kv head h / (Hq / Hkv). The keys are read in place, in blocks of BK rows, with
// the attention kernel's score passes (a kv head's query heads share each key load); the
// next block's rows are prefetched while one is scored.
at::Tensor slot_scores(at::Tensor q, at::Tensor k, at::Tensor slots, double scale,
                       double softcap) {
  const bool i8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && q.scalar_type() == at::kFloat &&
              (k.scalar_type() == at::kFloat || i8) && slots.scalar_type() == at::kInt &&
              q.size(1) == k.size(2) - (i8 ? 4 : 0) && q.size(0) % k.size(1) == 0 &&
              k.stride(2) == 1 && k.stride(1) == k.size(2),
              "slot_scores wants q [Hq, D] fp32, k [S, Hkv, D] fp32 or [S, Hkv, D + 4] int8 "
              "(rows of contiguous heads) and int32 slots");
  q = q.contiguous();
  slots = slots.contiguous();
  const int64_t hq = q.size(0), hkv = k.size(1), d = q.size(1), g = hq / hkv;
  const int64_t c = slots.numel(), num = k.size(0);
  auto out = at::empty({hq, c}, q.options());
  const int32_t* s = slots.data_ptr<int32_t>();
  for (int64_t j = 0; j < c; ++j)
    TORCH_CHECK(s[j] >= 0 && s[j] < num, "slot_scores: slot ", s[j], " out of range");
  const float* Q = q.data_ptr<float>();
  if (i8)
    score_slots<int8_t>(Q, k.data_ptr<int8_t>(), s, c, k.stride(0), k.size(2), hkv, g, d,
                        float(scale), float(softcap), out.data_ptr<float>());
  else
    score_slots<float>(Q, k.data_ptr<float>(), s, c, k.stride(0), k.size(2), hkv, g, d,
                       float(scale), float(softcap), out.data_ptr<float>());
  return out;
}

// The SIMD paths this build compiled (the CPU it was built for): for reports and tests.
std::vector<std::string> simd_paths() {
  std::vector<std::string> p;
  if (kSimd) p.push_back("avx2");
  if (PV_COLS == 64) p.push_back("avx512");
  if (kDpBf16) p.push_back("avx512bf16");
  if (kVnni) p.push_back("avx512vnni");  // int8 pools: int16 dot products
  return p;
}
