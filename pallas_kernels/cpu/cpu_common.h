// What jspec's CPU kernels share: 16-float vectors (GCC vector extensions: AVX-512 registers
// where the CPU has them, two AVX2 registers elsewhere) and the work split between the calling
// thread and XLA's intra-op thread pool.
//
// run_phases(pool, phases) runs a kernel call's phases one after another, each phase's units on
// the calling thread and up to (pool threads - 1) helpers, which take them from a shared ticket;
// parallel_for(pool, n, fn) is one phase. See run_phases below.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

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

// Bits of float16 / bfloat16 values and float32 (the KV pages' elements: paged_attention_cpu.h).
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// IEEE half -> float32, exact.
inline float half_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {  // zero or subnormal: m 2^-24
    const float f = static_cast<float>(m) * 5.9604644775390625e-8f;
    return bits_float(float_bits(f) | sign);
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, NaN
  return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

// float32 -> IEEE half, rounded to nearest even (as XLA's convert): overflow to inf, NaN stays NaN.
inline uint16_t float_half(float f) {
  uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00 | (x > 0x7f800000u ? 0x200 | (x >> 13) : 0));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00);  // >= 65520: rounds to inf
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half; adding 0.5 rounds at 2^-24, to even
    const float a = bits_float(x) + 0.5f;
    return static_cast<uint16_t>(sign | (float_bits(a) - 0x3f000000u));
  }
  x += 0xc8000fffu + ((x >> 13) & 1);  // rebias the exponent (-112 << 23) and round to even
  return static_cast<uint16_t>(sign | (x >> 13));
}

// bfloat16 -> float32 (exact) and back, rounded to nearest even (NaN stays NaN).
inline float bf16_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

// 8-bit floats (OCP FP8, vLLM's "fp8" KV caches): E4M3 ("fn": bias 7, no infinities, S.1111.111
// is NaN, largest 448) and E5M2 (bias 15, float16's top byte: infinities and NaNs as float16's).
// -> float32, exact.
inline float e4m3_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24, e = (b >> 3) & 0xf, m = b & 7;
  if (e == 0xf && m == 7) return bits_float(sign | 0x7fc00000u);                      // NaN
  if (e == 0) return bits_float(float_bits(static_cast<float>(m) * 0.001953125f) | sign);  // m 2^-9
  return bits_float(sign | ((e + 120) << 23) | (m << 20));
}

inline float e5m2_float(uint8_t b) { return half_float(static_cast<uint16_t>(b) << 8); }

// float32 -> E4M3 / E5M2, rounded to nearest even after saturating to the largest finite value
// (+-448 / +-57344, as vLLM's fp8 KV writes do: a key past the range keeps its sign and becomes
// the largest value, not a NaN or an infinity); NaN stays NaN. Equal to
// ml_dtypes' cast of numpy.clip(x, -max, max).
template <int kMant, int kBias>
inline uint8_t float_fp8(float f, float max_finite, uint8_t nan) {
  const uint8_t sign = static_cast<uint8_t>((float_bits(f) >> 24) & 0x80);
  float a = std::fabs(f);
  if (!(a == a)) return static_cast<uint8_t>(sign | nan);
  a = std::min(a, max_finite);
  const int min_exp = 1 - kBias;  // the smallest normal exponent
  int e;
  std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): a's exponent is e - 1
  e = std::max(e - 1, min_exp);
  // the value in units of its exponent's last mantissa bit, rounded to even (the default mode)
  const int64_t q = static_cast<int64_t>(std::nearbyint(std::ldexp(a, kMant - e)));
  // normal: ((e + bias) << mant) + q - 2^mant; subnormal (e = min_exp, q < 2^mant): q.
  // q = 2^(mant + 1) carries into the next exponent by itself.
  const int64_t one = int64_t{1} << kMant;
  const int64_t bits = q < one ? q : (static_cast<int64_t>(e + kBias) << kMant) + q - one;
  return static_cast<uint8_t>(sign | bits);
}

inline uint8_t float_e4m3(float f) { return float_fp8<3, 7>(f, 448.0f, 0x7f); }
inline uint8_t float_e5m2(float f) { return float_fp8<2, 15>(f, 57344.0f, 0x7e); }

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

typedef int32_t i16v __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

// exp over 16 lanes (Cephes-style: 2^n * polynomial on [-ln2/2, ln2/2], ~2 ulp); -inf -> 0.
inline v16 vexp(v16 x) {
  const v16 hi = splat(88.3762626647949f), lo = splat(-87.3365478515625f);
  v16 xc = x > hi ? hi : x;  // lane-wise selects (GCC vector extension)
  const auto under = xc < lo;
  xc = under ? lo : xc;
  const v16 fx = xc * splat(1.44269504088896341f) + splat(0.5f);
  v16 n = __builtin_convertvector(__builtin_convertvector(fx, i16v), v16);  // toward zero
  n = n > fx ? n - splat(1.0f) : n;                                        // floor(fx + 1/2)
  v16 r = xc - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v16 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  const i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof scale);
  y = y * scale;
  return under ? v16{} : y;
}

#ifdef JSPEC_AVX2_TILES
// Keeps a loaded vector in its register for the FMAs that use it. Left to itself GCC 12 folds
// the load into each FMA that reads the vector (vfmadd231ps mem, ...): a tile of 3 x 4 outputs
// then loads 26 vectors per 24 FMAs instead of 14, and on a core that loads one 256-bit vector
// per cycle (Zen 1) the loads, not the FMAs, set the pace (measured 2026-12-04).
inline void pin(__m256& v) { asm("" : "+x"(v)); }

// Sum of the 8 lanes of an AVX2 register (the two halves, then pairwise), the same order always.
inline float hsum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

// One step of run_phases: `units` calls fn(0 .. units - 1), in any order, on any of the threads.
// `warm` / `warm_bytes`: data the phase will read first (its weight), which threads left
// without a unit of the phase before it read ahead into their caches.
struct Phase {
  int64_t units;
  std::function<void(int64_t)> fn;
  const void* warm = nullptr;
  int64_t warm_bytes = 0;
};

constexpr int64_t kWarmPiece = 16 << 10;  // bytes of a phase's warm data read ahead at a time

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

namespace team {

// One call's phases and their progress, shared by the caller and its helpers.
struct Job {
  std::atomic<uint64_t> ticket{0};  // (phase << 32) | next unit of that phase
  std::atomic<int64_t> done{0};     // units of the current phase done
  std::atomic<int64_t> warmed{0};   // (phase << 32) | next warm piece of the phase after it
  std::vector<Phase> phases;

  uint64_t first(uint64_t ph) const {  // the first phase from ph on with units
    while (ph < phases.size() && phases[ph].units == 0) ++ph;
    return ph;
  }

  // Claims and runs units until the last phase is done.
  void work() {
    const uint64_t P = phases.size();
    for (;;) {
      const uint64_t t = ticket.fetch_add(1);
      const uint64_t ph = t >> 32, i = t & 0xffffffffu;
      if (ph >= P) return;
      const Phase& p = phases[ph];
      if (static_cast<int64_t>(i) < p.units) {
        p.fn(static_cast<int64_t>(i));
        if (done.fetch_add(1) + 1 == p.units) {  // the phase's last unit: start the next one
          const uint64_t next = first(ph + 1);
          done.store(0);
          warmed.store(static_cast<int64_t>(next << 32));
          ticket.store(next << 32);
        }
        continue;
      }
      // nothing left in this phase: read ahead the next phase's data while the others finish
      const Phase* ahead = ph + 1 < P ? &phases[ph + 1] : nullptr;
      const int64_t pieces = ahead ? (ahead->warm_bytes + kWarmPiece - 1) / kWarmPiece : 0;
      for (int spins = 0; (ticket.load() >> 32) == ph; ++spins) {
        int64_t w = warmed.load();
        const int64_t piece = w & 0xffffffff;
        if (static_cast<uint64_t>(w >> 32) == ph && piece < pieces && warmed.compare_exchange_strong(w, w + 1)) {
          const char* base = static_cast<const char*>(ahead->warm) + piece * kWarmPiece;
          const int64_t n = std::min(kWarmPiece, ahead->warm_bytes - piece * kWarmPiece);
          for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(base + b, 0, 2);
        } else if (spins < 256) {
          spin_pause();
        } else {  // a long wait: the thread it waits for may have lost its core to another
          std::this_thread::yield();
        }
      }
    }
  }
};

}  // namespace team

// The phases one after another, a phase's units taken from a shared ticket by the calling thread
// and up to (pool threads - 1) helpers; a phase starts once every unit of the one before it is
// done. A helper is scheduled once for all the phases (not once per phase: it does not go back to
// XLA's pool, and to sleep, between two), and one that comes late joins the phase under way. A
// thread with no unit left in a phase waits by spinning (the units are small, the waits short;
// past a few hundred spins it yields its core) and meanwhile reads ahead the next phase's `warm` data, 16 KB at a time. Returns when the last
// phase is done: every unit has returned, and a helper never touches the caller's stack after
// that (it runs the phases' functions only for units it claimed before the end; the job itself
// lives as long as its last holder).
//
// Tried and left out (measured 2026-12-05): helpers that linger, spinning, after
// their job for the next call's, so as not to sleep between calls: on the 2-core VM a decode
// step got slower (the lingering thread competes with the thread running XLA's other ops).
inline void run_phases(xla::ffi::ThreadPool& pool, std::vector<Phase> phases) {
  auto job = std::make_shared<team::Job>();
  job->phases = std::move(phases);
  const uint64_t start = job->first(0);
  if (start >= job->phases.size()) return;
  job->ticket.store(start << 32);
  job->warmed.store(static_cast<int64_t>(start << 32));
  int64_t units = 0;
  for (const Phase& p : job->phases) units = std::max(units, p.units);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0), units - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job] { job->work(); });
  job->work();
}

// fn(i) for every i in [0, n), each once, on the calling thread and the helpers (one phase).
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn) {
  run_phases(pool, {Phase{n, std::move(fn)}});
}

}  // namespace jspec_cpu
