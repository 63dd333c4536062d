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
//   out     [T, H, D]             float32
//
// Query i of row r's span sits at position kv_len - q_len + i and attends over keys 0 .. that
// position. Tokens in no span get zeros. Out-of-range inputs are never read out of bounds:
// kv_len is clamped to [0, MB * BS], q_len to [0, kv_len]; a span's tokens outside [0, T) are
// skipped; a query stops before the first block it needs whose table entry is outside [0, NB)
// (zeros if that is block 0); the layer is clamped to [0, L).
//
// A task is (query tile, kv head): up to kTile consecutive queries of one span and the G = H /
// Hkv query heads of one kv head, so each K/V block is read once for G * kTile queries. Two
// passes over the keys of the tile's last query (scores, then the probability-weighted sum of
// values), block by block: blocks past them are never read; the keys of a query's causal
// future inside the tile are scored and then get probability 0. Decode (a one-query tile) does
// exactly what decode_attention does: G dots per key. A tile of several queries scores 16
// keys at a time against a transposed copy (vector accumulators, no horizontal sums) and,
// for a compile-time D, sums values with its outputs held in registers. Tasks, heaviest
// first, are shared out over XLA's
// intra-op thread pool. With a bf16 cache, q and the probabilities are rounded to bf16 before
// their dots, as the XLA reference (`llama.decode_attention`) does; accumulation is float32.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;  // query positions per task

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

struct Shape {
  int64_t tokens, heads, kv_heads, dim;  // T, H, Hkv, D
  int64_t layers, blocks, block_size;    // L, NB, BS
  int64_t rows, max_blocks;              // R, MB: table rows and entries per row
};

// One row's span after clamping: its queries i = 0 .. len - 1 are tokens start + i at
// positions first + i, attending over keys 0 .. min(first + i + 1, usable) - 1.
struct Span {
  int64_t start, len, first, usable;
};

// A task's queries: span indices lo .. hi - 1 of row `row` (all inside [0, T)).
struct Tile {
  int64_t row, lo, hi, keys;  // keys: those its last query sees (what the task reads)
};

// One (row, kv head)'s keys or values in the pool: position t is block(t / BS)[t % BS].
template <typename T>
struct Paged {
  const T* head;         // the layer's block 0 at kv head h; blocks are block_stride apart
  const int32_t* table;  // the row's MB block numbers
  int64_t block_stride, block_size;
  const T* block(int64_t j) const { return head + int64_t{table[j]} * block_stride; }
  // Block j + 1 if the first `len` positions reach into it, else nullptr.
  const T* after(int64_t j, int64_t len) const {
    return (j + 1) * block_size < len ? block(j + 1) : nullptr;
  }
};

// The positions a row's queries may attend over: len (already clamped to [0, MB * BS]) cut
// before the first block it needs whose table entry is outside [0, NB) (never read).
int64_t usable_length(int64_t len, const int32_t* table, const Shape& s) {
  for (int64_t j = 0; j * s.block_size < len; ++j)
    if (table[j] < 0 || table[j] >= s.blocks) return j * s.block_size;
  return len;
}

// Row r's span, clamped as the contract says.
Span span_of(const int32_t* table, int32_t q_start, int32_t q_len, int32_t kv_len,
             const Shape& s) {
  const int64_t kv = std::clamp<int64_t>(kv_len, 0, s.max_blocks * s.block_size);
  const int64_t ql = std::clamp<int64_t>(q_len, 0, kv);
  return Span{q_start, ql, kv - ql, usable_length(kv, table, s)};
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
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, d);
    load_row(k + t * d, row, d);
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

// kt [D, kKeys] <- keys k [n, D] (n <= kKeys) as float32, transposed, zero-padded past n.
template <int DIM, typename T>
void load_transposed(const T* __restrict k, int64_t n, int64_t dyn_d, float* __restrict kt) {
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  for (int64_t t = 0; t < kKeys; ++t)
    for (int64_t i = 0; i < d; ++i) kt[i * kKeys + t] = t < n ? to_f32(k[t * d + i]) : 0.f;
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
    load_transposed<DIM>(k + t0 * d, c, d, kt);
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
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, d);
    load_row(v + t * d, row, d);
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
    for (int64_t t = 0; t < c; ++t) load_row(v + (t0 + t) * DIM, vf + t * DIM, DIM);
    int64_t m = 0;
    for (; m + 2 <= m_count; m += 2)
      chunk_values<2, DIM>(probs + m * stride + t0, vf, c, stride, out + m * DIM);
    for (; m < m_count; ++m)
      chunk_values<1, DIM>(probs + m * stride + t0, vf, c, stride, out + m * DIM);
  }
}

// In place: s[0..len) -> probabilities (rounded to bf16 when `round` is set), s[len..stride)
// -> 0 (keys the query does not see).
void softmax(float* s, int64_t len, int64_t stride, bool round) {
  std::fill(s + len, s + stride, 0.f);
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
};

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

// scores [M, len] = q_m . k_t / sqrt(D) over the keys 0..len-1, block by block; `decode`
// (one query, G vectors): G dots per key, exactly as decode_attention.
template <int DIM, typename T>
void scores_of(const float* q, const Paged<T>& k, int64_t len, int64_t m_count, bool decode,
               int64_t d, float* scores, float* buf) {
  const float scale = 1.f / std::sqrt(float(d));
  for (int64_t j = 0, t = 0; t < len; ++j, t += k.block_size) {
    const int64_t n = std::min(k.block_size, len - t);
    if (decode)
      block_scores<DIM>(q, k.block(j), k.after(j, len), n, m_count, d, scale, scores + t, len,
                        buf);
    else
      block_scores_tiled<DIM>(q, k.block(j), n, m_count, d, scale, scores + t, len, buf);
  }
}

// out [M, D] += sum_t probs[m * len + t] * v_t over the values 0..len-1, block by block.
template <int DIM, typename T>
void weighted_values(const float* probs, const Paged<T>& v, int64_t len, int64_t m_count,
                     bool decode, int64_t d, float* out, float* buf) {
  for (int64_t j = 0, t = 0; t < len; ++j, t += v.block_size) {
    const int64_t n = std::min(v.block_size, len - t);
    if constexpr (DIM > 0)
      if (!decode) {
        block_values_tiled<DIM>(probs + t, v.block(j), n, m_count, len, out, buf);
        continue;
      }
    block_values<DIM>(probs + t, v.block(j), v.after(j, len), n, m_count, d, len, out, buf);
  }
}

// One task: a tile of one span, kv head h. DIM > 0 fixes the head dim at compile time.
template <int DIM, typename T>
void attend_tile(const Inputs<T>& in, const Shape& s, const Span& span, const Tile& tile,
                 int64_t h, Scratch& w) {
  const int64_t g_count = s.heads / s.kv_heads, d = s.dim, count = tile.hi - tile.lo;
  const int64_t token = span.start + tile.lo, m_count = count * g_count, len = tile.keys;
  const bool bf16 = sizeof(T) == 2;
  w.q.resize(m_count * d);
  w.scores.resize(m_count * len);
  w.out.assign(m_count * d, 0.f);
  w.row.resize(d * kKeys);
  load_queries(in.q, s, token, h, count, bf16, w.q.data());
  const int32_t* table = in.table + tile.row * s.max_blocks;
  const int64_t head = h * s.block_size * d, stride = s.kv_heads * s.block_size * d;
  const Paged<T> k{in.k + head, table, stride, s.block_size};
  const Paged<T> v{in.v + head, table, stride, s.block_size};
  scores_of<DIM>(w.q.data(), k, len, m_count, count == 1, d, w.scores.data(), w.row.data());
  for (int64_t m = 0; m < m_count; ++m) {  // query lo + m / G sees keys 0..its position
    const int64_t keys = std::min(span.first + tile.lo + m / g_count + 1, span.usable);
    softmax(w.scores.data() + m * len, std::max<int64_t>(keys, 0), len, bf16);
  }
  weighted_values<DIM>(w.scores.data(), v, len, m_count, count == 1, d, w.out.data(),
                       w.row.data());
  store_outputs(w.out.data(), s, token, h, count, in.out);
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

// The step's tiles, heaviest first: each span's queries inside [0, T), kTile at a time.
std::vector<Tile> tiles_of(const std::vector<Span>& spans, const Shape& s) {
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < int64_t(spans.size()); ++r) {
    const Span& sp = spans[r];
    const int64_t lo = std::max<int64_t>(0, -sp.start);
    const int64_t hi = std::min<int64_t>(sp.len, s.tokens - sp.start);
    for (int64_t i = lo; i < hi; i += kTile) {
      const int64_t end = std::min(i + kTile, hi);
      tiles.push_back(Tile{r, i, end, std::min(sp.first + end, sp.usable)});
    }
  }
  auto work = [](const Tile& t) { return (t.hi - t.lo) * t.keys; };  // dots per query head
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

template <typename T>
void run(ffi::ThreadPool& pool, const Inputs<T>& in, const std::vector<Span>& spans,
         const Shape& s) {
  const std::vector<Tile> tiles = tiles_of(spans, s);
  zero_uncovered(spans, tiles, s, in.out);
  auto each = [&](auto dim) {
    parallel_for(pool, int64_t(tiles.size()) * s.kv_heads, [&](int64_t task) {
      thread_local Scratch scratch;
      const Tile& tile = tiles[task / s.kv_heads];
      attend_tile<decltype(dim)::value, T>(in, s, spans[tile.row], tile, task % s.kv_heads,
                                           scratch);
    });
  };
  if (s.dim == 64)
    each(std::integral_constant<int, 64>{});
  else if (s.dim == 128)
    each(std::integral_constant<int, 128>{});
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
  if (kd[4] != s.dim || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.layers < 1 ||
      s.block_size < 1)
    return "ragged_attention: inconsistent shapes";
  if (k.element_type() != v.element_type()) return "ragged_attention: k and v dtypes differ";
  return nullptr;
}

// The call's arguments, as the handler receives them.
struct Args {
  ffi::Buffer<ffi::F32> q;
  ffi::AnyBuffer k, v;
  ffi::Buffer<ffi::S32> table, q_start, q_len, kv_len;
  int32_t layer;
  float* out;
};

// Runs the kernel on the pool's layer `layer` (clamped to [0, L)), k/v's elements of type T.
template <typename T>
void run_layer(ffi::ThreadPool& pool, const Args& a, const Shape& s) {
  const int64_t l = std::clamp<int64_t>(a.layer, 0, s.layers - 1);
  const int64_t offset = l * s.blocks * s.kv_heads * s.block_size * s.dim;
  const int32_t* table = a.table.typed_data();
  const Inputs<T> in{a.q.typed_data(), static_cast<const T*>(a.k.untyped_data()) + offset,
                     static_cast<const T*>(a.v.untyped_data()) + offset, table, a.out};
  std::vector<Span> spans(s.rows);
  for (int64_t r = 0; r < s.rows; ++r)
    spans[r] = span_of(table + r * s.max_blocks, a.q_start.typed_data()[r],
                       a.q_len.typed_data()[r], a.kv_len.typed_data()[r], s);
  run<T>(pool, in, spans, s);
}

ffi::Error RaggedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> table,
                               ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_len,
                               ffi::Buffer<ffi::S32> kv_len, ffi::BufferR0<ffi::S32> layer,
                               ffi::ResultBuffer<ffi::F32> out) {
  Shape s;
  if (const char* error = shape_of(q, k, v, table, q_start, q_len, kv_len, s))
    return ffi::Error::InvalidArgument(error);
  const Args a{q, k, v, table, q_start, q_len, kv_len, *layer.typed_data(), out->typed_data()};
  switch (k.element_type()) {
    case ffi::F32:
      run_layer<float>(pool, a, s);
      return ffi::Error::Success();
    case ffi::U16:
    case ffi::BF16:
      run_layer<uint16_t>(pool, a, s);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("ragged_attention: k/v must be f32, bf16 or u16");
  }
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
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
