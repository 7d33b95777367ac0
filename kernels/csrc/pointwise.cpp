// Fused pointwise ops for the compute side's dense slices (lamina.splitter.fuse), and
// the greedy sampler's row argmax (lamina.sampling, via lamina.kernels.argmax_rows), also
// over the tokens a structured output's bitmask allows (masked_argmax_rows).
//
// Data in: tensors of the slices' graphs (fp32 or bf16, any strides; rows whose last dim
// is not contiguous are copied first; cos/sin broadcast against x). Data out: one new tensor each, laid out like
// x (dims in x's stride order), as the eager op chain would give.
//
// Each op replaces a chain of 3-10 eager ops (one dispatch and one allocation each) by one
// pass. Rounding follows the eager chain: every intermediate the chain rounds to the
// tensor's dtype is rounded here too (bf16: round to nearest even), and no products are
// contracted into FMAs, so rope is bitwise equal to the chain; rms_norm sums squares in
// another order and silu_mul's exp is its own (within 2 ulp), so those two can differ from
// the chain in the last bit of an fp32 intermediate (rarely visible after bf16 rounding).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "lamina_ext.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// No FMA contraction in this file's own functions (after the includes, so the headers'
// inline functions are compiled as everywhere else).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t GRAIN = 32768;  // elements per thread before a pass goes parallel

inline float bf2f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7fc0) : uint16_t(r);
}

struct F32 {
  using T = float;
  static float ld(float x) { return x; }
  static float st(float x) { return x; }
  static float rnd(float x) { return x; }  // the dtype's own rounding
};
struct BF16 {
  using T = uint16_t;
  static float ld(uint16_t x) { return bf2f(x); }
  static uint16_t st(float x) { return f2bf(x); }
  static float rnd(float x) { return bf2f(f2bf(x)); }
};

// Element offsets of every row (all dims but the last) of t, in row-major order.
std::vector<int64_t> row_offsets(const at::Tensor& t) {
  const int64_t nd = t.dim(), rows = t.numel() / std::max<int64_t>(t.size(-1), 1);
  std::vector<int64_t> off(rows), idx(std::max<int64_t>(nd - 1, 0), 0);
  int64_t o = 0;
  for (int64_t r = 0; r < rows; ++r) {
    off[r] = o;
    for (int64_t d = nd - 2; d >= 0; --d) {
      o += t.stride(d);
      if (++idx[d] < t.size(d)) break;
      o -= t.stride(d) * t.size(d);
      idx[d] = 0;
    }
  }
  return off;
}

// A new tensor of x's sizes whose dims are laid out in x's stride order (as eager
// pointwise ops lay out their outputs), dense.
at::Tensor empty_like_layout(const at::Tensor& x, at::ScalarType dtype) {
  const int64_t nd = x.dim();
  std::vector<int64_t> perm(nd);
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
    if (x.size(a) == 1 || x.size(b) == 1) return false;
    return x.stride(a) > x.stride(b);
  });
  if (perm.empty() || perm.back() != nd - 1)  // keep rows contiguous
    std::iota(perm.begin(), perm.end(), 0);
  std::vector<int64_t> sizes(nd), inv(nd);
  for (int64_t i = 0; i < nd; ++i) sizes[i] = x.size(perm[i]), inv[perm[i]] = i;
  return at::empty(sizes, x.options().dtype(dtype)).permute(inv);
}

// t itself if its rows are contiguous, else a contiguous copy.
at::Tensor rows_of(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() >= 1, op, ": ", name, " must have at least one dim");
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

template <class K>
void rms_rows(const at::Tensor& x, const at::Tensor& w, float eps, at::Tensor& out) {
  using T = typename K::T;
  const int64_t D = x.size(-1);
  const auto xo = row_offsets(x), oo = row_offsets(out);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t rows = static_cast<int64_t>(xo.size());
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + xo[r];
      T* orow = op + oo[r];
      float acc[16] = {0};
      int64_t i = 0;
      for (; i + 16 <= D; i += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = K::ld(xr[i + j]);
          acc[j] += v * v;
        }
      float s = 0.f;
      for (; i < D; ++i) {
        const float v = K::ld(xr[i]);
        s += v * v;
      }
      for (int j = 0; j < 16; ++j) s += acc[j];
      const float inv = 1.0f / std::sqrt(s / static_cast<float>(D) + eps);
#pragma omp simd
      for (int64_t c = 0; c < D; ++c)  // weight * to(x * rsqrt, dtype), rounded
        orow[c] = K::st(K::ld(wp[c]) * K::rnd(K::ld(xr[c]) * inv));
    }
  });
}

template <class K>
inline void rope_row(const typename K::T* __restrict xr, const typename K::T* __restrict cr,
                     const typename K::T* __restrict sr, typename K::T* __restrict orow,
                     int64_t h) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = K::ld(xr[i]), x2 = K::ld(xr[i + h]);
    orow[i] = K::st(K::rnd(x1 * K::ld(cr[i])) + K::rnd(-x2 * K::ld(sr[i])));
    orow[i + h] = K::st(K::rnd(x2 * K::ld(cr[i + h])) + K::rnd(x1 * K::ld(sr[i + h])));
  }
}

template <class K>
void rope_rows(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, at::Tensor& out) {
  using T = typename K::T;
  const int64_t D = x.size(-1), h = D / 2;
  const auto xo = row_offsets(x), co = row_offsets(c), so = row_offsets(s),
             oo = row_offsets(out);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* cp = reinterpret_cast<const T*>(c.data_ptr());
  const T* sp = reinterpret_cast<const T*>(s.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(xo.size()),
                   std::max<int64_t>(1, GRAIN / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      // x*cos + cat(-x2, x1)*sin, each product and the sum rounded as eager does
      rope_row<K>(xp + xo[r], cp + co[r], sp + so[r], op + oo[r], h);
    }
  });
}

// exp(x), branch-free so loops over it vectorise (Cephes' expf: within 2 ulp); x is
// clamped to [-87, 88], so exp(-x) in silu saturates instead of overflowing.
inline float exp_f(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(std::fma(xc, 1.44269504088896341f, 0.5f));
  const float r = std::fma(n, 2.12194440e-4f, std::fma(n, -0.693359375f, xc));
  float p = 1.9875691500e-4f;  // explicit FMAs: the file's fp-contract=off keeps products
  p = std::fma(p, r, 1.3981999507e-3f);  // elsewhere rounded as eager rounds them
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

template <class K>
void silu_mul_rows(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  using T = typename K::T;
  const int64_t D = a.size(-1);
  const auto ao = row_offsets(a), bo = row_offsets(b), oo = row_offsets(out);
  const T* ap = reinterpret_cast<const T*>(a.data_ptr());
  const T* bp = reinterpret_cast<const T*>(b.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(ao.size()),
                   std::max<int64_t>(1, GRAIN / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* __restrict ar = ap + ao[r];
      const T* __restrict br = bp + bo[r];
      T* __restrict orow = op + oo[r];
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {  // to(silu(a)) * b, each rounded as eager does
        const float g = K::ld(ar[i]);
        orow[i] = K::st(K::rnd(g / (1.0f + exp_f(-g))) * K::ld(br[i]));
      }
    }
  });
}

// Greedy sampling's argmax over one row of V logits: the first index of the maximum,
// a NaN counting as the maximum (torch.argmax's rule), -1 for V == 0. Vector lanes keep
// their own first maximum (strictly greater replaces); the lowest index among the lanes
// holding the overall maximum is then the first one.
template <class K>
int64_t argmax_row(const typename K::T* x, int64_t V) {
  int64_t i = 0, best_i = -1;
  float best = 0.f;
  bool nan = false;
#if defined(__AVX512F__)
  if (V >= 32) {
    auto load = [&](int64_t j) {
      if constexpr (std::is_same_v<K, BF16>)  // bf16 -> fp32: the bits moved up 16
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j))), 16));
      else
        return _mm512_loadu_ps(reinterpret_cast<const float*>(x + j));
    };
    __m512 mv = load(0);
    __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = iv;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 un = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= V; i += 16) {
      const __m512 v = load(i);
      cur = _mm512_add_epi32(cur, step);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);
      un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mv = _mm512_mask_mov_ps(mv, gt, v);
      iv = _mm512_mask_mov_epi32(iv, gt, cur);
    }
    nan = un != 0;
    alignas(64) float lv[16];
    alignas(64) int32_t li[16];
    _mm512_store_ps(lv, mv);
    _mm512_store_si512(reinterpret_cast<__m512i*>(li), iv);
    best = lv[0], best_i = li[0];
    for (int l = 1; l < 16; ++l)
      if (lv[l] > best || (lv[l] == best && li[l] < best_i)) best = lv[l], best_i = li[l];
  }
#endif
  for (; i < V; ++i) {  // the tail (or the whole row without AVX-512)
    const float v = K::ld(x[i]);
    nan |= v != v;
    if (best_i < 0 || v > best) best = v, best_i = i;
  }
  if (nan)  // rare: the first NaN is the answer
    for (i = 0; i < V; ++i)
      if (K::ld(x[i]) != K::ld(x[i])) return i;
  return best_i;
}

// Structured output's greedy argmax: the first index of the maximum among the tokens
// whose bit is set in `bits` (bit t & 7 of byte t >> 3 = token t), a NaN among them
// counting as the maximum; -1 when no token is allowed. Blocks of 16 tokens whose 16
// bits are all clear are skipped unread (a grammar often allows a few tokens only). A
// lane's -1 index means it has taken no allowed token yet, so an allowed -inf is taken.
template <class K>
int64_t masked_argmax_row(const typename K::T* x, const uint8_t* bits, int64_t V) {
  auto allowed = [&](int64_t t) { return (bits[t >> 3] >> (t & 7)) & 1; };
  int64_t i = 0, best_i = -1;
  float best = 0.f;
  bool nan = false;
#if defined(__AVX512F__)
  if (V >= 16) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __m512i iv = _mm512_set1_epi32(-1);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                            14, 15);
    __mmask16 un = 0;
    for (; i + 16 <= V; i += 16) {
      uint16_t m16;
      std::memcpy(&m16, bits + (i >> 3), 2);  // tokens i..i+15 (i is a multiple of 16)
      const __mmask16 m = m16;
      if (!m) continue;
      __m512 v;
      if constexpr (std::is_same_v<K, BF16>)
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16));
      else
        v = _mm512_loadu_ps(reinterpret_cast<const float*>(x + i));
      const __mmask16 fresh = _mm512_mask_cmpeq_epi32_mask(m, iv, _mm512_set1_epi32(-1));
      const __mmask16 take = _mm512_mask_cmp_ps_mask(m, v, mv, _CMP_GT_OQ) | fresh;
      un |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
      mv = _mm512_mask_mov_ps(mv, take, v);
      iv = _mm512_mask_mov_epi32(iv, take,
                                 _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(i))));
    }
    nan = un != 0;
    alignas(64) float lv[16];
    alignas(64) int32_t li[16];
    _mm512_store_ps(lv, mv);
    _mm512_store_si512(reinterpret_cast<__m512i*>(li), iv);
    for (int l = 0; l < 16; ++l)
      if (li[l] >= 0 && (best_i < 0 || lv[l] > best || (lv[l] == best && li[l] < best_i)))
        best = lv[l], best_i = li[l];
  }
#endif
  for (; i < V; ++i) {  // the tail (or the whole row without AVX-512)
    if (!(i & 7) && i + 8 <= V && !bits[i >> 3]) {
      i += 7;  // eight tokens none of which is allowed
      continue;
    }
    if (!allowed(i)) continue;
    const float v = K::ld(x[i]);
    nan |= v != v;
    if (best_i < 0 || v > best) best = v, best_i = i;
  }
  if (nan)  // rare: the first allowed NaN is the answer
    for (i = 0; i < V; ++i)
      if (allowed(i) && K::ld(x[i]) != K::ld(x[i])) return i;
  return best_i;
}

bool is_bf16(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 tensors only, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16;
}

}  // namespace

at::Tensor fused_rms_norm(at::Tensor x, at::Tensor w, double eps) {
  x = rows_of(x, "rms_norm", "x");
  w = rows_of(w, "rms_norm", "weight");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [", x.size(-1), "] of x's dtype, got ", w.sizes(),
              " ", w.scalar_type());
  at::Tensor out = empty_like_layout(x, x.scalar_type());
  if (x.numel() == 0) return out;
  if (is_bf16(x, "rms_norm")) rms_rows<BF16>(x, w, static_cast<float>(eps), out);
  else rms_rows<F32>(x, w, static_cast<float>(eps), out);
  return out;
}

at::Tensor fused_rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  x = rows_of(x, "rope", "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "rope: the rotated dim must be even, got ", x.size(-1));
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: cos/sin must have x's dtype ", x.scalar_type());
  // broadcast views
  at::Tensor c = rows_of(cos, "rope", "cos").expand(x.sizes()),
             s = rows_of(sin, "rope", "sin").expand(x.sizes());
  at::Tensor out = empty_like_layout(x, x.scalar_type());
  if (x.numel() == 0) return out;
  if (is_bf16(x, "rope")) rope_rows<BF16>(x, c, s, out);
  else rope_rows<F32>(x, c, s, out);
  return out;
}

at::Tensor fused_silu_mul(at::Tensor gate, at::Tensor up) {
  gate = rows_of(gate, "silu_mul", "gate");
  up = rows_of(up, "silu_mul", "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "silu_mul: gate and up must match, got ", gate.sizes(), " ",
              gate.scalar_type(), " and ", up.sizes(), " ", up.scalar_type());
  const bool bf16 = is_bf16(gate, "silu_mul");
  at::Tensor out = empty_like_layout(gate, gate.scalar_type());
  if (gate.numel() == 0) return out;
  if (bf16) silu_mul_rows<BF16>(gate, up, out);
  else silu_mul_rows<F32>(gate, up, out);
  return out;
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "argmax_rows: x must be [rows, vocab], got ", x.sizes());
  x = rows_of(x, "argmax_rows", "x");
  const bool bf16 = is_bf16(x, "argmax_rows");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 || R == 0, "argmax_rows: empty rows have no argmax");
  TORCH_CHECK(V < (int64_t{1} << 31), "argmax_rows: rows of at most 2^31 - 1 elements");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const char* base = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = x.stride(0) * x.element_size();
  at::parallel_for(0, R, std::max<int64_t>(1, GRAIN / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const void* row = base + r * row_bytes;
      op[r] = bf16 ? argmax_row<BF16>(static_cast<const uint16_t*>(row), V)
                   : argmax_row<F32>(static_cast<const float*>(row), V);
    }
  });
  return out;
}

at::Tensor masked_argmax_rows(at::Tensor x, at::Tensor bits) {
  TORCH_CHECK(x.dim() == 2, "masked_argmax_rows: x must be [rows, vocab], got ", x.sizes());
  x = rows_of(x, "masked_argmax_rows", "x");
  const bool bf16 = is_bf16(x, "masked_argmax_rows");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(bits.dim() == 2 && bits.size(0) == R && bits.size(1) * 8 >= V &&
                  bits.scalar_type() == at::kByte && bits.is_contiguous(),
              "masked_argmax_rows: bits must be contiguous uint8 [", R, ", >= ", (V + 7) / 8,
              "], got ", bits.sizes(), " ", bits.scalar_type());
  TORCH_CHECK(V < (int64_t{1} << 31), "masked_argmax_rows: rows of at most 2^31 - 1 elements");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const char* base = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = x.stride(0) * x.element_size();
  const uint8_t* bp = bits.data_ptr<uint8_t>();
  const int64_t nb = bits.size(1);
  at::parallel_for(0, R, std::max<int64_t>(1, GRAIN / std::max<int64_t>(V, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const void* row = base + r * row_bytes;
      op[r] = bf16 ? masked_argmax_row<BF16>(static_cast<const uint16_t*>(row), bp + r * nb, V)
                   : masked_argmax_row<F32>(static_cast<const float*>(row), bp + r * nb, V);
    }
  });
  return out;
}

#pragma GCC pop_options
