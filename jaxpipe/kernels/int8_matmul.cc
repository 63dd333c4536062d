// y = x_scale[m] * w_scale[n] * (x8 @ w8)[m, n] on the CPU (dynamic W8A8, int8_matmul.py):
//
//   x      [M, K]     int8, row-major contiguous: each row quantized, in [-127, 127]; or
//                     float32 rows, quantized here per row (int8.py's arithmetic, `Quads`)
//   xs     [M]        float32: each int8 row's scale ([0] with float32 rows)
//   w      [L, K, N]  int8 in "int8 panel order" (int8_matmul.py: pack), in [-127, 127]
//   ws     [L, N]     float32: each output column's scale
//   layer  []         int32: which of the L weights (clamped to [0, L)), read in place
//   y      [M, N]     float32: (float(acc) * ws[n]) * xs[m], acc the exact int32 dot
//   gated  attribute: y [M, N / 2] = silu(y's first N / 2 columns) * y's last N / 2 (a gated
//          MLP's gate and up projections; N / 2 a multiple of 64), as the bf16 kernel's
//
// Int8 panel order: columns in panels of kPanel = 64 (the last one w_p = N % 64 wide if 64
// does not divide N); panel p, K * w_p bytes from byte 64 * K * p, holds K / 4 "quad rows",
// each w_p columns x 4 k's (k = 4j .. 4j + 3: one int32 lane per column), then the K % 4
// tail rows as w_p columns x (K % 4) bytes. So one 64-byte load is 16 columns x 4 k's:
// exactly the operand of vpdpbusd (64 multiply-adds an instruction), and of AMX's B tiles.
//
// x is copied into quads too, [M, ceil(K / 4)] int32 lanes, its tail quad zero-padded; a
// task's panel tail is padded into a quad row the same way, so every path runs whole quads.
//
// Paths (the `path` attribute; `jaxpipe_int8_matmul_paths` says which this build has):
//   0 portable     plain loops over int32 sums, any CPU
//   1 avx2         vpmaddubsw + vpmaddwd (no VNNI). vpmaddubsw multiplies u8 by s8 and adds
//                  pairs into s16 with saturation: with an unsigned operand up to 255 a
//                  pair reaches 2 x 255 x 127 = 64770 and saturates. So the u8 operand is
//                  |x| (at most 127) and the s8 one is w with x's sign (vpsignb): a pair is
//                  at most 2 x 127 x 127 = 32258 < 32767, never saturated, provided w is
//                  not -128 (quantized weights are in [-127, 127]). vpmaddwd by ones then
//                  widens the pairs into int32 sums of 4.
//   2 avx_vnni     vpdpbusd in its VEX form on 256-bit vectors
//   3 avx512_vnni  vpdpbusd on 512-bit vectors
//   4 amx_int8     AMX tiles, tdpbssd (s8 x s8): 32 rows x 32 columns in four C tiles; a
//                  panel narrower than 64, K not a multiple of 64 or a tail runs avx512_vnni.
//                  Compiled only where the CPU has amx_int8; untested where none ran it.
// vpdpbusd multiplies u8 by s8 too. There the zero point goes on the weights, in registers:
// a loaded weight vector xor 0x80 is w + 128 as u8 (one op per vector, shared by the tile's
// rows), x stays s8, and sum_k (w + 128) x = acc + 128 sum_k x: the correction is one int32
// per row, computed once when x is copied (`Quads`). The stored weight stays the signed int8
// that XLA's dot (the reference) reads, and no per-column sums are kept.
//
// Sums are exact: |acc| <= K x 127 x 127 (+ 128 x 127 x K for the VNNI correction) fits int32
// for K < 66,000. A task is (panel, chunk of kChunk rows), shared over XLA's thread pool;
// a thread claims its next task first and prefetches that task's panel into L2 over this
// task's tiles, so a panel's stream from memory overlaps the compute on the one before it (as
// the bf16 kernel: decode's 8-96 rows are neither memory- nor compute-bound alone).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define JAXPIPE_AMX_INT8 1
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

constexpr int64_t kPanel = 64;  // columns per panel
constexpr int64_t kChunk = 48;  // rows per task
// The next task's panel is prefetched (into L2, over this task's tiles) when it is a
// different panel and two fit in L2 beside x (as the bf16 kernel: K <= 5120 here).
constexpr int64_t kAheadMaxBytes = 320 << 10;

enum Path : int64_t { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAmxInt8 = 4 };

constexpr uint32_t kBuiltPaths = (1u << kPortable)
#ifdef __AVX2__
                                 | (1u << kAvx2)
#endif
#ifdef __AVXVNNI__
                                 | (1u << kAvxVnni)
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                                 | (1u << kAvx512Vnni)
#endif
#ifdef JAXPIPE_AMX_INT8
                                 | (1u << kAmxInt8)
#endif
    ;

// One panel of one task: quad rows of `width` int32 lanes, the padded tail quad row (null
// when 4 divides K), the panel's column scales, and what to prefetch meanwhile.
struct Panel {
  const int32_t* w;
  const int32_t* tail;
  int64_t width;
  const float* scale;
  Ahead ahead;
};

// x of a task's rows as the paths read them: quads [rows, kq] (kq = ceil(K / 4), x's row
// stride), `full` = K / 4 whole quads, then the tail; per row its scale and 128 * sum_k x.
struct Rows {
  const int32_t* x;
  int64_t kq, full;
  const int32_t* shift;
  const float* scale;
};

namespace portable {

// y's `rows` rows x the panel's columns: int32 sums over every quad, then the scales.
void panel_task(const Rows& x, const Panel& pn, float* y, int64_t ldy, int64_t rows) {
  std::vector<int32_t> acc(pn.width);
  for (int64_t m = 0; m < rows; ++m) {
    std::fill(acc.begin(), acc.end(), 0);
    for (int64_t j = 0; j < x.kq; ++j) {
      int8_t xb[4];
      std::memcpy(xb, x.x + m * x.kq + j, 4);
      const auto* w = reinterpret_cast<const int8_t*>(j < x.full ? pn.w + j * pn.width : pn.tail);
      for (int64_t c = 0; c < pn.width; ++c)
        for (int t = 0; t < 4; ++t) acc[c] += int32_t{xb[t]} * int32_t{w[4 * c + t]};
    }
    for (int64_t c = 0; c < pn.width; ++c)
      y[m * ldy + c] = static_cast<float>(acc[c]) * pn.scale[c] * x.scale[m];
  }
}

}  // namespace portable

#ifdef __AVX2__
// The 256-bit paths (avx2, avx_vnni): tiles of R rows (Dot::kRows) x 8 * NV columns; a
// panel in column groups of 16, each over all the task's rows (its weights stay in L1 while
// the rows read them). `Dot` is the path's multiply-accumulate of one quad row.
namespace ymm {

constexpr int kVecs = 2;

// y[R rows, cols at c0] = scales x the sums of Dot over all quads. Dot::pre(w) prepares a
// loaded weight vector (once for all rows), Dot::add(acc, w, xq) adds one row's 4-k dots,
// Dot::kShift says whether the row's 128 * sum_k x comes off (the VNNI zero point).
template <typename Dot, int R, int NV>
void tile(const Rows& x, const Panel& pn, int64_t c0, int64_t cols, float* y, int64_t ldy,
          const AheadTile& ahead) {
  const int64_t last = cols - 8 * (NV - 1);
  const __m256i mask = lanes(last);
  __m256i acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm256_setzero_si256(); }); });
  // One loop over every quad, the tail's weights from its padded row: a second call site
  // for the tail made GCC keep the accumulators in memory.
  for (int64_t j = 0; j < x.kq; ++j) {
    if (j < ahead.iters)
      for (int64_t i = 0; i < ahead.per_j; ++i)
        __builtin_prefetch(ahead.p + 64 * (j * ahead.per_j + i), 0, 2);  // into L2
    const int32_t* w = (j < x.full ? pn.w + j * pn.width : pn.tail) + c0;
    __m256i wv[NV];
    unroll<NV>([&](auto v) {
      const auto* src = w + 8 * v;
      wv[v] = Dot::pre(v + 1 < NV || last == 8 ? _mm256_loadu_si256((const __m256i*)src)
                                               : _mm256_maskload_epi32(src, mask));
    });
    unroll<R>([&](auto r) {
      const __m256i xq = _mm256_set1_epi32(x.x[r * x.kq + j]);
      unroll<NV>([&](auto v) { acc[r][v] = Dot::add(acc[r][v], wv[v], xq); });
    });
  }
  unroll<R>([&](auto r) {
    const __m256i shift = _mm256_set1_epi32(Dot::kShift ? x.shift[r] : 0);
    const __m256 xs = _mm256_set1_ps(x.scale[r]);
    unroll<NV>([&](auto v) {
      const bool whole = v + 1 < NV || last == 8;
      const float* s = pn.scale + c0 + 8 * v;
      const __m256 ws = whole ? _mm256_loadu_ps(s) : _mm256_maskload_ps(s, mask);
      const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][v], shift));
      const __m256 out = _mm256_mul_ps(_mm256_mul_ps(f, ws), xs);
      float* dst = y + r * ldy + 8 * v;
      if (whole)
        _mm256_storeu_ps(dst, out);
      else
        _mm256_maskstore_ps(dst, mask, out);
    });
  });
}

template <typename Dot, int R>
void tile_rows(const Rows& x, const Panel& pn, int64_t c0, int64_t cols, float* y, int64_t ldy,
               int64_t rows, const AheadTile& ahead) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<Dot, R - 1>(x, pn, c0, cols, y, ldy, rows, ahead);
  }
  if (cols > 8)
    tile<Dot, R, kVecs>(x, pn, c0, cols, y, ldy, ahead);
  else
    tile<Dot, R, 1>(x, pn, c0, cols, y, ldy, ahead);
}

template <typename Dot>
void panel_task(const Rows& x, const Panel& pn, float* y, int64_t ldy, int64_t rows) {
  constexpr int64_t group = 8 * kVecs;
  const int64_t groups = (pn.width + group - 1) / group;
  constexpr int kRowsY = Dot::kRows;
  const int64_t tiles = groups * ((rows + kRowsY - 1) / kRowsY);
  for (int64_t c0 = 0, i = 0; c0 < pn.width; c0 += group) {
    const int64_t cols = std::min(group, pn.width - c0);
    for (int64_t m = 0; m < rows; m += kRowsY, ++i) {
      const Rows xr{x.x + m * x.kq, x.kq, x.full, x.shift + m, x.scale + m};
      tile_rows<Dot, kRowsY>(xr, pn, c0, cols, y + m * ldy + c0, ldy,
                             std::min<int64_t>(kRowsY, rows - m),
                             ahead_tile(pn.ahead, i, tiles, x.kq));
    }
  }
}

// vpsignb + vpmaddubsw + vpmaddwd: |x| (u8, <= 127) times w with x's sign (s8), pairs in s16
// (<= 32258: no saturation), then pairs of pairs into int32.
struct Avx2Dot {  // 4 rows: 8 accumulators, 2 weights, x, |x|, ones, a temporary
  static constexpr int kRows = 4;
  static constexpr bool kShift = false;
  static __m256i pre(__m256i w) { return w; }
  static __m256i add(__m256i acc, __m256i w, __m256i xq) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(xq), _mm256_sign_epi8(w, xq));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};

#ifdef __AVXVNNI__
struct AvxVnniDot {  // (w + 128) as u8 times x as s8; the row's 128 * sum x comes off after
  static constexpr int kRows = 6;  // 12 accumulators, 2 weights, x, the 0x80 bytes: 16 ymm
  static constexpr bool kShift = true;
  static __m256i pre(__m256i w) { return _mm256_xor_si256(w, _mm256_set1_epi8(-128)); }
  static __m256i add(__m256i acc, __m256i w, __m256i xq) {
    return _mm256_dpbusd_avx_epi32(acc, w, xq);
  }
};
#endif

}  // namespace ymm
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// vpdpbusd on 512-bit vectors: tiles of 6 rows x 64 columns (24 accumulators, 4 weights).
namespace zmm {

constexpr int kRowsZ = 6;

template <int R, int NV>
void tile(const Rows& x, const Panel& pn, float* y, int64_t ldy, const AheadTile& ahead) {
  const int64_t last = pn.width - 16 * (NV - 1);  // columns of the last vector, 1..16
  const __mmask16 mask = static_cast<__mmask16>(last == 16 ? 0xffffu : (1u << last) - 1);
  const __m512i flip = _mm512_set1_epi8(-128);
  __m512i acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm512_setzero_si512(); }); });
  const int32_t* __restrict xp = x.x;
  const int32_t *pw = pn.w, *tail = pn.tail;
  const int64_t kq = x.kq, full = x.full, width = pn.width;
  for (int64_t j = 0; j < kq; ++j) {  // one loop, as the 256-bit tile's
    if (j < ahead.iters)
      for (int64_t i = 0; i < ahead.per_j; ++i)
        __builtin_prefetch(ahead.p + 64 * (j * ahead.per_j + i), 0, 2);  // into L2
    const int32_t* w = j < full ? pw + j * width : tail;
    __m512i wv[NV];
    unroll<NV>([&](auto v) {
      wv[v] = _mm512_xor_si512(flip, v + 1 < NV ? _mm512_loadu_si512(w + 16 * v)
                                                : _mm512_maskz_loadu_epi32(mask, w + 16 * v));
    });
    unroll<R>([&](auto r) {
      const __m512i xq = _mm512_set1_epi32(xp[r * kq + j]);
      unroll<NV>([&](auto v) { acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], wv[v], xq); });
    });
  }
  unroll<R>([&](auto r) {
    const __m512i shift = _mm512_set1_epi32(x.shift[r]);
    const __m512 xs = _mm512_set1_ps(x.scale[r]);
    unroll<NV>([&](auto v) {
      const __mmask16 m = v + 1 < NV ? static_cast<__mmask16>(0xffffu) : mask;
      const __m512 ws = _mm512_maskz_loadu_ps(m, pn.scale + 16 * v);
      const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], shift));
      _mm512_mask_storeu_ps(y + r * ldy + 16 * v, m, _mm512_mul_ps(_mm512_mul_ps(f, ws), xs));
    });
  });
}

template <int R, int NV>
void tile_rows(const Rows& x, const Panel& pn, float* y, int64_t ldy, int64_t rows,
               const AheadTile& ahead) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1, NV>(x, pn, y, ldy, rows, ahead);
  }
  tile<R, NV>(x, pn, y, ldy, ahead);
}

template <int NV>
void panel_rows(const Rows& x, const Panel& pn, float* y, int64_t ldy, int64_t rows) {
  const int64_t tiles = (rows + kRowsZ - 1) / kRowsZ;
  for (int64_t m = 0, i = 0; m < rows; m += kRowsZ, ++i) {
    const Rows xr{x.x + m * x.kq, x.kq, x.full, x.shift + m, x.scale + m};
    tile_rows<kRowsZ, NV>(xr, pn, y + m * ldy, ldy, std::min<int64_t>(kRowsZ, rows - m),
                          ahead_tile(pn.ahead, i, tiles, x.kq));
  }
}

void panel_task(const Rows& x, const Panel& pn, float* y, int64_t ldy, int64_t rows) {
  switch ((pn.width + 15) / 16) {
    case 4: return panel_rows<4>(x, pn, y, ldy, rows);
    case 3: return panel_rows<3>(x, pn, y, ldy, rows);
    case 2: return panel_rows<2>(x, pn, y, ldy, rows);
    default: return panel_rows<1>(x, pn, y, ldy, rows);
  }
}

}  // namespace zmm
#endif

#ifdef JAXPIPE_AMX_INT8
namespace amx {

// acc [32, 32] int32 = x's 32 rows (quads, kq apart) times the panel's columns c0 .. c0 + 31.
inline void block(const int32_t* a, int64_t kq, const int32_t* w, int64_t c0, int64_t full,
                  int32_t* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t j = 0; j < full; j += 16) {
    _tile_loadd(4, a + j, 4 * kq);
    _tile_loadd(5, a + 16 * kq + j, 4 * kq);
    const int32_t* b = w + j * kPanel + c0;
    _tile_loadd(6, b, 4 * kPanel);
    _tile_loadd(7, b + 16, 4 * kPanel);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  _tile_stored(2, acc + 16 * 32, 128);
  _tile_stored(3, acc + 16 * 32 + 16, 128);
}

void panel_task(const Rows& x, const Panel& pn, float* y, int64_t ldy, int64_t rows) {
  if (pn.width != kPanel || pn.tail || x.full % 16 != 0)
    return zmm::panel_task(x, pn, y, ldy, rows);
  thread_local std::vector<int32_t> pad, acc(32 * 32);
  amx_configure();
  for (int64_t m = 0; m < rows; m += 32) {
    const int64_t mr = std::min<int64_t>(32, rows - m);
    const int32_t* a = x.x + m * x.kq;
    if (mr < 32) {  // a tail of fewer than 32 rows: zero rows after it
      pad.assign(32 * x.kq, 0);
      std::copy(a, a + mr * x.kq, pad.begin());
      a = pad.data();
    }
    for (int64_t c0 = 0; c0 < kPanel; c0 += 32) {
      block(a, x.kq, pn.w, c0, x.full, acc.data());
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t c = 0; c < 32; ++c)
          y[(m + r) * ldy + c0 + c] =
              static_cast<float>(acc[r * 32 + c]) * pn.scale[c0 + c] * x.scale[m + r];
    }
  }
  _tile_release();
}

}  // namespace amx
#endif

// x [M, K] int8 as quads [M, kq] (tail zero-padded) and each row's 128 * sum_k x.
// x's rows as the paths read them: codes in quads [M, kq] (tail zero-padded), each row's
// scale and 128 * sum_k code. From codes and scales (`quantized_matmul`), or from f32 rows
// quantized here exactly as int8.py's `_quantize` (`int8_matmul`): no separate XLA pass
// over x, and no second op per call.
struct Quads {
  std::vector<int32_t> x, shift;
  std::vector<float> scale;
  Quads(const int8_t* x8, const float* xs, int64_t m, int64_t k)
      : x(m * ((k + 3) / 4), 0), shift(m), scale(xs, xs + m) {
    for (int64_t r = 0; r < m; ++r) {
      int8_t* codes = row_codes(r, k);
      std::memcpy(codes, x8 + r * k, k);
      shift[r] = 128 * sum(codes, k);
    }
  }
  // Rows in blocks of kBlockRows over the pool once there are kParallel values (prefill),
  // on the calling thread below that (decode: a few rows, less than a task's scheduling).
  Quads(const float* xf, int64_t m, int64_t k, ffi::ThreadPool& pool)
      : x(m * ((k + 3) / 4), 0), shift(m), scale(m) {
    constexpr int64_t kBlockRows = 16, kParallel = 1 << 16;
    auto rows = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int8_t* codes = row_codes(r, k);
        scale[r] = quantize(xf + r * k, k, codes);
        shift[r] = 128 * sum(codes, k);
      }
    };
    if (m * k < kParallel) {
      rows(0, m);
      return;
    }
    parallel_for(pool, (m + kBlockRows - 1) / kBlockRows, [&](int64_t b, int64_t) {
      rows(b * kBlockRows, std::min(m, (b + 1) * kBlockRows));
    });
  }
  int8_t* row_codes(int64_t r, int64_t k) {
    return reinterpret_cast<int8_t*>(x.data() + r * ((k + 3) / 4));
  }
  static int32_t sum(const int8_t* codes, int64_t k) {
    int32_t total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < k; ++i) total += codes[i];
    return total;
  }
  // codes = round(v * f32(1 / s)) in [-127, 127], s = max |v| * f32(1 / 127) (1 if 0),
  // ties to even; returns s, or NaN for a row with inf or NaN (so are its outputs). The
  // products are int8.py's definition: under -ffast-math neither is rewritten (a division
  // would be), and non-finite values are found by their bits (-ffast-math assumes none).
  static float quantize(const float* v, int64_t k, int8_t* codes) {
    const auto [amax, finite] = range(v, k);
    const float s = amax > 0.f ? amax * kStep : 1.f, inv = 1.f / s;
    round(v, k, inv, codes);
    if (finite) return s;
    const uint32_t nan = 0x7fc00000u;
    float out;
    std::memcpy(&out, &nan, 4);
    return out;
  }
  // (max |v|, whether every v is finite).
  static std::pair<float, bool> range(const float* v, int64_t k) {
    float amax = 0.f;
    uint32_t special = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512i exp = _mm512_set1_epi32(0x7f800000);
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (; i < k; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(k - i >= 16 ? 0xffffu : (1u << (k - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(m, v + i);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(x));
      bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), exp), exp);
    }
    amax = _mm512_reduce_max_ps(vmax);
    special = bad;
#endif
    for (; i < k; ++i) {
      uint32_t bits;
      std::memcpy(&bits, v + i, 4);
      special |= (bits & 0x7f800000u) == 0x7f800000u;
      amax = std::max(amax, std::fabs(v[i]));
    }
    return {amax, special == 0};
  }
  // codes[i] = clamp(round half to even(v[i] * inv), -127, 127).
  static void round(const float* v, int64_t k, float inv, int8_t* codes) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 scale = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (; i < k; i += 16) {
      const __mmask16 m = static_cast<__mmask16>(k - i >= 16 ? 0xffffu : (1u << (k - i)) - 1);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, v + i), scale);
      const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvt_roundps_epi32(
          x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
      _mm512_mask_cvtsepi32_storeu_epi8(codes + i, m, q);
    }
#endif
    for (; i < k; ++i)
      codes[i] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i] * inv), -127.f, 127.f));
  }
  static constexpr float kStep = 1.f / 127.f;  // int8.py's STEP
};

// Panel p's tail rows (K % 4 of them, stored as width x rem bytes) as one zero-padded quad row.
void tail_of(const int8_t* panel, int64_t k, int64_t width, int32_t* out) {
  const int64_t full = k / 4 * 4, rem = k - full;
  const int8_t* t = panel + full * width;
  for (int64_t c = 0; c < width; ++c) {
    int8_t q[4] = {0, 0, 0, 0};
    std::memcpy(q, t + c * rem, rem);
    std::memcpy(out + c, q, 4);
  }
}

// y = scales x (x @ w), w [K, N] in int8 panel order, on path `task` (a panel_task);
// tasks are (panel, chunk of rows), panel-major so a thread's consecutive tasks share a panel.
// `gated`: y [M, N / 2] = silu(x @ w's first N / 2 columns) * (x @ its last N / 2), (N / 2) %
// kPanel == 0: a task multiplies a gate panel and its up panel into two L1-sized buffers and
// writes their product, never the [M, N] one.
template <typename Task>
void matmul(ffi::ThreadPool& pool, Task task, const Quads& q, const int8_t* w, const float* ws,
            float* y, int64_t m, int64_t k, int64_t n, bool gated) {
  const int64_t kq = (k + 3) / 4, full = k / 4, out_n = gated ? n / 2 : n;
  const int64_t panels = (out_n + kPanel - 1) / kPanel, chunks = (m + kChunk - 1) / kChunk;
  // w's panel p (its tail padded into `tail`), prefetching `ahead` while it runs.
  auto panel = [&](int64_t p, int32_t* tail, Ahead ahead) {
    const int64_t width = std::min(kPanel, n - p * kPanel);
    const int8_t* at = w + p * kPanel * k;
    if (k % 4) tail_of(at, k, width, tail);
    return Panel{reinterpret_cast<const int32_t*>(at), k % 4 ? tail : nullptr, width,
                 ws + p * kPanel, ahead};
  };
  // The thread's next task's panel (+ `shift`: the up half's), unless it is this task's.
  auto ahead = [&](int64_t p, int64_t next, int64_t shift) {
    if (next < 0 || next / chunks == p || kPanel * k > kAheadMaxBytes) return Ahead{};
    const int64_t at = next / chunks + shift;
    return Ahead{reinterpret_cast<const char*>(w + at * kPanel * k),
                 std::min(kPanel, n - at * kPanel) * k};
  };
  parallel_for(pool, panels * chunks, [&](int64_t t, int64_t next) {
    const int64_t p = t / chunks, m0 = t % chunks * kChunk, rows = std::min(kChunk, m - m0);
    thread_local std::vector<int32_t> tail(kPanel), up_tail(kPanel);
    const Rows xr{q.x.data() + m0 * kq, kq, full, q.shift.data() + m0, q.scale.data() + m0};
    if (!gated)
      return task(xr, panel(p, tail.data(), ahead(p, next, 0)), y + m0 * n + p * kPanel, n, rows);
    thread_local std::vector<float> g(kChunk * kPanel), u(kChunk * kPanel);
    task(xr, panel(p, tail.data(), ahead(p, next, 0)), g.data(), kPanel, rows);
    task(xr, panel(p + panels, up_tail.data(), ahead(p, next, panels)), u.data(), kPanel, rows);
    for (int64_t r = 0; r < rows; ++r)
      gate(g.data() + r * kPanel, u.data() + r * kPanel, kPanel, y + (m0 + r) * out_n + p * kPanel);
  });
}

uint32_t usable_paths() {
#ifdef JAXPIPE_AMX_INT8
  if (!amx_permitted()) return kBuiltPaths & ~(1u << kAmxInt8);
#endif
  return kBuiltPaths;
}

using Task = void (*)(const Rows&, const Panel&, float*, int64_t, int64_t);

// `path`'s panel task (`path` < 0: the last this build has); null if it cannot run here.
Task task_of(int64_t path) {
  if (path < 0) path = 31 - __builtin_clz(usable_paths());
  if (path > 31 || !(usable_paths() >> path & 1u)) return nullptr;
  switch (path) {
    case kPortable: return portable::panel_task;
#ifdef __AVX2__
    case kAvx2: return ymm::panel_task<ymm::Avx2Dot>;
#endif
#ifdef __AVXVNNI__
    case kAvxVnni: return ymm::panel_task<ymm::AvxVnniDot>;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case kAvx512Vnni: return zmm::panel_task;
#endif
#ifdef JAXPIPE_AMX_INT8
    case kAmxInt8: return amx::panel_task;
#endif
    default: return nullptr;
  }
}

// x [M, K] s8 codes with xs [M] their scales, or f32 rows (xs [0]) quantized here.
ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> xs,
                          ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> ws,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                          bool gated, int64_t path) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = ws.dimensions(), yd = y->dimensions();
  const bool codes = x.element_type() == ffi::S8;
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] ||
      static_cast<int64_t>(xs.element_count()) != (codes ? xd[0] : 0) || sd[0] != wd[0] ||
      sd[1] != wd[2] || yd[0] != xd[0] || yd[1] != (gated ? wd[2] / 2 : wd[2]) ||
      layer.element_count() != 1 || (!codes && x.element_type() != ffi::F32))
    return ffi::Error::InvalidArgument(
        "int8_matmul: need x [M,K] s8 with xs [M] (or f32 with xs [0]), w [L,K,N] s8, "
        "ws [L,N], layer [], y [M,N] ([M,N/2] gated)");
  if (gated && wd[2] % (2 * kPanel) != 0)
    return ffi::Error::InvalidArgument("int8_matmul: gated needs N a multiple of 128");
  const Task task = task_of(path);
  if (task == nullptr)
    return ffi::Error::InvalidArgument("int8_matmul: this build has no path " +
                                       std::to_string(path));
  const int64_t k = wd[1], n = wd[2];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1);
  const int64_t m = xd[0];
  if (m == 0 || n == 0) return ffi::Error::Success();
  const auto* data = x.untyped_data();
  const Quads q = codes ? Quads(static_cast<const int8_t*>(data), xs.typed_data(), m, k)
                        : Quads(static_cast<const float*>(data), m, k, pool);
  matmul(pool, task, q, w.typed_data() + l * k * n, ws.typed_data() + l * n, y->typed_data(),
         m, k, n, gated);
  return ffi::Error::Success();
}

}  // namespace

// Bit i set: path i (Path above) is compiled in and runs here (-march=native; AMX permitted).
extern "C" uint32_t jaxpipe_int8_matmul_paths() { return usable_paths(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("gated")
                                  .Attr<int64_t>("path"));
