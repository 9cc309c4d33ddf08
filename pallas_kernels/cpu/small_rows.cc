// A few-row matrix product for XLA's CPU backend, as an XLA FFI custom call.
//
//   y[m, n] = sum_k x[m, k] * w[n, k]      x [M, K], w [N, K] (rows of the weight), y [M, N]
//
// M is small (a decode step's rows, a verification's k + 1, a few slots of either): XLA's CPU
// dot sends 2 or more rows through a general matrix product that re-packs the weight, so on
// these CPUs a 5-row product there costs ~1.5x a 1-row one, though both read the same bytes.
// Here the weight is read once, as sequential streams, and each loaded vector is multiplied by
// several rows of x held in registers:
//   - plain layout w [N, K] (the tied LM head's embedding table): 4 weight rows side by side,
//     4 streams, each vector against up to 5 rows of x (a last N % 4 rows one at a time, against
//     up to 8 rows of x);
//   - packed layout [N / 4, K / 16, 4, 16] (pallas_kernels.cpu.small_rows.pack_rows, made once when
//     the engine loads the weights): 4 weight rows interleaved 16 floats at a time, one stream,
//     each vector against up to 5 rows of x (5 x 4 accumulators);
//   - quantized layouts uint8 [N / 4, K / 32, 4, 24 | 36] (pallas_kernels.cpu.small_rows.pack_quantized:
//     a GGUF file's Q4_1 / Q8_0 blocks, 4 rows interleaved a block at a time): the packed tile's
//     arithmetic on weights dequantized in registers (see "quantized weights" below), the same
//     results bit for bit at a fifth of the bytes or less.
// More rows of x run in further tiles that re-read the weight tile from L1. Weight rows are
// split into chunks that XLA's intra-op thread pool and the calling thread take from a shared
// counter.
//
// Built at first use by pallas_kernels/small_rows.py with the machine's C++ compiler and
// -march=native: the 16-lane vectors become AVX-512 where the CPU has it; on a CPU with AVX2 and
// FMA but not AVX-512 the tiles are written in AVX2 intrinsics (3 rows of x per tile instead of 5,
// see the second `tile`), and elsewhere the 16-lane vectors are whatever the compiler makes of them.
// Python reference: pallas_kernels.cpu.small_rows.small_rows_matmul_reference.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"  // JSPEC_AVX2_TILES: which tiles this build compiles
#include "small_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jspec_cpu::hsum;
using jspec_cpu::kLanes;
using jspec_cpu::load;
using jspec_cpu::splat;
using jspec_cpu::store;
using jspec_cpu::v16;
using jspec_cpu::kChunkRows;

namespace {

constexpr int kPackRows = 4;         // weight rows interleaved by the packed layout
#ifndef JSPEC_AVX2_TILES
constexpr int kMaxRowsPlain = 8;     // rows of x per tile, plain layout (8 accumulators)
constexpr int kMaxRowsPacked = 5;    // rows of x per tile, packed layout (5 x 4 accumulators)
#else  // 16 registers of 8 floats, the rows of x held: R x C accumulators + R rows + 1 weight vector
constexpr int kMaxRowsPlain = 7;     // 7 + 7 + 1
constexpr int kMaxRowsPacked = 3;    // 12 + 3 + 1
#endif
// Each step asks for the weight's cache lines 8 KB ahead into L2 (prefetcht1): with several rows
// of x the FMAs keep the core busy long enough that the hardware prefetcher alone falls behind
// (measured on Zen 4: a 5-row product went from ~1.5-1.9x one row to ~1.1-1.25x; into L1 or
// non-temporal was slower). Prefetches past the end of the weight are harmless.
constexpr int64_t kPrefetchFloats = 8192 / sizeof(float);

// The weight rows n .. n + C of a tile: row j's floats k .. k + 16 sit at
// wt + (k / 16) * step + j * jstride, and (plain layout only) a tail of K % 16 at wt + j * K + k.
//   plain  [N, K]:                     wt = w + n K, step = 16,     jstride = K
//   packed [N / 4, K / 16, 4, 16]:     wt = w + n K, step = 4 * 16, jstride = 16
// y[m .. m + R, n .. n + C] for R rows of x. Each output is summed in the same order (16 lanes
// along k, then the lanes) whatever R is, so a row's result does not depend on its neighbours.
#ifndef JSPEC_AVX2_TILES
template <int R, int C>
void tile(const float* x, const float* wt, float* y, int64_t K, int64_t N, int64_t m, int64_t n,
          int64_t step, int64_t jstride) {
  v16 acc[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) acc[i][j] = v16{};
  int64_t k = 0;
  const float* wk = wt;
  for (; k + kLanes <= K; k += kLanes, wk += step) {
    v16 xv[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      xv[i] = load(x + (m + i) * K + k);
#if defined(__AVX512F__)
      asm("" : "+v"(xv[i]));  // held in a register: GCC would otherwise re-load it in every FMA
#endif
    }
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) __builtin_prefetch(wk + kPrefetchFloats + j * jstride, 0, 2);
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      const v16 wv = load(wk + j * jstride);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += x[(m + i) * K + t] * wt[j * K + t];
      y[(m + i) * N + n + j] = s;
    }
  }
}

#else
// AVX2 + FMA (16 vector registers of 8 floats): the same tiles in intrinsics, each 16-float
// vector of a weight row read as two halves that add into one 8-lane accumulator per output
// (the v16 code above, on these CPUs, kept its accumulators in memory: GCC spilled the 2 x 20
// halves and split every load). R <= 3 rows of x against C = 4 weight rows (or R <= 7 against
// C = 1): 12 accumulators, the 3 rows of x and one weight vector in registers, each vector
// loaded once (jspec_cpu::pin): 7 loads for 12 FMAs (~2.0 G FMA/s per core on Zen 1 at 5 rows,
// weights in L2; 1.7 when GCC folded the loads into the FMAs). Summed in the same order
// whatever R is.
template <int R, int C>
void tile(const float* x, const float* wt, float* y, int64_t K, int64_t N, int64_t m, int64_t n,
          int64_t step, int64_t jstride) {
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  const float* wk = wt;
  const float* xm = x + m * K;
  for (; k + kLanes <= K; k += kLanes, wk += step) {
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchFloats + j * jstride), _MM_HINT_T1);
#pragma GCC unroll 2
    for (int h = 0; h < kLanes; h += 8) {
      __m256 xv[R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        xv[i] = _mm256_loadu_ps(xm + i * K + k + h);
        jspec_cpu::pin(xv[i]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        __m256 wv = _mm256_loadu_ps(wk + j * jstride + h);
        jspec_cpu::pin(wv);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) {
      float s = jspec_cpu::hsum8(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += x[(m + i) * K + t] * wt[j * K + t];
      y[(m + i) * N + n + j] = s;
    }
  }
}
#endif

// ------------------------------------------------------------------ quantized weights (kQ4_1, kQ8_0)
// The packed tile's arithmetic on weights dequantized in registers: for each block of 32 weights
// (one record per weight row, the tile's 4 rows' records side by side: one sequential stream),
// each 16 (AVX2: 8) weights are made float32 exactly as GGUF dequantizes them (d q + m, or d q)
// and go into the same accumulators, in the same order, as the packed floats would: a product
// equals the packed float32 weight's bit for bit, at 0.75 or 1.125 bytes a weight instead of 4.
using jspec_cpu::Layout;

template <Layout L>
constexpr int64_t record_bytes() {
  return L == Layout::kQ4_1 ? jspec_cpu::kQ4_1Record : jspec_cpu::kQ8_0Record;
}

constexpr int kQuantRows = 4;  // weight rows per tile (the records' interleave)
// how far ahead the record stream is prefetched (into L2). 16-32 KB ran 4-10% faster than 8 KB in
// small_rows_harness.cc qstream at 1-5 rows, but in the model's step 32 KB was 5-10% slower (three
// alternated profiles; a chunk's records are ~27 KB, so it prefetched the other thread's chunk):
// measured 2026-12-05.
constexpr int64_t kPrefetchBytes = 8192;

inline float read_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

#ifndef JSPEC_AVX2_TILES
constexpr int kMaxRowsQuant = 5;  // 20 accumulators, 5 rows of x, the weight vector, d, m

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int8_t s8x16 __attribute__((vector_size(16), aligned(1)));

// Weights 16 h .. 16 h + 16 of a record, as float32.
template <Layout L>
inline v16 dequant(const uint8_t* rec, int h) {
#if defined(__AVX512F__)
  // (GCC's vector conversion of 16 bytes unpacks them one by one through scalar registers)
  if constexpr (L == Layout::kQ4_1) {
    // the 16 values d q + m the block can hold, then each weight looked up by its nibble (the
    // permute reads an index's low 4 bits: the low nibble needs no mask)
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(read_f32(rec)), _mm512_set1_ps(read_f32(rec + 4)));
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 8)));
    if (h) q = _mm512_srli_epi32(q, 4);
    return reinterpret_cast<v16>(_mm512_permutexvar_ps(q, table));
  } else {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 4 + 16 * h)));
    return reinterpret_cast<v16>(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(read_f32(rec))));
  }
#else
  using jspec_cpu::i16v;
  if constexpr (L == Layout::kQ4_1) {
    u8x16 b;
    std::memcpy(&b, rec + 8, sizeof b);
    i16v q = __builtin_convertvector(b, i16v);
    q = h ? q >> 4 : q & 15;
    return __builtin_convertvector(q, v16) * splat(read_f32(rec)) + splat(read_f32(rec + 4));
  } else {
    s8x16 b;
    std::memcpy(&b, rec + 4 + 16 * h, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, i16v), v16) * splat(read_f32(rec));
  }
#endif
}

template <Layout L, int R>
void qtile(const float* x, const uint8_t* wt, float* y, int64_t K, int64_t N, int64_t m, int64_t n) {
  constexpr int64_t RB = record_bytes<L>();
  v16 acc[R][kQuantRows];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kQuantRows; ++j) acc[i][j] = v16{};
  const uint8_t* rec = wt;
  for (int64_t k = 0; k < K; k += jspec_cpu::kQuantBlock, rec += kQuantRows * RB) {
#pragma GCC unroll 4
    for (int64_t b = 0; b < kQuantRows * RB; b += 64) __builtin_prefetch(rec + kPrefetchBytes + b, 0, 2);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      v16 xv[R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        xv[i] = load(x + (m + i) * K + k + h * kLanes);
#if defined(__AVX512F__)
        asm("" : "+v"(xv[i]));
#endif
      }
#pragma GCC unroll 4
      for (int j = 0; j < kQuantRows; ++j) {
        const v16 wv = dequant<L>(rec + j * RB, h);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) acc[i][j] += xv[i] * wv;
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kQuantRows; ++j) y[(m + i) * N + n + j] = hsum(acc[i][j]);
}

#else
// 16 registers: the 4 x R accumulators of the AVX-512 tile do not fit for R > 2. From 3 rows of x
// on, the tile takes its 4 weight rows two at a time (2 R accumulators; the second pass reads the
// records from L1) and each FMA reads x from memory (L1: a tile's rows of x are a few KB): every
// weight is still dequantized once for all R rows, and each accumulator sums the same products in
// the same order as the packed tile's. (Holding 2 rows of x in registers for all 4 weight rows,
// as before, dequantized each weight once per 2 rows: a 5-row product cost ~3x a 1-row one, now
// ~2x; measured 2026-12-05.)
constexpr int kMaxRowsQuant = 5;

// Weights 8 e .. 8 e + 8 of a record (e in 0 .. 3), as float32 (d q is exact: fma(q, d, m) is
// the d q + m of GGUF's dequantization, rounded once).
template <Layout L>
inline __m256 dequant8(const uint8_t* rec, int e) {
  if constexpr (L == Layout::kQ4_1) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 8 + 8 * (e & 1)));
    __m256i q = _mm256_cvtepu8_epi32(b);
    q = e >= 2 ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(read_f32(rec)), _mm256_set1_ps(read_f32(rec + 4)));
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 4 + 8 * e));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(read_f32(rec)));
  }
}

template <Layout L, int R>
void qtile(const float* x, const uint8_t* wt, float* y, int64_t K, int64_t N, int64_t m, int64_t n) {
  constexpr int64_t RB = record_bytes<L>();
  const float* xm = x + m * K;
  constexpr int J = R <= 2 ? kQuantRows : 2;  // weight rows per pass over the tile
#pragma GCC unroll 1
  for (int jh = 0; jh < kQuantRows; jh += J) {
    __m256 acc[R][J];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) acc[i][j] = _mm256_setzero_ps();
    const uint8_t* rec = wt;
    for (int64_t k = 0; k < K; k += jspec_cpu::kQuantBlock, rec += kQuantRows * RB) {
      if (jh == 0) {  // the second pair's records came in with the first's
#pragma GCC unroll 4
        for (int64_t b = 0; b < kQuantRows * RB; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchBytes + b), _MM_HINT_T1);
      }
#pragma GCC unroll 4
      for (int e = 0; e < 4; ++e) {
        __m256 xv[R];  // all 4 weight rows at once: x in registers
        if constexpr (J == kQuantRows) {
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) {
            xv[i] = _mm256_loadu_ps(xm + i * K + k + 8 * e);
            jspec_cpu::pin(xv[i]);
          }
        }
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) {
          __m256 wv = dequant8<L>(rec + (jh + j) * RB, e);
          jspec_cpu::pin(wv);
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i)
            acc[i][j] = _mm256_fmadd_ps(J == kQuantRows ? xv[i] : _mm256_loadu_ps(xm + i * K + k + 8 * e), wv, acc[i][j]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < J; ++j) y[(m + i) * N + n + jh + j] = jspec_cpu::hsum8(acc[i][j]);
  }
}
#endif

// tile(std::integral_constant<int, R>{}, m) for the rows of x [M, ...]: MAXR rows at a time from
// m = 0, then one tile of the M % MAXR rows left (R a compile-time constant in every call).
template <int R, typename F>
void last_tile(int64_t left, int64_t m, F& tile) {
  if constexpr (R >= 1) {
    if (left == R) return tile(std::integral_constant<int, R>{}, m);
    last_tile<R - 1>(left, m, tile);
  }
}

template <int MAXR, typename F>
void row_tiles(int64_t M, F&& tile) {
  int64_t m = 0;
  for (; m + MAXR <= M; m += MAXR) tile(std::integral_constant<int, MAXR>{}, m);
  last_tile<MAXR - 1>(M - m, m, tile);
}

// Every row of x against the 4 weight rows of one quantized tile, kMaxRowsQuant rows of x at a time.
template <Layout L>
void qcolumn(const float* x, const uint8_t* wt, float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  row_tiles<kMaxRowsQuant>(M, [&](auto R, int64_t m) { qtile<L, R>(x, wt, y, K, N, m, n); });
}

template <Layout L>
void qrows(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t group = (K / jspec_cpu::kQuantBlock) * kQuantRows * record_bytes<L>();  // bytes of 4 rows
  for (int64_t n = n0; n < n1; n += kQuantRows) qcolumn<L>(x, w + (n / kQuantRows) * group, y, M, K, N, n);
}

// ------------------------------------------------------------------ int8 dot products (kQ4_1Dot, kQ8_0Dot)
// 16 weight rows a block at a time, each of x's rows quantized to int8 a block at a time
// (jspec_cpu::QuantRows). Per block and row of x, the 32 weights' integer products with a are
// summed exactly in 16 int32 lanes (lane j: weight row j), 4 products a lane an instruction
// (AVX512-VNNI vpdpbusd: unsigned weight bytes times signed bytes of x, 4 of them broadcast to every
// lane), then y_j += (dw_j dx) sum_j, and for Q4_1 y_j += m_j (dx sum(a)), as two FMAs in that
// order. Without VNNI the same sums come from AVX2's vpmaddubsw (DotBlock below) or, on older CPUs,
// 32-bit multiplies: the same bits (the integer sums are exact, the float steps the same
// operations). A weight's 16 rows are unpacked once for up to 8 rows of x.
using jspec_cpu::QuantRows;

template <Layout L>
constexpr int64_t dot_group_bytes() {  // a block of the 16 rows
  return jspec_cpu::kDotRows * record_bytes<L == Layout::kQ4_1Dot ? Layout::kQ4_1 : Layout::kQ8_0>();
}

#if defined(__AVX512F__)
constexpr int kMaxRowsDot = 8;  // 8 unpacked weight vectors, d, m, 8 accumulators and temporaries
#else
constexpr int kMaxRowsDot = 4;
#endif

// c + a b, rounded once, lane by lane.
inline v16 vfma(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#else
  v16 out;
  for (int l = 0; l < kLanes; ++l) out[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return out;
#endif
}

#if defined(__AVX512VNNI__)
typedef __m512i ivec;
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
typedef int32_t unaligned_i32 __attribute__((may_alias, aligned(1)));
// acc + the 4-byte dot products of w's unsigned bytes with the 4 signed bytes at a, lane by lane.
// (a read in place: a broadcast from memory is a load; from a register, as GCC compiled a copy of
// x's bytes, it took a shuffle-port uop beside each dot product.)
inline ivec dot4(ivec acc, ivec w, const int8_t* a) {
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(a)));
}
inline ivec low_nibbles(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline ivec high_nibbles(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec isub(ivec a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
inline v16 ifloat(ivec v) { return reinterpret_cast<v16>(_mm512_cvtepi32_ps(v)); }
#else
typedef uint32_t ivec __attribute__((vector_size(kLanes * sizeof(uint32_t)), aligned(4)));  // 4 bytes a lane
inline ivec izero() { return ivec{}; }
inline ivec iload(const uint8_t* p) {
  ivec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline ivec dot4(ivec acc, ivec w, const int8_t* bytes) {
  using jspec_cpu::i16v;
  int32_t a;
  std::memcpy(&a, bytes, sizeof a);
  i16v s = reinterpret_cast<i16v>(acc);
  for (int u = 0; u < 4; ++u)
    s += reinterpret_cast<i16v>((w >> (8 * u)) & 0xff) * static_cast<int32_t>(static_cast<int8_t>(a >> (8 * u)));
  return reinterpret_cast<ivec>(s);
}
inline ivec low_nibbles(ivec v) { return v & 0x0f0f0f0fu; }
inline ivec high_nibbles(ivec v) { return (v >> 4) & 0x0f0f0f0fu; }
inline ivec iadd(ivec a, ivec b) { return a + b; }
inline ivec isub(ivec a, int32_t s) { return a - static_cast<uint32_t>(s); }
inline v16 ifloat(ivec v) { return __builtin_convertvector(reinterpret_cast<jspec_cpu::i16v>(v), v16); }
#endif

#if defined(__AVX512VNNI__) || !defined(__AVX2__)
// A block of the 16 weight rows in registers, and their integer sums with a block of x's bytes.
template <Layout L>
struct DotBlock {
  ivec w[8];  // vector t: the 16 rows' weights 4 t .. 4 t + 3 (Q8_0: + 128)
  explicit DotBlock(const uint8_t* rec) {
    if constexpr (L == Layout::kQ4_1Dot) {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const ivec v = iload(rec + 128 + 64 * t);
        w[t] = low_nibbles(v), w[4 + t] = high_nibbles(v);
      }
    } else {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) w[t] = iload(rec + 64 + 64 * t);
    }
  }
  // lane j: sum over the block of weight j's bytes times the 32 signed bytes at a, exactly
  ivec sums(const int8_t* a) const {
    ivec s0 = dot4(izero(), w[0], a), s1 = dot4(izero(), w[1], a + 4);
#pragma GCC unroll 3
    for (int t = 2; t < 8; t += 2) s0 = dot4(s0, w[t], a + 4 * t), s1 = dot4(s1, w[t + 1], a + 4 * t + 4);
    return iadd(s0, s1);
  }
};
#else
// AVX2 without VNNI: vpmaddubsw multiplies unsigned bytes by signed ones and adds each pair into 16
// bits, which saturate. Taken a nibble at a time the sums cannot: a pair is at most 2 * 15 * 128 =
// 3,840 and the block's 8 pairs per lane at most 30,720 < 32,767, so they are added in 16 bits, then
// vpmaddwd widens each lane's two halves to 32 (Q8_0's bytes as low + 16 high nibble). The exact
// integer sums of the VNNI path (measured 2026-12-05: the 32-bit multiplies of the
// plain fallback made an AVX2 build's int8 verification 2.3x slower than its float one).
template <Layout L>
struct DotBlock {
  static constexpr int kParts = L == Layout::kQ4_1Dot ? 1 : 2;  // nibble vectors per 4 weights
  alignas(32) uint8_t nib[kParts][8][64];  // [part][t]: as the layout's vector t, a nibble a byte
  explicit DotBlock(const uint8_t* rec) {
    const __m256i low = _mm256_set1_epi8(15);
    auto put = [&](int p, int t, int h, __m256i v) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(nib[p][t] + 32 * h), v);
    };
    for (int t = 0; t < (kParts == 1 ? 4 : 8); ++t)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + (kParts == 1 ? 128 : 64) +
                                                                             64 * t + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (kParts == 1) {
          put(0, t, h, lo), put(0, 4 + t, h, hi);
        } else {
          put(0, t, h, lo), put(1, t, h, hi);
        }
      }
  }
  ivec sums(const int8_t* a) const {
    __m256i x[8];
    for (int t = 0; t < 8; ++t) {
      int32_t four;
      std::memcpy(&four, a + 4 * t, sizeof four);
      x[t] = _mm256_set1_epi32(four);
    }
    __m256i out[2];
    for (int h = 0; h < 2; ++h) {
      out[h] = _mm256_setzero_si256();
      for (int p = 0; p < kParts; ++p) {
        auto w = [&](int t) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(nib[p][t] + 32 * h)); };
        __m256i s16 = _mm256_maddubs_epi16(w(0), x[0]);
        for (int t = 1; t < 8; ++t) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w(t), x[t]));
        out[h] = _mm256_add_epi32(out[h], _mm256_madd_epi16(s16, _mm256_set1_epi16(p == 0 ? 1 : 16)));
      }
    }
    ivec r;
    std::memcpy(&r, out, sizeof r);
    return r;
  }
};
#endif

template <Layout L, int R>
void dtile(const QuantRows& xq, const uint8_t* wt, float* y, int64_t K, int64_t N, int64_t m, int64_t n) {
  constexpr bool q41 = L == Layout::kQ4_1Dot;
  constexpr int64_t GB = dot_group_bytes<L>();
  const int64_t nb = K / jspec_cpu::kQuantBlock;
  v16 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = v16{};
  const uint8_t* rec = wt;
  for (int64_t b = 0; b < nb; ++b, rec += GB) {
#pragma GCC unroll 9
    for (int64_t p = 0; p < GB; p += 64) __builtin_prefetch(rec + kPrefetchBytes + p, 0, 2);
    const v16 dw = load(reinterpret_cast<const float*>(rec));
    const v16 mw = q41 ? load(reinterpret_cast<const float*>(rec + 64)) : v16{};
    const DotBlock<L> block(rec);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int64_t at = (m + i) * nb + b;
      ivec s = block.sums(xq.a.data() + (m + i) * K + b * jspec_cpu::kQuantBlock);
      if constexpr (!q41) s = isub(s, xq.s128[at]);
      acc[i] = vfma(ifloat(s), dw * splat(xq.d[at]), acc[i]);
      if constexpr (q41) acc[i] = vfma(mw, splat(xq.ds[at]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) store(y + (m + i) * N + n, acc[i]);
}

template <Layout L>
void drows(const QuantRows& xq, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t group = (K / jspec_cpu::kQuantBlock) * dot_group_bytes<L>();  // bytes of 16 rows
  for (int64_t n = n0; n < n1; n += jspec_cpu::kDotRows) {
    const uint8_t* wt = w + (n / jspec_cpu::kDotRows) * group;
    row_tiles<kMaxRowsDot>(M, [&](auto R, int64_t m) { dtile<L, R>(xq, wt, y, K, N, m, n); });
  }
}

// Every row of x against one tile of C weight rows, MAXR rows of x at a time.
template <int C, int MAXR>
void column(const float* x, const float* wt, float* y, int64_t M, int64_t K, int64_t N, int64_t n,
            int64_t step, int64_t jstride) {
  row_tiles<MAXR>(M, [&](auto R, int64_t m) { tile<R, C>(x, wt, y, K, N, m, n, step, jstride); });
}

// Weight rows n0 .. n1 (n0, n1 multiples of 4 in the packed and quantized layouts, of 16 in the
// int8 dot layouts, which read x quantized: xq).
void rows(const float* x, jspec_cpu::Weight wt, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
          const QuantRows* xq = nullptr) {
  const float* w = static_cast<const float*>(wt.data);
  switch (wt.layout) {
    case Layout::kQ4_1Dot:
      return drows<Layout::kQ4_1Dot>(*xq, static_cast<const uint8_t*>(wt.data), y, M, K, N, n0, n1);
    case Layout::kQ8_0Dot:
      return drows<Layout::kQ8_0Dot>(*xq, static_cast<const uint8_t*>(wt.data), y, M, K, N, n0, n1);
    case Layout::kQ4_1:
      return qrows<Layout::kQ4_1>(x, static_cast<const uint8_t*>(wt.data), y, M, K, N, n0, n1);
    case Layout::kQ8_0:
      return qrows<Layout::kQ8_0>(x, static_cast<const uint8_t*>(wt.data), y, M, K, N, n0, n1);
    case Layout::kPacked:  // the tile's 4 rows lie interleaved in memory: one sequential stream, x reused 4 times
      for (int64_t n = n0; n < n1; n += kPackRows)
        column<kPackRows, kMaxRowsPacked>(x, w + n * K, y, M, K, N, n, kPackRows * kLanes, kLanes);
      return;
    case Layout::kPlain: {  // 4 weight rows side by side (4 streams, each prefetched), then the rows left over
      int64_t n = n0;
      for (; n + kPackRows <= n1; n += kPackRows)
        column<kPackRows, kMaxRowsPacked>(x, w + n * K, y, M, K, N, n, kLanes, K);
      for (; n < n1; ++n) column<1, kMaxRowsPlain>(x, w + n * K, y, M, K, N, n, kLanes, K);
      return;
    }
  }
}

// y = x w^T over weight rows split into chunks between the threads; with r (rows of the same
// shape as y) each chunk adds r to its outputs once they are summed (a residual connection).
void product(ffi::ThreadPool& pool, const float* xp, jspec_cpu::Weight w, float* yp, const float* rp, int64_t M,
             int64_t K, int64_t N) {
  QuantRows xq;
  if (jspec_cpu::int8_dot(w.layout)) xq.quantize_all(xp, M, K);
  jspec_cpu::parallel_for(pool, jspec_cpu::product_chunks(N), [&](int64_t c) {
    jspec_cpu::product_chunk(xp, w, yp, rp, M, K, N, c, &xq);
  });
}

// Checks x [M, K'] and the weight (jspec_cpu::weight_of); sets M, K, N and the weight.
ffi::Error shapes(const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& w, int64_t& M, int64_t& K, int64_t& N,
                  jspec_cpu::Weight& wt) {
  if (x.dimensions().size() != 2 || !jspec_cpu::weight_of(w, wt, N, K)) {
    return ffi::Error::InvalidArgument("small_rows: expected x [M, K] and w float32 [N, K] or [N / 4, K / 16, 4, 16], "
                                       "or uint8 [N / 4, K / 32, 4, 24 | 36]");
  }
  M = x.dimensions()[0];
  return ffi::Error::Success();
}

ffi::Error SmallRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::ResultBuffer<ffi::F32> y) {
  int64_t M, K, N;
  jspec_cpu::Weight wt;
  if (auto e = shapes(x, w, M, K, N, wt); e.failure()) return e;
  if (x.dimensions()[1] != K) return ffi::Error::InvalidArgument("small_rows: x and w disagree on K");
  product(pool, x.typed_data(), wt, y->typed_data(), nullptr, M, K, N);
  return ffi::Error::Success();
}

// The first index of each row's maximum (jspec.sampling.argmax's greedy pick), x [R, V] -> int32
// [R]: one vector pass for the maximum, then the first position that holds it. XLA's CPU code
// for the same reduction took ~0.6 ms over a verification step's 5 rows of 49,152 logits (the
// step's own products ~12 ms). NaN entries are passed over; a row with no number gives V - 1,
// as the reference (pallas_kernels.cpu.small_rows.row_argmax_reference) does for an all-NaN row.
ffi::Error RowArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[1] < 1) return ffi::Error::InvalidArgument("row_argmax: expected x [R, V] with V >= 1");
  const int64_t R = d[0], V = d[1];
  using jspec_cpu::v16;
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.typed_data() + r * V;
    v16 best = jspec_cpu::splat(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + jspec_cpu::kLanes <= V; i += jspec_cpu::kLanes) {
      const v16 v = jspec_cpu::load(row + i);
      best = v > best ? v : best;
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < jspec_cpu::kLanes; ++l) m = best[l] > m ? best[l] : m;
    for (; i < V; ++i) m = row[i] > m ? row[i] : m;
    int64_t at = V - 1;
    for (int64_t j = 0; j < V; ++j) {
      if (row[j] == m) {
        at = j;
        break;
      }
    }
    out->typed_data()[r] = static_cast<int32_t>(at);
  }
  return ffi::Error::Success();
}

// The product with the work around it in a decoder layer folded in (no XLA op of its own between
// two products): x first through RMSNorm with gain `scale` [K0] (when scale is not empty), y then
// plus `residual` [M, N] (when not empty). x [M, K0] may be narrower than the packed weight's K
// (zero-padded here). The norm sums each row in one order whatever M is, like the product.
ffi::Error SmallRowsFusedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> residual,
                              ffi::ResultBuffer<ffi::F32> y, float eps) {
  int64_t M, K, N;
  jspec_cpu::Weight wt;
  if (auto e = shapes(x, w, M, K, N, wt); e.failure()) return e;
  const int64_t K0 = x.dimensions()[1];
  const bool norm = scale.element_count() > 0;
  const bool add = residual.element_count() > 0;
  if (K0 > K || (wt.layout != jspec_cpu::Layout::kPacked && K0 != K) || (norm && scale.element_count() != K0) ||
      (add && residual.element_count() != M * N)) {
    return ffi::Error::InvalidArgument("small_rows_fused: x [M, K0], scale [K0] and residual [M, N] must fit w");
  }
  std::vector<float> xs;
  const float* xp = x.typed_data();
  if (norm || K0 != K) {
    xs.resize(M * K);
    jspec_cpu::rms_norm_rows(xp, norm ? scale.typed_data() : nullptr, xs.data(), M, K0, K, eps);
    xp = xs.data();
  }
  product(pool, xp, wt, y->typed_data(), add ? residual.typed_data() : nullptr, M, K, N);
  return ffi::Error::Success();
}

}  // namespace

namespace jspec_cpu {

bool weight_of(const xla::ffi::AnyBuffer& w, Weight& out, int64_t& N, int64_t& K) {
  const auto d = w.dimensions();
  out.data = w.untyped_data();
  if (w.element_type() == ffi::DataType::F32 && d.size() == 2) {
    out.layout = Layout::kPlain, N = d[0], K = d[1];
  } else if (w.element_type() == ffi::DataType::F32 && d.size() == 4 && d[2] == kPackRows && d[3] == kLanes) {
    out.layout = Layout::kPacked, N = d[0] * kPackRows, K = d[1] * kLanes;
  } else if (w.element_type() == ffi::DataType::U8 && d.size() == 4 && d[2] == kQuantRows &&
             (d[3] == kQ4_1Record || d[3] == kQ8_0Record)) {
    out.layout = d[3] == kQ4_1Record ? Layout::kQ4_1 : Layout::kQ8_0, N = d[0] * kQuantRows, K = d[1] * kQuantBlock;
  } else if (w.element_type() == ffi::DataType::U8 && d.size() == 4 && d[2] == kDotRows &&
             (d[3] == kQ4_1Record || d[3] == kQ8_0Record)) {
    out.layout = d[3] == kQ4_1Record ? Layout::kQ4_1Dot : Layout::kQ8_0Dot, N = d[0] * kDotRows, K = d[1] * kQuantBlock;
  } else {
    return false;
  }
  return true;
}

void product_chunk(const float* x, Weight w, float* y, const float* r, int64_t M, int64_t K, int64_t N, int64_t c,
                   const QuantRows* xq) {
  const int64_t n0 = c * kChunkRows, n1 = std::min(N, (c + 1) * kChunkRows);
  rows(x, w, y, M, K, N, n0, n1, xq);
  if (r != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] += r[m * N + n];
}

void QuantRows::resize(int64_t M, int64_t k) {
  K = k;
  a.resize(M * K);
  d.resize(M * (K / kQuantBlock));
  ds.resize(d.size());
  s128.resize(d.size());
}

void QuantRows::quantize(const float* row, int64_t m, int64_t b0, int64_t b1) {
  const int64_t nb = K / kQuantBlock;
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = row + b * kQuantBlock;
    int8_t* ab = a.data() + m * K + b * kQuantBlock;
    int32_t sum = 0;
    float amax;
#if defined(__AVX512F__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ab), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + 16), _mm512_cvtsepi32_epi8(q1));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    amax = 0.f;
    for (int64_t i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < kQuantBlock; ++i) {  // nearest even, as the vector conversion rounds
      const float v = std::nearbyint(xb[i] * id);
      ab[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
      sum += ab[i];
    }
#endif
    const int64_t at = m * nb + b;
    d[at] = amax / 127.f;
    ds[at] = d[at] * static_cast<float>(sum);
    s128[at] = 128 * sum;
  }
}

void QuantRows::quantize_all(const float* x, int64_t M, int64_t k) {
  resize(M, k);
  for (int64_t m = 0; m < M; ++m) quantize(x + m * K, m, 0, K / kQuantBlock);
}

void rms_norm_rows(const float* x, const float* g, float* out, int64_t M, int64_t K0, int64_t K, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K0;
    float* o = out + m * K;
    float inv = 1.f;
    if (g != nullptr) {
      // the squares summed in 16 lanes (lane l: elements l, l + 16, ...), then across the lanes
      // and the last K0 % 16 in order, whatever M is. (One chain of K0 dependent adds took ~0.7 us a
      // row at K0 = 576, measured 2026-12-06: two norms a layer, in phases of one unit.)
      v16 acc = v16{};
      int64_t k = 0;
      for (; k + kLanes <= K0; k += kLanes) {
        const v16 v = load(row + k);
        acc += v * v;
      }
      float ss = hsum(acc);
      for (; k < K0; ++k) ss += row[k] * row[k];
      inv = 1.f / std::sqrt(ss / static_cast<float>(K0) + eps);
    }
    for (int64_t k = 0; k < K0; ++k) o[k] = g != nullptr ? g[k] * (row[k] * inv) : row[k];
    for (int64_t k = K0; k < K; ++k) o[k] = 0.f;
  }
}

}  // namespace jspec_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecSmallRows, SmallRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // w [N, K], packed or quantized
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecSmallRowsFused, SmallRowsFusedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K0]
                                  .Arg<ffi::AnyBuffer>()          // w [N, K], packed or quantized
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [K0] or [0]: RMSNorm gain
                                  .Arg<ffi::Buffer<ffi::F32>>()   // residual [M, N] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecRowArgmax, RowArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [R, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()); // int32 [R]
