// Decode attention on the CPU: one query token per sequence over its cached keys and values.
//
//   q   [B, H, D]      float32
//   k,v [N, Hkv, S, D] float32, or bfloat16 (its bits, uint16): one layer's cache, N >= B
//   len [B]            int32: tokens each row attends to (0 = idle row -> zeros)
//   out [B, H, D]      float32
//
// Each (row, kv head) pair is one task: its G = H / Hkv query heads read the row's keys once
// (two passes: scores, then the probability-weighted sum of values), touching only `len`
// positions, so no row pays for another row's length. Tasks are shared out over XLA's own
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
  int64_t rows, heads, kv_heads, seq, dim;
};

// scores[g * len + t] = q_g . k_t / sqrt(D) for the G queries of one kv head.
template <int DIM, typename T>
void scores_of(const float* qg, const T* k, int64_t len, int64_t g_count, int64_t dyn_d,
               float scale, float* scores, float* row) {
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  for (int64_t t = 0; t < len; ++t) {
    load_row(k + t * d, row, d);
    for (int64_t g = 0; g < g_count; ++g) {
      const float* qq = qg + g * d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qq[i] * row[i];
      scores[g * len + t] = acc * scale;
    }
  }
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

template <int DIM, typename T>
void weighted_values(const float* probs, const T* v, int64_t len, int64_t g_count,
                     int64_t dyn_d, float* out, float* row) {
  const int64_t d = DIM > 0 ? DIM : dyn_d;
  std::fill(out, out + g_count * d, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    load_row(v + t * d, row, d);
    for (int64_t g = 0; g < g_count; ++g) {
      const float p = probs[g * len + t];
      float* o = out + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += p * row[i];
    }
  }
}

// One task: row b, kv head h. DIM > 0 fixes the head dim at compile time (unrolled loops).
template <int DIM, typename T>
void attend_one(const float* q, const T* k, const T* v, const int32_t* lens, float* out,
                const Shape& s, int64_t task) {
  const int64_t b = task / s.kv_heads, h = task % s.kv_heads;
  const int64_t g_count = s.heads / s.kv_heads, d = s.dim;
  float* o = out + (b * s.heads + h * g_count) * d;
  const int64_t len = std::min<int64_t>(std::max<int32_t>(lens[b], 0), s.seq);
  if (len == 0) {
    std::fill(o, o + g_count * d, 0.f);
    return;
  }
  const bool bf16 = sizeof(T) == 2;
  std::vector<float> qg(g_count * d), scores(g_count * len), row(d);
  const float* qb = q + (b * s.heads + h * g_count) * d;
  for (int64_t i = 0; i < g_count * d; ++i) qg[i] = bf16 ? round_bf16(qb[i]) : qb[i];
  const int64_t base = (b * s.kv_heads + h) * s.seq * d;
  scores_of<DIM>(qg.data(), k + base, len, g_count, d, 1.f / std::sqrt(float(d)), scores.data(),
            row.data());
  for (int64_t g = 0; g < g_count; ++g) softmax(scores.data() + g * len, len, bf16);
  weighted_values<DIM>(scores.data(), v + base, len, g_count, d, o, row.data());
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
void run(ffi::ThreadPool& pool, const float* q, const void* k, const void* v,
         const int32_t* lens, float* out, const Shape& s) {
  const T* kt = static_cast<const T*>(k);
  const T* vt = static_cast<const T*>(v);
  auto each = [&](auto dim) {
    parallel_for(pool, s.rows * s.kv_heads, [&](int64_t task) {
      attend_one<decltype(dim)::value, T>(q, kt, vt, lens, out, s, task);
    });
  };
  if (s.dim == 64)
    each(std::integral_constant<int, 64>{});
  else if (s.dim == 128)
    each(std::integral_constant<int, 128>{});
  else
    each(std::integral_constant<int, 0>{});
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lens,
                               ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: q must be [B,H,D], k/v [N,Hkv,S,D]");
  Shape s{qd[0], qd[1], kd[1], kd[2], qd[2]};
  if (kd[0] < s.rows || kd[3] != s.dim || s.heads % s.kv_heads != 0 ||
      lens.element_count() != s.rows)
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("decode_attention: k and v dtypes differ");
  switch (k.element_type()) {
    case ffi::F32:
      run<float>(pool, q.typed_data(), k.untyped_data(), v.untyped_data(), lens.typed_data(),
                 out->typed_data(), s);
      return ffi::Error::Success();
    case ffi::U16:
    case ffi::BF16:
      run<uint16_t>(pool, q.typed_data(), k.untyped_data(), v.untyped_data(),
                    lens.typed_data(), out->typed_data(), s);
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
                                  .Ret<ffi::Buffer<ffi::F32>>());
