// Decode attention on the CPU: one query token per sequence over its keys and values, which
// live in a paged pool and are found through a block table.
//
//   q     [B, H, D]              float32
//   k,v   [L, NB, Hkv, BS, D]    float32, or bfloat16 (or its bits, uint16): L layers of a pool
//                                of NB blocks of BS tokens
//   len   [B]                    int32: tokens each row attends to (0 = idle row -> zeros)
//   table [B, MB]                int32: row b's position t is k[layer, table[b, t / BS], h, t % BS]
//   layer []                     int32: which of the L layers to read (a runtime value, so the
//                                pool of a whole pipeline stage is read in place inside a scan)
//   out   [B, H, D]              float32
//
// Out-of-range inputs are never read out of bounds: a length is clamped to [0, MB * BS]; a row
// stops before the first block it needs whose table entry is outside [0, NB) (it attends over
// the positions before that block only, or is idle if that is block 0); the layer is clamped to
// [0, L). Entries of blocks a row does not need are never looked at.
//
// Each (row, kv head) pair is one task: its G = H / Hkv query heads read the row's keys once
// (two passes: scores, then the probability-weighted sum of values), block by block (a block's
// BS tokens are contiguous [BS, D] rows for one head), touching only `len` positions, so no row
// pays for another row's length. Tasks are shared out over XLA's own intra-op thread pool. With
// a bf16 cache, q and the probabilities are rounded to bf16 before their dots, as the XLA
// reference (`llama.decode_attention`) does; accumulation is float32.
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
  int64_t rows, heads, kv_heads, dim;   // B, H, Hkv, D
  int64_t layers, blocks, block_size;   // L, NB, BS
  int64_t max_blocks;                   // MB: table entries per row
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

// The positions row b attends over: lens[b] clamped to [0, MB * BS], cut before the first
// block it needs whose table entry is outside [0, NB) (that block is never read).
int64_t usable_length(int32_t len, const int32_t* table, const Shape& s) {
  const int64_t n = std::clamp<int64_t>(len, 0, s.max_blocks * s.block_size);
  for (int64_t j = 0; j * s.block_size < n; ++j)
    if (table[j] < 0 || table[j] >= s.blocks) return j * s.block_size;
  return n;
}

// Asks for row t of `next` (the block after the one being read, or nullptr) to be cached: a
// block is too short a stream for the hardware prefetcher (measured: 8% faster at BS = 16).
template <typename T>
inline void prefetch_row(const T* next, int64_t t, int64_t d) {
  if (next == nullptr) return;
  const char* p = reinterpret_cast<const char*>(next + t * d);
  for (int64_t i = 0; i < d * int64_t{sizeof(T)}; i += 64) __builtin_prefetch(p + i);
}

// scores[g * stride + t] = q_g . k_t * scale for one block's n keys k [n, D] and the G queries
// of one kv head. __restrict lets the compiler keep `row` in registers across the G dots
// (measured: 15% faster).
template <int DIM, typename T>
void block_scores(const float* __restrict qg, const T* __restrict k, const T* next, int64_t n,
                  int64_t g_count, int64_t dyn_d, float scale, float* __restrict scores,
                  int64_t stride, float* __restrict row) {
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, d);
    load_row(k + t * d, row, d);
    for (int64_t g = 0; g < g_count; ++g) {
      const float* qq = qg + g * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qq[i] * row[i];
      scores[g * stride + t] = acc * scale;
    }
  }
}

// out[g] += sum_t probs[g * stride + t] * v_t for one block's n values v [n, D] and the G
// queries of one kv head.
template <int DIM, typename T>
void block_values(const float* __restrict probs, const T* __restrict v, const T* next,
                  int64_t n, int64_t g_count, int64_t dyn_d, int64_t stride,
                  float* __restrict out, float* __restrict row) {
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_row(next, t, d);
    load_row(v + t * d, row, d);
    for (int64_t g = 0; g < g_count; ++g) {
      const float p = probs[g * stride + t];
      float* o = out + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += p * row[i];
    }
  }
}

// scores [G, len]: q_g . k_t / sqrt(D) over the row's first len keys, block by block.
template <int DIM, typename T>
void scores_of(const float* qg, const Paged<T>& k, int64_t len, int64_t g_count, int64_t d,
               float* scores, float* row) {
  const float scale = 1.f / std::sqrt(float(d));
  for (int64_t j = 0, t = 0; t < len; ++j, t += k.block_size)
    block_scores<DIM>(qg, k.block(j), k.after(j, len), std::min(k.block_size, len - t), g_count,
                      d, scale, scores + t, len, row);
}

// In place: scores -> probabilities (rounded to bf16 when `round` is set).
void softmax(float* s, int64_t len, bool round) {
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

// out [G, D] = sum_t probs[g * len + t] * v_t over the row's first len values, block by block.
template <int DIM, typename T>
void weighted_values(const float* probs, const Paged<T>& v, int64_t len, int64_t g_count,
                     int64_t d, float* out, float* row) {
  std::fill(out, out + g_count * d, 0.f);
  for (int64_t j = 0, t = 0; t < len; ++j, t += v.block_size)
    block_values<DIM>(probs + t, v.block(j), v.after(j, len), std::min(v.block_size, len - t),
                      g_count, d, len, out, row);
}

// The pointers one task reads: the layer's pool (already offset to `layer`) and the task's row.
template <typename T>
struct Inputs {
  const float* q;
  const T *k, *v;  // the selected layer: [NB, Hkv, BS, D]
  const int32_t *lens, *table;
  float* out;
};

// One task: row b, kv head h. DIM > 0 fixes the head dim at compile time (unrolled loops).
template <int DIM, typename T>
void attend_one(const Inputs<T>& in, const Shape& s, int64_t task) {
  const int64_t b = task / s.kv_heads, h = task % s.kv_heads;
  const int64_t g_count = s.heads / s.kv_heads, d = s.dim;
  float* o = in.out + (b * s.heads + h * g_count) * d;
  const int32_t* table = in.table + b * s.max_blocks;
  const int64_t len = usable_length(in.lens[b], table, s);
  if (len == 0) {
    std::fill(o, o + g_count * d, 0.f);
    return;
  }
  const bool bf16 = sizeof(T) == 2;
  std::vector<float> qg(g_count * d), scores(g_count * len), row(d);
  const float* qb = in.q + (b * s.heads + h * g_count) * d;
  for (int64_t i = 0; i < g_count * d; ++i) qg[i] = bf16 ? round_bf16(qb[i]) : qb[i];
  const int64_t head = h * s.block_size * d, stride = s.kv_heads * s.block_size * d;
  const Paged<T> k{in.k + head, table, stride, s.block_size};
  const Paged<T> v{in.v + head, table, stride, s.block_size};
  scores_of<DIM>(qg.data(), k, len, g_count, d, scores.data(), row.data());
  for (int64_t g = 0; g < g_count; ++g) softmax(scores.data() + g * len, len, bf16);
  weighted_values<DIM>(scores.data(), v, len, g_count, d, o, row.data());
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

template <typename T>
void run(ffi::ThreadPool& pool, const Inputs<T>& in, const Shape& s) {
  auto each = [&](auto dim) {
    parallel_for(pool, s.rows * s.kv_heads, [&](int64_t task) {
      attend_one<decltype(dim)::value, T>(in, s, task);
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
                     ffi::Buffer<ffi::S32>& lens, ffi::Buffer<ffi::S32>& table, Shape& s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2)
    return "decode_attention: q must be [B,H,D], k/v [L,NB,Hkv,BS,D], table [B,MB]";
  if (!std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return "decode_attention: k and v shapes differ";
  s = Shape{qd[0], qd[1], kd[2], qd[2], kd[0], kd[1], kd[3], td[1]};
  const auto n_lens = static_cast<int64_t>(lens.element_count());
  if (kd[4] != s.dim || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.layers < 1 ||
      s.block_size < 1 || n_lens != s.rows || td[0] != s.rows)
    return "decode_attention: inconsistent shapes";
  if (k.element_type() != v.element_type()) return "decode_attention: k and v dtypes differ";
  return nullptr;
}

// Runs the kernel on the pool's layer `layer` (clamped to [0, L)), k/v's elements of type T.
template <typename T>
void run_layer(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k,
               ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& lens, ffi::Buffer<ffi::S32>& table,
               int32_t layer, float* out, const Shape& s) {
  const int64_t l = std::clamp<int64_t>(layer, 0, s.layers - 1);
  const int64_t offset = l * s.blocks * s.kv_heads * s.block_size * s.dim;
  const Inputs<T> in{q.typed_data(), static_cast<const T*>(k.untyped_data()) + offset,
                     static_cast<const T*>(v.untyped_data()) + offset, lens.typed_data(),
                     table.typed_data(), out};
  run<T>(pool, in, s);
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lens,
                               ffi::Buffer<ffi::S32> table, ffi::BufferR0<ffi::S32> layer,
                               ffi::ResultBuffer<ffi::F32> out) {
  Shape s;
  if (const char* error = shape_of(q, k, v, lens, table, s))
    return ffi::Error::InvalidArgument(error);
  const int32_t l = *layer.typed_data();
  switch (k.element_type()) {
    case ffi::F32:
      run_layer<float>(pool, q, k, v, lens, table, l, out->typed_data(), s);
      return ffi::Error::Success();
    case ffi::U16:
    case ffi::BF16:
      run_layer<uint16_t>(pool, q, k, v, lens, table, l, out->typed_data(), s);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("decode_attention: k/v must be f32, bf16 or u16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
