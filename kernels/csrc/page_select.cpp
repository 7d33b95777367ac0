// topk's page selection (Quest / HiSparse) for all of a step's decode rows in one call.
//
// Data in (per row r of R; lamina/memory/sparsity.py builds them):
//   q [R, Hq, D] fp32: the rows' queries (or their `signed_queries` [R, W], W = 2 Hkv D:
//     per kv head the sums over its query heads of q- and q+; from q they are summed here);
//   bounds[r] [pages_r, W] fp32: its pages' channel-wise min then max, the same layout;
//     or, from int8 pools, int8 rows [pages_r, W + 4 Hkv]: those codes, then each kv
//     head's fp32 scale (`quantize_bounds`);
//   params [R, 6] int64: n (keys in the row), c (keys to pick), sinks, recent, page size
//     P, and where the row's n slots start in `table`;
//   table [S] int32 (optional: empty for none): the step's slot tables, concatenated;
//   page_slots (optional: empty list, or an empty entry, for none): the slots row r's
//     bounds summarize, int32 [pages_r * P], checked against its table.
// Data out: {idx int64 [sum of picks], cu int64 [R + 1], slots int32, stale int64 [R]}:
// row r's key indices (sorted) are idx[cu[r]:cu[r + 1]], and with a table their slots the
// same span of slots (else slots is empty); stale[r] is -1, or the first page whose
// page_slots differ from the table (a fork, a recomputation: the caller rebuilds those
// bounds and picks the row again; its picks here are of the old bounds).
// The rule is `pick_pages`'s: the first page when there are sinks, the last pages covering
// `recent` keys and the keys past the last summarized page, then the pages with the
// highest bound q- . min + q+ . max while all fit in c. Ties go to the earlier page.
// Per row: one pass over its bounds (a page's score is a dot product of W floats) and a
// partial sort of its page ids. In Python this was a torch product and NumPy calls per row,
// ~100 us each; here a row of 512 pages takes a few us when its bounds are in cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "lamina_ext.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// x . y over n values (fp32, or int8 codes widened), in 16 independent partial sums so
// the compiler vectorizes it without reassociating a single sum.
template <typename T>
inline float dot(const float* x, const T* y, int64_t n) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int u = 0; u < 16; ++u) acc[u] += x[i + u] * static_cast<float>(y[i + u]);
  for (; i < n; ++i) acc[i % 16] += x[i] * static_cast<float>(y[i]);
  float s = 0.f;
  for (int u = 0; u < 16; ++u) s += acc[u];
  return s;
}

// A page's fp32 bounds row against the signed query: W floats.
inline float score_f32(const float* sq, const float* row, int64_t W) {
#if defined(__AVX512F__)
  if (W % 64 == 0) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < W; i += 64) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(sq + i), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 16), _mm512_loadu_ps(sq + i + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 32), _mm512_loadu_ps(sq + i + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 48), _mm512_loadu_ps(sq + i + 48), a3);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
#endif
  return dot(sq, row, W);
}

// An int8 bounds row (int8 pools): the codes in the fp32 layout, then each kv head's
// fp32 scale; the score is sum over heads of scale x (q- . min codes + q+ . max codes).
inline float score_i8(const float* sq, const int8_t* row, int64_t W, int64_t hkv) {
  const int64_t hd = W / (2 * hkv);  // head_dim
#if defined(__AVX512F__)
  if (hd % 16 == 0) {  // one 16-lane sum a head, scaled into one total: one reduction a page
    __m512 tot = _mm512_setzero_ps();
    for (int64_t h = 0; h < hkv; ++h) {
      __m512 acc = _mm512_setzero_ps();
      for (int part = 0; part < 2; ++part) {  // the min codes, then the max codes
        const int64_t o = (part * hkv + h) * hd;
        for (int64_t c = 0; c < hd; c += 16) {
          const __m512 y = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + o + c))));
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(sq + o + c), y, acc);
        }
      }
      float sc;
      std::memcpy(&sc, row + W + 4 * h, 4);
      tot = _mm512_fmadd_ps(acc, _mm512_set1_ps(sc), tot);
    }
    return _mm512_reduce_add_ps(tot);
  }
#endif
  float s = 0.f;
  for (int64_t h = 0; h < hkv; ++h) {
    float sc;
    std::memcpy(&sc, row + W + 4 * h, 4);
    s += sc * (dot(sq + h * hd, row + h * hd, hd) +
               dot(sq + (hkv + h) * hd, row + (hkv + h) * hd, hd));
  }
  return s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// score_i8 for 4 pages at once as int16 x int16 dot products (vpdpwssd, 32 codes an
// instruction) of the signed query rounded to int16 (q ~= q16 * qs, |error| <= qs / 2:
// ~1.5e-5 of its largest entry) and the codes widened to int16, summed exactly in int32
// (|sum| < 2^31 for head_dim <= 2048). Each q16 load serves the 4 pages, and their 4
// totals are reduced together. s[u] = page u's score (rows at row0 + u * stride).
inline void score4_vnni(const int16_t* q16, float qs, const int8_t* row0, int64_t stride,
                        int64_t W, int64_t hkv, float* s) {
  const int64_t hd = W / (2 * hkv);
  __m512 tot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (int64_t h = 0; h < hkv; ++h) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int part = 0; part < 2; ++part) {  // the min codes, then the max codes
      const int64_t o = (part * hkv + h) * hd;
      for (int64_t c = 0; c < hd; c += 32) {
        const __m512i qv = _mm512_loadu_si512(q16 + o + c);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u)
          acc[u] = _mm512_dpwssd_epi32(acc[u], qv, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(row0 + u * stride + o + c))));
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      float sc;
      std::memcpy(&sc, row0 + u * stride + W + 4 * h, 4);
      tot[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[u]), _mm512_set1_ps(sc), tot[u]);
    }
  }
  // the four 16-lane totals, transposed as they are summed
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(tot[0], tot[1]),
                                   _mm512_unpackhi_ps(tot[0], tot[1]));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(tot[2], tot[3]),
                                   _mm512_unpackhi_ps(tot[2], tot[3]));
  const __m512 v = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))));
  const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  _mm_storeu_ps(s, _mm_mul_ps(h4, _mm_set1_ps(qs)));
}
#endif

// A row's bounds: fp32 rows, or int8 rows (hkv > 0).
struct Bounds {
  const void* data;
  int64_t stride;  // bytes a page
  int64_t hkv;     // 0: fp32 rows

  // s[j] = page (p0 + j)'s score against the signed query sq [W], for j < m.
  void scores(const float* sq, int64_t W, int64_t p0, int64_t m, float* s) const {
    const char* base = static_cast<const char*>(data) + p0 * stride;
    if (!hkv) {
      for (int64_t j = 0; j < m; ++j)
        s[j] = score_f32(sq, reinterpret_cast<const float*>(base + j * stride), W);
      return;
    }
    int64_t j = 0;  // int8 rows: four at a time where VNNI is compiled in, then one by one
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if ((W / (2 * hkv)) % 32 == 0) {
      float mx = 0.f;
      for (int64_t i = 0; i < W; ++i) mx = std::max(mx, std::abs(sq[i]));
      const float qs = mx > 0.f ? mx / 32767.f : 1.f;
      std::vector<int16_t> q16(W);
      for (int64_t i = 0; i < W; ++i) q16[i] = static_cast<int16_t>(std::lrintf(sq[i] / qs));
      for (; j + 4 <= m; j += 4) {
        // the pages 16 ahead, into L2: one core's demand misses alone reach ~5 GB/s
        const char* ahead = base + (j + 16) * stride;
        if (j + 20 <= m)
          for (int64_t l = 0; l < 4 * stride; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T1);
        score4_vnni(q16.data(), qs, reinterpret_cast<const int8_t*>(base + j * stride), stride,
                    W, hkv, s + j);
      }
    }
#endif
    for (; j < m; ++j)
      s[j] = score_i8(sq, reinterpret_cast<const int8_t*>(base + j * stride), W, hkv);
  }
};

struct RowPlan {
  int64_t first = 0;   // sink pages taken whole (0 or 1)
  int64_t npages = 0;  // pages [first, npages) compete
  int64_t left = 0;    // how many of them are taken
  int64_t done = 0;    // keys [done, n) are taken (the recent tail)
  int64_t all = 0;     // c >= n: every key
};

RowPlan plan_row(int64_t n, int64_t c, int64_t sinks, int64_t recent, int64_t P,
                 int64_t pages) {
  RowPlan p;
  if (c >= n) {
    p.all = 1;
    return p;
  }
  p.first = (sinks > 0 && pages > 0) ? 1 : 0;
  const int64_t need = recent - (n - pages * P);  // recent keys the tail does not cover
  const int64_t extra = need > 0 ? (need + P - 1) / P : 0;
  p.npages = std::max(p.first, pages - extra);
  p.done = p.npages * P;
  const int64_t room = c - p.first * P - (n - p.done);
  p.left = room > 0 ? std::min(room / P, p.npages - p.first) : 0;
  return p;
}

int64_t picked(const RowPlan& p, int64_t n, int64_t P) {
  return p.all ? n : p.first * P + p.left * P + (n - p.done);
}

// Row r's picks into out (sorted key indices).
void pick_row(const RowPlan& p, int64_t n, int64_t P, const float* sq, const Bounds& b,
              int64_t W, int64_t* out) {
  if (p.all) {
    std::iota(out, out + n, int64_t(0));
    return;
  }
  int64_t o = 0;
  for (int64_t k = 0; k < p.first * P; ++k) out[o++] = k;
  if (p.left > 0) {
    const int64_t m = p.npages - p.first;
    std::vector<float> s(m);
    b.scores(sq, W, p.first, m, s.data());
    // one uint64 key a page, ascending = best first: the score's bits made to order as
    // unsigned and flipped (high word), then the page id (low word: ties to the earlier)
    std::vector<uint64_t> key(m);
    for (int64_t j = 0; j < m; ++j) {
      uint32_t u;
      std::memcpy(&u, &s[j], 4);
      u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
      key[j] = (uint64_t(~u) << 32) | uint64_t(j);
    }
    if (p.left < m) std::nth_element(key.begin(), key.begin() + p.left, key.end());
    for (int64_t j = 0; j < p.left; ++j) key[j] &= 0xFFFFFFFFu;  // page ids, to sort
    std::sort(key.begin(), key.begin() + p.left);
    for (int64_t j = 0; j < p.left; ++j)
      for (int64_t k = 0; k < P; ++k) out[o++] = (p.first + int64_t(key[j])) * P + k;
  }
  for (int64_t k = p.done; k < n; ++k) out[o++] = k;
}

// The rows' signed queries [R, W] from q [R, Hq, D] (`signed_queries`'s layout): per kv
// head h, [q- sums | q+ sums] at (0 * Hkv + h) * D and (1 * Hkv + h) * D.
at::Tensor signed_rows(const at::Tensor& q, int64_t hkv) {
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2), G = Hq / hkv;
  auto out = at::zeros({R, 2 * hkv * D}, at::kFloat);
  const float* x = q.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < hkv; ++h) {
      float* neg = o + (r * 2 * hkv + h) * D;
      float* pos = neg + hkv * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* v = x + ((r * Hq) + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) {
          neg[d] += std::min(v[d], 0.f);
          pos[d] += std::max(v[d], 0.f);
        }
      }
    }
  return out;
}

// The first page whose slots differ (-1: none).
int64_t first_stale(const int32_t* have, const int32_t* want, int64_t pages, int64_t P) {
  if (std::memcmp(have, want, sizeof(int32_t) * pages * P) == 0) return -1;
  for (int64_t g = 0; g < pages; ++g)
    if (std::memcmp(have + g * P, want + g * P, sizeof(int32_t) * P) != 0) return g;
  return -1;
}

}  // namespace

std::vector<at::Tensor> page_pick(at::Tensor q, std::vector<at::Tensor> bounds,
                                  at::Tensor params, c10::optional<at::Tensor> table_opt,
                                  std::vector<at::Tensor> page_slots) {
  const int64_t R = static_cast<int64_t>(bounds.size());
  TORCH_CHECK((q.dim() == 2 || q.dim() == 3) && q.size(0) == R &&
                  q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "page_pick wants queries [R, Hq, D] or signed queries [R, W] fp32 contiguous "
              "on the CPU, R = ", R, " rows");
  TORCH_CHECK(params.dim() == 2 && params.size(0) == R && params.size(1) == 6 &&
                  params.scalar_type() == at::kLong && params.is_contiguous(),
              "page_pick wants params [R, 6] int64 (n, c, sinks, recent, page size, table "
              "offset)");
  const at::Tensor table = table_opt.has_value() ? *table_opt : at::empty({0}, at::kInt);
  const bool gather = table.numel() > 0;
  TORCH_CHECK(!gather || (table.dim() == 1 && table.scalar_type() == at::kInt &&
                          table.is_contiguous() && table.device().is_cpu()),
              "page_pick wants the step's slot table [S] int32 contiguous on the CPU");
  TORCH_CHECK(page_slots.empty() || (gather && static_cast<int64_t>(page_slots.size()) == R),
              "page_pick: page_slots needs the step's table and one entry a row");
  at::Tensor sq = q;
  if (q.dim() == 3) {
    TORCH_CHECK(R == 0 || bounds[0].dim() == 2, "page_pick: row 0's bounds must be 2-D");
    const int64_t w0 = R ? bounds[0].size(1) : 0;
    // fp32 rows are W = 2 Hkv D wide; int8 rows W + 4 Hkv
    const int64_t hkv = R == 0 ? 1 : bounds[0].scalar_type() == at::kChar
        ? w0 / (2 * q.size(2) + 4) : w0 / (2 * q.size(2));
    TORCH_CHECK(R == 0 || (hkv > 0 && q.size(1) % hkv == 0),
                "page_pick: ", q.size(1), " query heads do not group over the bounds' ", hkv,
                " kv heads");
    sq = signed_rows(q, hkv);
  }
  const int64_t W = sq.size(1);
  const int64_t* pr = params.data_ptr<int64_t>();
  std::vector<RowPlan> plans(R);
  auto cu = at::zeros({R + 1}, at::kLong);
  int64_t* c = cu.data_ptr<int64_t>();
  std::vector<Bounds> rows(R);
  for (int64_t r = 0; r < R; ++r) {
    const at::Tensor& b = bounds[r];
    const bool i8 = b.scalar_type() == at::kChar;
    const int64_t extra = i8 ? b.size(1) - W : 0;  // int8 rows: 4 bytes of scale a kv head
    TORCH_CHECK(b.dim() == 2 && b.is_contiguous() && b.device().is_cpu() &&
                    ((b.scalar_type() == at::kFloat && b.size(1) == W) ||
                     (i8 && extra > 0 && extra % 4 == 0 && W % (2 * (extra / 4)) == 0)),
                "page_pick: row ", r, "'s bounds must be [pages, ", W, "] fp32 or [pages, ",
                W, " + 4 Hkv] int8 rows, contiguous on the CPU");
    rows[r] = Bounds{b.data_ptr(), b.size(1) * static_cast<int64_t>(b.element_size()),
                     extra / 4};
    const int64_t* x = pr + 6 * r;
    TORCH_CHECK(x[0] >= 0 && x[1] >= 0 && x[2] >= 0 && x[3] >= 0 && x[4] >= 1 &&
                    b.size(0) * x[4] <= x[0] &&
                    (!gather || (x[5] >= 0 && x[5] + x[0] <= table.size(0))),
                "page_pick: row ", r, " has bad params (n, c, sinks, recent, page, offset) = (",
                x[0], ", ", x[1], ", ", x[2], ", ", x[3], ", ", x[4], ", ", x[5], ") for ",
                b.size(0), " pages and a table of ", table.numel());
    if (!page_slots.empty() && page_slots[r].numel() > 0)
      TORCH_CHECK(page_slots[r].dim() == 1 && page_slots[r].scalar_type() == at::kInt &&
                      page_slots[r].is_contiguous() && page_slots[r].device().is_cpu() &&
                      page_slots[r].numel() == b.size(0) * x[4],
                  "page_pick: row ", r, "'s page_slots must be int32 [", b.size(0) * x[4],
                  "] (its pages' slots), contiguous on the CPU");
    plans[r] = plan_row(x[0], x[1], x[2], x[3], x[4], b.size(0));
    c[r + 1] = c[r] + picked(plans[r], x[0], x[4]);
  }
  auto idx = at::empty({c[R]}, at::kLong);
  auto slots = at::empty({gather ? c[R] : 0}, at::kInt);
  int64_t* out = idx.data_ptr<int64_t>();
  int32_t* so = slots.data_ptr<int32_t>();
  auto stale = at::full({R}, -1, at::kLong);
  int64_t* st = stale.data_ptr<int64_t>();
  const float* s = sq.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (!page_slots.empty() && page_slots[r].numel() > 0)
        st[r] = first_stale(page_slots[r].data_ptr<int32_t>(),
                            table.data_ptr<int32_t>() + pr[6 * r + 5], bounds[r].size(0),
                            pr[6 * r + 4]);
      pick_row(plans[r], pr[6 * r], pr[6 * r + 4], s + r * W, rows[r], W, out + c[r]);
      if (gather) {  // the picked keys' slots, the table the kernels attend with
        const int32_t* t = table.data_ptr<int32_t>() + pr[6 * r + 5];
        for (int64_t j = c[r]; j < c[r + 1]; ++j) so[j] = t[out[j]];
      }
    }
  });
  return {idx, cu, slots, stale};
}
