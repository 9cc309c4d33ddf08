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
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#include <cstdlib>

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

// One job of parallel_for: indices taken from a shared counter by every thread that runs it.
struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
  int64_t n = 0;
  std::function<void(int64_t)> fn;

  void run() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  }
};

// Helper threads of jspec's own that, after a job, spin for JSPEC_CPU_SPIN_US microseconds
// (read once) watching for the next one before they sleep. A decode step calls the kernels
// ~150 times, a few tens of microseconds apart (XLA's small fusions run between them on the
// calling thread); XLA's pool threads go to sleep in those gaps, and the first helper of each
// call then arrives ~30-50 us late, when a projection's whole product takes ~100-600 us. With
// JSPEC_CPU_SPIN_US=0 (or a second call while one runs) the work goes to XLA's pool as before.
class SpinPool {
 public:
  static SpinPool& get(int64_t helpers) {
    static SpinPool* pool = new SpinPool(helpers);  // never destroyed: threads outlive static teardown
    return *pool;
  }
  int64_t spin_us() const { return spin_us_; }
  int64_t helpers() const { return static_cast<int64_t>(threads_.size()); }

  // Runs job on the calling thread and the helpers; false (nothing run) when another call holds the pool.
  bool run(const std::shared_ptr<Job>& job) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load() > 0) wake_.notify_all();
    job->run();
    while (job->active.load() > 0 || helpers_in_.load() > 0) _jspec_relax();
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_.reset();
    }
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  static void _jspec_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }

  explicit SpinPool(int64_t helpers) {
    const char* env = std::getenv("JSPEC_CPU_SPIN_US");
    spin_us_ = env ? std::max<int64_t>(0, std::atoll(env)) : kDefaultSpinUs;
    if (spin_us_ == 0) return;
    for (int64_t h = 0; h < helpers; ++h) threads_.emplace_back([this] { loop(); });
    for (auto& t : threads_) t.detach();
  }

  void loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        _jspec_relax();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
          break;
        }
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load();
        job = job_;
        if (job) helpers_in_.fetch_add(1);
      }
      if (job) {
        job->run();
        helpers_in_.fetch_sub(1);
      }
    }
  }

  static constexpr int64_t kDefaultSpinUs = 0;
  int64_t spin_us_ = 0;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleepers_{0};
  std::atomic<int64_t> helpers_in_{0};
  std::atomic<bool> busy_{false};
  std::shared_ptr<Job> job_;
};

inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn) {
  auto job = std::make_shared<Job>();
  job->n = n;
  job->fn = std::move(fn);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0), n - 1);
  if (helpers > 0) {
    SpinPool& spin = SpinPool::get(std::max<int64_t>(pool.num_threads() - 1, 0));
    if (spin.helpers() > 0 && spin.run(job)) return;
  }
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([job] {
      job->active.fetch_add(1);
      job->run();
      job->active.fetch_sub(1);
    });
  }
  job->run();
  while (job->active.load() > 0) std::this_thread::yield();
}

}  // namespace jspec_cpu
