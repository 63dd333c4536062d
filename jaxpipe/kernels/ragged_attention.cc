// Attention of ragged query spans on the CPU: each row (sequence) of a step contributes a span
// of consecutive query tokens (a prefill chunk, or one token for decode) that attends, causally,
// over the row's keys and values, which live in a paged pool and are found through a block table.
//
//   q       [T, H, D]             float32: the step's query tokens
//   k,v     [L, NB, Hkv, BS, D]   float32, or bfloat16 (or its bits, uint16): L layers of a pool
//                                 of NB blocks of BS tokens
//   table   [R, MB]               int32: row r's position t: k[layer, table[r, t / BS], h, t % BS]
//   q_start [R]                   int32: row r's queries are tokens q_start[r] .. + q_len[r] - 1
//   q_len   [R]                   int32: its span's length (0 = idle row)
//   kv_len  [R]                   int32: its keys, span included (written by the caller before)
//   layer   []                    int32: which of the L layers to read (a runtime value)
//   window  []                    int32: sliding window (a runtime value; <= 0: none)
//   out     [T, H, D]             float32
//   attributes scale (> 0; 0: 1 / sqrt(D)) and softcap (<= 0: none), float32
//
// Query i of row r's span sits at position p = kv_len - q_len + i and attends over keys
// lo .. p, lo = max(0, p - window + 1) with a window, else 0 (HF's sliding window: the last
// `window` keys, itself included). Its scores are scale * q.k, then softcap * tanh(score /
// softcap) with a softcap (Gemma 2), before the softmax. Tokens in no span get zeros.
// Out-of-range inputs are never read out of bounds: kv_len is clamped to [0, MB * BS], q_len
// to [0, kv_len]; a span's tokens outside [0, T) are skipped; a query stops before the first
// block it needs (lo's block .. p's) whose table entry is outside [0, NB) (zeros if that is
// lo's block); the layer is clamped to [0, L).
//
// A task is (query tile, kv head): up to kTile consecutive queries of one span and the G = H /
// Hkv query heads of one kv head, so each K/V block is read once for G * kTile queries. Two
// passes over the tile's keys, from its first query's window start (the portable code: from
// that block's start) to its last query's position (scores, then the probability-weighted sum
// of values): a block wholly before the first query's window start is never read, nor its
// table entry looked at, whatever it holds (a scheduler may free and reuse such blocks), and
// neither is a block whose entry is outside [0, NB); keys of a query's causal future inside
// the tile, or before its own window start, are scored and then get probability 0. Tasks,
// heaviest first, are shared out over XLA's intra-op thread pool. With a bf16 cache, q and the
// probabilities are rounded to bf16 before their dots, as the XLA reference
// (`decoder.decode_attention`) does; accumulation is float32.
//
// Paths (the `path` attribute, `jaxpipe_attention_paths`; -1: the last built that takes the
// call). With a bf16 (u16) pool, D = 64, 128 or 256 and avx512_bf16 ("avx512_bf16", `fast::`):
// vdpbf16ps products of bf16 pairs, keys in vector lanes for a decode task, the tile's query
// vectors in lanes for a tile of several queries (see there); `bench_attention.py`
// on SmolLM2's heads: decode 32 rows x 512 keys 1.11 -> 0.79 ms (timed in turns with the XLA
// path; 0.27 ms back to back, K and V in L3), a 4 x 256-query prefill after 256 keys
// 8.05 -> 2.36 ms. Out of cache a decode call reads K and V at 23-27 GB/s (the f32 path
// 17-18): rows are prefetched 32 positions ahead, a row's lines at a time as rows are used
// (whole blocks prefetched at once two blocks ahead ran at 14-15 GB/s). The same pools on
// AVX2 + FMA ("avx2"): decode tasks in `avx2::`, tiles of several queries on the portable
// code; it also takes int8 pools (kernels/kv_int8.py) of those head dims, each row's codes
// widened to f32 8 at a time, its scale applied once a row (to the key's score, the value's
// probability), q and the probabilities kept f32 as the portable path keeps them; on the
// avx512_bf16 path (with avx512_vnni) an int8 pool's decode rows run int16 products instead
// (`avx2::vnni`, vpdpwssd: q and the probabilities times the value scales quantized per head
// to int16; decode 256 rows x 2048 keys 18.6-20.1 -> 13.9-14.4 ms a layer, against a bf16
// pool's 21.2-24.2), and its tiles of several queries bf16 products of the codes and of q and
// the probabilities split in two bf16 parts each (`fast::attend_int8`; on an AMD EPYC family
// 25, SmolLM2's heads, 1.37-1.47x the portable code's speed). With amx_bf16 ("amx",
// `fast::attend_amx`): avx512_bf16's, but a bf16 pool's tiles of several queries run their
// two products on AMX tiles (tdpbf16ps), keys read from the pool as A tiles in place; on an
// Intel Xeon model 207 (amx_bf16) a 512-query chunk after 1536 keys 19.45 -> 10.70 ms a
// layer, 4 x 256 after 256 8.14 -> 3.73. Otherwise ("portable": f32 pools, other head dims,
// or asked for) f32 code: a decode task does G dots per key; a tile of several queries scores
// 16 keys at a time against a transposed copy and, for a compile-time D, sums values with its
// outputs held in registers. Every path honours windows, soft caps and scales.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
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
using jaxpipe_cpu::parallel_for;
#ifdef JAXPIPE_AMX
using jaxpipe_cpu::amx_configure, jaxpipe_cpu::amx_permitted;
#endif
#ifdef __AVX2__
using jaxpipe_cpu::lanes;
#endif

namespace {

constexpr int64_t kTile = 16;  // query positions per task

// f(0), .., f(N - 1) with compile-time indices, so GCC keeps arrays of vectors indexed by them
// in registers.
template <typename F, int... I>
__attribute__((always_inline)) inline void unroll(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__attribute__((always_inline)) inline void unroll(F&& f) {
  unroll(f, std::make_integer_sequence<int, N>{});
}

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float round_bf16(float f) {  // round to nearest even, as a float32
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void load_row(const float* src, float* dst, int64_t d) {
  std::memcpy(dst, src, d * sizeof(float));
}

inline void load_row(const uint16_t* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_f32(src[i]);
}

// An int8 cache's row (kernels/kv_int8.py): d codes, then its scale's bf16 bits (low byte,
// high byte); the vector is codes * scale, dequantized here as the row is read.
constexpr int64_t kScaleBytes = 2;

inline float row_scale(const int8_t* row, int64_t d) {
  uint16_t bits;
  std::memcpy(&bits, row + d, sizeof bits);  // little-endian: low byte first
  return bf16_to_f32(bits);
}

inline void load_row(const int8_t* src, float* dst, int64_t d) {
  const float scale = row_scale(src, d);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = float(src[i]) * scale;
}

// Elements of one stored row of head dim d in a pool of T: d, or d codes and a scale (int8).
template <typename T>
constexpr int64_t row_width(int64_t d) {
  return std::is_same_v<T, int8_t> ? d + kScaleBytes : d;
}

struct Shape {
  int64_t tokens, heads, kv_heads, dim;  // T, H, Hkv, D
  int64_t layers, blocks, block_size;    // L, NB, BS
  int64_t rows, max_blocks;              // R, MB: table rows and entries per row
};

// One row's span after clamping: its queries i = 0 .. len - 1 are tokens start + i at
// positions first + i (their keys: `keys_of`); table: the row's MB block numbers.
struct Span {
  int64_t start, len, first;
  const int32_t* table;
};

// The keys a query attends over: positions lo .. hi - 1 (none if hi == lo).
struct Range {
  int64_t lo, hi;
};

// A task's queries: span indices lo .. hi - 1 of row `row` (all inside [0, T)); it reads
// positions from .. keys - 1: its first query's lo to its last query's hi (both only grow
// with the position: keys_of).
struct Tile {
  int64_t row, lo, hi, from, keys;
};

// How a call attends: window (<= 0: none), the score scale (> 0; 0: 1 / sqrt(D)) and the
// logit soft cap (<= 0: none).
struct Options {
  int64_t window;
  float scale, softcap;
};

// The scale of q.k: `scale`, or 1 / sqrt(d) if it is 0, computed where it is used as before
// the option existed (a compile-time d folds it), so the default is bit for bit the old one.
inline float scale_of(float scale, int64_t d) {
  return scale > 0 ? scale : 1.f / std::sqrt(float(d));
}

// s[0 .. n) <- cap * tanh(s / cap) (Gemma 2's logit soft-capping); nothing if cap <= 0.
inline void soft_cap(float* s, int64_t n, float cap) {
  if (cap <= 0) return;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// One (row, kv head)'s keys or values in the pool: position t is block(t / BS)[t % BS].
template <typename T>
struct Paged {
  const T* head;         // the layer's block 0 at kv head h; blocks are block_stride apart
  const int32_t* table;  // the row's MB block numbers
  int64_t block_stride, block_size, blocks;  // blocks: NB
  const T* block(int64_t j) const { return head + int64_t{table[j]} * block_stride; }
  // Whether block j's table entry is inside [0, NB). A task's range holds a bad one only
  // with a window: after one query's keys and before a later query's window start.
  bool ok(int64_t j) const { return table[j] >= 0 && table[j] < blocks; }
  // Block j + 1 if the first `len` positions reach into it and it is in the pool, else
  // nullptr.
  const T* after(int64_t j, int64_t len) const {
    return (j + 1) * block_size < len && ok(j + 1) ? block(j + 1) : nullptr;
  }
};

// A paged (row, head)'s positions from, from + 1, ... in order, without a division by the
// block size per position (one costs more than the position's dot products). A position whose
// block's table entry is outside [0, NB) is not read: it gives `missing` (a row of zeros). A
// tile's keys hold such a block only between one query's keys and a later query's window.
template <typename T>
struct Cursor {
  const Paged<T>& paged;
  int64_t dim, block, offset;
  const T* missing;
  Cursor(const Paged<T>& p, int64_t d, int64_t from, const T* zeros)
      : paged(p), dim(d), block(from / p.block_size), offset(from % p.block_size),
        missing(zeros) {}
  const T* next() {
    const T* at = paged.ok(block) ? paged.block(block) + offset * dim : missing;
    if (++offset == paged.block_size) offset = 0, ++block;
    return at;
  }
};

// fn(block j, its first row o, rows n, their index from `from`) for the positions from ..
// end - 1, a block (or the part of one inside them) at a time.
template <typename F>
inline void each_block(int64_t from, int64_t end, int64_t block_size, F&& fn) {
  for (int64_t t = from; t < end;) {
    const int64_t j = t / block_size, o = t % block_size, n = std::min(block_size - o, end - t);
    fn(j, o, n, t - from);
    t += n;
  }
}

// Positions lo .. hi - 1 cut before the first of their blocks whose table entry is outside
// [0, NB) (never read): the new hi (lo if that is lo's block).
int64_t usable_end(int64_t lo, int64_t hi, const int32_t* table, const Shape& s) {
  for (int64_t j = lo / s.block_size; j * s.block_size < hi; ++j)
    if (table[j] < 0 || table[j] >= s.blocks) return std::max(lo, j * s.block_size);
  return hi;
}

// The keys span query i attends over: its window (every position up to its own without
// one) cut by usable_end. Neither end decreases with i.
Range keys_of(const Span& sp, int64_t i, const Shape& s, int64_t window) {
  const int64_t p = sp.first + i;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
  return Range{lo, usable_end(lo, p + 1, sp.table, s)};
}

// Row r's span, clamped as the contract says.
Span span_of(const int32_t* table, int32_t q_start, int32_t q_len, int32_t kv_len,
             const Shape& s) {
  const int64_t kv = std::clamp<int64_t>(kv_len, 0, s.max_blocks * s.block_size);
  const int64_t ql = std::clamp<int64_t>(q_len, 0, kv);
  return Span{q_start, ql, kv - ql, table};
}

// Asks for row t of `next` (the block after the one being read, or nullptr) to be cached: a
// block is too short a stream for the hardware prefetcher (measured: 8% faster at BS = 16).
template <typename T>
inline void prefetch_row(const T* next, int64_t t, int64_t d) {
  if (next == nullptr) return;
  const char* p = reinterpret_cast<const char*>(next + t * d);
  for (int64_t i = 0; i < d * int64_t{sizeof(T)}; i += 64) __builtin_prefetch(p + i);
}

// scores[m * stride + t] = q_m . k_t * scale for one block's n keys k [n, D] and the M query
// vectors of a tile (a query's G heads are G consecutive vectors). Keys past a query's own
// range are scored too (at most a tile's length of them) and dropped by the softmax: no
// per-key bookkeeping in the inner loop. __restrict lets the compiler keep `row` in registers
// across the M dots (measured: 15% faster in the decode kernel).
template <int DIM, typename T>
void block_scores(const float* __restrict q, const T* __restrict k, const T* next, int64_t n,
                  int64_t m_count, int64_t dyn_d, float scale, float* __restrict scores,
                  int64_t stride, float* __restrict row) {
  const int64_t d = DIM > 0 ? DIM : dyn_d, w = row_width<T>(d);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, w);
    load_row(k + t * w, row, d);
    for (int64_t m = 0; m < m_count; ++m) {
      const float* qq = q + m * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qq[i] * row[i];
      scores[m * stride + t] = acc * scale;
    }
  }
}

constexpr int64_t kKeys = 16;  // keys per chunk in the multi-query score path

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }
inline float to_f32(int8_t x) { return float(x); }

// kt [D, kKeys] <- keys k [n, D] (n <= kKeys) as float32, transposed, zero-padded past n.
template <int DIM, typename T>
void load_transposed(const T* __restrict k, int64_t n, int64_t dyn_d, float* __restrict kt) {
  const int64_t d = DIM > 0 ? DIM : dyn_d, w = row_width<T>(d);
  for (int64_t t = 0; t < kKeys; ++t) {
    float scale = 1.f;  // int8 rows: codes times the row's scale
    if constexpr (std::is_same_v<T, int8_t>) scale = t < n ? row_scale(k + t * w, d) : 0.f;
    for (int64_t i = 0; i < d; ++i)
      kt[i * kKeys + t] = t < n ? to_f32(k[t * w + i]) * scale : 0.f;
  }
}

// scores[r * stride + t] = q_r . k_t * scale for ROWS query vectors q [ROWS, D] and c <= kKeys
// keys kt [D, kKeys]: one vector accumulator per query, ROWS independent FMA chains.
template <int ROWS, int DIM>
inline void chunk_dots(const float* __restrict q, const float* __restrict kt, int64_t c,
                       int64_t dyn_d, float scale, float* __restrict scores, int64_t stride) {
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  float acc[ROWS][kKeys] = {};
  for (int64_t i = 0; i < d; ++i)
    for (int r = 0; r < ROWS; ++r) {
      const float qi = q[r * d + i];
#pragma omp simd
      for (int64_t t = 0; t < kKeys; ++t) acc[r][t] += qi * kt[i * kKeys + t];
    }
  for (int r = 0; r < ROWS; ++r)
    for (int64_t t = 0; t < c; ++t) scores[r * stride + t] = acc[r][t] * scale;
}

// block_scores for tiles of several queries: keys kKeys at a time, transposed so that each
// query's scores are a vector accumulator (no horizontal sum per dot), 8 queries at a time.
// Not inlined, here and in block_values_tiled: inlined, they made the decode loops spill.
template <int DIM, typename T>
__attribute__((noinline)) void block_scores_tiled(const float* __restrict q,
                                                  const T* __restrict k, int64_t n,
                                                  int64_t m_count, int64_t dyn_d, float scale,
                                                  float* __restrict scores, int64_t stride,
                                                  float* __restrict kt) {
  constexpr int kRows = 8;
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  for (int64_t t0 = 0; t0 < n; t0 += kKeys) {
    const int64_t c = std::min(kKeys, n - t0);
    load_transposed<DIM>(k + t0 * row_width<T>(d), c, d, kt);
    int64_t m = 0;
    for (; m + kRows <= m_count; m += kRows)
      chunk_dots<kRows, DIM>(q + m * d, kt, c, d, scale, scores + m * stride + t0, stride);
    for (; m < m_count; ++m)
      chunk_dots<1, DIM>(q + m * d, kt, c, d, scale, scores + m * stride + t0, stride);
  }
}

// out[m] += sum_t probs[m * stride + t] * v_t for one block's n values v [n, D] and the M
// query vectors of a tile (probabilities past a query's range are 0).
template <int DIM, typename T>
void block_values(const float* __restrict probs, const T* __restrict v, const T* next,
                  int64_t n, int64_t m_count, int64_t dyn_d, int64_t stride,
                  float* __restrict out, float* __restrict row) {
  const int64_t d = DIM > 0 ? DIM : dyn_d, w = row_width<T>(d);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, w);
    load_row(v + t * w, row, d);
    for (int64_t m = 0; m < m_count; ++m) {
      const float p = probs[m * stride + t];
      float* o = out + m * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += p * row[i];
    }
  }
}

// out[r] += sum_t probs[r * stride + t] * v_t for ROWS query vectors and c values vf [c, D]
// (float32), the ROWS outputs held in registers across the c values.
template <int ROWS, int DIM>
inline void chunk_values(const float* __restrict probs, const float* __restrict vf, int64_t c,
                         int64_t stride, float* __restrict out) {
  float acc[ROWS][DIM];
  for (int r = 0; r < ROWS; ++r)
    for (int i = 0; i < DIM; ++i) acc[r][i] = out[r * DIM + i];
  for (int64_t t = 0; t < c; ++t)
    for (int r = 0; r < ROWS; ++r) {
      const float p = probs[r * stride + t];
#pragma omp simd
      for (int i = 0; i < DIM; ++i) acc[r][i] += p * vf[t * DIM + i];
    }
  for (int r = 0; r < ROWS; ++r)
    for (int i = 0; i < DIM; ++i) out[r * DIM + i] = acc[r][i];
}

// block_values for tiles of several queries and a compile-time D: values kKeys at a time,
// converted once into vf [kKeys, D], then 2 queries at a time.
template <int DIM, typename T>
__attribute__((noinline)) void block_values_tiled(const float* __restrict probs,
                                                  const T* __restrict v, int64_t n,
                                                  int64_t m_count, int64_t stride,
                                                  float* __restrict out, float* __restrict vf) {
  for (int64_t t0 = 0; t0 < n; t0 += kKeys) {
    const int64_t c = std::min(kKeys, n - t0);
    for (int64_t t = 0; t < c; ++t)
      load_row(v + (t0 + t) * row_width<T>(DIM), vf + t * DIM, DIM);
    int64_t m = 0;
    for (; m + 2 <= m_count; m += 2)
      chunk_values<2, DIM>(probs + m * stride + t0, vf, c, stride, out + m * DIM);
    for (; m < m_count; ++m)
      chunk_values<1, DIM>(probs + m * stride + t0, vf, c, stride, out + m * DIM);
  }
}

// In place: s[lo..hi) -> probabilities (rounded to bf16 when `round` is set), the rest of
// s[0..stride) -> 0 (keys the query does not see).
void softmax(float* s, int64_t lo, int64_t hi, int64_t stride, bool round) {
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + stride, 0.f);
  s += lo;
  const int64_t len = hi - lo;
  if (len == 0) return;
  float m = -INFINITY;
  for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  if (round)
    for (int64_t t = 0; t < len; ++t) s[t] = round_bf16(s[t]);
}

// The pointers one task reads: the layer's pool (already offset to `layer`) and the spans.
template <typename T>
struct Inputs {
  const float* q;
  const T *k, *v;  // the selected layer: [NB, Hkv, BS, D]
  const int32_t* table;
  float* out;
  Options opt;
};

// Kv head h's pages of `pool` (the layer's K or V, in.k or in.v) in the tile's row.
template <typename T>
Paged<T> pages(const T* pool, const Inputs<T>& in, const Shape& s, const Tile& tile, int64_t h) {
  const int64_t row = row_width<T>(s.dim);
  return Paged<T>{pool + h * s.block_size * row, in.table + tile.row * s.max_blocks,
                  s.kv_heads * s.block_size * row, s.block_size, s.blocks};
}

// A worker's buffers, reused across its tasks (kept per XLA thread between calls: at most
// kTile * G * (MB * BS + 2 * D) floats).
struct Scratch {
  std::vector<float> q;       // [M, D]: the tile's M = count * G query vectors
  std::vector<float> scores;  // [M, keys of the last query]
  std::vector<float> out;     // [M, D]
  std::vector<float> row;     // [D], or [D, kKeys] for the multi-query score path
};

// q [M, D] <- the tile's queries for kv head h (rounded to bf16 if `round`).
void load_queries(const float* src, const Shape& s, int64_t token, int64_t h, int64_t count,
                  bool round, float* q) {
  const int64_t g_count = s.heads / s.kv_heads, width = g_count * s.dim;
  for (int64_t qi = 0; qi < count; ++qi) {
    const float* x = src + ((token + qi) * s.heads + h * g_count) * s.dim;
    for (int64_t i = 0; i < width; ++i) q[qi * width + i] = round ? round_bf16(x[i]) : x[i];
  }
}

// out [T, H, D] <- acc [M, D], the tile's outputs for kv head h.
void store_outputs(const float* acc, const Shape& s, int64_t token, int64_t h, int64_t count,
                   float* out) {
  const int64_t g_count = s.heads / s.kv_heads, width = g_count * s.dim;
  for (int64_t qi = 0; qi < count; ++qi)
    std::copy(acc + qi * width, acc + (qi + 1) * width,
              out + ((token + qi) * s.heads + h * g_count) * s.dim);
}

// scores [M, end - from] = scale * q_m . k_t over the keys from..end-1 (from: a block's
// first position), block by block, skipping blocks outside the pool (no query's keys: their
// scores are left as they were); `decode` (one query, G vectors): G dots per key, exactly as
// decode_attention.
template <int DIM, typename T>
void scores_of(const float* q, const Paged<T>& k, int64_t from, int64_t end, int64_t m_count,
               bool decode, int64_t d, float scale, float* scores, float* buf) {
  const int64_t width = end - from;
  for (int64_t j = from / k.block_size, t = from; t < end; ++j, t += k.block_size) {
    const int64_t n = std::min(k.block_size, end - t);
    if (!k.ok(j)) continue;
    float* at = scores + (t - from);
    if (decode)
      block_scores<DIM>(q, k.block(j), k.after(j, end), n, m_count, d, scale, at, width, buf);
    else
      block_scores_tiled<DIM>(q, k.block(j), n, m_count, d, scale, at, width, buf);
  }
}

// out [M, D] += sum_t probs[m * (end - from) + t - from] * v_t over the values from..end-1,
// block by block, skipping blocks outside the pool (probability 0 for every query).
template <int DIM, typename T>
void weighted_values(const float* probs, const Paged<T>& v, int64_t from, int64_t end,
                     int64_t m_count, bool decode, int64_t d, float* out, float* buf) {
  const int64_t width = end - from;
  for (int64_t j = from / v.block_size, t = from; t < end; ++j, t += v.block_size) {
    const int64_t n = std::min(v.block_size, end - t);
    if (!v.ok(j)) continue;
    const float* p = probs + (t - from);
    if constexpr (DIM > 0)
      if (!decode) {
        block_values_tiled<DIM>(p, v.block(j), n, m_count, width, out, buf);
        continue;
      }
    block_values<DIM>(p, v.block(j), v.after(j, end), n, m_count, d, width, out, buf);
  }
}

// One task: a tile of one span, kv head h. DIM > 0 fixes the head dim at compile time.
template <int DIM, typename T>
void attend_tile(const Inputs<T>& in, const Shape& s, const Span& span, const Tile& tile,
                 int64_t h, Scratch& w) {
  const int64_t g_count = s.heads / s.kv_heads, d = s.dim, count = tile.hi - tile.lo;
  const int64_t token = span.start + tile.lo, m_count = count * g_count;
  const int64_t from = tile.from / s.block_size * s.block_size, width = tile.keys - from;
  const bool bf16 = sizeof(T) == 2;
  w.q.resize(m_count * d);
  w.scores.resize(m_count * width);
  w.out.assign(m_count * d, 0.f);
  w.row.resize(d * kKeys);
  load_queries(in.q, s, token, h, count, bf16, w.q.data());
  const Paged<T> k = pages(in.k, in, s, tile, h), v = pages(in.v, in, s, tile, h);
  scores_of<DIM>(w.q.data(), k, from, tile.keys, m_count, count == 1, d,
                 scale_of(in.opt.scale, d), w.scores.data(), w.row.data());
  soft_cap(w.scores.data(), m_count * width, in.opt.softcap);
  for (int64_t m = 0; m < m_count; ++m) {  // vector m: query lo + m / G
    const Range keys = keys_of(span, tile.lo + m / g_count, s, in.opt.window);
    softmax(w.scores.data() + m * width, keys.lo - from, keys.hi - from, width, bf16);
  }
  weighted_values<DIM>(w.scores.data(), v, from, tile.keys, m_count, count == 1, d,
                       w.out.data(), w.row.data());
  store_outputs(w.out.data(), s, token, h, count, in.out);
}

// The step's tiles, heaviest first: each span's queries inside [0, T), kTile at a time.
std::vector<Tile> tiles_of(const std::vector<Span>& spans, const Shape& s, int64_t window) {
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < int64_t(spans.size()); ++r) {
    const Span& sp = spans[r];
    const int64_t lo = std::max<int64_t>(0, -sp.start);
    const int64_t hi = std::min<int64_t>(sp.len, s.tokens - sp.start);
    for (int64_t i = lo; i < hi; i += kTile) {
      const int64_t end = std::min(i + kTile, hi);
      const Range first = keys_of(sp, i, s, window), last = keys_of(sp, end - 1, s, window);
      tiles.push_back(Tile{r, i, end, first.lo, last.hi});
    }
  }
  // dots per query head
  auto work = [](const Tile& t) { return (t.hi - t.lo) * (t.keys - t.from); };
  std::stable_sort(tiles.begin(), tiles.end(),
                   [&](const Tile& a, const Tile& b) { return work(a) > work(b); });
  return tiles;
}

// out [T, H, D]: zeros for the tokens in no tile (the tiles write all of theirs).
void zero_uncovered(const std::vector<Span>& spans, const std::vector<Tile>& tiles,
                    const Shape& s, float* out) {
  std::vector<char> covered(s.tokens, 0);
  for (const Tile& t : tiles)
    std::fill(covered.begin() + spans[t.row].start + t.lo,
              covered.begin() + spans[t.row].start + t.hi, 1);
  const int64_t width = s.heads * s.dim;
  for (int64_t i = 0; i < s.tokens; ++i)
    if (!covered[i]) std::fill(out + i * width, out + (i + 1) * width, 0.f);
}

#ifdef __AVX512BF16__
// ---- bf16 pools with avx512_bf16: the tile's attention as two small GEMMs ---------------------
//
// For a task (tile of `count` queries, kv head h), the M = count * G query vectors are the
// columns of both products, 16 to a vector register:
//   scores  S^T [keys, M] = K [keys, D] . Q^T [D, M]: each key row's (dim 2i, 2i + 1) pair of
//           bf16, broadcast, times Q^T's pairs for 16 queries, one vdpbf16ps (the bf16
//           matmul kernel's scheme; Q^T is laid out once per task);
//   softmax down each column (a query's keys), masked to the keys it sees, probabilities
//           rounded to bf16 and paired along keys: P [keys / 2, M];
//   output  O [M, D] = P . V: each query's (key 2j, 2j + 1) probability pair, broadcast, times
//           V's rows 2j and 2j + 1 interleaved dim by dim (laid out once per task).
// Products are exact and sums f32; q and the probabilities are rounded to bf16 as in the XLA
// reference. A decode task (M = G) reads the row's keys and values once, like the generic
// path, with a fraction of its instructions; tiles of several queries run near the matmul
// kernel's speed instead of scalar-broadcast f32 FMAs.
namespace fast {

// exp(x) for x <= 0 (the softmax's shifted scores), within 1 ulp of expf for x > -87 and a
// tiny normal number below: exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, by
// its degree-7 Taylor polynomial (remainder below 6e-9). glibc's vector expf takes a scalar path per lane for inputs past its
// range (-inf, or below -88): 35% of a decode call's time went there.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);     // and the rest
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Stands in for the rows of a block outside the pool (`Cursor`): D <= 256 bf16 zeros.
alignas(64) constexpr uint16_t kZeroRow[256] = {};

inline uint32_t bf16_pair(float lo, float hi) {
  const auto bits = [](float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  };
  return bits(lo) | (bits(hi) << 16);
}

// Buffers of one task, kept per thread between calls.
struct Work {
  std::vector<uint32_t> qt;  // [D / 2, MP]: Q^T as bf16 pairs
  std::vector<float> st;     // [keys, MP]: scores, then unnormalised probabilities
  std::vector<uint32_t> pp;  // [keys / 2, MP]: probabilities as bf16 pairs along keys
  std::vector<uint32_t> vp;  // [keys / 2, D]: V rows 2j, 2j + 1 interleaved
  std::vector<int32_t> lo, hi;  // [MP]: each query vector's keys lo .. hi - 1 (of st's rows)
  std::vector<float> out;    // [M, D]
  std::vector<__m512i> qv;   // [G, D / 32]: a decode query's heads as bf16 pairs
  std::vector<uint32_t> pa;  // [MP, keys / 2]: pp transposed, a query vector's pairs a row (amx)
  std::vector<uint16_t> pad;  // [16, D]: a group of key rows copied out of the pool (amx)
  std::vector<uint16_t> kb, vb;  // [keys, D]: an int8 pool's codes as bf16 (amx)
  std::vector<float> ks, vs, s16;  // [keys]: their rows' scales; [keys, 16]: scores (amx)
};

// Query vector m of a tile (m = qi * G + g: query qi, head g of kv head h) in q or out.
inline int64_t vector_at(const Shape& s, int64_t token, int64_t h, int64_t m) {
  const int64_t g_count = s.heads / s.kv_heads;
  return ((token + m / g_count) * s.heads + h * g_count + m % g_count) * s.dim;
}

// qt[i * mp + c] = (q_m[2i], q_m[2i + 1]) for query vectors m = m0 + c, c < mc.
void load_qt(const float* q, const Shape& s, int64_t token, int64_t h, int64_t m0,
             int64_t mc, int64_t mp, uint32_t* qt) {
  const int64_t d = s.dim;
  std::fill(qt, qt + d / 2 * mp, 0u);
  for (int64_t c = 0; c < mc; ++c) {
    const float* x = q + vector_at(s, token, h, m0 + c);
    for (int64_t i = 0; i < d / 2; ++i) qt[i * mp + c] = bf16_pair(x[2 * i], x[2 * i + 1]);
  }
}

// st[r * mp + lanes] = scale * (key row r . query vectors) for R consecutive key rows at k
// (D bf16 each) and NV vectors of query lanes.
template <int R, int NV, int D>
inline void score_rows(const uint16_t* k, const uint32_t* qt, int64_t mp, float scale,
                       float* st) {
  __m512 acc[R][NV];
  unroll<R>([&](auto r) { unroll<NV>([&](auto v) { acc[r][v] = _mm512_setzero_ps(); }); });
  const auto* kp = reinterpret_cast<const uint32_t*>(k);
  for (int i = 0; i < D / 2; ++i) {
    __m512i w[NV];
    unroll<NV>([&](auto v) { w[v] = _mm512_loadu_si512(qt + i * mp + 16 * v); });
    unroll<R>([&](auto r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(kp[r * D / 2 + i]));
      unroll<NV>([&](auto v) { acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)w[v], x); });
    });
  }
  const __m512 sc = _mm512_set1_ps(scale);
  unroll<R>([&](auto r) {
    unroll<NV>([&](auto v) { _mm512_storeu_ps(st + r * mp + 16 * v, _mm512_mul_ps(acc[r][v], sc)); });
  });
}

template <int R, int NV, int D>
void score_tail(const uint16_t* k, const uint32_t* qt, int64_t mp, float scale, float* st,
                int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return score_tail<R - 1, NV, D>(k, qt, mp, scale, st, rows);
  }
  score_rows<R, NV, D>(k, qt, mp, scale, st);
}

// S^T for the row's keys from .. end - 1 (st row i: key from + i), block by block (rows of a
// block are contiguous); a block outside the pool is skipped (its rows of st are left as they
// were: no query sees them).
template <int NV, int D>
void scores(const Paged<uint16_t>& k, int64_t from, int64_t end, const uint32_t* qt, int64_t mp,
            float scale, float* st) {
  constexpr int R = NV == 1 ? 8 : NV == 2 ? 10 : 8;
  each_block(from, end, k.block_size, [&](int64_t j, int64_t o, int64_t n, int64_t at) {
    if (!k.ok(j)) return;
    if (const uint16_t* ahead = k.after(j + 1, end))  // the block after next: 2 in flight
      for (int64_t b = 0; b < k.block_size * D * 2; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead) + b, _MM_HINT_T0);
    const uint16_t* block = k.block(j) + o * D;
    for (int64_t r = 0; r < n; r += R)
      score_tail<R, NV, D>(block + r * D, qt, mp, scale, st + (at + r) * mp,
                           std::min<int64_t>(R, n - r));
  });
}

// Query lanes c .. c + 15 of st [len, mp]: each lane's scores over its keys lo .. hi - 1 ->
// their exponentials shifted by the lane's maximum (the other keys: 0), in place; returns
// 1 / each lane's sum (0 for a lane that sees no key).
inline __m512 exps(float* st, int64_t len, int64_t mp, int64_t c, const int32_t* lo,
                   const int32_t* hi) {
  const __m512i first = _mm512_loadu_si512(lo + c), end = _mm512_loadu_si512(hi + c);
  auto inside = [&](int64_t t) {  // the lanes that see key t
    const __m512i at = _mm512_set1_epi32(int(t));
    return _mm512_mask_cmpgt_epi32_mask(_mm512_cmple_epi32_mask(first, at), end, at);
  };
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; ++t)
    mx = _mm512_mask_max_ps(mx, inside(t), mx, _mm512_loadu_ps(st + t * mp + c));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const __mmask16 in = inside(t);
    const __m512 e = _mm512_maskz_mov_ps(
        in, exp_nonpositive(_mm512_maskz_sub_ps(in, _mm512_loadu_ps(st + t * mp + c), mx)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(st + t * mp + c, e);
  }
  const __mmask16 any = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_maskz_div_ps(any, _mm512_set1_ps(1.f), sum);
}

// 16 lanes of x (t) and of y (t + 1), rounded to bf16, as 16 pairs (x_i, y_i).
inline __m512i pairs_of(__m512 x, __m512 y) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(y, x));
}

// Softmax down each query lane c of st [len, mp] over its keys lo[c] .. hi[c] - 1 (the others:
// 0), the probabilities as bf16 pairs along keys into pp [ceil(len / 2), mp].
void softmax_pairs(float* st, int64_t len, int64_t mp, const int32_t* lo, const int32_t* hi,
                   uint32_t* pp) {
  for (int64_t c = 0; c < mp; c += 16) {
    const __m512 inv = exps(st, len, mp, c, lo, hi);
    for (int64_t t = 0; t < len; t += 2) {
      const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(st + t * mp + c), inv);
      const __m512 p1 = t + 1 < len ? _mm512_mul_ps(_mm512_loadu_ps(st + (t + 1) * mp + c), inv)
                                    : _mm512_setzero_ps();
      _mm512_storeu_si512(pp + t / 2 * mp + c, pairs_of(p0, p1));
    }
  }
}

// vp[j * D + 2d + e] = v row (2j + e), dim d, of the values from .. from + len - 1: value rows
// paired along keys (row len, and the rows of blocks outside the pool: zeros).
template <int D>
void value_pairs(const Paged<uint16_t>& v, int64_t from, int64_t len, uint32_t* vp) {
  static_assert(D % 32 == 0, "whole vectors of 32 dims");
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                      40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                      32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  Cursor<uint16_t> rows{v, D, from, kZeroRow}, ahead{v, D, from, kZeroRow};  // ahead: 32 on
  for (int64_t i = 0; i < 32 && i < len; ++i) ahead.next();
  for (int64_t t = 0; t < len; t += 2) {
    for (int64_t i = t + 32; i < t + 34 && i < len; ++i) prefetch_row(ahead.next(), 0, D);
    const uint16_t* a = rows.next();
    const uint16_t* b = t + 1 < len ? rows.next() : nullptr;
    unroll<D / 32>([&](auto c) {
      const __m512i x = _mm512_loadu_si512(a + 32 * c);
      const __m512i y = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + t / 2 * D + 32 * c, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vp + t / 2 * D + 32 * c + 16, _mm512_permutex2var_epi16(x, hi, y));
    });
  }
}

// Columns c0 .. c0 + DC - 1 of out rows 0 .. R - 1 (D floats each) = sum over key pairs j of
// pp[j * mp + r] . vp[j] (DC columns a pass: R * DC / 16 accumulators in registers).
template <int R, int D, int DC>
inline void value_rows(const uint32_t* pp, int64_t mp, const uint32_t* vp, int64_t pairs,
                       int64_t c0, float* out) {
  constexpr int NC = DC / 16;
  __m512 acc[R][NC];
  unroll<R>([&](auto r) { unroll<NC>([&](auto c) { acc[r][c] = _mm512_setzero_ps(); }); });
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i w[NC];
    unroll<NC>([&](auto c) { w[c] = _mm512_loadu_si512(vp + j * D + c0 + 16 * c); });
    unroll<R>([&](auto r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[j * mp + r]));
      unroll<NC>([&](auto c) { acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)w[c], x); });
    });
  }
  unroll<R>([&](auto r) {
    unroll<NC>([&](auto c) { _mm512_storeu_ps(out + r * D + c0 + 16 * c, acc[r][c]); });
  });
}

template <int R, int D, int DC>
void value_tail(const uint32_t* pp, int64_t mp, const uint32_t* vp, int64_t pairs, int64_t c0,
                float* out, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return value_tail<R - 1, D, DC>(pp, mp, vp, pairs, c0, out, rows);
  }
  value_rows<R, D, DC>(pp, mp, vp, pairs, c0, out);
}

// w.lo, w.hi [mp] <- the keys query vectors m0 + c (c < mc; query tile.lo + m / G) see,
// counted from the task's first key tile.from (its first query's window start); lanes past mc
// see none.
void key_lanes(const Span& span, const Tile& tile, const Shape& s, int64_t window, int64_t m0,
               int64_t mc, int64_t mp, Work& w) {
  const int64_t g_count = s.heads / s.kv_heads;
  w.lo.assign(mp, 0);
  w.hi.assign(mp, 0);
  for (int64_t c = 0; c < mc; ++c) {
    const Range keys = keys_of(span, tile.lo + (m0 + c) / g_count, s, window);
    w.lo[c] = int32_t(keys.lo - tile.from);
    w.hi[c] = int32_t(keys.hi - tile.from);
  }
}

// vp <- the value pairs of positions from .. from + len - 1 (value_pairs), then zeros up to a
// whole AMX tile of 16 pairs (one at least): once for all of a task's passes of query vectors.
template <int D>
void tile_value_pairs(const Paged<uint16_t>& v, int64_t from, int64_t len,
                      std::vector<uint32_t>& vp) {
  const int64_t pairs = (len + 1) / 2, lp = std::max<int64_t>((pairs + 15) / 16 * 16, 16);
  vp.resize(lp * D);
  value_pairs<D>(v, from, len, vp.data());
  std::fill(vp.begin() + pairs * D, vp.end(), 0u);
}

// Query vectors m0 .. m0 + mc - 1 (mc <= 16 * NV) of a task, over the keys tile.from ..
// tile.keys - 1: blocks before the first query's window start are not read. w.vp holds the
// task's value pairs (tile_value_pairs).
template <int NV, int D>
void attend_nv(const Inputs<uint16_t>& in, const Shape& s, const Span& span, const Tile& tile,
               int64_t h, int64_t m0, int64_t mc, Work& w) {
  const int64_t token = span.start + tile.lo, len = tile.keys - tile.from;
  const int64_t mp = 16 * NV, pairs = (len + 1) / 2;
  w.qt.resize(D / 2 * mp);
  w.st.resize(std::max<int64_t>(len, 1) * mp);
  w.pp.resize(std::max<int64_t>(pairs, 1) * mp);
  w.out.resize(mc * D);
  key_lanes(span, tile, s, in.opt.window, m0, mc, mp, w);
  load_qt(in.q, s, token, h, m0, mc, mp, w.qt.data());
  const Paged<uint16_t> k = pages(in.k, in, s, tile, h);
  scores<NV, D>(k, tile.from, tile.keys, w.qt.data(), mp, scale_of(in.opt.scale, D),
                w.st.data());
  soft_cap(w.st.data(), len * mp, in.opt.softcap);
  softmax_pairs(w.st.data(), len, mp, w.lo.data(), w.hi.data(), w.pp.data());
  constexpr int DC = D < 128 ? D : 128, R = DC == 64 ? 6 : 3;  // R * DC / 16 accumulators
  for (int64_t c0 = 0; c0 < D; c0 += DC)
    for (int64_t c = 0; c < mc; c += R)
      value_tail<R, D, DC>(w.pp.data() + c, mp, w.vp.data(), pairs, c0, w.out.data() + c * D,
                           std::min<int64_t>(R, mc - c));
  for (int64_t c = 0; c < mc; ++c)
    std::copy(w.out.data() + c * D, w.out.data() + (c + 1) * D,
              in.out + vector_at(s, token, h, m0 + c));
}

#ifdef JAXPIPE_AMX
// ---- AMX tiles (tdpbf16ps) for a tile of several queries: the "amx" path ---------------------
//
// attend_nv's two products as 16 x 16 tiles of AMX: S^T [keys, M] = K . Q^T with 16 key rows
// of the pool as an A tile (32 dims, rows D apart: read in place; a group of 16 keys that
// crosses a block's end or holds keys of a block outside the pool is copied out first) and
// Q^T's pairs (qt) as B tiles; O [M, D] = P . V with a query vector's probabilities (pairs
// along keys: pp transposed) as the rows of an A tile and V's interleaved pairs (vp) as B
// tiles. The keys are padded to whole tiles with zero probabilities and zero values. The
// softmax and the layouts are attend_nv's; products are exact and sums f32 as there.

// AMX's intrinsics take a tile's number as a literal (they are spelt into the assembly): these
// take it as a value, which is a constant wherever they are called (unroll's indices), so the
// switch folds away.
#define JAXPIPE_TILES(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
inline void tile_zero(int t) {
  switch (t) {
#define JAXPIPE_CASE(T) case T: _tile_zero(T); break;
    JAXPIPE_TILES(JAXPIPE_CASE)
#undef JAXPIPE_CASE
  }
}
inline void tile_load(int t, const void* p, int64_t stride) {
  switch (t) {
#define JAXPIPE_CASE(T) case T: _tile_loadd(T, p, stride); break;
    JAXPIPE_TILES(JAXPIPE_CASE)
#undef JAXPIPE_CASE
  }
}
inline void tile_store(int t, void* p, int64_t stride) {
  switch (t) {
#define JAXPIPE_CASE(T) case T: _tile_stored(T, p, stride); break;
    JAXPIPE_TILES(JAXPIPE_CASE)
#undef JAXPIPE_CASE
  }
}
// C tile c (0 .. 3) += A tile 4 times B tile b (5 .. 7).
inline void tile_dot(int c, int b) {
  switch (c * 8 + b) {
#define JAXPIPE_CASE(C) case C * 8 + 5: _tile_dpbf16ps(C, 4, 5); break; \
                        case C * 8 + 6: _tile_dpbf16ps(C, 4, 6); break; \
                        case C * 8 + 7: _tile_dpbf16ps(C, 4, 7); break;
    JAXPIPE_CASE(0) JAXPIPE_CASE(1) JAXPIPE_CASE(2) JAXPIPE_CASE(3)
#undef JAXPIPE_CASE
  }
}
#undef JAXPIPE_TILES

// st rows 0 .. 16 * ceil(len / 16) - 1 = the unscaled scores of keys from .. end - 1 (len = end
// - from; rows past len, and the rows of blocks outside the pool: zero rows' scores, which no
// query sees).
template <int NV, int D>
void amx_scores(const Paged<uint16_t>& k, int64_t from, int64_t end, const uint32_t* qt,
                int64_t mp, float* st, uint16_t* pad) {
  const int64_t bs = k.block_size;
  for (int64_t t0 = from; t0 < end; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, end - t0), j = t0 / bs, o = t0 % bs;
    if (o < 16)  // a block's first group: ask for the block after next (2 in flight)
      if (const uint16_t* ahead = k.after(j + 1, end))
        for (int64_t b = 0; b < bs * D * 2; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead) + b, _MM_HINT_T0);
    const uint16_t* a = pad;
    if (n == 16 && o + 16 <= bs && k.ok(j)) {
      a = k.block(j) + o * D;
    } else {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = t0 + i;
        if (i < n && k.ok(t / bs))
          std::copy_n(k.block(t / bs) + t % bs * D, D, pad + i * D);
        else
          std::fill_n(pad + i * D, D, uint16_t{0});
      }
    }
    unroll<NV>([&](auto v) { tile_zero(v); });
    unroll<D / 32>([&](auto c) {
      tile_load(4, a + 32 * c, D * 2);
      unroll<NV>([&](auto v) {
        tile_load(5 + v, qt + 16 * c * mp + 16 * v, mp * 4);
        tile_dot(v, 5 + v);
      });
    });
    float* out = st + (t0 - from) * mp;
    unroll<NV>([&](auto v) { tile_store(v, out + 16 * v, mp * 4); });
  }
}

// pa[m * lp + j] = pp[j * mp + m] for query vectors m < mp and pairs j < lp (a multiple of 16),
// 16 pairs (16 rows of pp, in L1) at a time.
inline void rows_of_pairs(const uint32_t* pp, int64_t lp, int64_t mp, uint32_t* pa) {
  const __m512i at = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(mp)));
  for (int64_t j = 0; j < lp; j += 16)
    for (int64_t m = 0; m < mp; ++m)
      _mm512_storeu_si512(pa + m * lp + j, _mm512_i32gather_epi32(at, pp + j * mp + m, 4));
}

// out [mp, D] = the probabilities' rows pa [mp, lp] times the value pairs vp [lp, D] (16 query
// vectors and 64 columns a pass: four C tiles).
template <int D>
void amx_values(const uint32_t* pa, int64_t lp, int64_t mp, const uint32_t* vp, float* out) {
  for (int64_t m0 = 0; m0 < mp; m0 += 16)
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      unroll<4>([&](auto c) { tile_zero(c); });
      for (int64_t j = 0; j < lp; j += 16) {
        tile_load(4, pa + m0 * lp + j, lp * 4);
        unroll<4>([&](auto c) {
          tile_load(5 + c % 2, vp + j * D + c0 + 16 * c, D * 4);
          tile_dot(c, 5 + c % 2);
        });
      }
      unroll<4>([&](auto c) { tile_store(c, out + m0 * D + c0 + 16 * c, D * 4); });
    }
}

// attend_nv on AMX tiles: query vectors m0 .. m0 + mc - 1 (mc <= 16 * NV) of a task (its
// value pairs in w.vp, zero up to a whole tile's 16 pairs).
template <int NV, int D>
void attend_amx(const Inputs<uint16_t>& in, const Shape& s, const Span& span, const Tile& tile,
                int64_t h, int64_t m0, int64_t mc, Work& w) {
  const int64_t token = span.start + tile.lo, len = tile.keys - tile.from;
  const int64_t mp = 16 * NV, pairs = (len + 1) / 2, lp = (pairs + 15) / 16 * 16;
  w.qt.resize(D / 2 * mp);
  w.st.resize(std::max<int64_t>((len + 15) / 16 * 16, 1) * mp);
  w.pp.resize(std::max<int64_t>(lp, 1) * mp);
  w.pa.resize(std::max<int64_t>(lp, 1) * mp);
  w.out.resize(mp * D);
  w.pad.resize(16 * D);
  key_lanes(span, tile, s, in.opt.window, m0, mc, mp, w);
  load_qt(in.q, s, token, h, m0, mc, mp, w.qt.data());
  const Paged<uint16_t> k = pages(in.k, in, s, tile, h);
  amx_configure();
  amx_scores<NV, D>(k, tile.from, tile.keys, w.qt.data(), mp, w.st.data(), w.pad.data());
  const float scale = scale_of(in.opt.scale, D);
  for (int64_t i = 0; i < len * mp; ++i) w.st[i] *= scale;
  soft_cap(w.st.data(), len * mp, in.opt.softcap);
  softmax_pairs(w.st.data(), len, mp, w.lo.data(), w.hi.data(), w.pp.data());
  std::fill(w.pp.begin() + pairs * mp, w.pp.begin() + lp * mp, 0u);
  rows_of_pairs(w.pp.data(), lp, mp, w.pa.data());
  amx_values<D>(w.pa.data(), lp, mp, w.vp.data(), w.out.data());
  _tile_release();
  for (int64_t c = 0; c < mc; ++c)
    std::copy(w.out.data() + c * D, w.out.data() + (c + 1) * D,
              in.out + vector_at(s, token, h, m0 + c));
}
#endif  // JAXPIPE_AMX

// ---- an int8 pool's tiles of several queries: bf16 products (avx512_bf16 and amx paths) ------
//
// An int8 row's codes are exact bf16 numbers; its scale multiplies the row's score (K) or
// probability (V). The portable path keeps q and the probabilities f32: here each f32 x of
// them is split into two bf16 numbers, x1 = bf16(x) and x2 = bf16(x - x1) (|x - x1 - x2| <=
// 2^-17 |x|), carried as two sets of 16 query lanes of the tile's products (lanes 0-15 the
// first parts, 16-31 the second) and summed after. A task turns its keys' and values' codes
// into bf16 rows once, for all its passes of 16 query vectors. The products run as a bf16
// pool's do: vdpbf16ps (attend_nv's `scores` and `value_rows`), or AMX tiles (kAmx:
// attend_amx's).

// The block table of rows made by a task: one block holds them all.
constexpr int32_t kOneBlock[2] = {0, -1};

// rows [16-rounded len, D] <- the codes of positions from .. from + len - 1 as bf16 (a block
// outside the pool, and rows past len: zeros), scales [the same] their rows' scales (0 there).
template <int D>
void codes_as_bf16(const Paged<int8_t>& p, int64_t from, int64_t len, uint16_t* rows,
                   float* scales) {
  static_assert(D + kScaleBytes <= sizeof(kZeroRow), "a zero row");
  Cursor<int8_t> cursor{p, D + kScaleBytes, from, reinterpret_cast<const int8_t*>(kZeroRow)};
  for (int64_t t = 0; t < len; ++t) {
    const int8_t* row = cursor.next();
    scales[t] = row_scale(row, D);
    unroll<D / 16>([&](auto c) {
      const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + t * D + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(x));
    });
  }
  const int64_t end = (len + 15) / 16 * 16;
  std::fill(rows + len * D, rows + end * D, uint16_t{0});
  std::fill(scales + len, scales + end, 0.f);
}

// x's 16 lanes rounded to bf16 (nearest even), as f32.
inline __m512 bf16_part(__m512 x) {
  const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}

// qt [D / 2, 32]: lane c < mc the first bf16 parts of query vector m0 + c's pairs, lane 16 + c
// the second parts (other lanes: 0).
void load_qt_split(const float* q, const Shape& s, int64_t token, int64_t h, int64_t m0,
                   int64_t mc, uint32_t* qt) {
  const int64_t d = s.dim;
  std::fill(qt, qt + d / 2 * 32, 0u);
  for (int64_t c = 0; c < mc; ++c) {
    const float* x = q + vector_at(s, token, h, m0 + c);
    for (int64_t i = 0; i < d / 2; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      qt[i * 32 + c] = bf16_pair(a, b);
      qt[i * 32 + 16 + c] = bf16_pair(a - round_bf16(a), b - round_bf16(b));
    }
  }
}

// The softmax of the 16 query lanes of st [len, 16] (lane c over keys lo[c] .. hi[c] - 1),
// each probability times its value row's scale (vscale [even-rounded len]) and split in two
// bf16 parts, as pairs along keys: pp [ceil(len / 2), 32], lanes 0-15 the first parts, 16-31
// the second.
void softmax_split(float* st, int64_t len, const int32_t* lo, const int32_t* hi,
                   const float* vscale, uint32_t* pp) {
  const __m512 inv = exps(st, len, 16, 0, lo, hi);
  for (int64_t t = 0; t < len; t += 2) {
    const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(st + t * 16),
                                    _mm512_mul_ps(inv, _mm512_set1_ps(vscale[t])));
    const __m512 p1 = t + 1 < len ? _mm512_mul_ps(_mm512_loadu_ps(st + (t + 1) * 16),
                                                  _mm512_mul_ps(inv, _mm512_set1_ps(vscale[t + 1])))
                                  : _mm512_setzero_ps();
    _mm512_storeu_si512(pp + t / 2 * 32, pairs_of(p0, p1));
    _mm512_storeu_si512(pp + t / 2 * 32 + 16,
                        pairs_of(_mm512_sub_ps(p0, bf16_part(p0)), _mm512_sub_ps(p1, bf16_part(p1))));
  }
}

// out [32, D] rows c and 16 + c (c < mc) <- the 32 query lanes' probabilities pp [lp, 32] times
// the value pairs vp [lp, D] (lp: pairs rounded up to whole tiles of 16; the AMX tiles read
// all lp, zero past `pairs`, the others only `pairs`).
template <int D, bool kAmx>
void split_values(const uint32_t* pp, int64_t pairs, int64_t lp, int64_t mc, const uint32_t* vp,
                  Work& w) {
#ifdef JAXPIPE_AMX
  if constexpr (kAmx) {
    rows_of_pairs(pp, lp, 32, w.pa.data());
    return amx_values<D>(w.pa.data(), lp, 32, vp, w.out.data());
  }
#endif
  constexpr int DC = D < 128 ? D : 128, R = DC == 64 ? 6 : 3;  // as attend_nv
  for (int64_t part : {0, 16})
    for (int64_t c0 = 0; c0 < D; c0 += DC)
      for (int64_t c = 0; c < mc; c += R)
        value_tail<R, D, DC>(pp + part + c, 32, vp, pairs, c0, w.out.data() + (part + c) * D,
                             std::min<int64_t>(R, mc - c));
}

// Query vectors m0 .. m0 + mc - 1 (mc <= 16) of an int8 task whose keys' and values' codes
// are w.kb and w.vp's pairs (len keys, `lp` pairs).
template <int D, bool kAmx>
void attend_int8_pass(const Inputs<int8_t>& in, const Shape& s, const Span& span,
                      const Tile& tile, int64_t h, int64_t m0, int64_t mc, int64_t len,
                      int64_t lp, Work& w) {
  const int64_t token = span.start + tile.lo, len16 = (len + 15) / 16 * 16;
  const Paged<uint16_t> kb{w.kb.data(), kOneBlock, 0, len16, 1};
  key_lanes(span, tile, s, in.opt.window, m0, mc, 16, w);
  load_qt_split(in.q, s, token, h, m0, mc, w.qt.data());
#ifdef JAXPIPE_AMX
  if constexpr (kAmx) amx_scores<2, D>(kb, 0, len, w.qt.data(), 32, w.st.data(), w.pad.data());
#endif
  if constexpr (!kAmx) scores<2, D>(kb, 0, len, w.qt.data(), 32, 1.f, w.st.data());
  const float scale = scale_of(in.opt.scale, D);
  for (int64_t t = 0; t < len; ++t) {
    const float by = w.ks[t] * scale;
    for (int64_t c = 0; c < 16; ++c)
      w.s16[t * 16 + c] = (w.st[t * 32 + c] + w.st[t * 32 + 16 + c]) * by;
  }
  soft_cap(w.s16.data(), len * 16, in.opt.softcap);
  softmax_split(w.s16.data(), len, w.lo.data(), w.hi.data(), w.vs.data(), w.pp.data());
  if constexpr (kAmx)  // AMX tiles read lp pairs; value_tail reads the (len + 1) / 2 written
    std::fill(w.pp.begin() + (len + 1) / 2 * 32, w.pp.begin() + lp * 32, 0u);
  split_values<D, kAmx>(w.pp.data(), (len + 1) / 2, lp, mc, w.vp.data(), w);
  for (int64_t c = 0; c < mc; ++c) {
    float* dst = in.out + vector_at(s, token, h, m0 + c);
    for (int64_t i = 0; i < D; ++i) dst[i] = w.out[c * D + i] + w.out[(16 + c) * D + i];
  }
}

// A task of several queries (kv head h) on an int8 pool, 16 query vectors a pass.
template <int D, bool kAmx = false>
void attend_int8(const Inputs<int8_t>& in, const Shape& s, const Span& span, const Tile& tile,
                 int64_t h, Work& w) {
  const int64_t len = tile.keys - tile.from, len16 = std::max<int64_t>((len + 15) / 16 * 16, 16);
  const int64_t lp = std::max<int64_t>(((len + 1) / 2 + 15) / 16 * 16, 16);
  const Paged<int8_t> k = pages(in.k, in, s, tile, h), v = pages(in.v, in, s, tile, h);
  w.kb.resize(len16 * D);
  w.vb.resize(len16 * D);
  w.ks.resize(len16);
  w.vs.resize(len16);
  codes_as_bf16<D>(k, tile.from, len, w.kb.data(), w.ks.data());
  codes_as_bf16<D>(v, tile.from, len, w.vb.data(), w.vs.data());
  tile_value_pairs<D>(Paged<uint16_t>{w.vb.data(), kOneBlock, 0, len16, 1}, 0, len, w.vp);
  w.qt.resize(D / 2 * 32);
  w.st.resize(len16 * 32);
  w.s16.resize(len16 * 16);
  w.pp.resize(lp * 32);
  w.out.resize(32 * D);
  if constexpr (kAmx) {
    w.pa.resize(lp * 32);
    w.pad.resize(16 * D);
#ifdef JAXPIPE_AMX
    amx_configure();
#endif
  }
  const int64_t m_count = (tile.hi - tile.lo) * (s.heads / s.kv_heads);
  for (int64_t m0 = 0; m0 < m_count; m0 += 16)
    attend_int8_pass<D, kAmx>(in, s, span, tile, h, m0, std::min<int64_t>(16, m_count - m0),
                              len, lp, w);
#ifdef JAXPIPE_AMX
  if constexpr (kAmx) _tile_release();
#endif
}

// ---- decode: one query, its G heads, keys in vector lanes ---------------------------------------
//
// A one-query task has too few query vectors to fill the lanes of the tile's products, so
// the keys fill them instead: a key row's dot with a query head is 2 (D = 64) vdpbf16ps of
// lane partial sums, and 16 keys' partials are added across lanes at once (`lanes_total`);
// the softmax runs on 16 keys a vector; the probabilities of keys 2j, 2j + 1, as a bf16 pair,
// multiply V's rows 2j, 2j + 1 interleaved in registers. About 30 vector instructions a key
// and kv head: the call is bound by reading K and V.

// r[t] = the sum of v[t]'s 16 lanes, t < 16 (45 instructions for 16 totals).
inline __m512 lanes_total(const __m512 (&v)[16]) {
  __m512 a[8], b[4];
  unroll<8>([&](auto i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  });
  unroll<4>([&](auto i) {  // lane L, element e: lane L's sum of v[4i + e]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  });
  auto halves = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return halves(halves(b[0], b[1]), halves(b[2], b[3]));
}

// st[g * ls + t] = scale * q_g . k_(from + t) for the G heads and keys from .. from + len - 1.
template <int D>
void decode_scores(const Paged<uint16_t>& k, int64_t from, int64_t len, const __m512i* qv,
                   int64_t g_count, int64_t ls, float scale_f, float* st) {
  constexpr int NP = D / 32;  // vectors of 32 bf16 per row
  const __m512 scale = _mm512_set1_ps(scale_f);
  Cursor<uint16_t> cursor{k, D, from, kZeroRow}, ahead{k, D, from, kZeroRow};  // ahead: 32 on
  for (int64_t i = 0; i < 32 && i < len; ++i) ahead.next();
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    const uint16_t* rows[16];
    for (int64_t i = 0; i < 16; ++i) rows[i] = i < n ? cursor.next() : rows[n - 1];
    for (int64_t i = 0; i < 16 && t0 + 32 + i < len; ++i)  // a row's lines at a time
      prefetch_row(ahead.next(), 0, D);
    for (int64_t g = 0; g < g_count; ++g) {
      __m512 part[16];
      unroll<16>([&](auto i) {
        __m512 acc = _mm512_setzero_ps();
        unroll<NP>([&](auto c) {
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(rows[i] + 32 * c),
                                 (__m512bh)qv[g * NP + c]);
        });
        part[i] = acc;
      });
      _mm512_storeu_ps(st + g * ls + t0, _mm512_mul_ps(lanes_total(part), scale));
    }
  }
}

// The softmax of st[g * ls .. + len) (len >= 1) as bf16 pairs along keys: pp[g * lp + j] =
// (p(2j), p(2j + 1)); key len (odd len) gets 0.
void decode_softmax(float* st, int64_t len, int64_t ls, int64_t g_count, int64_t lp,
                    uint32_t* pp) {
  for (int64_t g = 0; g < g_count; ++g) {
    float* s = st + g * ls;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 in = static_cast<__mmask16>(len - t >= 16 ? 0xffff : (1u << (len - t)) - 1);
      mx = _mm512_mask_max_ps(mx, in, mx, _mm512_loadu_ps(s + t));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 in = static_cast<__mmask16>(len - t >= 16 ? 0xffff : (1u << (len - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(
          in, exp_nonpositive(_mm512_maskz_sub_ps(in, _mm512_loadu_ps(s + t), top)));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(s + t, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t t = 0; t < len; t += 32) {  // 32 probabilities -> 16 pairs
      const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(s + t), inv);
      const __m512 p1 = _mm512_mul_ps(_mm512_loadu_ps(s + t + 16), inv);
      _mm512_storeu_si512(pp + g * lp + t / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
  }
}

// out[g] = sum over key pairs j of pp[g * lp + j] . (V rows from + 2j, from + 2j + 1
// interleaved), for the GS heads g0 .. g0 + GS - 1.
template <int GS, int D>
void decode_values(const Paged<uint16_t>& v, int64_t from, int64_t len, const uint32_t* pp,
                   int64_t lp, int64_t g0, float* out) {
  constexpr int NC = D / 16;
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                      40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                      32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  __m512 acc[GS][NC];
  unroll<GS>([&](auto g) { unroll<NC>([&](auto c) { acc[g][c] = _mm512_setzero_ps(); }); });
  Cursor<uint16_t> rows{v, D, from, kZeroRow}, ahead{v, D, from, kZeroRow};  // ahead: 32 on
  for (int64_t i = 0; i < 32 && i < len; ++i) ahead.next();
  for (int64_t t = 0; t < len; t += 2) {
    for (int64_t i = t + 32; i < t + 34 && i < len; ++i) prefetch_row(ahead.next(), 0, D);
    const uint16_t* a = rows.next();
    const uint16_t* b = t + 1 < len ? rows.next() : nullptr;
    __m512i w[NC];
    unroll<NC / 2>([&](auto c) {
      const __m512i x = _mm512_loadu_si512(a + 32 * c);
      const __m512i y = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
      w[2 * c] = _mm512_permutex2var_epi16(x, lo, y);
      w[2 * c + 1] = _mm512_permutex2var_epi16(x, hi, y);
    });
    unroll<GS>([&](auto g) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[(g0 + g) * lp + t / 2]));
      unroll<NC>([&](auto c) { acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)w[c], p); });
    });
  }
  unroll<GS>([&](auto g) {
    unroll<NC>([&](auto c) { _mm512_storeu_ps(out + (g0 + g) * D + 16 * c, acc[g][c]); });
  });
}

// out [G, D]: the G heads' weighted values, kMost heads a pass (kMost * D / 16 accumulators in
// registers; at D = 256 one head a pass, V read once per head: two heads a pass over half the
// columns each ran at 1.2x the portable path's time, this at 1.07x, on Gemma's 8 / 4 x 256
// heads, 64 rows x 1024 keys).
template <int D>
void decode_values_for(const Paged<uint16_t>& v, int64_t from, int64_t len, const uint32_t* pp,
                       int64_t lp, int64_t g_count, float* out) {
  constexpr int kMost = D == 64 ? 5 : D == 128 ? 2 : 1;
  for (int64_t g0 = 0; g0 < g_count; g0 += kMost) {
    auto pass = [&](auto gs) {
      decode_values<decltype(gs)::value, D>(v, from, len, pp, lp, g0, out);
    };
    switch (std::min<int64_t>(kMost, g_count - g0)) {
      case 1: pass(std::integral_constant<int, 1>{}); break;
      case 2: if constexpr (kMost >= 2) pass(std::integral_constant<int, 2>{}); break;
      case 3: if constexpr (kMost >= 3) pass(std::integral_constant<int, 3>{}); break;
      case 4: if constexpr (kMost >= 4) pass(std::integral_constant<int, 4>{}); break;
      default: if constexpr (kMost >= 5) pass(std::integral_constant<int, 5>{}); break;
    }
  }
}

// A one-query task: the G heads of kv head h over the query's keys tile.from .. tile.keys - 1
// (its window, which may begin inside a block; blocks before it are not read).
template <int D>
void decode(const Inputs<uint16_t>& in, const Shape& s, const Span& span, const Tile& tile,
            int64_t h, Work& w) {
  const int64_t g_count = s.heads / s.kv_heads, token = span.start + tile.lo;
  const int64_t from = tile.from, len = tile.keys - tile.from;
  if (len <= 0) {
    for (int64_t g = 0; g < g_count; ++g)
      std::fill_n(in.out + vector_at(s, token, h, g), D, 0.f);
    return;
  }
  constexpr int NP = D / 32;
  const Paged<uint16_t> k = pages(in.k, in, s, tile, h), v = pages(in.v, in, s, tile, h);
  const int64_t ls = (len + 31) / 32 * 32, lp = ls / 2;  // whole vectors of keys and pairs
  w.st.assign(g_count * ls, 0.f);
  w.pp.resize(g_count * lp);
  w.out.resize(g_count * D);
  auto& qv = w.qv;
  qv.resize(g_count * NP);
  for (int64_t g = 0; g < g_count; ++g) {
    const float* x = in.q + vector_at(s, token, h, g);
    for (int c = 0; c < NP; ++c)
      qv[g * NP + c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * c + 16),
                                                    _mm512_loadu_ps(x + 32 * c));
  }
  decode_scores<D>(k, from, len, qv.data(), g_count, ls, scale_of(in.opt.scale, D),
                   w.st.data());
  soft_cap(w.st.data(), g_count * ls, in.opt.softcap);
  decode_softmax(w.st.data(), len, ls, g_count, lp, w.pp.data());
  decode_values_for<D>(v, from, len, w.pp.data(), lp, g_count, w.out.data());
  for (int64_t g = 0; g < g_count; ++g)
    std::copy_n(w.out.data() + g * D, D, in.out + vector_at(s, token, h, g));
}

// One task (a tile of one span, kv head h) on a bf16 pool with D = 64, 128 or 256: its query
// vectors 48 at a time (the scores' register tile holds 3 vectors of 16 query lanes), on AMX
// tiles where kAmx.
template <int D, bool kAmx = false>
void attend_tile(const Inputs<uint16_t>& in, const Shape& s, const Span& span,
                 const Tile& tile, int64_t h, Work& w) {
  if (tile.hi - tile.lo == 1) return decode<D>(in, s, span, tile, h, w);
  tile_value_pairs<D>(pages(in.v, in, s, tile, h), tile.from, tile.keys - tile.from, w.vp);
  const int64_t m_count = (tile.hi - tile.lo) * (s.heads / s.kv_heads);
  for (int64_t m0 = 0; m0 < m_count; m0 += 48) {
    const int64_t mc = std::min<int64_t>(48, m_count - m0);
    auto pass = [&](auto nv) {
      constexpr int NV = decltype(nv)::value;
#ifdef JAXPIPE_AMX
      if constexpr (kAmx) return attend_amx<NV, D>(in, s, span, tile, h, m0, mc, w);
#endif
      attend_nv<NV, D>(in, s, span, tile, h, m0, mc, w);
    };
    if (mc <= 16)
      pass(std::integral_constant<int, 1>{});
    else if (mc <= 32)
      pass(std::integral_constant<int, 2>{});
    else
      pass(std::integral_constant<int, 3>{});
  }
}

}  // namespace fast
#endif  // __AVX512BF16__

#if defined(__AVX2__) && defined(__FMA__)
// ---- bf16 pools on AVX2 + FMA: decode rows ------------------------------------------------------
//
// A one-query task (the G heads of one kv head over its row's keys): each block of K (then of
// V) is widened to f32 once into an L1 scratch; each head's scores take 8 keys at a time (8
// accumulators of partial dots, summed across lanes together: `lanes_total`), and its
// weighted sum of the values keeps the head's output in registers over the block's rows. The
// generic loop instead summed across lanes once per (key, head) and read and wrote each
// head's output row once per value row. q and the probabilities are rounded to bf16, as the
// XLA reference does; products are exact and sums f32.
namespace avx2 {

// exp(x) for x <= 0 (the softmax's shifted scores): 2^n * exp(r), n = round(x / ln 2), |r| <=
// ln 2 / 2, by its degree-7 Taylor polynomial, within 1 ulp of expf above -87 (the avx512_bf16
// path's, with 2^n built in the exponent bits).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2, high part
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);     // and the rest
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n, n >= -126
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// r[i] = the sum of v[i]'s 8 lanes, i < 8.
inline __m256 lanes_total(const __m256 (&v)[8]) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // b0: [v0..v3 over lanes 0-3 | v0..v3 over lanes 4-7], b1 the same for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// x rounded to bf16 (nearest even), as f32.
inline __m256 round_bf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// dst [n, D] f32 <- src [n, D] bf16, asking meanwhile for the same lines of `next` (the next
// block, or nullptr) to be cached, one line per line read: spread out, the prefetches keep
// the memory system busy without overflowing its miss buffers (a whole block's lines asked
// for at once, two blocks ahead, left the widening waiting on every load).
template <int D>
inline void widen_rows(const uint16_t* __restrict src, int64_t n, float* __restrict dst,
                       const uint16_t* next) {
  for (int64_t i = 0; i < n * D; i += 32) {  // one 64-byte line of bf16 a step
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
    unroll<4>([&](auto c) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 8 * c));
      _mm256_storeu_ps(dst + i + 8 * c,
                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
    });
  }
}

// fn(row r, r) for an int8 block's rows src [n, D + 2] (codes, then the row's bf16 scale),
// each row's scale into scales[r], asking meanwhile for the same lines of `next` (the next
// block, or nullptr) to be cached, as the row is read.
template <int D, typename F>
inline void int8_rows(const int8_t* src, int64_t n, const int8_t* next, float* scales, F&& fn) {
  constexpr int64_t kWidth = D + kScaleBytes;
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* row = src + r * kWidth;
    if (next != nullptr)
      for (int64_t i = 0; i < kWidth; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * kWidth + i), _MM_HINT_T0);
    scales[r] = row_scale(row, D);
    fn(row, r);
  }
}

// dst [n, D] f32 <- an int8 pool's rows src [n, D + 2] (codes, then the row's bf16 scale):
// each row's codes widened to f32 8 at a time, its scale into scales[r], applied once per row
// by the caller (to the row's score, or to its probability). `next`: as above.
template <int D>
inline void widen_rows(const int8_t* __restrict src, int64_t n, float* __restrict dst,
                       const int8_t* next, float* __restrict scales) {
  int8_rows<D>(src, n, next, scales, [&](const int8_t* row, int64_t r) {
    unroll<D / 8>([&](auto c) {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
      _mm256_storeu_ps(dst + r * D + 8 * c, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)));
    });
  });
}

// A bf16 pool's rows carry no scale: `scales` is unused.
template <int D>
inline void widen_rows(const uint16_t* __restrict src, int64_t n, float* __restrict dst,
                       const uint16_t* next, float*) {
  widen_rows<D>(src, n, dst, next);
}

// st[g * ls + i] = scale * q_g . k_i for the block's rows i (kf [8-rounded n, D]; rows past
// n are stale and their scores past the row's keys, which the softmax never reads), each
// also times rows[i] where `rows` is given (an int8 row's scale: kf holds its codes).
template <int D>
void block_scores(const float* __restrict kf, int64_t n, const float* __restrict q,
                  int64_t g_count, float scale, float* __restrict st, int64_t ls,
                  const float* __restrict rows) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < g_count; ++g)
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      __m256 acc[8];
      unroll<8>([&](auto i) { acc[i] = _mm256_setzero_ps(); });
      for (int c = 0; c < D; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + g * D + c);
        unroll<8>([&](auto i) {
          acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kf + (i0 + i) * D + c), qc, acc[i]);
        });
      }
      const __m256 by = rows ? _mm256_mul_ps(_mm256_loadu_ps(rows + i0), sc) : sc;
      _mm256_storeu_ps(st + g * ls + i0, _mm256_mul_ps(lanes_total(acc), by));
    }
}

// s[0 .. len) <- its softmax (len >= 1), rounded to bf16 where `round` (a bf16 pool's).
inline void softmax(float* s, int64_t len, bool round) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 in = _mm256_castsi256_ps(lanes(std::min<int64_t>(8, len - t)));
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + t), in));
  }
  mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, _MM_SHUFFLE(1, 0, 3, 2)));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, _MM_SHUFFLE(2, 3, 0, 1)));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 in = _mm256_castsi256_ps(lanes(std::min<int64_t>(8, len - t)));
    const __m256 e = _mm256_and_ps(in, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mx)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + t, e);
  }
  sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(sum, sum, 1));
  sum = _mm256_hadd_ps(sum, sum);
  sum = _mm256_hadd_ps(sum, sum);
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), sum);
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(s + t), inv);
    _mm256_storeu_ps(s + t, round ? round_bf16(p) : p);
  }
}

// out[g] += sum_i p[g * ls + i] * v_i over the block's n rows (vf [n, D] f32), 8 vectors of
// the head's output in registers at a time.
template <int D>
void block_values(const float* __restrict vf, int64_t n, const float* __restrict p, int64_t ls,
                  int64_t g_count, float* __restrict out, const float* __restrict rows) {
  constexpr int kPass = D / 8 < 8 ? D / 8 : 8;  // accumulators per pass
  for (int64_t g = 0; g < g_count; ++g)
    for (int c0 = 0; c0 < D; c0 += 8 * kPass) {
      __m256 acc[kPass];
      unroll<kPass>([&](auto c) { acc[c] = _mm256_loadu_ps(out + g * D + c0 + 8 * c); });
      for (int64_t i = 0; i < n; ++i) {
        const __m256 pb = _mm256_set1_ps(rows ? p[g * ls + i] * rows[i] : p[g * ls + i]);
        unroll<kPass>([&](auto c) {
          acc[c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vf + i * D + c0 + 8 * c), acc[c]);
        });
      }
      unroll<kPass>([&](auto c) { _mm256_storeu_ps(out + g * D + c0 + 8 * c, acc[c]); });
    }
}


#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// An int8 pool's decode rows by int16 products (vpdpwssd, avx512_vnni), on the avx512_bf16
// path's CPUs: the codes sign-extended to int16 (exact); q quantized per head to int16
// (q_g = qs_g * q16_g, qs_g = max |q_g| / 32767, nearest even), and each head's
// probability-times-row-scale w_t quantized the same way over the task's keys for the
// values. Sums are exact int32 (a key's dot: D / 16 products a lane, at most 16 x 32767 x 127;
// values flushed to f32 every kFlush keys: kFlush x 32767 x 127 < 2^31), so the arithmetic is
// `int16_reference` in tests/kernel_tests/test_kv_int8.py to the rounding of the two quantizations.
namespace vnni {

constexpr float kStep16 = 1.f / 32767.f;
constexpr int64_t kFlush = 256;  // keys between int32 -> f32 flushes of the value sums

// v [n] -> codes [n] with v ~= s * codes; returns s (1 where v is all zero).
inline float quantize16(const float* v, int64_t n, int16_t* codes) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float s = amax > 0.f ? amax * kStep16 : 1.f, inv = 1.f / s;
  for (int64_t i = 0; i < n; ++i)
    codes[i] = static_cast<int16_t>(std::clamp(std::nearbyint(v[i] * inv), -32767.f, 32767.f));
  return s;
}

// r[i] = the sum of v[i]'s 16 int32 lanes, i < 16 (exact): pairs, then quads inside 128-bit
// lanes, then across them (45 shuffles and adds for 16 dots).
inline __m512i lanes_total(const __m512i (&v)[16]) {
  auto ps = [](__m512i x) { return _mm512_castsi512_ps(x); };
  auto si = [](__m512 x) { return _mm512_castps_si512(x); };
  __m512i s8[8], u[4];
  unroll<8>([&](auto j) {
    s8[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
  });
  unroll<4>([&](auto j) {
    u[j] = _mm512_add_epi32(
        si(_mm512_shuffle_ps(ps(s8[2 * j]), ps(s8[2 * j + 1]), _MM_SHUFFLE(1, 0, 1, 0))),
        si(_mm512_shuffle_ps(ps(s8[2 * j]), ps(s8[2 * j + 1]), _MM_SHUFFLE(3, 2, 3, 2))));
  });
  auto halves = [](__m512i x, __m512i y) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return halves(halves(u[0], u[1]), halves(u[2], u[3]));
}

// kw [16-rounded n, D] int16 <- the block's rows' codes, scales[r] their scales (rows past n:
// zeros, scale 0); asks for the same lines of `next` (or nullptr) as widen_rows does.
template <int D>
inline void widen16(const int8_t* __restrict src, int64_t n, int16_t* __restrict kw,
                    float* __restrict scales, const int8_t* next) {
  int8_rows<D>(src, n, next, scales, [&](const int8_t* row, int64_t r) {
    unroll<D / 32>([&](auto c) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c));
      _mm512_storeu_si512(kw + r * D + 32 * c, _mm512_cvtepi8_epi16(x));
    });
  });
  for (int64_t r = n; r < (n + 15) / 16 * 16; ++r) {
    std::fill_n(kw + r * D, D, int16_t{0});
    scales[r] = 0.f;
  }
}

// st[g * ls + i] = scale * qs[g] * scales[i] * (q16_g . kw_i) for the block's rows, 16 at a
// time.
template <int D>
void block_scores(const int16_t* __restrict kw, int64_t n, const int16_t* __restrict q16,
                  const float* qs, int64_t g_count, float scale, float* __restrict st,
                  int64_t ls, const float* __restrict scales) {
  for (int64_t g = 0; g < g_count; ++g) {
    const __m512 by = _mm512_set1_ps(scale * qs[g]);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      __m512i acc[16];
      unroll<16>([&](auto i) { acc[i] = _mm512_setzero_si512(); });
      unroll<D / 32>([&](auto c) {
        const __m512i qc = _mm512_loadu_si512(q16 + g * D + 32 * c);
        unroll<16>([&](auto i) {
          const __m512i key = _mm512_loadu_si512(kw + (i0 + i) * D + 32 * c);
          acc[i] = _mm512_dpwssd_epi32(acc[i], key, qc);
        });
      });
      const __m512 dots = _mm512_cvtepi32_ps(lanes_total(acc));
      _mm512_storeu_ps(st + g * ls + i0,
                       _mm512_mul_ps(_mm512_mul_ps(dots, _mm512_loadu_ps(scales + i0)), by));
    }
  }
}

// out[g] = ws[g] * sum_t w16[g * lw + t] * v_t (codes) over keys from .. from + len - 1, GS
// heads g0 .. g0 + GS - 1 a pass: key pairs interleaved as int16 (t, t + 1) per dim, one
// vpdpwssd per 16 dims and head.
template <int GS, int D>
void values(const Paged<int8_t>& v, int64_t from, int64_t len, const int16_t* w16, int64_t lw,
            const float* ws, int64_t g0, float* out) {
  constexpr int NC = D / 16;
  static_assert(D + kScaleBytes <= sizeof(fast::kZeroRow), "a zero row");
  const auto* zeros = reinterpret_cast<const int8_t*>(fast::kZeroRow);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                      40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                      32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  __m512 sum[GS][NC];
  __m512i acc[GS][NC];
  unroll<GS>([&](auto g) { unroll<NC>([&](auto c) {
    sum[g][c] = _mm512_setzero_ps();
    acc[g][c] = _mm512_setzero_si512();
  }); });
  Cursor<int8_t> rows{v, D + kScaleBytes, from, zeros}, ahead{v, D + kScaleBytes, from, zeros};
  for (int64_t i = 0; i < 32 && i < len; ++i) ahead.next();
  for (int64_t t = 0; t < len; t += 2) {
    for (int64_t i = t + 32; i < t + 34 && i < len; ++i)
      prefetch_row(ahead.next(), 0, D + kScaleBytes);
    const int8_t* a = rows.next();
    const int8_t* b = t + 1 < len ? rows.next() : zeros;
    __m512i p[NC];
    unroll<NC / 2>([&](auto c) {
      const __m512i x = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * c)));
      const __m512i y = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c)));
      p[2 * c] = _mm512_permutex2var_epi16(x, lo, y);
      p[2 * c + 1] = _mm512_permutex2var_epi16(x, hi, y);
    });
    unroll<GS>([&](auto g) {
      int32_t pair;
      std::memcpy(&pair, w16 + (g0 + g) * lw + t, sizeof pair);
      const __m512i wp = _mm512_set1_epi32(pair);
      unroll<NC>([&](auto c) { acc[g][c] = _mm512_dpwssd_epi32(acc[g][c], p[c], wp); });
    });
    if ((t + 2) % kFlush == 0) {
      unroll<GS>([&](auto g) { unroll<NC>([&](auto c) {
        sum[g][c] = _mm512_add_ps(sum[g][c], _mm512_cvtepi32_ps(acc[g][c]));
        acc[g][c] = _mm512_setzero_si512();
      }); });
    }
  }
  unroll<GS>([&](auto g) {
    const __m512 scale = _mm512_set1_ps(ws[g0 + g]);
    unroll<NC>([&](auto c) {
      const __m512 total = _mm512_add_ps(sum[g][c], _mm512_cvtepi32_ps(acc[g][c]));
      _mm512_storeu_ps(out + (g0 + g) * D + 16 * c, _mm512_mul_ps(total, scale));
    });
  });
}

// `values` for the G heads, as many a pass as 24 accumulators hold.
template <int D>
void values_for(const Paged<int8_t>& v, int64_t from, int64_t len, const int16_t* w16,
                int64_t lw, const float* ws, int64_t g_count, float* out) {
  constexpr int kMost = D == 64 ? 6 : D == 128 ? 3 : 1;
  for (int64_t g0 = 0; g0 < g_count; g0 += kMost) {
    auto pass = [&](auto gs) {
      values<decltype(gs)::value, D>(v, from, len, w16, lw, ws, g0, out);
    };
    switch (std::min<int64_t>(kMost, g_count - g0)) {
      case 1: pass(std::integral_constant<int, 1>{}); break;
      case 2: if constexpr (kMost >= 2) pass(std::integral_constant<int, 2>{}); break;
      case 3: if constexpr (kMost >= 3) pass(std::integral_constant<int, 3>{}); break;
      case 4: if constexpr (kMost >= 4) pass(std::integral_constant<int, 4>{}); break;
      case 5: if constexpr (kMost >= 5) pass(std::integral_constant<int, 5>{}); break;
      default: if constexpr (kMost >= 6) pass(std::integral_constant<int, 6>{}); break;
    }
  }
}

}  // namespace vnni
#define JAXPIPE_INT16_DECODE 1
#endif

struct Work {
  std::vector<float> q, st, rows, out;  // q [G, D], st [G, ls], rows [kKeys-rounded BS, D], out
  std::vector<float> scales;            // [kKeys-rounded BS]: an int8 block's row scales
  std::vector<int16_t> q16, kw, w16;    // decode16: q [G, D], a block's keys, weights [G, lw]
  std::vector<float> qs, ws, value_scales;  // their scales [G], [G]; value rows' scales [ls]
};

// A one-query task's parts: its G heads, its keys from .. end - 1 (len of them), its G heads'
// query vectors and where their outputs go, and kv head h's pages of K and V.
template <typename T>
struct OneQuery {
  int64_t g_count, from, end, len;
  const float* q;  // the G heads' query vectors, consecutive
  float* dst;
  Paged<T> k, v;
  OneQuery(const Inputs<T>& in, const Shape& s, const Span& span, const Tile& tile, int64_t h,
           int64_t d)
      : g_count(s.heads / s.kv_heads), from(tile.from), end(tile.keys), len(end - from),
        q(in.q + ((span.start + tile.lo) * s.heads + h * g_count) * d),
        dst(in.out + ((span.start + tile.lo) * s.heads + h * g_count) * d),
        k(pages(in.k, in, s, tile, h)), v(pages(in.v, in, s, tile, h)) {}
};

#ifdef JAXPIPE_INT16_DECODE
// `decode` of an int8 pool on the avx512_bf16 path's CPUs with avx512_vnni: int16 products
// (`vnni::`). Scores a block at a time (its codes sign-extended once into kw, each head's 16
// keys a pass); the probabilities times each key's scale quantized per head, then the values
// in key pairs from the pool.
template <int D>
void decode16(const Inputs<int8_t>& in, const Shape& s, const Span& span, const Tile& tile,
              int64_t h, Work& w) {
  constexpr int64_t kRow = D + kScaleBytes;
  const OneQuery<int8_t> task(in, s, span, tile, h, D);
  const int64_t g_count = task.g_count, from = task.from, end = task.end, len = task.len;
  const float* q = task.q;
  float* dst = task.dst;
  const auto &k = task.k, &v = task.v;
  if (len <= 0) return std::fill_n(dst, g_count * D, 0.f), void();
  const int64_t ls = (len + 15) / 16 * 16 + 16, lw = (len + 1) / 2 * 2;
  const int64_t block_rows = (s.block_size + 15) / 16 * 16;
  w.st.resize(g_count * ls);
  w.kw.resize(block_rows * D);
  w.scales.resize(block_rows);
  w.value_scales.resize(ls);
  w.q16.resize(g_count * D);
  w.qs.resize(g_count);
  w.w16.resize(g_count * lw);
  w.ws.resize(g_count);
  w.out.resize(g_count * D);
  for (int64_t g = 0; g < g_count; ++g)
    w.qs[g] = vnni::quantize16(q + g * D, D, w.q16.data() + g * D);
  const float scale = scale_of(in.opt.scale, D);
  each_block(from, end, s.block_size, [&](int64_t j, int64_t o, int64_t n, int64_t at) {
    vnni::widen16<D>(k.block(j) + o * kRow, n, w.kw.data(), w.scales.data(),
                     k.after(j + 1, end));
    vnni::block_scores<D>(w.kw.data(), n, w.q16.data(), w.qs.data(), g_count, scale,
                          w.st.data() + at, ls, w.scales.data());
  });
  each_block(from, end, s.block_size, [&](int64_t j, int64_t o, int64_t n, int64_t at) {
    const int8_t* rows = v.block(j) + o * kRow;  // the value rows' scales (and their lines)
    for (int64_t r = 0; r < n; ++r) w.value_scales[at + r] = row_scale(rows + r * kRow, D);
  });
  for (int64_t g = 0; g < g_count; ++g) {
    float* p = w.st.data() + g * ls;
    soft_cap(p, len, in.opt.softcap);
    softmax(p, len, false);
    for (int64_t t = 0; t < len; ++t) p[t] *= w.value_scales[t];  // the value rows' scales
    w.ws[g] = vnni::quantize16(p, len, w.w16.data() + g * lw);
    std::fill(w.w16.data() + g * lw + len, w.w16.data() + (g + 1) * lw, int16_t{0});
  }
  vnni::values_for<D>(v, from, len, w.w16.data(), lw, w.ws.data(), g_count, w.out.data());
  std::copy_n(w.out.data(), g_count * D, dst);
}
#endif

// A one-query task: the G heads of kv head h over the query's keys tile.from .. tile.keys - 1
// (its window, which may begin inside a block). A block's scores are stored 8 keys at a time
// from its first key read (any block size): those past them are overwritten by the next
// block's or land in st's 8 spare entries. A bf16 pool (T u16) rounds q and the
// probabilities to bf16, as the XLA path does; an int8 pool's codes are widened as they are,
// each key row's scale multiplies its score and each value row's its probability (once a
// row, not once an element), and q and the probabilities stay f32 as the portable path
// keeps them. kWide (an int8 pool on the avx512_bf16 path): `decode16`'s int16 products
// where the build has avx512_vnni (every CPU with avx512_bf16 so far), else as here.
template <int D, typename T, bool kWide = false>
void decode(const Inputs<T>& in, const Shape& s, const Span& span, const Tile& tile,
            int64_t h, Work& w) {
#ifdef JAXPIPE_INT16_DECODE
  if constexpr (kWide && std::is_same_v<T, int8_t>) {
    return decode16<D>(in, s, span, tile, h, w);
  }
#endif
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  constexpr int64_t kRow = row_width<T>(D), kKeys = 8;
  const OneQuery<T> task(in, s, span, tile, h, D);
  const int64_t g_count = task.g_count, from = task.from, end = task.end, len = task.len;
  const float* q = task.q;
  float* dst = task.dst;
  const auto &k = task.k, &v = task.v;
  if (len <= 0) return std::fill_n(dst, g_count * D, 0.f), void();
  const int64_t ls = (len + kKeys - 1) / kKeys * kKeys + kKeys;
  const int64_t block_rows = (s.block_size + kKeys - 1) / kKeys * kKeys;
  w.q.resize(g_count * D);
  w.st.resize(g_count * ls);
  w.rows.resize(block_rows * D);
  w.scales.assign(block_rows, 0.f);
  float* rs = kBf16 ? nullptr : w.scales.data();
  w.out.assign(g_count * D, 0.f);
  for (int64_t i = 0; i < g_count * D; i += 8) {
    const __m256 x = _mm256_loadu_ps(q + i);
    _mm256_storeu_ps(w.q.data() + i, kBf16 ? round_bf16(x) : x);
  }
  const float scale = scale_of(in.opt.scale, D);
  each_block(from, end, s.block_size, [&](int64_t j, int64_t o, int64_t n, int64_t at) {
    float* rows = w.rows.data();
    widen_rows<D>(k.block(j) + o * kRow, n, rows, k.after(j + 1, end), rs);
    block_scores<D>(rows, n, w.q.data(), g_count, scale, w.st.data() + at, ls, rs);
  });
  for (int64_t g = 0; g < g_count; ++g) {
    soft_cap(w.st.data() + g * ls, len, in.opt.softcap);
    softmax(w.st.data() + g * ls, len, kBf16);
  }
  each_block(from, end, s.block_size, [&](int64_t j, int64_t o, int64_t n, int64_t at) {
    float* rows = w.rows.data();
    widen_rows<D>(v.block(j) + o * kRow, n, rows, v.after(j + 1, end), rs);
    block_values<D>(rows, n, w.st.data() + at, ls, g_count, w.out.data(), rs);
  });
  std::copy_n(w.out.data(), g_count * D, dst);
}

}  // namespace avx2
#endif  // AVX2 and FMA

// The kernel's paths (the `path` attribute; ragged_attention.PATHS names them by index):
// the portable loops run every call; avx2 (decode rows) and avx512_bf16 (decode rows and
// tiles of several queries) run calls on a bf16 pool with D = 64, 128 or 256 where built.
// amx: avx512_bf16's, with a bf16 pool's tiles of several queries on AMX tiles.
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

// The paths this build has and the process may run (AMX needs the kernel's permission).
uint32_t usable_paths() {
#ifdef JAXPIPE_AMX
  if (!amx_permitted()) return kBuiltPaths & ~(1u << kAmx);
#endif
  return kBuiltPaths;
}

// The path a call on a pool of `bf16`, `int8` (or f32) elements and head dim `dim` runs:
// `path`, or (< 0) the last this build has that can run it; -1 if `path` is not built or
// cannot run it. avx2 and avx512_bf16 take bf16 and int8 pools (avx512_bf16's int8 decode rows
// run `decode16`'s int16 products: an int8 row's dequantized values are not bf16 numbers; its
// int8 tiles `fast::attend_int8`); so does amx (its int8 tiles on AMX tiles).
int64_t path_for(int64_t path, bool bf16, bool int8, int64_t dim) {
  const bool dims = dim == 64 || dim == 128 || dim == 256;  // the avx* and amx paths' own
  const uint32_t takes =
      (1u << kPortable) |
      (dims && (bf16 || int8) ? (1u << kAvx2) | (1u << kAvx512Bf16) | (1u << kAmx) : 0u);
  const uint32_t usable = usable_paths() & takes;
  if (path < 0) return 31 - __builtin_clz(usable);
  if (path >= 32 || !(usable >> path & 1u)) return -1;
  return path;
}

// (tile, kv head; -1: all of them): a decode row's kv heads in one task, one after the other:
// they share each block's record (kv heads are adjacent in the pool), so a row's reads stay
// close together.
[[maybe_unused]] std::vector<std::pair<int64_t, int64_t>> row_tasks(
    const std::vector<Tile>& tiles, const Shape& s) {
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t i = 0; i < int64_t(tiles.size()); ++i) {
    if (tiles[i].hi - tiles[i].lo == 1)
      tasks.emplace_back(i, -1);
    else
      for (int64_t h = 0; h < s.kv_heads; ++h) tasks.emplace_back(i, h);
  }
  return tasks;
}

// The tiles' tasks on the avx512_bf16 path (a bf16 pool, D = 64, 128 or 256), or on the amx
// path (kAmx: tiles of several queries on AMX tiles).
template <int D, bool kAmx = false>
void run_avx512_bf16(ffi::ThreadPool& pool, const Inputs<uint16_t>& in,
                     const std::vector<Span>& spans, const std::vector<Tile>& tiles,
                     const Shape& s) {
#ifdef __AVX512BF16__
  const auto tasks = row_tasks(tiles, s);
  parallel_for(pool, int64_t(tasks.size()), [&](int64_t t) {
    thread_local fast::Work work;
    const auto [i, h] = tasks[t];
    const Tile& tile = tiles[i];
    for (int64_t head = std::max<int64_t>(h, 0); head < (h < 0 ? s.kv_heads : h + 1); ++head)
      fast::attend_tile<D, kAmx>(in, s, spans[tile.row], tile, head, work);
  });
#endif
}

// The tiles' tasks on the avx2 path (a bf16 or an int8 pool: decode rows in `avx2::decode`,
// tiles of several queries on the portable code), or an int8 pool's on the avx512_bf16 path
// (kWide: decode rows on `decode16`'s int16 products, tiles on `fast::attend_int8`'s bf16
// products) or on the amx path (kWide and kAmx: the tiles' products on AMX tiles).
template <int D, typename T, bool kWide = false, bool kAmx = false>
void run_avx2(ffi::ThreadPool& pool, const Inputs<T>& in, const std::vector<Span>& spans,
              const std::vector<Tile>& tiles, const Shape& s) {
#if defined(__AVX2__) && defined(__FMA__)
  const auto tasks = row_tasks(tiles, s);
  parallel_for(pool, int64_t(tasks.size()), [&](int64_t t) {
    const auto [i, h] = tasks[t];
    const Tile& tile = tiles[i];
    if (h >= 0) {
#ifdef __AVX512BF16__
      if constexpr (kWide && std::is_same_v<T, int8_t>) {
        thread_local fast::Work work;
        return fast::attend_int8<D, kAmx>(in, s, spans[tile.row], tile, h, work);
      }
#endif
      thread_local Scratch scratch;
      return attend_tile<D, T>(in, s, spans[tile.row], tile, h, scratch);
    }
    thread_local avx2::Work work;
    for (int64_t head = 0; head < s.kv_heads; ++head)
      avx2::decode<D, T, kWide>(in, s, spans[tile.row], tile, head, work);
  });
#endif
}

// The call's tiles on `path` (path_for's answer: one that runs this call).
template <typename T>
void run(ffi::ThreadPool& pool, const Inputs<T>& in, const std::vector<Span>& spans,
         const Shape& s, int64_t path) {
  const std::vector<Tile> tiles = tiles_of(spans, s, in.opt.window);
  zero_uncovered(spans, tiles, s, in.out);
  auto each = [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    if constexpr (std::is_same_v<T, uint16_t> && kDim > 0) {
      if (path == kAvx512Bf16) return run_avx512_bf16<kDim>(pool, in, spans, tiles, s);
      if (path == kAmx) return run_avx512_bf16<kDim, true>(pool, in, spans, tiles, s);
    }
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, int8_t> && kDim > 0)
      if (path == kAvx512Bf16) return run_avx2<kDim, T, true>(pool, in, spans, tiles, s);
#endif
#ifdef JAXPIPE_AMX
    if constexpr (std::is_same_v<T, int8_t> && kDim > 0)
      if (path == kAmx) return run_avx2<kDim, T, true, true>(pool, in, spans, tiles, s);
#endif
    if constexpr (!std::is_same_v<T, float> && kDim > 0)
      if (path == kAvx2) return run_avx2<kDim, T>(pool, in, spans, tiles, s);
    parallel_for(pool, int64_t(tiles.size()) * s.kv_heads, [&](int64_t task) {
      const Tile& tile = tiles[task / s.kv_heads];
      thread_local Scratch scratch;
      attend_tile<kDim, T>(in, s, spans[tile.row], tile, task % s.kv_heads, scratch);
    });
  };
  if (s.dim == 64)
    each(std::integral_constant<int, 64>{});
  else if (s.dim == 128)
    each(std::integral_constant<int, 128>{});
  else if (s.dim == 256)
    each(std::integral_constant<int, 256>{});
  else
    each(std::integral_constant<int, 0>{});
}

// The shapes of a call, or an error message if they do not fit together.
const char* shape_of(ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                     ffi::Buffer<ffi::S32>& table, ffi::Buffer<ffi::S32>& q_start,
                     ffi::Buffer<ffi::S32>& q_len, ffi::Buffer<ffi::S32>& kv_len, Shape& s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2)
    return "ragged_attention: q must be [T,H,D], k/v [L,NB,Hkv,BS,D], table [R,MB]";
  if (!std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return "ragged_attention: k and v shapes differ";
  s = Shape{qd[0], qd[1], kd[2], qd[2], kd[0], kd[1], kd[3], td[0], td[1]};
  for (auto* x : {&q_start, &q_len, &kv_len})
    if (static_cast<int64_t>(x->element_count()) != s.rows)
      return "ragged_attention: q_start, q_len and kv_len must be [R]";
  // An int8 pool's rows hold D codes and a scale (kernels/kv_int8.py).
  const int64_t width = k.element_type() == ffi::S8 ? s.dim + kScaleBytes : s.dim;
  if (kd[4] != width || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.layers < 1 ||
      s.block_size < 1)
    return "ragged_attention: inconsistent shapes";
  if (k.element_type() != v.element_type()) return "ragged_attention: k and v dtypes differ";
  return nullptr;
}

// Each clamped span's tokens inside [0, T): (token, row, position).
struct Placed {
  int64_t token, row, position;
};

std::vector<Placed> placed_tokens(const std::vector<Span>& spans, const Shape& s) {
  std::vector<Placed> out;
  for (int64_t r = 0; r < int64_t(spans.size()); ++r) {
    const Span& sp = spans[r];
    for (int64_t i = std::max<int64_t>(0, -sp.start); i < sp.len && sp.start + i < s.tokens; ++i)
      out.push_back(Placed{sp.start + i, r, sp.first + i});
  }
  return out;
}

// y = x rotated by its position (HF's rotate-half RoPE): c, s the cos and sin of the D / 2
// angles.
inline void rope(const float* x, const float* c, const float* sn, int64_t d, float* y) {
  const int64_t h = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    y[i] = x[i] * c[i] - x[i + h] * sn[i];
    y[i + h] = x[i + h] * c[i] + x[i] * sn[i];
  }
}

inline void store_row(const float* x, int64_t d, float* y) { std::copy(x, x + d, y); }

// x quantized into an int8 row (kernels/kv_int8.py's `quantize`, bit for bit): scale =
// max|x| / 127 rounded up to bf16, codes rint(x / scale), then the scale's bits.
inline void store_row(const float* x, int64_t d, int8_t* y) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float step = amax / 127.f;
  uint32_t bits;
  std::memcpy(&bits, &step, sizeof bits);
  const uint16_t scale_bits = static_cast<uint16_t>((bits + 0xffffu) >> 16);  // ceil to bf16
  const float scale = bf16_to_f32(scale_bits), div = scale > 0 ? scale : 1.f;
  for (int64_t i = 0; i < d; ++i)
    y[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / div), -127.f, 127.f));
  std::memcpy(y + d, &scale_bits, sizeof scale_bits);
}
inline void store_row(const float* x, int64_t d, uint16_t* y) {
  for (int64_t i = 0; i < d; ++i) {
    const float r = round_bf16(x[i]);
    uint32_t bits;
    std::memcpy(&bits, &r, sizeof bits);
    y[i] = static_cast<uint16_t>(bits >> 16);
  }
}

// The new tokens of `write_and_attend`, before it attends: each span token's query heads
// rotated into `q_out`, its key heads rotated and its value heads written into the layer's
// pool (in its storage type) at the token's position; a position whose block's table entry is
// outside [0, NB) is not written (the attention never reads it either).
template <typename T>
void rope_and_write(ffi::ThreadPool& pool, const float* q, const float* kv, const float* cos,
                    const float* sin, const int32_t* table, const std::vector<Span>& spans,
                    const Shape& s, float* q_out, T* k, T* v) {
  const std::vector<Placed> tokens = placed_tokens(spans, s);
  const int64_t d = s.dim, h = s.dim / 2, chunk = 32;
  parallel_for(pool, (int64_t(tokens.size()) + chunk - 1) / chunk, [&](int64_t c) {
    std::vector<float> rotated(d);
    const int64_t end = std::min<int64_t>(int64_t(tokens.size()), (c + 1) * chunk);
    for (int64_t i = c * chunk; i < end; ++i) {
      const Placed& t = tokens[i];
      const float *cs = cos + t.token * h, *sn = sin + t.token * h;
      for (int64_t head = 0; head < s.heads; ++head)
        rope(q + (t.token * s.heads + head) * d, cs, sn, d, q_out + (t.token * s.heads + head) * d);
      const int32_t block = table[t.row * s.max_blocks + t.position / s.block_size];
      if (block < 0 || block >= s.blocks) continue;
      for (int64_t head = 0; head < s.kv_heads; ++head) {
        const int64_t at = ((block * s.kv_heads + head) * s.block_size +
                             t.position % s.block_size) * row_width<T>(d);
        const float* key = kv + ((t.token * 2) * s.kv_heads + head) * d;
        rope(key, cs, sn, d, rotated.data());
        store_row(rotated.data(), d, k + at);
        store_row(kv + ((t.token * 2 + 1) * s.kv_heads + head) * d, d, v + at);
      }
    }
  });
}

// The call's arguments, as the handler receives them (k, v: the pool to read, already holding
// the step's keys and values).
struct Args {
  const float* q;
  void *k, *v;
  const int32_t *table, *q_start, *q_len, *kv_len;
  int32_t layer;
  float* out;
  Options opt;
  int64_t path;  // the `path` attribute (< 0: path_for's choice)
};

// The spans of a call, clamped as the contract says.
std::vector<Span> spans_of(const Args& a, const Shape& s) {
  std::vector<Span> spans(s.rows);
  for (int64_t r = 0; r < s.rows; ++r)
    spans[r] = span_of(a.table + r * s.max_blocks, a.q_start[r], a.q_len[r], a.kv_len[r], s);
  return spans;
}

// Runs the kernel on the pool's layer `layer` (clamped to [0, L)), k/v's elements of type T.
// With `fresh` (q, kv [T, 2, Hkv, D], cos, sin [T, D / 2]: write_and_attend), the step's
// tokens are rotated and written first (a.q then points at a.out, where their queries land).
template <typename T>
void run_layer(ffi::ThreadPool& pool, Args a, const Shape& s,
               const std::array<const float*, 4>* fresh = nullptr) {
  const int64_t l = std::clamp<int64_t>(a.layer, 0, s.layers - 1);
  const int64_t offset = l * s.blocks * s.kv_heads * s.block_size * row_width<T>(s.dim);
  T* k = static_cast<T*>(a.k) + offset;
  T* v = static_cast<T*>(a.v) + offset;
  const std::vector<Span> spans = spans_of(a, s);
  if (fresh != nullptr) {
    const auto [q, kv, cos, sin] = *fresh;
    rope_and_write<T>(pool, q, kv, cos, sin, a.table, spans, s, a.out, k, v);
    a.q = a.out;  // each task reads its queries before it writes their outputs
  }
  run<T>(pool, Inputs<T>{a.q, k, v, a.table, a.out, a.opt}, spans, s, a.path);
}

// Runs the call on the path it asks for (checked before anything is written), by k/v's type.
template <typename... Fresh>
ffi::Error run_typed(ffi::ThreadPool& pool, ffi::DataType type, Args a, const Shape& s,
                    const Fresh*... fresh) {
  const int64_t asked = a.path;
  a.path = path_for(asked, type == ffi::U16 || type == ffi::BF16, type == ffi::S8, s.dim);
  if (a.path < 0)
    return ffi::Error::InvalidArgument(
        "ragged_attention: path " + std::to_string(asked) + " is not built here or cannot run "
        "this call (the avx paths take head dim 64, 128 or 256, bf16 and int8 pools)");
  switch (type) {
    case ffi::F32:
      run_layer<float>(pool, a, s, fresh...);
      return ffi::Error::Success();
    case ffi::U16:
    case ffi::BF16:
      run_layer<uint16_t>(pool, a, s, fresh...);
      return ffi::Error::Success();
    case ffi::S8:
      run_layer<int8_t>(pool, a, s, fresh...);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("ragged_attention: k/v must be f32, bf16, u16 or s8");
  }
}

// The call's scalars: the layer and window (runtime values) and the attributes.
struct Scalars {
  ffi::BufferR0<ffi::S32> layer, window;
  float scale, softcap;
  int64_t path;
};

Args args_of(ffi::Buffer<ffi::F32>& q, void* k, void* v, ffi::Buffer<ffi::S32>& table,
             ffi::Buffer<ffi::S32>& q_start, ffi::Buffer<ffi::S32>& q_len,
             ffi::Buffer<ffi::S32>& kv_len, const Scalars& c, float* out) {
  return Args{q.typed_data(), k, v, table.typed_data(), q_start.typed_data(),
              q_len.typed_data(), kv_len.typed_data(), *c.layer.typed_data(), out,
              Options{*c.window.typed_data(), c.scale, c.softcap}, c.path};
}

ffi::Error RaggedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> table,
                               ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len,
                               ffi::Buffer<ffi::S32> kv_len, ffi::BufferR0<ffi::S32> layer,
                               ffi::BufferR0<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out,
                               float scale, float softcap, int64_t path) {
  Shape s;
  if (const char* error = shape_of(q, k, v, table, q_start, q_len, kv_len, s))
    return ffi::Error::InvalidArgument(error);
  return run_typed(pool, k.element_type(),
                  args_of(q, k.untyped_data(), v.untyped_data(), table, q_start, q_len, kv_len,
                          Scalars{layer, window, scale, softcap, path}, out->typed_data()),
                  s);
}

// write_and_attend: the pool comes back as outputs 1 and 2, aliased to inputs 4 and 5 (the
// same memory), so the step's keys and values are written in place.
ffi::Error RaggedAttentionWriteImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv,
    ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len,
    ffi::Buffer<ffi::S32> kv_len, ffi::BufferR0<ffi::S32> layer, ffi::BufferR0<ffi::S32> window,
    ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
    ffi::Result<ffi::AnyBuffer> v_out, float scale, float softcap, int64_t path) {
  Shape s;
  if (const char* error = shape_of(q, k, v, table, q_start, q_len, kv_len, s))
    return ffi::Error::InvalidArgument(error);
  auto kd = kv.dimensions(), cd = cos.dimensions(), sd = sin.dimensions();
  if (kd.size() != 4 || kd[0] != s.tokens || kd[1] != 2 || kd[2] != s.kv_heads ||
      kd[3] != s.dim || cd.size() != 2 || cd[0] != s.tokens || cd[1] != s.dim / 2 ||
      !std::equal(cd.begin(), cd.end(), sd.begin(), sd.end()) || s.dim % 2 != 0)
    return ffi::Error::InvalidArgument(
        "write_and_attend: kv must be [T,2,Hkv,D] and cos, sin [T,D/2] (D even)");
  if (k_out->untyped_data() != k.untyped_data() || v_out->untyped_data() != v.untyped_data())
    return ffi::Error::InvalidArgument("write_and_attend: the pool outputs must alias k, v");
  const std::array<const float*, 4> fresh{q.typed_data(), kv.typed_data(), cos.typed_data(),
                                          sin.typed_data()};
  return run_typed(pool, k.element_type(),
                  args_of(q, k_out->untyped_data(), v_out->untyped_data(), table, q_start,
                          q_len, kv_len, Scalars{layer, window, scale, softcap, path},
                          out->typed_data()),
                  s, &fresh);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeRaggedAttention, RaggedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("path"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeRaggedAttentionWrite, RaggedAttentionWriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("path"));

// Bit i set: path i (Path above) is compiled into this build (-march=native) and runs here
// (AMX permitted).
extern "C" uint32_t jaxpipe_attention_paths() { return usable_paths(); }

// 1 where the avx512_bf16 path runs an int8 pool's decode rows by int16 products (vnni::).
extern "C" uint32_t jaxpipe_attention_int16_decode() {
#ifdef JAXPIPE_INT16_DECODE
  return 1;
#else
  return 0;
#endif
}
