// Prompt attention over contiguous bf16 K/V as blocked bf16 pair dot products
// (vdpbf16ps), for CPUs with AVX512-BF16 but no AMX, where torch's CPU flash kernel runs
// bf16 at its fp32 speed (lamina.kernels.prompt_sdpa says when this one is used).
//
// Data in: q [n, Hq, D] bf16 (a prompt or a chunk's queries), k / v [m, Hkv, D] bf16
// (the request's keys gathered from its slots, m >= n when causal), the softmax scale,
// and whether the queries are the last n of the m key positions (causal: query i sees
// keys 0 .. m - n + i) or lie past all of them (every key seen). Data out: o [n, Hq, D]
// fp32 and lse [n, Hq] fp32 (natural log), so a caller can merge it with other key ranges.
//
// Why not torch's kernel: on a 2-core AMD EPYC (AVX512-BF16, no AMX) its bf16 path reached
// 122 GFLOP/s on a 3072-token causal prompt while bf16 GEMM reaches ~400 on the same
// cores: its bf16 products go through fp32. Here K and V are packed once into the
// layouts vdpbf16ps reads (key pairs of channels; value pairs of keys), and one work item
// (a kv head's GQA group over BQ query positions) keeps its scores, probabilities and
// output rows in L2 while it walks the key blocks it can see with an online softmax.
// Math: bf16 products summed in fp32, probabilities rounded to bf16 for the values'
// products (as torch's bf16 flash kernel does), sums and the output in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "lamina_ext.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#define LAMINA_PROMPT_FLASH 1
#else
#define LAMINA_PROMPT_FLASH 0
#endif

bool prompt_flash_compiled() { return LAMINA_PROMPT_FLASH; }

#if LAMINA_PROMPT_FLASH
namespace {

constexpr int BQ = 32;   // query positions a work item
constexpr int BK = 128;  // keys a block (128: 10% faster than 64, as fast as 256)
constexpr int MR = 8;    // score rows a micro-tile (x 32 keys: 16 accumulators)
constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2 = 0.693147180559945309f;

// 2^x for x <= 0 (lanes below -126 give 0): 2^round(x) by scalef times a degree-6
// polynomial of the fraction in [-0.5, 0.5] (relative error ~2e-7).
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));  // -inf -> a finite 0 result
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh bcast_pair(const uint16_t* p) {  // two bf16 -> every 32-bit lane
  int32_t w;
  std::memcpy(&w, p, 4);
  return (__m512bh)_mm512_set1_epi32(w);
}

// K of one kv head, packed: [m_pad / 16][D / 2][16 keys][2 channels] (zeros past m).
// V: [m_pad / 2][D][2 keys] (zeros past m).
void pack_kv(const uint16_t* k, const uint16_t* v, int64_t m, int64_t m_pad, int64_t Hkv,
             int64_t D, uint16_t* kp, uint16_t* vp) {
  const int64_t rs = Hkv * D;  // a key's row stride
  for (int64_t j = 0; j < m_pad; ++j) {
    uint32_t* kb = reinterpret_cast<uint32_t*>(kp) + (j / 16) * (D / 2) * 16 + j % 16;
    uint16_t* vb = vp + (j / 2) * D * 2 + j % 2;
    if (j < m) {
      const uint16_t* kr = k + j * rs;
      const uint16_t* vr = v + j * rs;
      for (int64_t c = 0; c < D / 2; ++c) std::memcpy(kb + c * 16, kr + 2 * c, 4);
      for (int64_t d = 0; d < D; ++d) vb[2 * d] = vr[d];
    } else {
      for (int64_t c = 0; c < D / 2; ++c) kb[c * 16] = 0;
      for (int64_t d = 0; d < D; ++d) vb[2 * d] = 0;
    }
  }
}

// s[r][0:32] (stride BK) = q rows r0 .. r0+7 (bf16, stride D) . packed keys of 32 keys.
template <int D>
inline void scores_tile(const uint16_t* q, const uint16_t* kp, float* s) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < D / 2; ++c) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + c * 32);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + (D / 2) * 32 + c * 32);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh qv = bcast_pair(q + r * D + 2 * c);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(s + r * BK, acc[r][0]);
    _mm512_storeu_ps(s + r * BK + 16, acc[r][1]);
  }
}

// o rows (fp32, stride D) = o * alpha[row] + p rows (bf16, stride BK) . packed values,
// over `pairs` key pairs; PR rows at a time.
template <int D>
inline void values_tile(const uint16_t* p, const uint16_t* vp, int64_t pairs,
                        const float* alpha, float* o) {
  constexpr int NC = D / 16, PR = D <= 256 ? 256 / D : 1;  // 16 accumulators
  __m512 acc[PR][NC];
  for (int r = 0; r < PR; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * D + c * 16));
  }
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const uint16_t* vb = vp + jp * D * 2;
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + c * 32);
#pragma GCC unroll 16
      for (int r = 0; r < PR; ++r)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], bcast_pair(p + r * BK + 2 * jp), vv);
    }
  }
  for (int r = 0; r < PR; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

// One row's online-softmax update over a block's scores s[0:BK] of which the first `vis`
// are visible: s -> p (bf16, into pb), m / l moved; returns the factor the row's output
// is scaled by (1 when the row sees nothing here).
inline float softmax_row(float* s, int64_t vis, float mul, float& m, float& l, uint16_t* pb) {
  if (vis <= 0) {
    std::memset(pb, 0, BK * 2);
    return 1.f;
  }
  __m512 t[BK / 16];
  __mmask16 keep[BK / 16];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  const __m512 vm = _mm512_set1_ps(mul);
  for (int c = 0; c < BK / 16; ++c) {
    const int64_t left = std::clamp<int64_t>(vis - c * 16, 0, 16);
    keep[c] = static_cast<__mmask16>((1u << left) - 1u);
    t[c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep[c], _mm512_loadu_ps(s + c * 16), vm);
    mx = _mm512_max_ps(mx, t[c]);
  }
  const float mn = std::max(m, _mm512_reduce_max_ps(mx));
  const float alpha = m == -INFINITY ? 0.f : std::exp2(m - mn);
  const __m512 vmn = _mm512_set1_ps(mn);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < BK / 16; ++c) {
    const __m512 e = _mm512_maskz_mov_ps(keep[c], exp2_neg(_mm512_sub_ps(t[c], vmn)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + c * 16), (__m256i)_mm512_cvtneps_pbh(e));
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mn;
  return alpha;
}

struct Problem {
  const uint16_t* q;  // [n, Hq, D]
  const uint16_t *kp, *vp;  // packed, per kv head: kv_k / kv_v elements apart
  int64_t kv_k, kv_v;
  int64_t n, m, Hq, Hkv, rep, offset;  // offset: query i sees keys <= offset + i
  float mul;  // scale * log2(e)
  float *o, *lse;  // [n, Hq, D], [n, Hq]
};

struct Scratch {
  std::vector<uint16_t> q, p;  // [rows, D], [rows, BK] bf16
  std::vector<float> s, o, m, l, alpha;  // [rows, BK], [rows, D], [rows] x 3
  std::vector<int64_t> lim;  // [rows]: the last key the row sees (-1: a padding row)
};

// Work item: kv head h, query positions p0 .. p0 + BQ - 1 (rows: position-major, the
// group's rep query heads within a position).
template <int D>
void work_item(const Problem& P, int64_t h, int64_t p0, Scratch& w) {
  constexpr int PR = D <= 256 ? 256 / D : 1;  // values_tile's rows (divides MR)
  const int64_t np = std::min<int64_t>(BQ, P.n - p0), rows = np * P.rep;
  const int64_t rows_pad = (rows + MR - 1) / MR * MR;
  for (int64_t r = 0; r < rows_pad; ++r) {
    const int64_t pl = r / P.rep;
    w.lim[r] = r < rows ? std::min(P.offset + p0 + pl, P.m - 1) : -1;
    w.m[r] = -INFINITY;
    w.l[r] = 0.f;
  }
  for (int64_t pl = 0; pl < np; ++pl)
    std::memcpy(&w.q[pl * P.rep * D], P.q + ((p0 + pl) * P.Hq + h * P.rep) * D, P.rep * D * 2);
  std::fill(w.q.begin() + rows * D, w.q.begin() + rows_pad * D, 0);
  std::fill(w.o.begin(), w.o.begin() + rows_pad * D, 0.f);
  const int64_t last = w.lim[rows - 1];  // the furthest key any row sees
  const uint16_t* kp = P.kp + h * P.kv_k;
  const uint16_t* vp = P.vp + h * P.kv_v;
  for (int64_t j0 = 0; j0 <= last; j0 += BK) {
    const int64_t seen = std::min<int64_t>(BK, last + 1 - j0);  // keys any row sees here
    for (int64_t r = 0; r < rows_pad; r += MR)
      for (int64_t c32 = 0; c32 * 32 < seen; ++c32)
        scores_tile<D>(&w.q[r * D], kp + (j0 + c32 * 32) * D, &w.s[r * BK + c32 * 32]);
    for (int64_t r = 0; r < rows_pad; ++r)
      w.alpha[r] = softmax_row(&w.s[r * BK], w.lim[r] - j0 + 1, P.mul, w.m[r], w.l[r],
                               &w.p[r * BK]);
    const int64_t pairs = (seen + 1) / 2;
    for (int64_t r = 0; r + PR <= rows_pad; r += PR)
      values_tile<D>(&w.p[r * BK], vp + j0 * D, pairs, &w.alpha[r], &w.o[r * D]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pl = r / P.rep, hq = h * P.rep + r % P.rep;
    float* orow = P.o + ((p0 + pl) * P.Hq + hq) * D;
    const float inv = 1.f / w.l[r];
    for (int64_t d = 0; d < D; ++d) orow[d] = w.o[r * D + d] * inv;
    P.lse[(p0 + pl) * P.Hq + hq] = (w.m[r] + std::log2(w.l[r])) * LN2;
  }
}

template <int D>
void run(const Problem& P) {
  const int64_t nqb = (P.n + BQ - 1) / BQ, items = P.Hkv * nqb;
  std::vector<Scratch> scratch(at::get_num_threads());
  const int64_t rows_pad = (BQ * P.rep + MR - 1) / MR * MR;
  for (Scratch& w : scratch) {
    w.q.resize(rows_pad * D); w.p.resize(rows_pad * BK);
    w.s.resize(rows_pad * BK); w.o.resize(rows_pad * D);
    w.m.resize(rows_pad); w.l.resize(rows_pad); w.alpha.resize(rows_pad); w.lim.resize(rows_pad);
  }
  // the latest query blocks see the most keys: handed out first
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t it = 0; it < items; ++it) {
    const int64_t qb = nqb - 1 - it / P.Hkv, h = it % P.Hkv;
    work_item<D>(P, h, qb * BQ, scratch[omp_get_thread_num()]);
  }
}

}  // namespace
#endif

std::vector<at::Tensor> prompt_flash_bf16(at::Tensor q, at::Tensor k, at::Tensor v,
                                          bool causal, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "prompt_flash_bf16: q [n, Hq, D], k / v [m, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "prompt_flash_bf16: bf16 tensors");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), m = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == D && Hq % Hkv == 0 && n > 0 && m > 0 && (!causal || m >= n),
              "prompt_flash_bf16: shapes q ", q.sizes(), " k ", k.sizes());
  TORCH_CHECK(D == 32 || D == 64 || D == 128 || D == 256,
              "prompt_flash_bf16: head size ", D, " (32, 64, 128 or 256)");
#if LAMINA_PROMPT_FLASH
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  const int64_t m_pad = (m + BK - 1) / BK * BK;
  auto kp = at::empty({Hkv, m_pad * D}, k.options());
  auto vp = at::empty({Hkv, m_pad * D}, k.options());
  auto o = at::empty({n, Hq, D}, q.options().dtype(at::kFloat));
  auto lse = at::empty({n, Hq}, q.options().dtype(at::kFloat));
  const auto* k16 = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* v16 = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* kp16 = reinterpret_cast<uint16_t*>(kp.data_ptr<at::BFloat16>());
  auto* vp16 = reinterpret_cast<uint16_t*>(vp.data_ptr<at::BFloat16>());
  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      pack_kv(k16 + h * D, v16 + h * D, m, m_pad, Hkv, D, kp16 + h * m_pad * D,
              vp16 + h * m_pad * D);
  });
  const Problem P{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), kp16, vp16,
                  m_pad * D, m_pad * D, n, m, Hq, Hkv, Hq / Hkv, causal ? m - n : m - 1,
                  static_cast<float>(scale) * LOG2E, o.data_ptr<float>(), lse.data_ptr<float>()};
  if (D == 32) run<32>(P);
  else if (D == 64) run<64>(P);
  else if (D == 128) run<128>(P);
  else run<256>(P);
  return {o, lse};
#else
  TORCH_CHECK(false, "prompt_flash_bf16: this CPU build has no AVX512-BF16");
#endif
}
