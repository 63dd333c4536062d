// y = bf16(x) @ w on the CPU for any number of rows, with w in "panel order" (matmul.py: pack):
//
//   x      [M, K]     float32, row-major contiguous; rounded to bf16 (nearest even)
//   w      [L, K, N]  bfloat16 (or its bits, uint16): a stack of L weights, each in panel order
//   layer  []         int32: which of them (clamped to [0, L)), read in place
//   y      [M, N]     float32: sum over k of bf16(x[m, k]) * w[layer, k, n], f32 sums
//   gated  attribute: y [M, N / 2] = silu(y's first N / 2 columns) * y's last N / 2 (a gated
//          MLP's gate and up projections; N / 2 a multiple of 64)
//
// A second entry, the grouped matmul (`JaxpipeGroupedMatmul`, an MoE layer's experts): x's
// rows in consecutive groups of `sizes` [G] rows (data), group g's rows times w[layer, g]
// ([L, G, K, N], natural row-major order, not panel order); each (group, panel) is copied
// into panel order in a buffer and run through the same path code (`grouped` below).
//
// Panel order (K even): columns go in panels of kPanel = 64 (the last one w_p = N % 64 wide
// if 64 does not divide N); panel p holds its columns for every k, K / 2 pair rows of w_p
// (bf16 of k = 2j, bf16 of k = 2j + 1) pairs, so one 64-byte load is 16 columns x 2 k's:
// exactly the operand of vdpbf16ps, which multiplies them by a broadcast pair of x values
// (32 multiply-adds an instruction). A panel is one contiguous stream (73 KB for K = 576),
// read sequentially: no cache-set conflicts from a row stride, nothing to shuffle.
//
// A task is (panel, chunk of kChunk rows): a tile of up to kRows rows keeps its kRows x 64
// sums in 24 vector registers over all of K, and the panel is read from L2 for the next tile
// of the chunk. Tasks are shared out over XLA's intra-op thread pool. Few rows (decode) stream
// each panel from memory once; many rows (prefill) are compute-bound. In between (decode of
// 16-96 rows), a thread claims its next task first and prefetches that task's panel into L2
// over this task's tiles, so a panel's stream from memory overlaps the compute on the one
// before it instead of stalling the task's first tile. Like XLA, x is rounded
// to bf16 before the dot; vdpbf16ps treats bf16 denormals (below 1.2e-38) as zero.
//
// Paths (the `path` attribute; `jaxpipe_matmul_paths` says which this build has, and
// the runtime's kernel choice (runtime/kernel_choice.py) picks among them by timing them here):
//   0 portable     plain loops, exact products and f32 sums, any CPU
//   1 avx2         AVX2 + FMA: a 32-byte load is 8 columns x 2 k's of bf16 pairs, widened
//                  to f32 in registers (the low half by a shift, the high half by a mask) and
//                  multiplied by broadcast f32 x values (x rounded to bf16 first): the same
//                  products and sums as the portable loop, at FMA speed
//   2 avx512_bf16  vdpbf16ps on the pairs as they are (above)
//   3 amx          AMX tiles (tdpbf16ps): a panel's pair rows are already the VNNI layout of
//                  AMX's B tiles (16 pair rows x 16 columns of bf16 pairs, 256 bytes apart),
//                  x's pairs that of its A tiles; 32 rows x 32 columns of sums in four C
//                  tiles. Panels narrower than 64 and K not a multiple of 32 run the
//                  avx512_bf16 path. Linux grants the tile state on request
//                  (arch_prctl(ARCH_REQ_XCOMP_PERM)), asked once; refused, the path is not
//                  offered. Untested where no CPU with amx_bf16 ran the tests.
#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define JAXPIPE_AMX 1
#endif

#include "cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpipe_cpu::Ahead, jaxpipe_cpu::AheadTile, jaxpipe_cpu::ahead_tile, jaxpipe_cpu::gate,
    jaxpipe_cpu::parallel_for, jaxpipe_cpu::unroll;
#ifdef __AVX2__
using jaxpipe_cpu::lanes;
#endif
#ifdef __AMX_TILE__
using jaxpipe_cpu::amx_configure, jaxpipe_cpu::amx_permitted;
#endif

namespace {

constexpr int64_t kPanel = 64;  // columns per panel: 4 vectors of 16
constexpr int kRows = 6;        // rows per register tile: 6 x 4 accumulators
constexpr int64_t kChunk = 8 * kRows;  // rows per task (at most: a path may take fewer)
// The next panel is prefetched only when two fit in a 1 MB L2 beside the x tiles (K <= 2560):
// a larger one evicts the panel the task's later tiles still read (K = 5632: 1.1x slower).
constexpr int64_t kAheadMaxBytes = 320 << 10;

enum Path : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Bf16 = 2, kAmx = 3 };

constexpr uint32_t kBuiltPaths = (1u << kPortable)
#if defined(__AVX2__) && defined(__FMA__)
                                 | (1u << kAvx2)
#endif
#ifdef __AVX512BF16__
                                 | (1u << kAvx512Bf16)
#endif
#ifdef JAXPIPE_AMX
                                 | (1u << kAmx)
#endif
    ;

inline uint16_t bf16_bits(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x [M, K] f32 -> xp [M, K / 2] of bf16 pairs (k = 2j low half, 2j + 1 high half).
void pairs_of(const float* x, int64_t count, uint32_t* xp) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  for (; i + 32 <= count; i += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(xp + i / 2, (__m512i)b);
  }
#endif
  for (; i < count; i += 2)
    xp[i / 2] = bf16_bits(x[i]) | (static_cast<uint32_t>(bf16_bits(x[i + 1])) << 16);
}

// One panel: `width` columns, pair rows `2 * width` bf16 apart.
struct Panel {
  const uint16_t* w;
  int64_t width;
};

// Each path: `panel_task(x, kp, panel, y, ldy, rows, ahead)` computes y[rows, panel columns]
// for `rows` rows of its x (`X` per row: `x_stride(kp)` elements), prefetching `ahead`.

#ifdef __AVX512BF16__
namespace bf16dp {

using X = uint32_t;  // x as bf16 pairs (pairs_of)
inline int64_t x_stride(int64_t kp) { return kp; }

// y's rows 0 .. R - 1 (ldy apart) x the panel's columns, over all kp pair rows. NV vectors of
// 16 columns; the last one masked when the panel is narrower than 16 * NV.
template <int R, int NV>
void tile(const uint32_t* __restrict x, int64_t kp, const Panel& pn, float* y, int64_t ldy,
          const AheadTile& ahead) {
  const int64_t last = pn.width - 16 * (NV - 1);  // columns of the last vector, 1..16
  const __mmask32 wmask = static_cast<__mmask32>(last == 16 ? ~0u : (1u << (2 * last)) - 1);
  const __mmask16 ymask = static_cast<__mmask16>((1u << last) - 1);
  const int64_t stride = 2 * pn.width;  // bf16 per pair row
  __m512 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm512_setzero_ps(); }); });
  const uint16_t* w = pn.w;
  for (int64_t j = 0; j < kp; ++j, w += stride) {
    if (j < ahead.iters)
      for (int64_t i = 0; i < ahead.per_j; ++i)
        _mm_prefetch(ahead.p + 64 * (j * ahead.per_j + i), _MM_HINT_T1);
    __m512i wv[NV];
    unroll<NV>([&](auto v) {
      wv[v] = v + 1 < NV ? _mm512_loadu_si512(w + 32 * v)
                         : _mm512_maskz_loadu_epi16(wmask, w + 32 * v);
    });
    unroll<R>([&](auto r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + j]));
      unroll<NV>([&](auto v) { acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)wv[v], xv); });
    });
  }
  unroll<R>([&](auto r) {
    unroll<NV>([&](auto v) {
      if (v + 1 < NV)
        _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
      else
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, ymask, acc[r][v]);
    });
  });
}

// Rows m0 .. m0 + rows - 1 (1 <= rows <= R) of one panel.
template <int R, int NV>
void tile_rows(const uint32_t* x, int64_t kp, const Panel& pn, float* y, int64_t ldy,
               int64_t rows, const AheadTile& ahead) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1, NV>(x, kp, pn, y, ldy, rows, ahead);
  }
  tile<R, NV>(x, kp, pn, y, ldy, ahead);
}

template <int NV>
void panel_rows(const uint32_t* x, int64_t kp, const Panel& pn, float* y, int64_t ldy,
                int64_t rows, const Ahead& ahead) {
  const int64_t tiles = (rows + kRows - 1) / kRows;
  for (int64_t i = 0, m = 0; m < rows; ++i, m += kRows)
    tile_rows<kRows, NV>(x + m * kp, kp, pn, y + m * ldy, ldy, std::min<int64_t>(kRows, rows - m),
                         ahead_tile(ahead, i, tiles, kp));
}

void panel_task(const uint32_t* x, int64_t kp, const Panel& pn, float* y, int64_t ldy,
                int64_t rows, const Ahead& ahead) {
  switch ((pn.width + 15) / 16) {
    case 4: return panel_rows<4>(x, kp, pn, y, ldy, rows, ahead);
    case 3: return panel_rows<3>(x, kp, pn, y, ldy, rows, ahead);
    case 2: return panel_rows<2>(x, kp, pn, y, ldy, rows, ahead);
    default: return panel_rows<1>(x, kp, pn, y, ldy, rows, ahead);
  }
}

}  // namespace bf16dp
#endif

#if defined(__AVX2__) && defined(__FMA__)
namespace avx2 {

using X = float;  // x rounded to bf16, kept as f32 (rounded_of): broadcast straight from memory
inline int64_t x_stride(int64_t kp) { return 2 * kp; }

// A tile: 5 rows x 16 columns, 10 accumulators + 4 widened weights + 2 broadcasts = 16 ymm
// registers. Its inner loop ran at 91 GFLOP/s on one Zen 3 core (95% of 2 FMAs x 8 lanes x
// 3.0 GHz; 4 rows: 77-83, 6 rows spill: 56-67; /tmp harness over panel_task, best of 30).
constexpr int kRowsAvx2 = 5;
constexpr int kVecs = 2;  // vectors of 8 columns per tile

// y's rows 0 .. R - 1 (ldy apart) x `cols` (1 .. 8 * NV) columns of the panel starting at
// column c0, over all kp pair rows. A pair row's 32-byte load is 8 columns x (k = 2j, 2j + 1)
// as bf16 pairs: the shift left by 16 is k = 2j's f32, the high half masked is k = 2j + 1's.
template <int R, int NV>
void tile(const float* __restrict x, int64_t kp, const Panel& pn, int64_t c0, int64_t cols,
          float* y, int64_t ldy, const AheadTile& ahead) {
  const int64_t last = cols - 8 * (NV - 1);  // columns of the last vector, 1..8
  const __m256i mask = lanes(last), high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t stride = 2 * pn.width, k = 2 * kp;
  __m256 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm256_setzero_ps(); }); });
  const uint16_t* w = pn.w + 2 * c0;
  for (int64_t j = 0; j < kp; ++j, w += stride) {
    if (j < ahead.iters)
      for (int64_t i = 0; i < ahead.per_j; ++i)
        _mm_prefetch(ahead.p + 64 * (j * ahead.per_j + i), _MM_HINT_T1);
    __m256 lo[NV], hi[NV];
    unroll<NV>([&](auto v) {
      const auto* src = reinterpret_cast<const __m256i*>(w + 16 * v);
      const __m256i pair = v + 1 < NV || last == 8
          ? _mm256_loadu_si256(src)
          : _mm256_maskload_epi32(reinterpret_cast<const int*>(src), mask);
      lo[v] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      hi[v] = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
    });
    unroll<R>([&](auto r) {
      const __m256 x0 = _mm256_broadcast_ss(x + r * k + 2 * j);
      const __m256 x1 = _mm256_broadcast_ss(x + r * k + 2 * j + 1);
      unroll<NV>([&](auto v) {
        acc[r][v] = _mm256_fmadd_ps(lo[v], x0, acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(hi[v], x1, acc[r][v]);
      });
    });
  }
  unroll<R>([&](auto r) {
    unroll<NV>([&](auto v) {
      if (v + 1 < NV || last == 8)
        _mm256_storeu_ps(y + r * ldy + 8 * v, acc[r][v]);
      else
        _mm256_maskstore_ps(y + r * ldy + 8 * v, mask, acc[r][v]);
    });
  });
}

template <int R>
void tile_rows(const float* x, int64_t kp, const Panel& pn, int64_t c0, int64_t cols, float* y,
               int64_t ldy, int64_t rows, const AheadTile& ahead) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(x, kp, pn, c0, cols, y, ldy, rows, ahead);
  }
  if (cols > 8)
    tile<R, kVecs>(x, kp, pn, c0, cols, y, ldy, ahead);
  else
    tile<R, 1>(x, kp, pn, c0, cols, y, ldy, ahead);
}

// The panel in column groups of 8 * kVecs, each over all the rows (a group's weights stay in
// L1/L2 while its row tiles read them).
void panel_task(const float* x, int64_t kp, const Panel& pn, float* y, int64_t ldy,
                int64_t rows, const Ahead& ahead) {
  constexpr int64_t group = 8 * kVecs;
  const int64_t groups = (pn.width + group - 1) / group;
  const int64_t row_tiles = (rows + kRowsAvx2 - 1) / kRowsAvx2, tiles = groups * row_tiles;
  for (int64_t g = 0, i = 0; g < groups; ++g) {
    const int64_t c0 = g * group, cols = std::min(group, pn.width - c0);
    for (int64_t m = 0; m < rows; m += kRowsAvx2, ++i)
      tile_rows<kRowsAvx2>(x + m * 2 * kp, kp, pn, c0, cols, y + m * ldy + c0, ldy,
                           std::min<int64_t>(kRowsAvx2, rows - m),
                           ahead_tile(ahead, i, tiles, kp));
  }
}

}  // namespace avx2
#endif

#ifdef JAXPIPE_AMX
namespace amx {

using X = uint32_t;  // x as bf16 pairs (pairs_of): rows of A tiles
inline int64_t x_stride(int64_t kp) { return kp; }

// y[32 rows, 32 columns at c0] += the panel's pair rows times a [32, kp] (rows lda bytes
// apart), kp a multiple of 16, the four C tiles stored to y (ldy floats apart).
inline void block(const uint32_t* a, int64_t lda, const uint16_t* w, int64_t c0, int64_t kp,
                  float* y, int64_t ldy) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t j = 0; j < kp; j += 16) {
    _tile_loadd(4, a + j, lda);
    _tile_loadd(5, reinterpret_cast<const char*>(a + j) + 16 * lda, lda);
    const uint16_t* b = w + j * 2 * kPanel + 2 * c0;  // pair row j, column c0
    _tile_loadd(6, b, 4 * kPanel);
    _tile_loadd(7, b + 32, 4 * kPanel);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t sy = ldy * sizeof(float);
  _tile_stored(0, y, sy);
  _tile_stored(1, y + 16, sy);
  _tile_stored(2, y + 16 * ldy, sy);
  _tile_stored(3, y + 16 * ldy + 16, sy);
}

void panel_task(const uint32_t* x, int64_t kp, const Panel& pn, float* y, int64_t ldy,
                int64_t rows, const Ahead& ahead) {
  if (pn.width != kPanel || kp % 16 != 0)
    return bf16dp::panel_task(x, kp, pn, y, ldy, rows, ahead);
  thread_local std::vector<uint32_t> pad;  // a tail of fewer than 32 rows, zero rows after
  thread_local std::vector<float> out(32 * 32);
  amx_configure();
  for (int64_t m = 0; m < rows; m += 32) {
    const int64_t mr = std::min<int64_t>(32, rows - m);
    const uint32_t* a = x + m * kp;
    if (mr < 32) {
      pad.assign(32 * kp, 0u);
      std::copy(a, a + mr * kp, pad.begin());
      a = pad.data();
    }
    for (int64_t c0 = 0; c0 < kPanel; c0 += 32) {
      if (mr == 32) {
        block(a, kp * 4, pn.w, c0, kp, y + m * ldy + c0, ldy);
        continue;
      }
      block(a, kp * 4, pn.w, c0, kp, out.data(), 32);
      for (int64_t r = 0; r < mr; ++r)
        std::copy_n(out.data() + r * 32, 32, y + (m + r) * ldy + c0);
    }
  }
  _tile_release();
}

}  // namespace amx
#endif

namespace portable {

using X = uint32_t;  // x as bf16 pairs (pairs_of)
inline int64_t x_stride(int64_t kp) { return kp; }

void panel_task(const uint32_t* x, int64_t kp, const Panel& pn, float* y, int64_t ldy,
                int64_t rows, const Ahead&) {
  std::vector<float> acc(pn.width);
  for (int64_t m = 0; m < rows; ++m) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < kp; ++j) {
      const uint32_t pair = x[m * kp + j];
      const float lo = bf16_to_f32(pair & 0xffffu), hi = bf16_to_f32(pair >> 16);
      const uint16_t* w = pn.w + 2 * pn.width * j;
#pragma omp simd
      for (int64_t c = 0; c < pn.width; ++c)
        acc[c] += lo * bf16_to_f32(w[2 * c]) + hi * bf16_to_f32(w[2 * c + 1]);
    }
    std::copy(acc.begin(), acc.end(), y + m * ldy);
  }
}

}  // namespace portable

// x [M, K] f32 -> xr [M, K] rounded to bf16 (nearest even), kept as f32 (the avx2 path's x).
void rounded_of(const float* x, int64_t count, float* xr) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // bits + 0x7fff + (bit 16), high half kept; NaN (exponent all ones, mantissa set) keeps a
  // quiet NaN's bits instead, as bf16_bits does.
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  for (; i + 8 <= count; i += 8) {
    const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(b, bias), odd), high);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, abs), inf);
    const __m256i q = _mm256_and_si256(_mm256_or_si256(b, quiet), high);
    _mm256_storeu_ps(xr + i, _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan)));
  }
#endif
  for (; i < count; ++i) xr[i] = bf16_to_f32(bf16_bits(x[i]));
}

// x as path `P` reads it: bf16 pairs [M, K / 2], or rounded f32 [M, K] (not value-initialised:
// zeroing it first cost a memset of the whole buffer per call).
template <typename P>
std::unique_ptr<typename P::X[]> x_of(const float* x, int64_t m, int64_t k) {
  std::unique_ptr<typename P::X[]> xp(new typename P::X[m * P::x_stride(k / 2)]);
  if constexpr (std::is_same_v<typename P::X, float>)
    rounded_of(x, m * k, xp.get());
  else
    pairs_of(x, m * k, xp.get());
  return xp;
}

// y = bf16(x) @ w, w [K, N] in panel order, on path `P`; tasks are (panel, chunk of rows),
// panel-major so that a thread's consecutive tasks read the same panel. `gated`: y [M, N / 2]
// = silu(x @ w's first N / 2 columns) * (x @ its last N / 2), (N / 2) % kPanel == 0: a task
// multiplies a gate panel and its up panel into two buffers (L1-sized) and writes their
// product.
template <typename P>
void matmul(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* y, int64_t m,
            int64_t k, int64_t n, bool gated) {
  if (m == 0 || n == 0) return;
  const int64_t kp = k / 2, xs_stride = P::x_stride(kp);
  const auto xp = x_of<P>(x, m, k);
  const int64_t out_n = gated ? n / 2 : n;
  const int64_t panels = (out_n + kPanel - 1) / kPanel, chunks = (m + kChunk - 1) / kChunk;
  auto panel = [&](int64_t p) { return Panel{w + p * kPanel * k, std::min(kPanel, n - p * kPanel)}; };
  // The thread's next task's panel, unless it is this one (another chunk of its rows).
  auto ahead = [&](int64_t p, int64_t next) {
    if (next < 0 || next / chunks == p || 2 * kPanel * k > kAheadMaxBytes) return Ahead{};
    const Panel pn = panel(next / chunks);
    return Ahead{reinterpret_cast<const char*>(pn.w), 2 * pn.width * k};
  };
  parallel_for(pool, panels * chunks, [&](int64_t t, int64_t next) {
    const int64_t p = t / chunks, m0 = t % chunks * kChunk, rows = std::min(kChunk, m - m0);
    const auto* xs = xp.get() + m0 * xs_stride;
    const Ahead a = ahead(p, next);
    if (!gated) return P::panel_task(xs, kp, panel(p), y + m0 * n + p * kPanel, n, rows, a);
    thread_local std::vector<float> g(kChunk * kPanel), u(kChunk * kPanel);
    const Ahead up = a.bytes ? ahead(p + panels, next + panels * chunks) : Ahead{};
    P::panel_task(xs, kp, panel(p), g.data(), kPanel, rows, a);
    P::panel_task(xs, kp, panel(p + panels), u.data(), kPanel, rows, up);
    for (int64_t r = 0; r < rows; ++r)
      gate(g.data() + r * kPanel, u.data() + r * kPanel, kPanel, y + (m0 + r) * out_n + p * kPanel);
  });
}

struct PortablePath {
  using X = portable::X;
  static int64_t x_stride(int64_t kp) { return portable::x_stride(kp); }
  static constexpr auto panel_task = portable::panel_task;
};
#if defined(__AVX2__) && defined(__FMA__)
struct Avx2Path {
  using X = avx2::X;
  static int64_t x_stride(int64_t kp) { return avx2::x_stride(kp); }
  static constexpr auto panel_task = avx2::panel_task;
};
#endif
#ifdef __AVX512BF16__
struct Bf16dpPath {
  using X = bf16dp::X;
  static int64_t x_stride(int64_t kp) { return bf16dp::x_stride(kp); }
  static constexpr auto panel_task = bf16dp::panel_task;
};
#endif
#ifdef JAXPIPE_AMX
struct AmxPath {
  using X = amx::X;
  static int64_t x_stride(int64_t kp) { return amx::x_stride(kp); }
  static constexpr auto panel_task = amx::panel_task;
};
#endif

// The paths this build has and the process may run (AMX needs the kernel's permission).
uint32_t usable_paths() {
#ifdef JAXPIPE_AMX
  if (!amx_permitted()) return kBuiltPaths & ~(1u << kAmx);
#endif
  return kBuiltPaths;
}

// fn(P{}) with `path`'s struct (`path` < 0: the fastest this build has; the kernel choice passes
// its measured choice); false if this build or process cannot run that path.
template <typename F>
bool with_path(int64_t path, F&& fn) {
  if (path < 0) path = 31 - __builtin_clz(usable_paths());
  if (!(usable_paths() >> path & 1u)) return false;
  switch (path) {
    case kPortable: fn(PortablePath{}); return true;
#if defined(__AVX2__) && defined(__FMA__)
    case kAvx2: fn(Avx2Path{}); return true;
#endif
#ifdef __AVX512BF16__
    case kAvx512Bf16: fn(Bf16dpPath{}); return true;
#endif
#ifdef JAXPIPE_AMX
    case kAmx: fn(AmxPath{}); return true;
#endif
    default: return false;
  }
}

bool run_path(int64_t path, ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* y,
              int64_t m, int64_t k, int64_t n, bool gated) {
  return with_path(path, [&](auto p) { matmul<decltype(p)>(pool, x, w, y, m, k, n, gated); });
}

// -- grouped: x's rows in segments, segment g times weight g (an MoE layer's experts) -------

// Columns c0 .. c0 + width - 1 of a natural-order w [K, N] as one panel (`pack`'s order):
// out [K / 2, width, 2]. Each pair row reads 2 x width contiguous bf16 of w's rows 2j, 2j + 1.
void panel_of(const uint16_t* w, int64_t k, int64_t n, int64_t c0, int64_t width,
              uint16_t* out) {
  for (int64_t j = 0; j < k / 2; ++j) {
    const uint16_t* a = w + 2 * j * n + c0;
    const uint16_t* b = a + n;
    uint16_t* o = out + 2 * j * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) o[2 * c] = a[c], o[2 * c + 1] = b[c];
  }
}

// One segment: x's rows m0 .. m0 + rows - 1 times w [K, N] (natural order).
struct Segment {
  const uint16_t* w;
  int64_t m0, rows;
};

// y[segment rows] = bf16(x[segment rows]) @ segment's w, for every segment, on path `P`; rows
// past the last segment are zeros. Tasks are (segment, output panel): a task copies its panel
// (and, `gated`, its up panel) of the expert's natural-order weight into panel order in an
// L2-sized buffer once, then runs the path's panel code over all of the segment's rows, so an
// expert's weight is read from memory once per call however many rows it has, and an expert
// no row chose is never read. Weights stay in natural order: the same arrays the dense and
// ragged paths read (model/moe.py), so the path can differ between step sizes.
template <typename P>
void grouped(ffi::ThreadPool& pool, const float* x, const std::vector<Segment>& segs, float* y,
             int64_t m, int64_t k, int64_t n, bool gated) {
  const int64_t out_n = gated ? n / 2 : n, kp = k / 2, xs_stride = P::x_stride(kp);
  int64_t used = 0;
  for (const Segment& s : segs) used = std::max(used, s.m0 + s.rows);
  std::fill(y + used * out_n, y + m * out_n, 0.f);
  if (used == 0 || out_n == 0) return;
  const auto xp = x_of<P>(x, used, k);
  const int64_t panels = (out_n + kPanel - 1) / kPanel;
  parallel_for(pool, static_cast<int64_t>(segs.size()) * panels, [&](int64_t t, int64_t) {
    const Segment& s = segs[t / panels];
    const int64_t c0 = t % panels * kPanel, width = std::min(kPanel, out_n - c0);
    thread_local std::vector<uint16_t> buf;
    buf.resize(2 * kPanel * k);
    const Panel pn{buf.data(), width}, up{buf.data() + kPanel * k, width};
    panel_of(s.w, k, n, c0, width, buf.data());
    const auto* xs = xp.get() + s.m0 * xs_stride;
    if (!gated) return P::panel_task(xs, kp, pn, y + s.m0 * n + c0, n, s.rows, Ahead{});
    panel_of(s.w, k, n, c0 + out_n, width, buf.data() + kPanel * k);
    thread_local std::vector<float> g(kChunk * kPanel), u(kChunk * kPanel);
    for (int64_t r0 = 0; r0 < s.rows; r0 += kChunk) {
      const int64_t rows = std::min(kChunk, s.rows - r0);
      P::panel_task(xs + r0 * xs_stride, kp, pn, g.data(), kPanel, rows, Ahead{});
      P::panel_task(xs + r0 * xs_stride, kp, up, u.data(), kPanel, rows, Ahead{});
      for (int64_t r = 0; r < rows; ++r)
        gate(g.data() + r * kPanel, u.data() + r * kPanel, width,
             y + (s.m0 + r0 + r) * out_n + c0);
    }
  });
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool gated,
                      int64_t path) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] != wd[1] ||
      yd[0] != xd[0] || yd[1] != (gated ? wd[2] / 2 : wd[2]) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "bf16_matmul: need x [M,K], w [L,K,N], layer [] and y [M,N] ([M,N/2] gated)");
  if (wd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("bf16_matmul: K must be even (panel order pairs k's)");
  if (gated && wd[2] % (2 * kPanel) != 0)
    return ffi::Error::InvalidArgument("bf16_matmul: gated needs N a multiple of 128");
  if (w.element_type() != ffi::BF16 && w.element_type() != ffi::U16)
    return ffi::Error::InvalidArgument("bf16_matmul: w must be bf16 or u16 (bf16 bits)");
  // Layer l's weight, read in place: slicing a stacked weight before a custom call costs XLA
  // a copy of it per call (a write and a second read of every weight).
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1);
  const auto* base = static_cast<const uint16_t*>(w.untyped_data()) + l * wd[1] * wd[2];
  if (!run_path(path, pool, x.typed_data(), base, y->typed_data(), xd[0], xd[1], wd[2], gated))
    return ffi::Error::InvalidArgument("bf16_matmul: this build has no path " +
                                       std::to_string(path));
  return ffi::Error::Success();
}


// x [M, K] f32 (rows sorted by group), w [L, G, K, N] bf16 natural order, layer [], sizes [G]
// i32 (rows of each group, in order; their sum at most M), y [M, N] ([M, N / 2] gated).
ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> sizes,
                             ffi::ResultBuffer<ffi::F32> y, bool gated, int64_t path) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || xd[1] != wd[2] ||
      yd[0] != xd[0] || yd[1] != (gated ? wd[3] / 2 : wd[3]) || layer.element_count() != 1 ||
      static_cast<int64_t>(sizes.element_count()) != wd[1])
    return ffi::Error::InvalidArgument(
        "grouped_matmul: need x [M,K], w [L,G,K,N], layer [], sizes [G] and y [M,N] "
        "([M,N/2] gated)");
  if (wd[2] % 2 != 0)
    return ffi::Error::InvalidArgument("grouped_matmul: K must be even (bf16 pairs of k's)");
  if (gated && wd[3] % 2 != 0)
    return ffi::Error::InvalidArgument("grouped_matmul: gated needs N even");
  if (w.element_type() != ffi::BF16 && w.element_type() != ffi::U16)
    return ffi::Error::InvalidArgument("grouped_matmul: w must be bf16 or u16 (bf16 bits)");
  const int64_t k = wd[2], n = wd[3];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1);
  const auto* base = static_cast<const uint16_t*>(w.untyped_data()) + l * wd[1] * k * n;
  std::vector<Segment> segs;
  int64_t m0 = 0;
  for (int64_t g = 0; g < wd[1]; ++g) {
    const int64_t rows = sizes.typed_data()[g];
    if (rows < 0 || m0 + rows > xd[0])
      return ffi::Error::InvalidArgument(
          "grouped_matmul: group sizes must be >= 0 and sum to at most M = " +
          std::to_string(xd[0]) + "; group " + std::to_string(g) + " has " +
          std::to_string(rows) + " rows after " + std::to_string(m0));
    if (rows > 0) segs.push_back({base + g * k * n, m0, rows});
    m0 += rows;
  }
  const bool ok = with_path(path, [&](auto p) {
    grouped<decltype(p)>(pool, x.typed_data(), segs, y->typed_data(), xd[0], k, n, gated);
  });
  if (!ok)
    return ffi::Error::InvalidArgument("grouped_matmul: this build has no path " +
                                       std::to_string(path));
  return ffi::Error::Success();
}

}  // namespace

// Bit i set: path i (Path above) is compiled in and runs here (-march=native; AMX permitted).
extern "C" uint32_t jaxpipe_matmul_paths() { return usable_paths(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeBf16Matmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("gated")
                                  .Attr<int64_t>("path"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("gated")
                                  .Attr<int64_t>("path"));
