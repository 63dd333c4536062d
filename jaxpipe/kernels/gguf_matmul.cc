// y = x @ w^T on the CPU with w in GGUF's quantized blocks, as they are stored
// (gguf_matmul.py; the arithmetic in gguf_blocks.py):
//
//   x      [M, K]     float32 rows, quantized here per block of 32 as llama.cpp pairs with the
//                     format: q8_0 codes and f16 scale (q8_0, q4_0 weights), plus q8_1's
//                     f16(d * sum codes) (q4_1 weights); q8_k per 256 (q4_k, q6_k weights)
//   w      [L, N, R]  uint8: L stacked GGUF matrices of N rows (output columns), each row K / 32
//                     blocks of the format (R bytes), read in place at `layer`
//   layer  []         int32: which of the L (clamped to [0, L))
//   y      [M, N]     float32: per block an exact int32 sum of code products, then
//                     y += (dx dw) sumi (+ mw sx for q4_1), in f32 (llama.cpp's vec_dot);
//                     q4_k: per super-block exact sums of sc_j sumi_j and m_j xsum_j, then
//                     y += (dx d) isum - (dx dmin) msum; q6_k: y += (dx d) sum_i sc_i sumi_i
//                     (each 16 weights' int8 scale)
//
// Paths (the `path` attribute; `jaxpipe_gguf_matmul_paths` says which this build has):
//   0 portable     plain loops, any CPU
//   1 avx2         vpmaddubsw + vpmaddwd (u8 x s8 pairs into s16, then int32)
//   2 avx_vnni     vpdpbusd, VEX, 256-bit
//   3 avx512_vnni  vpdpbusd on 512-bit vectors
// Every format on every SIMD path, from kQuadRows rows:
// a task decodes its panel of kCols weight rows once into quad order (namespace quad: a
// vector is 8 or 16 columns' 4 codes, as the int8 kernel's panels) and multiplies it by all
// its rows in register tiles of rows x columns, one vpdpbusd a (row, 8 or 16 columns, 4
// k's), per-block int32 sums scaled into f32 accumulators, one output a lane (the k-quants:
// per sub-block sums times its scale, vpmulld, then per super-block). Fewer rows: blocks
// decoded in registers as they are read (q4's 16 nibble bytes become one 32-byte vector: low
// nibbles, codes 0..15, then high ones, 16..31; the 512-bit tile takes two blocks a vector,
// namespace zmm), one vector a (row, column, block) and a horizontal sum per output.
// The multiplies take u8 x s8. q4 codes are the u8 side as they are (0..15; q4_0's -8 comes
// off as 8 * x's codes); q8_0 weights go in as w + 128 (the VNNI paths; 128 * x's codes come
// off) or as |w| (u8, up to 128) with x carrying w's sign (vpsignb; x's codes are in
// [-127, 127]): a vpmaddubsw pair is then at most 2 x 128 x 127 = 32512, never saturated,
// and every sum is exact.
//
// A task is (a chunk of kCols output columns, a chunk of rows), over XLA's thread pool; the
// direct tiles' chunks are kChunk rows, a decoded panel's as many as keep every thread 4
// tasks (`rows_per_task`), so that a decode serves many rows.
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

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxpipe_cpu::parallel_for, jaxpipe_cpu::unroll;

constexpr int64_t kBlock = 32;
constexpr int64_t kCols = 64;   // output columns per task
constexpr int64_t kChunk = 48;  // rows per task
constexpr int64_t kQuadChunk = 384;  // rows per task at most, on a decoded panel
constexpr int64_t kQuadRows = 4;     // rows from which tasks decode their panel (quad::)
constexpr int64_t kQuadRowsK256 = 16;  // the same for q4_k and q6_k on the 256-bit paths

enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4 };
constexpr int64_t kBlockBytes[] = {34, 18, 20, 144, 210};
constexpr int64_t kBlockWeights[] = {32, 32, 32, 256, 256};
constexpr int64_t kSuper = 256;  // a k-quant super-block: 8 sub-blocks of kBlock

enum Path : int64_t { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };

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
    ;

inline float f16(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

inline float to_f16(float v) { return static_cast<float>(static_cast<_Float16>(v)); }

// x's rows as llama.cpp's q8_0 / q8_1 blocks: codes [M, K], and per (row, block) [M, B]: d
// (f16-rounded) and s = f16(d * sum of codes) (q8_1).
// `wide` (the 512-bit path) adds d and s as 8 lanes a block, [M, B, 8], so that one 64-byte
// load is a block pair's: d8 = d in all 8 lanes; s8 = s in lane 0, zeros after.
// q8_k (`kq`, for q4_k): d [M, K / 256] (f32, per super-block) and sum [M, K / 32] (each
// sub-block's code sum) instead.
struct Acts {
  int64_t k, blocks;
  std::vector<int8_t> codes;
  std::vector<float> d, s, d8, s8;
  std::vector<int32_t> sum, sum16;  // codes' sums per block of 32; per 16 (`halves`)
  Acts(int64_t m, int64_t k_, bool wide, bool kq, bool halves)
      : k(k_), blocks(k_ / kBlock), codes(m * k_), d(kq ? m * (k_ / kSuper) : m * blocks),
        s(kq ? 0 : m * blocks), d8(wide && !kq ? 8 * m * blocks : 0), s8(d8.size()),
        sum(m * blocks), sum16(halves ? m * (k_ / 16) : 0) {}
  // Row r as q8_k (gguf_blocks.quantize_rows_k, to the bit): per 256, v = the first value of
  // largest magnitude, iscale = -127 / v, codes = min(127, round half to even(iscale x)),
  // d = 1 / iscale (all 0 for a zero super-block).
  void quantize_k(const float* x, int64_t r) {
    const int64_t supers = k / kSuper;
    for (int64_t b = 0; b < supers; ++b) {
      const float* v = x + b * kSuper;
      int8_t* q = codes.data() + r * k + b * kSuper;
      float amax = 0.f, top = 0.f;
      for (int i = 0; i < kSuper; ++i)
        if (std::fabs(v[i]) > amax) amax = std::fabs(v[i]), top = v[i];
      int32_t* sums = sum.data() + r * blocks + b * (kSuper / kBlock);
      int32_t* sums16 = sum16.empty() ? nullptr : sum16.data() + (r * k + b * kSuper) / 16;
      if (amax == 0.f) {
        std::fill(q, q + kSuper, 0);
        std::fill(sums, sums + kSuper / kBlock, 0);
        if (sums16) std::fill(sums16, sums16 + kSuper / 16, 0);
        d[r * supers + b] = 0.f;
        continue;
      }
      float iscale = -127.f / top;
      asm volatile("" : "+x"(iscale));  // no reassociation into the products below
      for (int j = 0; j < 2 * kSuper / kBlock; ++j) {  // 16 codes each
        int32_t total = 0;
        for (int i = 16 * j; i < 16 * (j + 1); ++i) {
          q[i] = static_cast<int8_t>(std::min(127.f, std::nearbyint(iscale * v[i])));
          total += q[i];
        }
        if (sums16) sums16[j] = total;
        sums[j / 2] = j % 2 ? sums[j / 2] + total : total;
      }
      d[r * supers + b] = 1.f / iscale;
    }
  }
  // Row r's blocks (gguf_blocks.quantize_rows, to the bit): d = amax * f32(1 / 127),
  // codes = roundf(x * (1 / d)) (0 where d is 0), clamped to [-127, 127].
  void quantize(const float* x, int64_t r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + b * kBlock;
      int8_t* q = codes.data() + r * k + b * kBlock;
      float amax = 0.f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      float dd = amax * kStep;
      // A barrier: -ffast-math would rewrite 1 / (amax * kStep) as (1 / amax) * 127, off by
      // an ulp, and a code halfway between two integers then rounds the other way.
      asm volatile("" : "+x"(dd));
      const float inv = dd > 0.f ? 1.f / dd : 0.f;
      int32_t total = 0;
      for (int i = 0; i < kBlock; ++i) {
        const float u = v[i] * inv, t = std::trunc(u);
        const float rounded = std::fabs(u - t) >= 0.5f ? t + std::copysign(1.f, u) : t;
        q[i] = static_cast<int8_t>(std::clamp(rounded, -127.f, 127.f));
        total += q[i];
      }
      const int64_t at = r * blocks + b;
      d[at] = to_f16(dd);
      s[at] = to_f16(dd * static_cast<float>(total));
      sum[at] = total;
      if (!d8.empty()) {
        std::fill(d8.begin() + 8 * at, d8.begin() + 8 * at + 8, d[at]);
        s8[8 * at] = s[at];
      }
    }
  }
  static constexpr float kStep = 1.f / 127.f;  // gguf_blocks.STEP
};

// The task's view: rows' activations from row m0, the weight rows, the output.
struct Task {
  const Acts* a;
  int64_t m0;
  const uint8_t* w;  // the layer's [N, R] bytes
  int64_t rb;        // R: bytes per weight row
  float* y;          // y[m0, 0]
  int64_t ldy;
};

// A path's columns c0 .. c0 + cols - 1 over `rows` rows in tiles `Tile<R, C>::go(t, r0, c0)`
// of R rows and C columns: whole tiles, then the rows left in a tile of fewer rows (the
// compile-time R each has), then the last columns one at a time.
template <template <int, int> class Tile, int R, int C>
void tile_rows(const Task& t, int64_t r0, int64_t rows, int64_t c0) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<Tile, R - 1, C>(t, r0, rows, c0);
  }
  Tile<R, C>::go(t, r0, c0);
}

template <template <int, int> class Tile, int R, int C>
void run_tiles(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  int64_t c = c0;
  for (; c + C <= c0 + cols; c += C)
    for (int64_t r = 0; r < rows; r += R)
      tile_rows<Tile, R, C>(t, r, std::min<int64_t>(R, rows - r), c);
  for (; c < c0 + cols; ++c)
    for (int64_t r = 0; r < rows; r += R)
      tile_rows<Tile, R, 1>(t, r, std::min<int64_t>(R, rows - r), c);
}

namespace portable {

// Code i (0..31) of the block at p, as the dot multiplies it (q4_0: q - 8).
template <int F>
int32_t code(const uint8_t* p, int i) {
  if constexpr (F == kQ8_0) {
    int8_t q;
    std::memcpy(&q, p + 2 + i, 1);
    return q;
  }
  const uint8_t byte = p[(F == kQ4_1 ? 4 : 2) + i % 16];
  return (i < 16 ? byte & 15 : byte >> 4) - (F == kQ4_0 ? 8 : 0);
}

// Not vectorized: GCC 12 turns the q8_0 sum below into vpdpbusd with the signed codes as
// unsigned (wrong sums: found by tests/kernel_tests/test_gguf_matmul.py), and plain loops are
// this path's point.
template <int F>
__attribute__((optimize("no-tree-vectorize"))) void run(const Task& t, int64_t c0,
                                                        int64_t cols, int64_t rows) {
  const Acts& a = *t.a;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = t.m0 + r;
    for (int64_t c = c0; c < c0 + cols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const uint8_t* p = t.w + c * t.rb + b * kBlockBytes[F];
        const int8_t* xq = a.codes.data() + m * a.k + b * kBlock;
        int32_t sumi = 0;
        for (int i = 0; i < kBlock; ++i) sumi += code<F>(p, i) * int32_t{xq[i]};
        const int64_t at = m * a.blocks + b;
        float term = (a.d[at] * f16(p)) * static_cast<float>(sumi);
        if constexpr (F == kQ4_1) term += f16(p + 2) * a.s[at];
        acc += term;
      }
      t.y[r * t.ldy + c] = acc;
    }
  }
}

// q4_k super-block at p: its eight 6-bit scales and minimums (ggml's get_scale_min_k4).
inline void scales_k(const uint8_t* p, int32_t* sc, int32_t* mn) {
  const uint8_t* s = p + 4;
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

__attribute__((optimize("no-tree-vectorize"))) void run_k(const Task& t, int64_t c0,
                                                          int64_t cols, int64_t rows) {
  const Acts& a = *t.a;
  const int64_t supers = a.k / kSuper;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = t.m0 + r;
    for (int64_t c = c0; c < c0 + cols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < supers; ++b) {
        const uint8_t* p = t.w + c * t.rb + b * kBlockBytes[kQ4_K];
        const int8_t* xq = a.codes.data() + m * a.k + b * kSuper;
        int32_t sc[8], mn[8], isum = 0, msum = 0;
        scales_k(p, sc, mn);
        for (int j = 0; j < 8; ++j) {
          int32_t sumi = 0;
          for (int i = 0; i < kBlock; ++i) {
            const uint8_t byte = p[16 + 32 * (j / 2) + i];
            sumi += (j % 2 ? byte >> 4 : byte & 15) * int32_t{xq[kBlock * j + i]};
          }
          isum += sc[j] * sumi;
          msum += mn[j] * a.sum[m * a.blocks + b * 8 + j];
        }
        const float dx = a.d[m * supers + b];
        acc = acc - (dx * f16(p + 2)) * static_cast<float>(msum) +
              (dx * f16(p)) * static_cast<float>(isum);
      }
      t.y[r * t.ldy + c] = acc;
    }
  }
}

// q6_k code i (0..255, as q - 32) of the super-block at p (ggml's block_q6_K).
inline int32_t code_k6(const uint8_t* p, int i) {
  const int h = i / 128, u = i % 128 / 32, l = i % 32;
  const uint8_t lo = p[64 * h + l + 32 * (u % 2)], hi = p[128 + 32 * h + l];
  return ((u < 2 ? lo & 15 : lo >> 4) | (((hi >> (2 * u)) & 3) << 4)) - 32;
}

__attribute__((optimize("no-tree-vectorize"))) void run_k6(const Task& t, int64_t c0,
                                                           int64_t cols, int64_t rows) {
  const Acts& a = *t.a;
  const int64_t supers = a.k / kSuper;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = t.m0 + r;
    for (int64_t c = c0; c < c0 + cols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < supers; ++b) {
        const uint8_t* p = t.w + c * t.rb + b * kBlockBytes[kQ6_K];
        const int8_t* xq = a.codes.data() + m * a.k + b * kSuper;
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          int32_t sumi = 0;
          for (int i = 16 * j; i < 16 * j + 16; ++i) sumi += code_k6(p, i) * int32_t{xq[i]};
          isum += static_cast<int8_t>(p[192 + j]) * sumi;
        }
        acc += (a.d[m * supers + b] * f16(p + 208)) * static_cast<float>(isum);
      }
      t.y[r * t.ldy + c] = acc;
    }
  }
}

}  // namespace portable

#ifdef __AVX2__
namespace ymm {

// u8 x s8 -> 8 int32 lanes, each the sum of 4 products: avx2's pairs then pairs of pairs.
struct Avx2Dot {
  static constexpr int kRows = 4, kCols2 = 2;  // 8 accumulators of 16 registers
  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  // acc + the s16 pairs of u x s times sc (q4_k's sub-block scale; pairs <= 2 x 15 x 127)
  static __m256i scaled(__m256i acc, __m256i u, __m256i s, __m256i sc) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc));
  }
};

#ifdef __AVXVNNI__
struct AvxVnniDot {
  static constexpr int kRows = 4, kCols2 = 2;
  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
  }
  static __m256i scaled(__m256i acc, __m256i u, __m256i s, __m256i sc) {  // vpdpwssd
    return _mm256_dpwssd_avx_epi32(acc, _mm256_maddubs_epi16(u, s), sc);
  }
};
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// q4_k on the avx512_vnni path: the 256-bit tile (one sub-block a vector) with EVEX vpdpwssd
// and 32 registers (more rows a tile); the 512-bit block-pair tile is for the 32-blocks.
struct Avx512KDot {
  static constexpr int kRows = 4, kCols2 = 2;
  static __m256i scaled(__m256i acc, __m256i u, __m256i s, __m256i sc) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), sc);
  }
};
#endif


// A block's 32 codes as one vector (q4: 0..15, low nibbles then high).
template <int F>
inline __m256i codes(const uint8_t* p) {
  if constexpr (F == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (F == kQ4_1 ? 4 : 2)));
  const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
  return _mm256_set_m128i(hi, lo);
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// y[R rows, C columns at c0]: per block, each column's codes decoded once for all R rows.
template <typename Dot, int F, int R, int C>
void tile(const Task& t, int64_t r0, int64_t c0) {
  const Acts& a = *t.a;
  __m256 acc[R][C];
  unroll<R>([&](auto r) { unroll<C>([&](auto c) { acc[r][c] = _mm256_setzero_ps(); }); });
  const int8_t* x = a.codes.data() + (t.m0 + r0) * a.k;
  const int64_t at0 = (t.m0 + r0) * a.blocks;
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256i wv[C], ws[C];  // q8_0: |w| and w (whose sign goes on x)
    float dw[C], mw[C];
    unroll<C>([&](auto c) {
      const uint8_t* p = t.w + (c0 + c) * t.rb + b * kBlockBytes[F];
      wv[c] = ws[c] = codes<F>(p);
      if constexpr (F == kQ8_0) wv[c] = _mm256_abs_epi8(ws[c]);
      dw[c] = f16(p);
      if constexpr (F == kQ4_1) mw[c] = f16(p + 2);
    });
    unroll<R>([&](auto r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * a.k + b * kBlock));
      const int64_t at = at0 + r * a.blocks + b;
      const float dx = a.d[at];
      __m256i shift;  // q4_0: each lane's 8 x its 4 x codes (lane by lane, as zmm's)
      if constexpr (F == kQ4_0) shift = Dot::dot(_mm256_set1_epi8(8), xv);
      unroll<C>([&](auto c) {
        __m256i p;
        if constexpr (F == kQ8_0) {
          p = Dot::dot(wv[c], _mm256_sign_epi8(xv, ws[c]));
        } else {
          p = Dot::dot(wv[c], xv);
        }
        if constexpr (F == kQ4_0) p = _mm256_sub_epi32(p, shift);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx * dw[c]), acc[r][c]);
        if constexpr (F == kQ4_1)
          acc[r][c] = _mm256_add_ps(acc[r][c], _mm256_setr_ps(mw[c] * a.s[at], 0, 0, 0, 0, 0, 0, 0));
      });
    });
  }
  unroll<R>([&](auto r) {
    unroll<C>([&](auto c) { t.y[(r0 + r) * t.ldy + c0 + c] = hsum(acc[r][c]); });
  });
}

// q4_k: y[R rows, C columns at c0]. Per super-block, each lane's sum over the 8 sub-blocks of
// sc_j x its products stays an exact int32 (<= 32 x 15 x 127 x 63 < 2^24, so its conversion
// is exact too), then one scale; the minimums' integer sum goes in scalar.
template <typename Dot, int R, int C>
void tile_k(const Task& t, int64_t r0, int64_t c0) {
  const Acts& a = *t.a;
  const int64_t supers = a.k / kSuper;
  __m256 acc[R][C];
  unroll<R>([&](auto r) { unroll<C>([&](auto c) { acc[r][c] = _mm256_setzero_ps(); }); });
  for (int64_t b = 0; b < supers; ++b) {
    int32_t sc[C][8], mn[C][8];
    const uint8_t* p[C];
    unroll<C>([&](auto c) {
      p[c] = t.w + (c0 + c) * t.rb + b * kBlockBytes[kQ4_K];
      portable::scales_k(p[c], sc[c], mn[c]);
    });
    __m256i isum[R][C];
    unroll<R>([&](auto r) { unroll<C>([&](auto c) { isum[r][c] = _mm256_setzero_si256(); }); });
    for (int q = 0; q < 4; ++q) {  // 32 bytes: sub-blocks 2q (low nibbles) and 2q + 1
      __m256i lo[C], hi[C];
      unroll<C>([&](auto c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[c] + 16 + 32 * q));
        lo[c] = _mm256_and_si256(raw, _mm256_set1_epi8(15));
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
      });
      unroll<R>([&](auto r) {
        const int8_t* x = a.codes.data() + (t.m0 + r0 + r) * a.k + b * kSuper + 64 * q;
        const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
        unroll<C>([&](auto c) {
          isum[r][c] = Dot::scaled(isum[r][c], lo[c], xlo,
                                   _mm256_set1_epi16(static_cast<int16_t>(sc[c][2 * q])));
          isum[r][c] = Dot::scaled(isum[r][c], hi[c], xhi,
                                   _mm256_set1_epi16(static_cast<int16_t>(sc[c][2 * q + 1])));
        });
      });
    }
    unroll<R>([&](auto r) {
      const int64_t m = t.m0 + r0 + r;
      const float dx = a.d[m * supers + b];
      const int32_t* xs = a.sum.data() + m * a.blocks + b * 8;
      unroll<C>([&](auto c) {
        int32_t msum = 0;
        for (int j = 0; j < 8; ++j) msum += mn[c][j] * xs[j];
        const float low = -(dx * f16(p[c] + 2)) * static_cast<float>(msum);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][c]), _mm256_set1_ps(dx * f16(p[c])),
                                    _mm256_add_ps(acc[r][c], _mm256_setr_ps(low, 0, 0, 0, 0, 0, 0, 0)));
      });
    });
  }
  unroll<R>([&](auto r) {
    unroll<C>([&](auto c) { t.y[(r0 + r) * t.ldy + c0 + c] = hsum(acc[r][c]); });
  });
}

// q6_k: y[R rows, C columns at c0]. A 32-weight chunk's codes q - 32 go in as |q - 32| (u8,
// <= 32) with x carrying their sign (vpsignb), so the s16 pairs are exact signed sums with no
// offset to take off; each 16's scale multiplies its pairs (vpmaddwd / vpdpwssd).
template <typename Dot, int R, int C>
void tile_k6(const Task& t, int64_t r0, int64_t c0) {
  const Acts& a = *t.a;
  const int64_t supers = a.k / kSuper;
  __m256 acc[R][C];
  unroll<R>([&](auto r) { unroll<C>([&](auto c) { acc[r][c] = _mm256_setzero_ps(); }); });
  const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* p[C];
    unroll<C>([&](auto c) { p[c] = t.w + (c0 + c) * t.rb + b * kBlockBytes[kQ6_K]; });
    __m256i isum[R][C];
    unroll<R>([&](auto r) { unroll<C>([&](auto c) { isum[r][c] = _mm256_setzero_si256(); }); });
    for (int ch = 0; ch < 8; ++ch) {  // 32 weights: half ch / 4, u = ch % 4
      const int h = ch / 4, u = ch % 4;
      __m256i wq[C], sc[C];
      unroll<C>([&](auto c) {
        const uint8_t* q = p[c];
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * h + 32 * (u % 2)));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(u < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        // bits 2u, 2u + 1 of qh to bits 4, 5
        const __m256i hb = u == 0 ? _mm256_slli_epi16(qh, 4) : u == 1 ? _mm256_slli_epi16(qh, 2)
                           : u == 2 ? qh : _mm256_srli_epi16(qh, 2);
        wq[c] = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(hb, top2)), _mm256_set1_epi8(32));
        const int8_t* s = reinterpret_cast<const int8_t*>(q + 192 + 2 * ch);
        sc[c] = _mm256_set_m128i(_mm_set1_epi16(s[1]), _mm_set1_epi16(s[0]));
      });
      unroll<R>([&](auto r) {
        const int8_t* x = a.codes.data() + (t.m0 + r0 + r) * a.k + b * kSuper + 32 * ch;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        unroll<C>([&](auto c) {
          isum[r][c] = Dot::scaled(isum[r][c], _mm256_abs_epi8(wq[c]),
                                   _mm256_sign_epi8(xv, wq[c]), sc[c]);
        });
      });
    }
    unroll<R>([&](auto r) {
      const float dx = a.d[(t.m0 + r0 + r) * supers + b];
      unroll<C>([&](auto c) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][c]),
                                    _mm256_set1_ps(dx * f16(p[c] + 208)), acc[r][c]);
      });
    });
  }
  unroll<R>([&](auto r) {
    unroll<C>([&](auto c) { t.y[(r0 + r) * t.ldy + c0 + c] = hsum(acc[r][c]); });
  });
}

// Each tile kind of a path `Dot` as a `run_tiles` Tile: the 32-weight formats' (F), q4_k's
// and q6_k's.
template <typename Dot, int F>
struct Blocks {
  template <int R, int C>
  struct Tile {
    static void go(const Task& t, int64_t r0, int64_t c0) { tile<Dot, F, R, C>(t, r0, c0); }
  };
};
template <typename Dot>
struct Q4K {
  template <int R, int C>
  struct Tile {
    static void go(const Task& t, int64_t r0, int64_t c0) { tile_k<Dot, R, C>(t, r0, c0); }
  };
};
template <typename Dot>
struct Q6K {
  template <int R, int C>
  struct Tile {
    static void go(const Task& t, int64_t r0, int64_t c0) { tile_k6<Dot, R, C>(t, r0, c0); }
  };
};

template <typename Dot, int F>
void run(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_tiles<Blocks<Dot, F>::template Tile, Dot::kRows, Dot::kCols2>(t, c0, cols, rows);
}
template <typename Dot>
void run_k(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_tiles<Q4K<Dot>::template Tile, Dot::kRows, Dot::kCols2>(t, c0, cols, rows);
}
template <typename Dot>
void run_k6(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_tiles<Q6K<Dot>::template Tile, Dot::kRows, Dot::kCols2>(t, c0, cols, rows);
}

}  // namespace ymm
#endif

#ifdef __AVX2__
// The 32-weight formats on the SIMD paths, as the int8 kernel multiplies: a task first decodes
// its panel of the file's rows (kCols columns, every block; `Panel`) into "quad order", the
// int8 kernel's panel order: for block b and quad j (its codes 4j .. 4j + 3), the panel's
// columns side by side, one int32 lane each. A vector of weights is then 8 or 16 columns'
// quads, the operand of one vpdpbusd whose other operand is one x row's quad broadcast, so
// each int32 lane sums one (row, column)'s block over its 8 quads without a horizontal add,
// and the f32 step (cvt, x dx dw, + mw sx for q4_1) runs once per block on 8 or 16 outputs.
// The decode (nibbles unpacked, an 8 x 8 transpose of quads per 8 columns) is done once per
// task and used by all its rows.
//
// The u8 operand is the weight: q4 codes as they are (0..15), q8_0's w xor 0x80 = w + 128
// (`kFlip`); the offset comes off each (row, block)'s integer sum before it is converted, as
// its initial value -off x (sum of x's block codes) (off = 128 for flipped q8_0, 8 for q4_0's
// q - 8, 0 for q4_1): every block's sum is then exactly llama.cpp's sumi. avx2's vpmaddubsw
// would saturate on 255 x 127 pairs, so there q8_0 stays signed and goes in as |w| with x
// carrying w's sign (vpsignb), as the 256-bit 32-weight tile does.
namespace quad {

// One task's panel in quad order: q [blocks, 8, width] int32 lanes (4 codes each), d (and m
// for q4_1) [blocks, width] f32; width = the columns rounded up to 16, zeros past them.
// q4_k (blocks = its sub-blocks of 32): d and m hold each super-block's d and dmin
// [blocks / 8, width], sc each sub-block's scale [blocks, width] and mp its minimums in
// pairs of s16 (m_2i, m_2i+1) [blocks / 2, width]. q6_k: d each super-block's d [blocks / 8,
// width], sc each 16 weights' scale [2 blocks, width].
struct Panel {
  int64_t width = 0, blocks = 0;
  std::vector<int32_t> q, sc, mp;
  std::vector<float> d, m;
  void reset(int64_t w, int64_t b) {
    width = w, blocks = b;
    q.resize(b * 8 * w);
    d.resize(b * w);
    m.resize(b * w);
  }
};

// A task over its decoded panel: `Decode` its columns once, then slices of two vectors
// (2 kVec columns) in tiles `Tile<R, NV>::go(t, pn, r0, g, cols)` of R rows (kR, the rows
// left in a tile of fewer) and NV vectors (1 for a last slice of kVec columns or fewer).
template <template <int, int> class Tile, int R, int kVec>
void panel_rows(const Task& t, const Panel& pn, int64_t r0, int64_t rows, int64_t g, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<Tile, R - 1, kVec>(t, pn, r0, rows, g, cols);
  }
  if (cols > kVec)
    Tile<R, 2>::go(t, pn, r0, g, cols);
  else
    Tile<R, 1>::go(t, pn, r0, g, cols);
}

template <void (*Decode)(const Task&, int64_t, int64_t, Panel&), template <int, int> class Tile,
          int kR, int kVec>
void run_panel(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  thread_local Panel pn;
  Decode(t, c0, cols, pn);
  const Task at{t.a, t.m0, t.w, t.rb, t.y + c0, t.ldy};
  for (int64_t g = 0; g < cols; g += 2 * kVec)
    for (int64_t r = 0; r < rows; r += kR)
      panel_rows<Tile, kR, kVec>(at, pn, r, std::min<int64_t>(kR, rows - r), g,
                                 std::min<int64_t>(2 * kVec, cols - g));
}

// a[0..3]'s 4 dwords (per 128-bit lane) transposed: a[j] lane dword i -> out[i] lane dword j.
inline void transpose4(const __m256i* a, __m256i* out) {
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The f16 at byte `at` (0 or 2) of each of v's 8 int32 lanes, as 8 floats.
inline __m256 halves(__m256i v, int at) {
  const __m256i pick = at == 0 ? _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
                                                  -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1,
                                                  -1, -1, -1, -1)
                               : _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1,
                                                  -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1,
                                                  -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0b1000);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

alignas(64) constexpr uint8_t kZeroBlock[64] = {};  // the columns past the panel's last

// Columns c0 .. c0 + cols - 1 (cols <= 8) of `w` (rows rb bytes), every block, into the
// panel's lanes g .. g + 7: vector j of column pair (c, c + 4) holds quads 0..3 (or 4..7) of
// both in its two halves; one transpose4 then gives quad i of all 8 columns in order.
template <int F, bool kFlip>
void decode8(const uint8_t* w, int64_t rb, int64_t cols, Panel& pn, int64_t g) {
  constexpr int64_t bb = kBlockBytes[F], off = F == kQ8_0 ? 2 : F == kQ4_1 ? 4 : 2;
  const uint8_t* row[8];
  for (int c = 0; c < 8; ++c) row[c] = c < cols ? w + c * rb : nullptr;
  const int64_t width = pn.width;
  for (int64_t b = 0; b < pn.blocks; ++b) {
    const uint8_t* p[8];
    for (int c = 0; c < 8; ++c) p[c] = row[c] ? row[c] + b * bb : kZeroBlock;
    __m256i lo[4], hi[4], out[4];
    for (int j = 0; j < 4; ++j) {
      const auto* a = reinterpret_cast<const __m128i*>(p[j] + off);
      const auto* z = reinterpret_cast<const __m128i*>(p[j + 4] + off);
      if constexpr (F == kQ8_0) {
        lo[j] = _mm256_set_m128i(_mm_loadu_si128(z), _mm_loadu_si128(a));
        hi[j] = _mm256_set_m128i(_mm_loadu_si128(z + 1), _mm_loadu_si128(a + 1));
        if constexpr (kFlip) {
          lo[j] = _mm256_xor_si256(lo[j], _mm256_set1_epi8(-128));
          hi[j] = _mm256_xor_si256(hi[j], _mm256_set1_epi8(-128));
        }
      } else {
        const __m256i v = _mm256_set_m128i(_mm_loadu_si128(z), _mm_loadu_si128(a));
        lo[j] = _mm256_and_si256(v, _mm256_set1_epi8(15));
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
      }
    }
    int32_t* q = pn.q.data() + b * 8 * width + g;
    transpose4(lo, out);
    for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * width), out[i]);
    transpose4(hi, out);
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (4 + i) * width), out[i]);
    // The 8 columns' headers (d, and m for q4_1: f16s at bytes 0 and 2), converted together.
    int32_t h[8];
    for (int c = 0; c < 8; ++c) std::memcpy(h + c, p[c], 4);
    const __m256i head = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
    _mm256_storeu_ps(pn.d.data() + b * width + g, halves(head, 0));
    if constexpr (F == kQ4_1) _mm256_storeu_ps(pn.m.data() + b * width + g, halves(head, 2));
  }
}

// Columns c0 .. c0 + cols - 1 of the task's weights into `pn` (cols <= kCols).
template <int F, bool kFlip>
void decode(const Task& t, int64_t c0, int64_t cols, Panel& pn) {
  pn.reset((cols + 15) / 16 * 16, t.a->blocks);
  for (int64_t g = 0; g < pn.width; g += 8)
    decode8<F, kFlip>(t.w + (c0 + g) * t.rb, t.rb, std::clamp<int64_t>(cols - g, 0, 8), pn, g);
}

// What comes off a (row, block)'s integer sum: off x its code sum.
template <int F, bool kFlip>
constexpr int32_t kOff = F == kQ4_0 ? 8 : F == kQ8_0 && kFlip ? 128 : 0;

// y[R rows from r0, 8 NV columns from g] over the decoded panel (the 256-bit paths).
template <typename Dot, int F, int R, int NV>
void tile(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
  constexpr bool flip = Dot::kFlip;
  const Acts& a = *t.a;
  const int64_t width = pn.width, row0 = t.m0 + r0;
  __m256 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm256_setzero_ps(); }); });
  for (int64_t b = 0; b < pn.blocks; ++b) {
    __m256i s[R][NV];
    unroll<R>([&](auto r) {
      const __m256i init = _mm256_set1_epi32(-kOff<F, flip> * a.sum[(row0 + r) * a.blocks + b]);
      unroll<NV>([&](auto v) { s[r][v] = init; });
    });
    const int32_t* q = pn.q.data() + b * 8 * width + g;
    unroll<8>([&](auto j) {
      __m256i wv[NV];
      unroll<NV>([&](auto v) {
        wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * width + 8 * v));
      });
      unroll<R>([&](auto r) {
        int32_t xq;
        std::memcpy(&xq, a.codes.data() + (row0 + r) * a.k + b * kBlock + 4 * j, 4);
        const __m256i xv = _mm256_set1_epi32(xq);
        unroll<NV>([&](auto v) {
          if constexpr (F == kQ8_0 && !flip)
            s[r][v] = Dot::add(s[r][v], _mm256_abs_epi8(wv[v]), _mm256_sign_epi8(xv, wv[v]));
          else
            s[r][v] = Dot::add(s[r][v], wv[v], xv);
        });
      });
    });
    __m256 dw[NV], mw[NV];
    unroll<NV>([&](auto v) {
      dw[v] = _mm256_loadu_ps(pn.d.data() + b * width + g + 8 * v);
      if constexpr (F == kQ4_1) mw[v] = _mm256_loadu_ps(pn.m.data() + b * width + g + 8 * v);
    });
    unroll<R>([&](auto r) {
      const int64_t at = (row0 + r) * a.blocks + b;
      const __m256 dx = _mm256_set1_ps(a.d[at]);
      unroll<NV>([&](auto v) {
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][v]), _mm256_mul_ps(dw[v], dx), acc[r][v]);
        if constexpr (F == kQ4_1) acc[r][v] = _mm256_fmadd_ps(mw[v], _mm256_set1_ps(a.s[at]), acc[r][v]);
      });
    });
  }
  const __m256i last = jaxpipe_cpu::lanes(cols - 8 * (NV - 1));
  unroll<R>([&](auto r) {
    float* dst = t.y + (r0 + r) * t.ldy + g;
    unroll<NV>([&](auto v) {
      if (v + 1 < NV || cols >= 8 * NV)
        _mm256_storeu_ps(dst + 8 * v, acc[r][v]);
      else
        _mm256_maskstore_ps(dst + 8 * v, last, acc[r][v]);
    });
  });
}

// u8 x s8 -> int32 sums of 4 (the two 256-bit paths).
struct Avx2Dot {
  static constexpr int kRows = 2;
  static constexpr bool kFlip = false;
  static __m256i add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
};
#ifdef __AVXVNNI__
struct AvxVnniDot {
  static constexpr int kRows = 3;
  static constexpr bool kFlip = true;
  static __m256i add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
};
#endif

template <typename Dot, int F>
struct BlockTiles {
  template <int R, int NV>
  struct T {
    static void go(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
      tile<Dot, F, R, NV>(t, pn, r0, g, cols);
    }
  };
};

// A task on a 256-bit path: 16-column slices of 8-lane vectors.
template <typename Dot, int F>
void run(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_panel<decode<F, Dot::kFlip>, BlockTiles<Dot, F>::template T, Dot::kRows, 8>(t, c0, cols, rows);
}

// q4_k's 8 columns at w (cols valid) into lanes g .. g + 7: per super-block, each 32 nibble
// bytes are sub-blocks 2i (low nibbles) and 2i + 1 (high), both laid out as decode8's; the
// scales and minimums through ggml's get_scale_min_k4 (portable::scales_k).
inline void decode8_k(const uint8_t* w, int64_t rb, int64_t cols, Panel& pn, int64_t g) {
  constexpr int64_t bb = kBlockBytes[kQ4_K];
  static const std::vector<uint8_t> zero(bb, 0);
  const int64_t width = pn.width, supers = pn.blocks / 8;
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* p[8];
    for (int c = 0; c < 8; ++c) p[c] = c < cols ? w + c * rb + b * bb : zero.data();
    for (int i = 0; i < 4; ++i) {
      __m256i lo[2][4], hi[2][4], out[4];  // [sub-block 2i or 2i + 1][column pair]
      for (int j = 0; j < 4; ++j) {
        const auto* a = reinterpret_cast<const __m128i*>(p[j] + 16 + 32 * i);
        const auto* z = reinterpret_cast<const __m128i*>(p[j + 4] + 16 + 32 * i);
        const __m256i v0 = _mm256_set_m128i(_mm_loadu_si128(z), _mm_loadu_si128(a));
        const __m256i v1 = _mm256_set_m128i(_mm_loadu_si128(z + 1), _mm_loadu_si128(a + 1));
        const __m256i low4 = _mm256_set1_epi8(15);
        lo[0][j] = _mm256_and_si256(v0, low4);
        hi[0][j] = _mm256_and_si256(v1, low4);
        lo[1][j] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
        hi[1][j] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
      }
      for (int h = 0; h < 2; ++h) {
        int32_t* q = pn.q.data() + (8 * b + 2 * i + h) * 8 * width + g;
        transpose4(lo[h], out);
        for (int u = 0; u < 4; ++u)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + u * width), out[u]);
        transpose4(hi[h], out);
        for (int u = 0; u < 4; ++u)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (4 + u) * width), out[u]);
      }
    }
    for (int c = 0; c < 8; ++c) {
      int32_t sc[8], mn[8];
      portable::scales_k(p[c], sc, mn);
      for (int j = 0; j < 8; ++j) pn.sc[(8 * b + j) * width + g + c] = sc[j];
      for (int j = 0; j < 4; ++j)
        pn.mp[(4 * b + j) * width + g + c] = mn[2 * j] | (mn[2 * j + 1] << 16);
      pn.d[b * width + g + c] = f16(p[c]);
      pn.m[b * width + g + c] = f16(p[c] + 2);
    }
  }
}

inline void decode_k(const Task& t, int64_t c0, int64_t cols, Panel& pn) {
  pn.reset((cols + 15) / 16 * 16, t.a->blocks);
  pn.sc.resize(pn.blocks * pn.width);
  pn.mp.resize(pn.blocks / 2 * pn.width);
  for (int64_t g = 0; g < pn.width; g += 8)
    decode8_k(t.w + (c0 + g) * t.rb, t.rb, std::clamp<int64_t>(cols - g, 0, 8), pn, g);
}

// q4_k on the 256-bit paths: y[R rows from r0, 8 NV columns from g], tile512_k's arithmetic
// (below) on 8 lanes, the minimums' s16 pairs through vpmaddwd.
template <typename Dot, int R, int NV>
void tile_k(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
  const Acts& a = *t.a;
  const int64_t width = pn.width, row0 = t.m0 + r0, supers = pn.blocks / 8;
  __m256 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm256_setzero_ps(); }); });
  for (int64_t b = 0; b < supers; ++b) {
    __m256i isum[R][NV], msum[R][NV];
    unroll<R>([&](auto r) { unroll<NV>([&](auto v) { isum[r][v] = _mm256_setzero_si256(); }); });
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t sb = 8 * b + j;
      const int32_t* q = pn.q.data() + sb * 8 * width + g;
      __m256i s[R][NV];
      unroll<R>([&](auto r) { unroll<NV>([&](auto v) { s[r][v] = _mm256_setzero_si256(); }); });
      unroll<8>([&](auto u) {
        __m256i wv[NV];
        unroll<NV>([&](auto v) {
          wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + u * width + 8 * v));
        });
        unroll<R>([&](auto r) {
          int32_t xq;
          std::memcpy(&xq, a.codes.data() + (row0 + r) * a.k + sb * kBlock + 4 * u, 4);
          const __m256i xv = _mm256_set1_epi32(xq);
          unroll<NV>([&](auto v) { s[r][v] = Dot::add(s[r][v], wv[v], xv); });
        });
      });
      unroll<NV>([&](auto v) {
        const __m256i sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn.sc.data() + sb * width + g + 8 * v));
        unroll<R>([&](auto r) {
          isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_mullo_epi32(s[r][v], sc));
        });
      });
    }
    unroll<R>([&](auto r) { unroll<NV>([&](auto v) { msum[r][v] = _mm256_setzero_si256(); }); });
    for (int64_t j = 0; j < 4; ++j) {
      __m256i mp[NV];
      unroll<NV>([&](auto v) {
        mp[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn.mp.data() + (4 * b + j) * width + g + 8 * v));
      });
      unroll<R>([&](auto r) {
        const int32_t* xs = a.sum.data() + (row0 + r) * a.blocks + 8 * b + 2 * j;
        const uint32_t pair = (static_cast<uint32_t>(xs[0]) & 0xffffu) | static_cast<uint32_t>(xs[1]) << 16;
        const __m256i xp = _mm256_set1_epi32(static_cast<int32_t>(pair));
        unroll<NV>([&](auto v) {
          msum[r][v] = _mm256_add_epi32(msum[r][v], _mm256_madd_epi16(mp[v], xp));
        });
      });
    }
    unroll<NV>([&](auto v) {
      const __m256 d = _mm256_loadu_ps(pn.d.data() + b * width + g + 8 * v);
      const __m256 dmin = _mm256_loadu_ps(pn.m.data() + b * width + g + 8 * v);
      unroll<R>([&](auto r) {
        const __m256 dx = _mm256_set1_ps(a.d[(row0 + r) * supers + b]);
        acc[r][v] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r][v]), _mm256_mul_ps(dx, dmin), acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][v]), _mm256_mul_ps(dx, d), acc[r][v]);
      });
    });
  }
  const __m256i last = jaxpipe_cpu::lanes(cols - 8 * (NV - 1));
  unroll<R>([&](auto r) {
    float* dst = t.y + (r0 + r) * t.ldy + g;
    unroll<NV>([&](auto v) {
      if (v + 1 < NV || cols >= 8 * NV)
        _mm256_storeu_ps(dst + 8 * v, acc[r][v]);
      else
        _mm256_maskstore_ps(dst + 8 * v, last, acc[r][v]);
    });
  });
}

template <typename Dot>
struct K4Tiles {
  template <int R, int NV>
  struct T {
    static void go(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
      tile_k<Dot, R, NV>(t, pn, r0, g, cols);
    }
  };
};

template <typename Dot>
void run_k(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_panel<decode_k, K4Tiles<Dot>::template T, Dot::kRows, 8>(t, c0, cols, rows);
}

// q6_k's 8 columns at w (cols valid) into lanes g .. g + 7: each 32 weights' codes q (0..63,
// stored; the 32 comes off as 32 x's codes per 16) as ymm::tile_k6 assembles them, then
// laid out as decode8's; sc each 16's scale [16 per super-block, width], d [supers, width].
inline void decode8_k6(const uint8_t* w, int64_t rb, int64_t cols, Panel& pn, int64_t g) {
  constexpr int64_t bb = kBlockBytes[kQ6_K];
  static const std::vector<uint8_t> zero(bb, 0);
  const int64_t width = pn.width, supers = pn.blocks / 8;
  const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* p[8];
    for (int c = 0; c < 8; ++c) p[c] = c < cols ? w + c * rb + b * bb : zero.data();
    for (int ch = 0; ch < 8; ++ch) {  // 32 weights: half ch / 4, u = ch % 4
      const int h = ch / 4, u = ch % 4;
      __m256i code[8], lo[4], hi[4], out[4];
      for (int c = 0; c < 8; ++c) {
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[c] + 64 * h + 32 * (u % 2)));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[c] + 128 + 32 * h));
        const __m256i low = _mm256_and_si256(u < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        const __m256i hb = u == 0 ? _mm256_slli_epi16(qh, 4) : u == 1 ? _mm256_slli_epi16(qh, 2)
                           : u == 2 ? qh : _mm256_srli_epi16(qh, 2);
        code[c] = _mm256_or_si256(low, _mm256_and_si256(hb, top2));
      }
      for (int j = 0; j < 4; ++j) {  // column pair (j, j + 4), as decode8's
        lo[j] = _mm256_permute2x128_si256(code[j], code[j + 4], 0x20);
        hi[j] = _mm256_permute2x128_si256(code[j], code[j + 4], 0x31);
      }
      int32_t* q = pn.q.data() + (8 * b + ch) * 8 * width + g;
      transpose4(lo, out);
      for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * width), out[i]);
      transpose4(hi, out);
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (4 + i) * width), out[i]);
    }
    for (int c = 0; c < 8; ++c) {
      const auto* sc = reinterpret_cast<const int8_t*>(p[c] + 192);
      for (int j = 0; j < 16; ++j) pn.sc[(16 * b + j) * width + g + c] = sc[j];
      pn.d[b * width + g + c] = f16(p[c] + 208);
    }
  }
}

inline void decode_k6(const Task& t, int64_t c0, int64_t cols, Panel& pn) {
  pn.reset((cols + 15) / 16 * 16, t.a->blocks);
  pn.sc.resize(2 * pn.blocks * pn.width);
  for (int64_t g = 0; g < pn.width; g += 8)
    decode8_k6(t.w + (c0 + g) * t.rb, t.rb, std::clamp<int64_t>(cols - g, 0, 8), pn, g);
}

// q6_k on the 256-bit paths: y[R rows from r0, 8 NV columns from g], tile512_k6's arithmetic
// (below) on 8 lanes. Dot's u8 x s8 pairs are at most 2 x 63 x 127, never saturated.
template <typename Dot, int R, int NV>
void tile_k6(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
  const Acts& a = *t.a;
  const int64_t width = pn.width, row0 = t.m0 + r0, supers = pn.blocks / 8, k16 = a.k / 16;
  __m256 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm256_setzero_ps(); }); });
  for (int64_t b = 0; b < supers; ++b) {
    __m256i isum[R][NV];
    unroll<R>([&](auto r) { unroll<NV>([&](auto v) { isum[r][v] = _mm256_setzero_si256(); }); });
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t h = 16 * b + j;
      const int32_t* q = pn.q.data() + ((8 * b + j / 2) * 8 + 4 * (j % 2)) * width + g;
      __m256i s[R][NV];
      unroll<R>([&](auto r) {
        const __m256i init = _mm256_set1_epi32(-32 * a.sum16[(row0 + r) * k16 + h]);
        unroll<NV>([&](auto v) { s[r][v] = init; });
      });
      unroll<4>([&](auto u) {
        __m256i wv[NV];
        unroll<NV>([&](auto v) {
          wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + u * width + 8 * v));
        });
        unroll<R>([&](auto r) {
          int32_t xq;
          std::memcpy(&xq, a.codes.data() + (row0 + r) * a.k + 16 * h + 4 * u, 4);
          const __m256i xv = _mm256_set1_epi32(xq);
          unroll<NV>([&](auto v) { s[r][v] = Dot::add(s[r][v], wv[v], xv); });
        });
      });
      unroll<NV>([&](auto v) {
        const __m256i sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn.sc.data() + h * width + g + 8 * v));
        unroll<R>([&](auto r) {
          isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_mullo_epi32(s[r][v], sc));
        });
      });
    }
    unroll<NV>([&](auto v) {
      const __m256 d = _mm256_loadu_ps(pn.d.data() + b * width + g + 8 * v);
      unroll<R>([&](auto r) {
        const __m256 dx = _mm256_set1_ps(a.d[(row0 + r) * supers + b]);
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][v]), _mm256_mul_ps(dx, d), acc[r][v]);
      });
    });
  }
  const __m256i last = jaxpipe_cpu::lanes(cols - 8 * (NV - 1));
  unroll<R>([&](auto r) {
    float* dst = t.y + (r0 + r) * t.ldy + g;
    unroll<NV>([&](auto v) {
      if (v + 1 < NV || cols >= 8 * NV)
        _mm256_storeu_ps(dst + 8 * v, acc[r][v]);
      else
        _mm256_maskstore_ps(dst + 8 * v, last, acc[r][v]);
    });
  });
}

template <typename Dot>
struct K6Tiles {
  template <int R, int NV>
  struct T {
    static void go(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
      tile_k6<Dot, R, NV>(t, pn, r0, g, cols);
    }
  };
};

template <typename Dot>
void run_k6(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_panel<decode_k6, K6Tiles<Dot>::template T, Dot::kRows, 8>(t, c0, cols, rows);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The 512-bit path: y[R rows from r0, 16 NV columns from g].
template <int F, int R, int NV>
void tile512(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
  const Acts& a = *t.a;
  const int64_t width = pn.width, row0 = t.m0 + r0;
  __m512 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm512_setzero_ps(); }); });
  for (int64_t b = 0; b < pn.blocks; ++b) {
    __m512i s[R][NV];
    unroll<R>([&](auto r) {
      const __m512i init = _mm512_set1_epi32(-kOff<F, true> * a.sum[(row0 + r) * a.blocks + b]);
      unroll<NV>([&](auto v) { s[r][v] = init; });
    });
    const int32_t* q = pn.q.data() + b * 8 * width + g;
    unroll<8>([&](auto j) {
      __m512i wv[NV];
      unroll<NV>([&](auto v) { wv[v] = _mm512_loadu_si512(q + j * width + 16 * v); });
      unroll<R>([&](auto r) {
        int32_t xq;
        std::memcpy(&xq, a.codes.data() + (row0 + r) * a.k + b * kBlock + 4 * j, 4);
        const __m512i xv = _mm512_set1_epi32(xq);
        unroll<NV>([&](auto v) { s[r][v] = _mm512_dpbusd_epi32(s[r][v], wv[v], xv); });
      });
    });
    __m512 dw[NV], mw[NV];
    unroll<NV>([&](auto v) {
      dw[v] = _mm512_loadu_ps(pn.d.data() + b * width + g + 16 * v);
      if constexpr (F == kQ4_1) mw[v] = _mm512_loadu_ps(pn.m.data() + b * width + g + 16 * v);
    });
    unroll<R>([&](auto r) {
      const int64_t at = (row0 + r) * a.blocks + b;
      const __m512 dx = _mm512_set1_ps(a.d[at]);
      unroll<NV>([&](auto v) {
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][v]), _mm512_mul_ps(dw[v], dx), acc[r][v]);
        if constexpr (F == kQ4_1) acc[r][v] = _mm512_fmadd_ps(mw[v], _mm512_set1_ps(a.s[at]), acc[r][v]);
      });
    });
  }
  const int64_t tail = cols - 16 * (NV - 1);
  const __mmask16 last = static_cast<__mmask16>(tail >= 16 ? 0xffffu : (1u << tail) - 1);
  unroll<R>([&](auto r) {
    float* dst = t.y + (r0 + r) * t.ldy + g;
    unroll<NV>([&](auto v) {
      _mm512_mask_storeu_ps(dst + 16 * v, v + 1 < NV ? static_cast<__mmask16>(0xffffu) : last,
                            acc[r][v]);
    });
  });
}

constexpr int kRows512 = 6;

template <int F>
struct Tiles512 {
  template <int R, int NV>
  struct T {
    static void go(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
      tile512<F, R, NV>(t, pn, r0, g, cols);
    }
  };
};

template <int F>
void run512(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_panel<decode<F, true>, Tiles512<F>::template T, kRows512, 16>(t, c0, cols, rows);
}

// q4_k on the 512-bit path: y[R rows from r0, 16 NV columns from g]. Per super-block the
// exact integers of the reference: isum = sum_j sc_j sumi_j (each sub-block's dpbusd sums
// times its column's scale, vpmulld) and msum = sum_j m_j xsum_j (s16 pairs, vpdpwssd);
// then y += (dx d) isum - (dx dmin) msum, per lane.
template <int R, int NV>
void tile512_k(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
  const Acts& a = *t.a;
  const int64_t width = pn.width, row0 = t.m0 + r0, supers = pn.blocks / 8;
  __m512 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm512_setzero_ps(); }); });
  for (int64_t b = 0; b < supers; ++b) {
    __m512i isum[R][NV], msum[R][NV];
    unroll<R>([&](auto r) { unroll<NV>([&](auto v) { isum[r][v] = _mm512_setzero_si512(); }); });
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t sb = 8 * b + j;
      const int32_t* q = pn.q.data() + sb * 8 * width + g;
      __m512i s[R][NV];
      unroll<R>([&](auto r) { unroll<NV>([&](auto v) { s[r][v] = _mm512_setzero_si512(); }); });
      unroll<8>([&](auto u) {
        __m512i wv[NV];
        unroll<NV>([&](auto v) { wv[v] = _mm512_loadu_si512(q + u * width + 16 * v); });
        unroll<R>([&](auto r) {
          int32_t xq;
          std::memcpy(&xq, a.codes.data() + (row0 + r) * a.k + sb * kBlock + 4 * u, 4);
          const __m512i xv = _mm512_set1_epi32(xq);
          unroll<NV>([&](auto v) { s[r][v] = _mm512_dpbusd_epi32(s[r][v], wv[v], xv); });
        });
      });
      unroll<NV>([&](auto v) {
        const __m512i sc = _mm512_loadu_si512(pn.sc.data() + sb * width + g + 16 * v);
        unroll<R>([&](auto r) {
          isum[r][v] = _mm512_add_epi32(isum[r][v], _mm512_mullo_epi32(s[r][v], sc));
        });
      });
    }
    unroll<R>([&](auto r) { unroll<NV>([&](auto v) { msum[r][v] = _mm512_setzero_si512(); }); });
    for (int64_t j = 0; j < 4; ++j) {
      __m512i mp[NV];
      unroll<NV>([&](auto v) { mp[v] = _mm512_loadu_si512(pn.mp.data() + (4 * b + j) * width + g + 16 * v); });
      unroll<R>([&](auto r) {
        const int32_t* xs = a.sum.data() + (row0 + r) * a.blocks + 8 * b + 2 * j;
        const uint32_t pair = (static_cast<uint32_t>(xs[0]) & 0xffffu) | static_cast<uint32_t>(xs[1]) << 16;
        const __m512i xp = _mm512_set1_epi32(static_cast<int32_t>(pair));
        unroll<NV>([&](auto v) { msum[r][v] = _mm512_dpwssd_epi32(msum[r][v], mp[v], xp); });
      });
    }
    unroll<NV>([&](auto v) {
      const __m512 d = _mm512_loadu_ps(pn.d.data() + b * width + g + 16 * v);
      const __m512 dmin = _mm512_loadu_ps(pn.m.data() + b * width + g + 16 * v);
      unroll<R>([&](auto r) {
        const __m512 dx = _mm512_set1_ps(a.d[(row0 + r) * supers + b]);
        acc[r][v] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[r][v]), _mm512_mul_ps(dx, dmin), acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), _mm512_mul_ps(dx, d), acc[r][v]);
      });
    });
  }
  const int64_t tail = cols - 16 * (NV - 1);
  const __mmask16 last = static_cast<__mmask16>(tail >= 16 ? 0xffffu : (1u << tail) - 1);
  unroll<R>([&](auto r) {
    float* dst = t.y + (r0 + r) * t.ldy + g;
    unroll<NV>([&](auto v) {
      _mm512_mask_storeu_ps(dst + 16 * v, v + 1 < NV ? static_cast<__mmask16>(0xffffu) : last,
                            acc[r][v]);
    });
  });
}

// q6_k on the 512-bit path: y[R rows from r0, 16 NV columns from g]. Per 16 weights the
// dpbusd sums of q x x, less 32 x's sum (q - 32, exactly), times the column's scale into
// isum (vpmulld); per super-block y += (dx d) isum, as ymm::tile_k6.
template <int R, int NV>
void tile512_k6(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
  const Acts& a = *t.a;
  const int64_t width = pn.width, row0 = t.m0 + r0, supers = pn.blocks / 8, k16 = a.k / 16;
  __m512 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm512_setzero_ps(); }); });
  for (int64_t b = 0; b < supers; ++b) {
    __m512i isum[R][NV];
    unroll<R>([&](auto r) { unroll<NV>([&](auto v) { isum[r][v] = _mm512_setzero_si512(); }); });
    for (int64_t j = 0; j < 16; ++j) {  // the 16 weights 16 j ..: quads 4 (j % 2) .. of 32-block j / 2
      const int64_t h = 16 * b + j;
      const int32_t* q = pn.q.data() + ((8 * b + j / 2) * 8 + 4 * (j % 2)) * width + g;
      __m512i s[R][NV];
      unroll<R>([&](auto r) {
        const __m512i init = _mm512_set1_epi32(-32 * a.sum16[(row0 + r) * k16 + h]);
        unroll<NV>([&](auto v) { s[r][v] = init; });
      });
      unroll<4>([&](auto u) {
        __m512i wv[NV];
        unroll<NV>([&](auto v) { wv[v] = _mm512_loadu_si512(q + u * width + 16 * v); });
        unroll<R>([&](auto r) {
          int32_t xq;
          std::memcpy(&xq, a.codes.data() + (row0 + r) * a.k + 16 * h + 4 * u, 4);
          const __m512i xv = _mm512_set1_epi32(xq);
          unroll<NV>([&](auto v) { s[r][v] = _mm512_dpbusd_epi32(s[r][v], wv[v], xv); });
        });
      });
      unroll<NV>([&](auto v) {
        const __m512i sc = _mm512_loadu_si512(pn.sc.data() + h * width + g + 16 * v);
        unroll<R>([&](auto r) {
          isum[r][v] = _mm512_add_epi32(isum[r][v], _mm512_mullo_epi32(s[r][v], sc));
        });
      });
    }
    unroll<NV>([&](auto v) {
      const __m512 d = _mm512_loadu_ps(pn.d.data() + b * width + g + 16 * v);
      unroll<R>([&](auto r) {
        const __m512 dx = _mm512_set1_ps(a.d[(row0 + r) * supers + b]);
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), _mm512_mul_ps(dx, d), acc[r][v]);
      });
    });
  }
  const int64_t tail = cols - 16 * (NV - 1);
  const __mmask16 last = static_cast<__mmask16>(tail >= 16 ? 0xffffu : (1u << tail) - 1);
  unroll<R>([&](auto r) {
    float* dst = t.y + (r0 + r) * t.ldy + g;
    unroll<NV>([&](auto v) {
      _mm512_mask_storeu_ps(dst + 16 * v, v + 1 < NV ? static_cast<__mmask16>(0xffffu) : last,
                            acc[r][v]);
    });
  });
}

constexpr int kRows512K = 4;

// q4_k's and q6_k's tiles on the 512-bit path as run_panel's Tiles.
template <int R, int NV>
struct K4Tiles512 {
  static void go(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
    tile512_k<R, NV>(t, pn, r0, g, cols);
  }
};
template <int R, int NV>
struct K6Tiles512 {
  static void go(const Task& t, const Panel& pn, int64_t r0, int64_t g, int64_t cols) {
    tile512_k6<R, NV>(t, pn, r0, g, cols);
  }
};

// A q4_k (q6_k) task on the 512-bit path: 32-column slices of 16-lane vectors.
void run512_k(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_panel<decode_k, K4Tiles512, kRows512K, 16>(t, c0, cols, rows);
}
void run512_k6(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_panel<decode_k6, K6Tiles512, kRows512K, 16>(t, c0, cols, rows);
}
#endif

}  // namespace quad
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 512-bit vpdpbusd, two blocks a vector: lanes 0-7 hold block b's sums, 8-15 block b + 1's,
// so each scale vector is [b's x 8, b + 1's x 8]. AVX-512 has no vpsignb, so q8_0 weights go
// in as w xor 0x80 = w + 128 (u8) and 128 * x's codes come off, as q4_0's 8 * x does, lane by
// lane (one vpdpbusd of 128s or 8s by x per row, shared by the columns): every lane's int32 is
// then its own 4 products' sum, small, so its conversion and scaling round as the magnitudes
// of the products, not of a shifted sum. An odd last block runs as a pair, its second half 0.
namespace zmm {

constexpr int kRows = 6, kCols2 = 2;

// Blocks b and b + 1 (`both` false: b only, zeros after) of the row at p: codes as the u8
// operand, 64 bytes.
template <int F>
inline __m512i codes2(const uint8_t* p, bool both) {
  constexpr int64_t bb = kBlockBytes[F];
  if constexpr (F == kQ8_0) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m256i hi = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + bb + 2))
                            : _mm256_set1_epi8(-128);  // 0 after the flip
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_xor_si512(w, _mm512_set1_epi8(-128));
  }
  constexpr int64_t off = F == kQ4_1 ? 4 : 2;
  const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + off));
  const __m128i q1 =
      both ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + bb + off)) : _mm_setzero_si128();
  const __m256i q = _mm256_set_m128i(q1, q0);
  const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi8(15));
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(15));
  // [lo b, lo b+1, hi b, hi b+1] -> [lo b, hi b, lo b+1, hi b+1]: each block's 32 codes in order
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

inline __m512 pair(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

template <int F, int R, int C>
void tile(const Task& t, int64_t r0, int64_t c0) {
  const Acts& a = *t.a;
  constexpr int64_t bb = kBlockBytes[F];
  __m512 acc[R][C];
  unroll<R>([&](auto r) { unroll<C>([&](auto c) { acc[r][c] = _mm512_setzero_ps(); }); });
  const int64_t row0 = t.m0 + r0;
  for (int64_t b = 0; b < a.blocks; b += 2) {
    const bool both = b + 1 < a.blocks;
    const __mmask64 xmask = both ? ~0ull : 0xffffffffull;
    const __mmask16 smask = both ? 0xffff : 0x00ff;
    __m512i wv[C];
    __m512 dw[C], mw[C];
    unroll<C>([&](auto c) {
      const uint8_t* p = t.w + (c0 + c) * t.rb + b * bb;
      wv[c] = codes2<F>(p, both);
      dw[c] = pair(f16(p), both ? f16(p + bb) : 0.f);
      if constexpr (F == kQ4_1) mw[c] = pair(f16(p + 2), both ? f16(p + bb + 2) : 0.f);
    });
    unroll<R>([&](auto r) {
      const int64_t at = (row0 + r) * a.blocks + b;
      const __m512i xv = _mm512_maskz_loadu_epi8(xmask, a.codes.data() + (row0 + r) * a.k + b * kBlock);
      const __m512 dx = _mm512_maskz_loadu_ps(smask, a.d8.data() + 8 * at);
      __m512i shift = _mm512_setzero_si512();  // each lane's 128 or 8 x its 4 x codes
      if constexpr (F != kQ4_1)
        shift = _mm512_dpbusd_epi32(shift, _mm512_set1_epi8(F == kQ8_0 ? -128 : 8), xv);
      __m512 xs;
      if constexpr (F == kQ4_1) xs = _mm512_maskz_loadu_ps(smask, a.s8.data() + 8 * at);
      unroll<C>([&](auto c) {
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[c], xv);
        if constexpr (F != kQ4_1) p = _mm512_sub_epi32(p, shift);
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), dw[c]), dx, acc[r][c]);
        if constexpr (F == kQ4_1) acc[r][c] = _mm512_fmadd_ps(mw[c], xs, acc[r][c]);
      });
    });
  }
  unroll<R>([&](auto r) {
    unroll<C>([&](auto c) {
      t.y[(r0 + r) * t.ldy + c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
    });
  });
}

template <int F>
struct Blocks {
  template <int R, int C>
  struct Tile {
    static void go(const Task& t, int64_t r0, int64_t c0) { tile<F, R, C>(t, r0, c0); }
  };
};

template <int F>
void run(const Task& t, int64_t c0, int64_t cols, int64_t rows) {
  run_tiles<Blocks<F>::template Tile, kRows, kCols2>(t, c0, cols, rows);
}

}  // namespace zmm
#endif

using Run = void (*)(const Task&, int64_t, int64_t, int64_t);

template <int F>
Run run_of(int64_t path, bool direct) {
  switch (path) {
    case kPortable: return portable::run<F>;
#ifdef __AVX2__
    case kAvx2: return direct ? ymm::run<ymm::Avx2Dot, F> : quad::run<quad::Avx2Dot, F>;
#endif
#ifdef __AVXVNNI__
    case kAvxVnni: return direct ? ymm::run<ymm::AvxVnniDot, F> : quad::run<quad::AvxVnniDot, F>;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case kAvx512Vnni: return direct ? zmm::run<F> : quad::run512<F>;
#endif
    default: return nullptr;
  }
}

Run run_k_of(int64_t path, bool direct) {
  switch (path) {
    case kPortable: return portable::run_k;
#ifdef __AVX2__
    case kAvx2: return direct ? ymm::run_k<ymm::Avx2Dot> : quad::run_k<quad::Avx2Dot>;
#endif
#ifdef __AVXVNNI__
    case kAvxVnni: return direct ? ymm::run_k<ymm::AvxVnniDot> : quad::run_k<quad::AvxVnniDot>;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    case kAvx512Vnni: return direct ? ymm::run_k<ymm::Avx512KDot> : quad::run512_k;
#endif
    default: return nullptr;
  }
}

Run run_k6_of(int64_t path, bool direct) {
  switch (path) {
    case kPortable: return portable::run_k6;
#ifdef __AVX2__
    case kAvx2: return direct ? ymm::run_k6<ymm::Avx2Dot> : quad::run_k6<quad::Avx2Dot>;
#endif
#ifdef __AVXVNNI__
    case kAvxVnni: return direct ? ymm::run_k6<ymm::AvxVnniDot> : quad::run_k6<quad::AvxVnniDot>;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    case kAvx512Vnni: return direct ? ymm::run_k6<ymm::Avx512KDot> : quad::run512_k6;
#endif
    default: return nullptr;
  }
}

// `path`'s routine for `format` (`path` < 0: the last this build has); null if none here.
// `direct`: the tiles that read the blocks in place (where `decodes` says no: too few rows for
// a panel's decode to cost less than its rows' multiplies save).
Run run_of(int64_t format, int64_t path, bool direct) {
  if (path > 31 || !(kBuiltPaths >> path & 1u)) return nullptr;
  switch (format) {
    case kQ8_0: return run_of<kQ8_0>(path, direct);
    case kQ4_0: return run_of<kQ4_0>(path, direct);
    case kQ4_1: return run_of<kQ4_1>(path, direct);
    case kQ4_K: return run_k_of(path, direct);
    case kQ6_K: return run_k6_of(path, direct);
    default: return nullptr;
  }
}

// Whether a call of `m` rows decodes its tasks' panels: on every SIMD path, from kQuadRows
// rows (the k-quants on the 256-bit paths from kQuadRowsK256, where their decode costs more).
bool decodes(int64_t format, int64_t path, int64_t m) {
  if (path == kPortable) return false;
  const bool k_quant = format == kQ4_K || format == kQ6_K;
  return m >= (k_quant && path != kAvx512Vnni ? kQuadRowsK256 : kQuadRows);
}

// Rows per task: kChunk, or for a task that decodes its panel first (`quad`) as many as
// keep 4 tasks a thread (a panel's decode is then shared by more rows), at most kQuadChunk.
int64_t rows_per_task(int64_t m, int64_t col_tasks, int64_t threads, bool quad) {
  if (!quad) return kChunk;
  int64_t chunk = kQuadChunk;
  while (chunk > kChunk && col_tasks * ((m + chunk - 1) / chunk) < 4 * std::max<int64_t>(threads, 1))
    chunk /= 2;
  return chunk;
}

ffi::Error GgufMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                          int64_t format, int64_t path) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (format < 0 || format > kQ6_K)
    return ffi::Error::InvalidArgument("gguf_matmul: unknown format " + std::to_string(format));
  const int64_t bb = kBlockBytes[format];
  const int64_t per = kBlockWeights[format];
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] % per != 0 ||
      wd[2] != xd[1] / per * bb || yd[0] != xd[0] || yd[1] != wd[1] ||
      layer.element_count() != 1 || wd[0] < 1)
    return ffi::Error::InvalidArgument(
        "gguf_matmul: need x [M,K] f32 (K a multiple of the block), w [L,N,K/block*bytes] u8, "
        "layer [], "
        "y [M,N]");
  if (path < 0) path = 31 - __builtin_clz(kBuiltPaths);
  const bool quad = decodes(format, path, xd[0]);
  const Run run = run_of(format, path, !quad);
  if (run == nullptr)
    return ffi::Error::InvalidArgument("gguf_matmul: this build has no path " +
                                       std::to_string(path));
  const int64_t m = xd[0], k = xd[1], n = wd[1], rb = wd[2];
  if (m == 0 || n == 0) return ffi::Error::Success();
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1);
  const bool kq = format == kQ4_K || format == kQ6_K;
  Acts acts(m, k, path == kAvx512Vnni || (path < 0 && (kBuiltPaths >> kAvx512Vnni & 1u)), kq,
            format == kQ6_K && quad);
  const float* xf = x.typed_data();
  constexpr int64_t kRowBlock = 16, kParallel = 1 << 16;
  auto quantize = [&](int64_t i) {
    for (int64_t r = i * kRowBlock; r < std::min(m, (i + 1) * kRowBlock); ++r)
      kq ? acts.quantize_k(xf + r * k, r) : acts.quantize(xf + r * k, r);
  };
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  if (m * k < kParallel)
    for (int64_t i = 0; i < row_blocks; ++i) quantize(i);
  else
    parallel_for(pool, row_blocks, quantize);
  const uint8_t* wl = w.typed_data() + l * n * rb;
  const int64_t col_tasks = (n + kCols - 1) / kCols;
  const int64_t chunk =
      rows_per_task(m, col_tasks, pool.num_threads(), quad);
  const int64_t chunks = (m + chunk - 1) / chunk;
  float* out = y->typed_data();
  parallel_for(pool, col_tasks * chunks, [&](int64_t i) {
    const int64_t c0 = i / chunks * kCols, m0 = i % chunks * chunk;
    const Task t{&acts, m0, wl, rb, out + m0 * n, n};
    run(t, c0, std::min(kCols, n - c0), std::min(chunk, m - m0));
  });
  return ffi::Error::Success();
}

}  // namespace

// Bit i set: path i (Path above) is compiled in (-march=native).
extern "C" uint32_t jaxpipe_gguf_matmul_paths() { return kBuiltPaths; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeGgufMatmul, GgufMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("path"));
