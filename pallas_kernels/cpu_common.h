// What jspec's CPU kernels share: 16-float vectors (GCC vector extensions: AVX-512 registers
// where the CPU has them, two AVX2 registers elsewhere) and the work split between the calling
// thread and XLA's intra-op thread pool.
//
// parallel_for(pool, n, fn) calls fn(i) for every i in [0, n), each once, on the calling thread
// and up to (pool threads - 1) helpers, which take indices from a shared counter. It returns as
// soon as every index is done and no helper is inside fn: a helper that wakes up late finds the
// counter spent and touches only the shared state (kept alive by its own reference), never the
// caller's stack, so the caller does not wait for a sleeping thread to wake.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

// Which code the kernels compile: AVX-512 where the CPU has it (the 16-lane vectors below are
// one register); on a CPU with AVX2 and FMA but not AVX-512, tiles written in AVX2 intrinsics
// (JSPEC_AVX2_TILES: 16 registers of 8 floats, so smaller tiles than the 16-lane code, which
// there would keep its accumulators in memory); elsewhere whatever the compiler makes of them.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JSPEC_AVX2_TILES 1
#endif

namespace jspec_cpu {

constexpr int kLanes = 16;

typedef float v16 __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

#if defined(__AVX512F__)
// One 512-bit load or store. (A memcpy of the 64 bytes is what GCC makes of it elsewhere; with
// -march=native on Intel cores that prefer 256-bit vectors it copied each vector through the stack
// as two halves, then re-loaded it whole, stalling on every load.)
inline v16 load(const float* p) { return reinterpret_cast<v16>(_mm512_loadu_ps(p)); }
inline void store(float* p, v16 v) { _mm512_storeu_ps(p, reinterpret_cast<__m512>(v)); }
#else
inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
#endif

inline float hsum(v16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

inline v16 splat(float f) { return v16{} + f; }

#ifdef JSPEC_AVX2_TILES
// Keeps a loaded vector in its register for the FMAs that use it. Left to itself GCC 12 folds
// the load into each FMA that reads the vector (vfmadd231ps mem, ...): a tile of 3 x 4 outputs
// then loads 26 vectors per 24 FMAs instead of 14, and on a core that loads one 256-bit vector
// per cycle (Zen 1) the loads, not the FMAs, set the pace (BENCHMARKS.md, nineteenth session).
inline void pin(__m256& v) { asm("" : "+x"(v)); }

// Sum of the 8 lanes of an AVX2 register (the two halves, then pairwise), the same order always.
inline float hsum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    int64_t n = 0;
    std::function<void(int64_t)> fn;
  };
  auto st = std::make_shared<State>();
  st->n = n;
  st->fn = std::move(fn);
  auto run = [](State& s) {
    for (int64_t i = s.next.fetch_add(1); i < s.n; i = s.next.fetch_add(1)) s.fn(i);
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0), n - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([st, run] {
      st->active.fetch_add(1);
      run(*st);
      st->active.fetch_sub(1);
    });
  }
  run(*st);
  while (st->active.load() > 0) std::this_thread::yield();
}

}  // namespace jspec_cpu
