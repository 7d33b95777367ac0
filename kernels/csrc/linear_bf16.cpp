// bf16 linears for the dense slices on CPUs with AVX512-BF16 but no AMX
// (lamina.kernels.linear; the splitter's "avx512bf16" dense backend).
//
// Data in: a weight w [O, I] bf16, packed once (pack_linear_bf16) into the layout
// vdpbf16ps reads: [ceil(O / 32) * 2 blocks of 16 outputs][I / 2 channel pairs][16][2],
// zeros past O; then per call x [..., I] bf16 (rows contiguous in the last dim) and an
// optional bias [O] (bf16 or fp32). Data out: y [..., O] bf16 = x w^T + bias, products
// summed in fp32 and rounded once to bf16 (round to nearest even), as an eager bf16
// linear; only the summation order differs.
//
// Why not oneDNN's bf16 GEMM: on a 2-core AMD EPYC it streamed SmolLM2's decode weights
// at 15 GB/s (1-8 rows) where this reaches 18-28 GB/s of the VM's ~27, and at 256-3072
// rows it reached 365-386 GFLOP/s against 405 here (benchmarks/linear_probe.py). One
// kernel for every row count: 8 rows x 32 outputs a micro-tile (16 accumulators; each
// weight vector feeds 8 rows, each broadcast x pair 2 vectors), threads split the work
// by (256-row chunk, 32 outputs) so a chunk's rows stay in a core's L2 while weight
// tiles stream past.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "lamina_ext.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#define LAMINA_LINEAR_BF16 1
#else
#define LAMINA_LINEAR_BF16 0
#endif

bool linear_bf16_compiled() { return LAMINA_LINEAR_BF16; }

namespace {

constexpr int64_t TILE = 32;   // outputs a micro-tile (two 16-output blocks)
constexpr int64_t CHUNK = 256; // rows a work item

#if LAMINA_LINEAR_BF16
// rows 0..M-1 of x (stride I) . one tile's two 16-output blocks -> y (stride O), `valid`
// of the tile's 32 outputs stored; bias (fp32, this tile's `valid` outputs) or nullptr.
template <int M>
inline void tile(const uint16_t* x, int64_t I, const uint16_t* wp, const float* bias,
                 uint16_t* y, int64_t O, int64_t valid) {
  const __mmask16 k0 = static_cast<__mmask16>((1u << std::min<int64_t>(valid, 16)) - 1u);
  const __mmask16 k1 = static_cast<__mmask16>((1u << std::clamp<int64_t>(valid - 16, 0, 16)) - 1u);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + 16) : _mm512_setzero_ps();
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) {
    acc[m][0] = b0;
    acc[m][1] = b1;
  }
  const int64_t bs = (I / 2) * 32;  // elements of one 16-output block
  for (int64_t c = 0; c < I / 2; ++c) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + c * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + bs + c * 32);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      int32_t v;
      std::memcpy(&v, x + m * I + 2 * c, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(v);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
    }
  }
  for (int m = 0; m < M; ++m) {
    auto* out = reinterpret_cast<__m256i*>(y + m * O);
    _mm256_mask_storeu_epi16(out, k0, (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
    _mm256_mask_storeu_epi16(reinterpret_cast<__m256i*>(y + m * O + 16), k1,
                             (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
  }
}

// n rows of x against one output tile: groups of 8, then the rest.
void rows(const uint16_t* x, int64_t I, const uint16_t* wp, const float* bias, uint16_t* y,
          int64_t O, int64_t n, int64_t valid) {
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) tile<8>(x + r * I, I, wp, bias, y + r * O, O, valid);
  const uint16_t* xr = x + r * I;
  uint16_t* yr = y + r * O;
  switch (n - r) {
    case 7: tile<7>(xr, I, wp, bias, yr, O, valid); break;
    case 6: tile<6>(xr, I, wp, bias, yr, O, valid); break;
    case 5: tile<5>(xr, I, wp, bias, yr, O, valid); break;
    case 4: tile<4>(xr, I, wp, bias, yr, O, valid); break;
    case 3: tile<3>(xr, I, wp, bias, yr, O, valid); break;
    case 2: tile<2>(xr, I, wp, bias, yr, O, valid); break;
    case 1: tile<1>(xr, I, wp, bias, yr, O, valid); break;
    default: break;
  }
}
#endif

}  // namespace

at::Tensor pack_linear_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "pack_linear_bf16: a 2-D bf16 CPU weight [out, in], got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t O = w.size(0), I = w.size(1), O_pad = (O + TILE - 1) / TILE * TILE;
  TORCH_CHECK(I % 2 == 0 && I > 0 && O > 0, "pack_linear_bf16: in features ", I,
              " must be even (bf16 pairs)");
  const at::Tensor wc = w.contiguous();
  auto p = at::zeros({O_pad / 16, I / 2, 32}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(p.data_ptr<at::BFloat16>());
  at::parallel_for(0, O, 64, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o)
      for (int64_t c = 0; c < I / 2; ++c)
        dst[(o / 16) * (I / 2) * 16 + c * 16 + o % 16] = src[o * (I / 2) + c];
  });
  return p;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t O = out_features, I = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "linear_bf16: bf16 CPU input, got ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) * 2 == I && packed.size(2) == 32 &&
                  packed.size(0) * 16 >= O && packed.size(0) * 16 < O + TILE,
              "linear_bf16: input ", x.sizes(), " does not fit the packed weight ",
              packed.sizes(), " of ", O, " outputs");
#if LAMINA_LINEAR_BF16
  const at::Tensor x2 = x.reshape({-1, I}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = O;
  auto y = at::empty(shape, x.options());
  if (M == 0) return y;
  const int64_t tiles = (O + TILE - 1) / TILE, chunks = (M + CHUNK - 1) / CHUNK;
  at::Tensor b32;  // fp32 [O] (a copy only for a bias of another dtype)
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == O, "linear_bf16: bias of ", bias->numel(), " for ", O,
                " outputs");
    b32 = bias->reshape({O}).to(at::kFloat).contiguous();
  }
  const auto* xs = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bs = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  const int64_t items = chunks * tiles;
  // one thread's items are consecutive: the same row chunk against successive tiles
#pragma omp parallel for schedule(static) num_threads(std::min<int64_t>(at::get_num_threads(), items))
  for (int64_t it = 0; it < items; ++it) {
    const int64_t mc = it / tiles, t = it % tiles, r0 = mc * CHUNK;
    rows(xs + r0 * I, I, ws + t * TILE * I, bs ? bs + t * TILE : nullptr, ys + r0 * O + t * TILE,
         O, std::min(CHUNK, M - r0), std::min(TILE, O - t * TILE));
  }
  return y;
#else
  TORCH_CHECK(false, "linear_bf16: this CPU build has no AVX512-BF16");
#endif
}
