// Fused pointwise ops for the compute side's dense slices (lamina.splitter.fuse).
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
#pragma GCC optimize("fp-contract=off")
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "lamina_ext.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

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
