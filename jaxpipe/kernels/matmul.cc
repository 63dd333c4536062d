// y = bf16(x) @ w on the CPU, for the few-row (decode) case where XLA's dot is far below memory
// bandwidth:
//
//   x  [M, K]  float32, row-major contiguous; rounded to bf16 (nearest even) before the dot
//   w  [L, K, N]  bfloat16 (or its bits, uint16), row-major contiguous: a stack of L weights
//   layer  [] int32: which of them (clamped to [0, L)), read in place
//   y  [M, N]  float32: sum over k of bf16(x[m, k]) * w[layer, k, n], products exact, f32 sums
//
// Columns are split into one contiguous range per worker of XLA's intra-op thread pool, so each
// worker streams its own part of every weight row. A worker goes over K in blocks of kBlock
// rows (partial sums added into y), and inside a block a chunk of C = 16 * NV columns at a time
// for all M rows: a tile of up to R rows keeps its R x C sums in vector registers over the
// block's rows, so each weight comes from memory once per call (software-prefetched kPrefetch
// rows ahead) and, for M > R, again from L1/L2 for the next row tile. With avx512_bf16 two
// weight rows are interleaved in registers and multiplied by pairs of x (vdpbf16ps: 32
// multiply-adds per instruction; like XLA it rounds x to bf16 first, but it treats bf16
// denormals as zero); with plain AVX-512 weights are widened bf16 -> f32 by a 16-bit shift for
// f32 FMAs; otherwise a portable loop. The build's -march=native picks the path.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPrefetch = 16;  // weight rows to prefetch ahead in K
constexpr int64_t kBlock = 256;    // weight rows per K block (even)
constexpr int64_t kSerialWork = int64_t{1} << 16;  // below this many weights: no helpers

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float round_bf16(float f) {  // round to nearest even, as a float32; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    bits = (bits | 0x00400000u) & 0xffff0000u;
  else
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Weight rows k0 .. k1 - 1 of a K block (k0 even); add: y already holds the blocks before.
struct Rows {
  int64_t k0, k1;
  bool add;
};

struct Problem {
  const float* x;     // [M, K], already rounded to bf16
  const uint32_t* xp;  // [M, KP = (K + 1) / 2]: bf16 bits of x[m, 2j] (low), x[m, 2j + 1] (high)
  const uint16_t* w;  // [K, N]
  float* y;           // [M, N]
  int64_t m, k, n;
};

#ifdef __AVX512F__
// 16 bf16 -> 16 f32 (only the lanes in `mask` are read).
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y[lanes in mask] = v, or += v if add.
inline void store(float* y, __mmask16 mask, __m512 v, bool add) {
  if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, y));
  _mm512_mask_storeu_ps(y, mask, v);
}

// f(0), f(1), .., f(N - 1) with compile-time indices, so that GCC keeps arrays of vectors
// indexed by them in registers (it spills them when loops index them).
template <typename F, int... I>
__attribute__((always_inline)) inline void unroll(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__attribute__((always_inline)) inline void unroll(F&& f) {
  unroll(f, std::make_integer_sequence<int, N>{});
}

#ifdef __AVX512BF16__
// y's columns 32q .. 32q + 31 from the sums of dpbf16 over the unpacklo (lo) and unpackhi (hi)
// of two weight rows: lane 4l + j of lo holds column 8l + j, of hi column 8l + 4 + j.
inline __m512 columns_of(__m512 lo, __m512 hi, int half) {
  alignas(64) int32_t idx[16];
  for (int c = 0; c < 16; ++c) {
    const int l = 2 * half + c / 8, j = c % 8;
    idx[c] = j < 4 ? 4 * l + j : 16 + 4 * l + j - 4;
  }
  return _mm512_permutex2var_ps(lo, _mm512_load_si512(idx), hi);
}

// Tile sums acc [R][2P] (lo, hi per 32 columns) into (add: onto) y's rows 0 .. R - 1, ldy
// apart, the lanes in each 32-column mask.
template <int R, int P>
__attribute__((always_inline)) inline void store_pairs(const __m512 (&acc)[R][2 * P],
                                                       const __mmask32 (&mask)[P], float* y,
                                                       int64_t ldy, bool add) {
  unroll<R>([&](auto r) {
    unroll<P>([&](auto q) {
      float* out = y + r * ldy + 32 * q;
      const __m512 lo = acc[r][2 * q], hi = acc[r][2 * q + 1];
      store(out, static_cast<__mmask16>(mask[q]), columns_of(lo, hi, 0), add);
      store(out + 16, static_cast<__mmask16>(mask[q] >> 16), columns_of(lo, hi, 1), add);
    });
  });
}

// Rows m0 .. m0 + R - 1, columns n0 .. n0 + cols - 1 (cols <= 16 * NV, NV even) of y, over
// the K block's rows, with avx512_bf16 dot products of pairs along K: weight rows 2j and 2j + 1 are
// interleaved in registers (unpacklo/hi), so each instruction does 32 multiply-adds.
template <int R, int NV>
void tile(const Problem& p, int64_t m0, int64_t n0, int64_t cols, const Rows& kr) {
  static_assert(NV % 2 == 0, "pairs of 16-column vectors");
  constexpr int P = NV / 2;  // 32-column weight vectors per row
  __mmask32 mask[P];
  __m512 acc[R][NV];
  unroll<P>([&](auto q) {
    const int64_t left = std::clamp<int64_t>(cols - 32 * q, 0, 32);
    mask[q] = static_cast<__mmask32>(left == 32 ? ~uint32_t{0} : (uint32_t{1} << left) - 1);
  });
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm512_setzero_ps(); }); });
  const int64_t n = p.n, pairs = kr.k1 / 2, kp = (p.k + 1) / 2;
  const uint16_t* w = p.w + n0;
  const uint32_t* x = p.xp + m0 * kp;
  auto dot = [&](int64_t j, auto next) __attribute__((always_inline)) {
    __m512i lo[P], hi[P];
    unroll<P>([&](auto q) {
      const __m512i a = _mm512_maskz_loadu_epi16(mask[q], w + 2 * j * n + 32 * q);
      const __m512i b = next(q);
      lo[q] = _mm512_unpacklo_epi16(a, b);
      hi[q] = _mm512_unpackhi_epi16(a, b);
    });
    unroll<R>([&](auto r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[r * kp + j]);
      unroll<P>([&](auto q) {
        acc[r][2 * q] = _mm512_dpbf16_ps(acc[r][2 * q], (__m512bh)lo[q], xv);
        acc[r][2 * q + 1] = _mm512_dpbf16_ps(acc[r][2 * q + 1], (__m512bh)hi[q], xv);
      });
    });
  };
  auto step = [&](int64_t j) __attribute__((always_inline)) {
    dot(j, [&](int q) { return _mm512_maskz_loadu_epi16(mask[q], w + (2 * j + 1) * n + 32 * q); });
  };
  int64_t j = kr.k0 / 2;
  for (; 2 * j + kPrefetch + 1 < kr.k1; ++j) {  // and the chunk's rows kPrefetch ahead
    unroll<2 * P>([&](auto i) {  // row 2j + kPrefetch + i % 2, 64 bytes i / 2
      const uint16_t* row = w + (2 * j + kPrefetch + i % 2) * n;
      _mm_prefetch(reinterpret_cast<const char*>(row + 32 * (i / 2)), _MM_HINT_T0);
    });
    step(j);
  }
  for (; j < pairs; ++j) step(j);
  if (kr.k1 % 2) dot(pairs, [](int) { return _mm512_setzero_si512(); });  // row K: zeros
  store_pairs<R, P>(acc, mask, p.y + m0 * n + n0, n, kr.add);
}
#else
// Rows m0 .. m0 + R - 1, columns n0 .. n0 + cols - 1 (cols <= 16 * NV) of y, over the K
// block's rows.
template <int R, int NV>
void tile(const Problem& p, int64_t m0, int64_t n0, int64_t cols, const Rows& kr) {
  __mmask16 mask[NV];
  __m512 acc[R][NV];
  unroll<NV>([&](auto v) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>((uint32_t{1} << left) - 1);
    unroll<R>([&](auto r) { acc[r][v] = _mm512_setzero_ps(); });
  });
  const int64_t n = p.n, k_end = kr.k1, ldx = p.k;
  const uint16_t* w = p.w + n0;
  const float* x = p.x + m0 * ldx;
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    __m512 wv[NV];
    unroll<NV>([&](auto v) { wv[v] = load_bf16(w + k * n + 16 * v, mask[v]); });
    unroll<R>([&](auto r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      unroll<NV>([&](auto v) { acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]); });
    });
  };
  int64_t k = kr.k0;
  for (; k + kPrefetch < k_end; ++k) {  // and the chunk's row kPrefetch ahead: 32 * NV bytes
    unroll<(NV + 1) / 2>([&](auto v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetch) * n + 32 * v),
                   _MM_HINT_T0);
    });
    step(k);
  }
  for (; k < k_end; ++k) step(k);
  unroll<R>([&](auto r) {
    unroll<NV>([&](auto v) {
      store(p.y + (m0 + r) * n + n0 + 16 * v, mask[v], acc[r][v], kr.add);
    });
  });
}
#endif  // __AVX512BF16__
#else
template <int R, int NV>
void tile(const Problem& p, int64_t m0, int64_t n0, int64_t cols, const Rows& kr) {
  constexpr int C = 16 * NV;
  float acc[R][C] = {};
  for (int64_t k = kr.k0; k < kr.k1; ++k) {
    float wv[C] = {};
    for (int64_t c = 0; c < cols; ++c) wv[c] = bf16_to_f32(p.w[k * p.n + n0 + c]);
    for (int r = 0; r < R; ++r) {
      const float xv = p.x[(m0 + r) * p.k + k];
#pragma omp simd
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& y = p.y[(m0 + r) * p.n + n0 + c];
      y = kr.add ? y + acc[r][c] : acc[r][c];
    }
}
#endif

// Rows m0 .. m0 + rows - 1 (1 <= rows <= R) of one column chunk.
template <int R, int NV>
void tile_rows(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t cols,
               const Rows& kr) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1, NV>(p, m0, rows, n0, cols, kr);
  }
  tile<R, NV>(p, m0, n0, cols, kr);
}

// Columns n0 .. n1 - 1 of y for all M rows, a chunk of 16 * NV columns at a time, R rows per
// tile (R * NV accumulators + NV weight vectors fit the 32 vector registers).
template <int R, int NV>
void columns(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t k = 0; k < p.k; k += kBlock) {
    const Rows kr{k, std::min(k + kBlock, p.k), k > 0};
    for (int64_t n = n0; n < n1; n += 16 * NV) {
      const int64_t cols = std::min<int64_t>(16 * NV, n1 - n);
      for (int64_t m = 0; m < p.m; m += R)
        tile_rows<R, NV>(p, m, std::min<int64_t>(R, p.m - m), n, cols, kr);
    }
  }
}

// The chunk shape for M rows: wide chunks for one or two rows (longer contiguous reads of
// each weight row), taller tiles when there are more rows to share each weight load.
void columns_for(const Problem& p, int64_t n0, int64_t n1) {
  if (p.m <= 2)
    columns<2, 8>(p, n0, n1);
  else if (p.m == 3)
    columns<3, 6>(p, n0, n1);
  else
    columns<6, 4>(p, n0, n1);
}

// Shares tasks 0..n-1 between the calling thread and the pool; returns when all are done.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &fn]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      fn(i);
      state->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  // A helper that starts after all tasks are claimed touches only `state` (kept alive by
  // its shared_ptr), never `fn`, so returning before every helper has run is safe.
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([state, n, work]() {
      if (state->next.load() < n) work();
    });
  work();
  while (state->done.load() < n) std::this_thread::yield();
}

// y = bf16(x) @ w, columns split into one contiguous range (a multiple of 16 wide) per worker.
void matmul(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* y, int64_t m,
            int64_t k, int64_t n) {
  if (m == 0 || n == 0) return;
  if (k == 0) return std::fill(y, y + m * n, 0.f);
  const int64_t kp = (k + 1) / 2;
  std::vector<float> xb(x, x + m * k);  // [M, K]
  std::vector<uint32_t> xp(m * kp, 0);  // [M, KP]
  for (int64_t i = 0; i < m * k; ++i) {
    xb[i] = round_bf16(xb[i]);
    uint32_t bits;
    std::memcpy(&bits, &xb[i], sizeof bits);
    xp[i / k * kp + i % k / 2] |= (bits >> 16) << (16 * (i % k % 2));
  }
  const Problem p{xb.data(), xp.data(), w, y, m, k, n};
  const int64_t groups = (n + 15) / 16;
  const int64_t tasks = k * n < kSerialWork ? 1 : std::min<int64_t>(pool.num_threads(), groups);
  parallel_for(pool, std::max<int64_t>(tasks, 1), [&](int64_t t) {
    const int64_t g0 = groups * t / tasks, g1 = groups * (t + 1) / tasks;
    columns_for(p, g0 * 16, std::min(g1 * 16, n));
  });
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] != wd[1] ||
      yd[0] != xd[0] || yd[1] != wd[2] || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "bf16_matmul: need x [M,K], w [L,K,N], layer [] and y [M,N]");
  if (w.element_type() != ffi::BF16 && w.element_type() != ffi::U16)
    return ffi::Error::InvalidArgument("bf16_matmul: w must be bf16 or u16 (bf16 bits)");
  // Layer l's weight, read in place: slicing a stacked weight before a custom call costs XLA
  // a copy of it per call (a write and a second read of every weight).
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1);
  const auto* base = static_cast<const uint16_t*>(w.untyped_data()) + l * wd[1] * wd[2];
  matmul(pool, x.typed_data(), base, y->typed_data(), xd[0], xd[1], wd[2]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeBf16Matmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
