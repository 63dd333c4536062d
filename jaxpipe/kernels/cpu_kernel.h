// What jaxpipe's CPU kernels share (matmul.cc, int8_matmul.cc, ragged_attention.cc): the
// task loop over XLA's thread pool, the prefetch of a thread's next panel, compile-time
// unrolling, the masked lanes of a partial 256-bit vector, the gated MLP's silu(g) * u, and
// AMX's tile setup. Included by each kernel's source, which kernels/build.py compiles with
// this directory on the include path (and this header in its cache key).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef __AMX_TILE__
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxpipe_cpu {

namespace ffi = xla::ffi;

// Shares tasks 0..n-1 between the calling thread and the pool; returns when all are done.
// A thread claims its next task before it runs one: fn(i, next), next = -1 when none is left,
// so it can prefetch what next reads (or fn(i), where nothing is prefetched).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &fn]() {
    for (int64_t i = state->next.fetch_add(1); i < n;) {
      const int64_t next = state->next.fetch_add(1);
      if constexpr (std::is_invocable_v<F, int64_t, int64_t>)
        fn(i, next < n ? next : -1);
      else
        fn(i);
      state->done.fetch_add(1);
      i = next;
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

// Bytes to bring into L2 while a task computes: the panel its thread multiplies next, so its
// stream from memory overlaps this one's compute instead of stalling the next task's start.
struct Ahead {
  const char* bytes = nullptr;
  int64_t size = 0;
};

// One tile's share of an Ahead: `per_j` lines at each of its first `iters` rows of the panel
// (pair rows, quad rows). Written out in each tile's loop: in a function of its own, GCC
// deems the prefetches side-effect free and drops the calls.
struct AheadTile {
  const char* p = nullptr;
  int64_t per_j = 0, iters = 0;
};

// Tile `i` of `tiles` over a panel of `rows` rows: its contiguous share of a's lines.
inline AheadTile ahead_tile(const Ahead& a, int64_t i, int64_t tiles, int64_t rows) {
  const int64_t lines = (a.size + 63) / 64, share = (lines + tiles - 1) / tiles;
  const int64_t mine = std::max<int64_t>(0, std::min(share, lines - i * share));
  if (a.bytes == nullptr || mine == 0 || rows == 0) return {};
  const int64_t per_j = (share + rows - 1) / rows;
  return {a.bytes + 64 * i * share, per_j, (mine + per_j - 1) / per_j};
}

// f(0), .., f(N - 1) with compile-time indices, so GCC keeps arrays of vectors indexed by them
// in registers (it spills them when loops index them).
template <typename F, int... I>
__attribute__((always_inline)) inline void unroll(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__attribute__((always_inline)) inline void unroll(F&& f) {
  unroll(f, std::make_integer_sequence<int, N>{});
}

// y = silu(g) * u = g / (1 + exp(-g)) * u, n values (exp's argument capped at 88: below
// g = -88 the product is 0 to float precision either way).
inline void gate(const float* g, const float* u, int64_t n, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.f + std::exp(std::min(-g[i], 88.f))) * u[i];
}

#ifdef __AVX2__
// Lanes 0 .. n - 1 set (n in 0..8): the mask of a partial vector's loads and stores.
inline __m256i lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

#ifdef __AMX_TILE__
// Linux keeps the AMX tile state off until a process asks for it (once, for all its threads).
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 at 16 rows of 64 bytes: the kernels' four C tiles, two A and two B. Loaded at
// each task: other code on the thread (oneDNN) may have changed it.
inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}
#endif

}  // namespace jaxpipe_cpu
