// Paged verification attention for XLA's CPU backend, as an XLA FFI custom call.
//
// The contract of pallas_kernels/paged_verify_attention.py, float32 queries over float32, float16,
// bfloat16 or 8-bit float (E4M3, E5M2) pages (read as float32: paged_attention_cpu.h):
//   q [B, T, Hq, D], k_pages / v_pages [KVH, P, S, D], block_tables int32 [B, W],
//   kv_lens int32 [B], q_lens int32 [B]  ->  out [B, T, Hq, D]
// Sequence b has q_lens[b] new query rows whose K/V are already in the pages; row t sits at
// position kv_lens[b] - q_lens[b] + t and sees the keys at positions <= its own; rows
// t >= q_lens[b] come out as zeros. Only the pages a row can see are read (never a table slot
// past kv_lens[b]), so stale, NaN or garbage pages beyond a sequence's length cannot leak in.
//
// One unit of work is one (sequence, KV head, chunk of 256 keys): the scores of all the rows of
// the KV head's query heads against the chunk's keys, 16 keys at a time (a block of keys comes
// from memory once and serves every row from L1; a row's 16 dot products are summed across
// lanes together), a softmax per row within the chunk, then the values (each value row read
// once, 4 rows' accumulators held in registers); the next keys are prefetched while one block
// is read. The chunks of a row are combined at the end (split-K, as flash-decoding does), so a
// single sequence's keys keep both cores busy. The XLA path
// (jspec/attention.py) gathers every page of a block of 256 keys into a copy first; here the
// pages are read in place. Each row's result is computed in the same order whatever the other
// rows, so a decode step's row equals the same row inside a verification step's.
//
// Pages of float16, bfloat16 or 8-bit floats are widened to float32 as the passes load them
// (unit<Pg>): the same operations on the same values, so the result is the float32 kernel's on
// the widened pages, bit for bit (the scalar tails are one fma whatever the pages hold). Where a
// block of 16 keys is scored by several rows (the query heads of a KV head, a verification's
// rows) the AVX-512 scores pass widens its keys once into a 16 KB buffer in L1 and every row reads
// that (30 layers at 1,000 keys, q_len 5: float16 and bfloat16 pages 6-12% faster); where the
// value pass has several row groups (a verification) it widens the chunk's value rows once too
// (E4M3 pages 12-17% faster). With one row group (a decode step) widening a whole chunk first
// (64 KB, past L1) ran no faster than float32 pages, where converting as they load ran a decode
// step's 30 layers at 1,000 keys in 1.49-1.63 ms against 1.78-1.90 (measured
// 2026-12-05).
//
// On a CPU with AVX2 and FMA but not AVX-512 (JSPEC_AVX2_TILES) the same passes run as AVX2
// tiles sized for 16 registers of 8 floats: scores 3 rows x 4 keys at a time, values 3 rows x
// 32 floats, exp and softmax in 8 lanes, and the key and value rows prefetched 4 blocks ahead.
//
// Built with pallas_kernels/cpu/small_rows.cc into one library (pallas_kernels/cpu/build.py).
// Reference: pallas_kernels.paged_verify_attention.paged_verify_attention_reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "paged_attention_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jspec_cpu::hsum;
using jspec_cpu::kLanes;
using jspec_cpu::load;
using jspec_cpu::splat;
using jspec_cpu::store;
using jspec_cpu::v16;
using jspec_cpu::i16v;
using jspec_cpu::vexp;
using jspec_cpu::F32Pages;

namespace {

using jspec_cpu::AttentionShapes;
using Shapes = AttentionShapes;

#ifdef JSPEC_AVX2_TILES
constexpr int kRowGroup = 3;  // rows of one head accumulated together in the value pass (3 x 32 floats)
#else
constexpr int kRowGroup = 4;  // rows of one head accumulated together in the value pass
#endif

// out[j] = sum of the lanes of a[j], for 16 vectors at once: four rounds that each fold half of
// every vector onto the other half of its partner's (15 two-vector shuffles and adds in all,
// against 16 separate horizontal sums). Folding leaves the lanes in bit-reversed order, so the
// inputs are taken in that order.
inline v16 fold(v16 a, v16 b, i16v lo, i16v hi) {
#if defined(__clang__)
  v16 x, y;
  for (int i = 0; i < kLanes; ++i) {
    x[i] = lo[i] < kLanes ? a[lo[i]] : b[lo[i] - kLanes];
    y[i] = hi[i] < kLanes ? a[hi[i]] : b[hi[i] - kLanes];
  }
  return x + y;
#else
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
#endif
}

inline v16 reduce16(const v16 (&a)[kLanes]) {
  static constexpr int kBitrev[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  const i16v lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16v hi1 = lo1 + 8;
  const i16v lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const i16v hi2 = lo2 + 4;
  const i16v lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const i16v hi3 = lo3 + 2;
  const i16v lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const i16v hi4 = lo4 + 1;
  v16 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) t[i] = fold(a[kBitrev[2 * i]], a[kBitrev[2 * i + 1]], lo1, hi1);
  for (int i = 0; i < 4; ++i) u[i] = fold(t[2 * i], t[2 * i + 1], lo2, hi2);
  for (int i = 0; i < 2; ++i) w[i] = fold(u[2 * i], u[2 * i + 1], lo3, hi3);
  return fold(w[0], w[1], lo4, hi4);
}

#ifdef JSPEC_AVX2_TILES
constexpr int64_t kAheadBlocks = 4;  // blocks of 16 keys prefetched ahead in the scores pass
#endif
constexpr int64_t kChunkKeys = 256;  // keys per unit of work (split-K, combined at the end)

// A page row of D elements as float32 (the same values the passes would load).
template <class Pg>
void widen_row(const typename Pg::T* src, float* dst, int64_t D) {
  int64_t c = 0;
  for (; c + kLanes <= D; c += kLanes) store(dst + c, Pg::v16s(src + c));
  for (; c < D; ++c) dst[c] = Pg::one(src + c);
}

// acc[r][d .. d + 16 NV] += sum over keys [from, to) of p[r * n + pos - from] v(pos)[d ..], for
// the first `rows` rows of a group, the accumulators held in registers through the keys.
template <class Pg, int NV, class VRow>
void value_block(const float* p, int64_t n, int64_t rows, int64_t from, int64_t to, int64_t d,
                 const VRow& vrow, float (&acc)[kRowGroup][256]) {
  v16 a[kRowGroup][NV];
  for (int r = 0; r < kRowGroup; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = r < rows ? load(acc[r] + d + i * kLanes) : v16{};
  for (int64_t pos = from; pos < to; ++pos) {
    const auto* v = vrow(pos) + d;
    if (pos + kLanes < to) {
      const auto* ahead = vrow(pos + kLanes) + d;
      for (int i = 0; i < NV; ++i) __builtin_prefetch(ahead + i * kLanes);
    }
    v16 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = Pg::v16s(v + i * kLanes);
    for (int r = 0; r < kRowGroup; ++r) {
      if (r >= rows) break;
      const v16 pr = splat(p[r * n + pos - from]);
      for (int i = 0; i < NV; ++i) a[r][i] = a[r][i] + pr * vv[i];
    }
  }
  for (int r = 0; r < kRowGroup && r < rows; ++r)
    for (int i = 0; i < NV; ++i) store(acc[r] + d + i * kLanes, a[r][i]);
}

#ifdef JSPEC_AVX2_TILES
// AVX2 + FMA (16 registers of 8 floats). The 16-lane code above keeps 16 score accumulators of
// a row (32 halves) or 4 x 4 value accumulators, more than these CPUs have registers for: GCC
// kept them in memory and the kernel ran slower than XLA's attention (at q_len 5 and 1,000
// keys, 30 layers: 55 ms against 31). Here the same passes are tiled to fit.

// exp over 8 lanes, the same method as vexp in intrinsics (vexp's 16-lane selects and
// conversions, on these CPUs, went partly lane by lane); -inf and anything below -87.3 -> 0.
inline __m256 vexp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// A row's softmax within the chunk: m = max of its `seen` scores, sr[i] = exp(sr[i] - m) in
// place, returns l = their sum (8 lanes, the last seen % 8 as one vector padded with -inf, then
// the lanes: hsum8).
inline float softmax_row_avx2(float* sr, int64_t seen, float& m) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= seen; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; i < seen; ++i) m = std::max(m, sr[i]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= seen; i += 8) {
    const __m256 p = vexp8(_mm256_sub_ps(_mm256_loadu_ps(sr + i), mb));
    _mm256_storeu_ps(sr + i, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (i < seen) {
    for (int j = 0; j < 8; ++j) lanes[j] = i + j < seen ? sr[i + j] - m : -std::numeric_limits<float>::infinity();
    const __m256 p = vexp8(_mm256_loadu_ps(lanes));
    _mm256_storeu_ps(lanes, p);
    for (int64_t j = i; j < seen; ++j) sr[j] = lanes[j - i];
    sum = _mm256_add_ps(sum, p);
  }
  return jspec_cpu::hsum8(sum);
}

// dots[i][j0 + j] = q_i . k_j (unscaled) for R <= 3 query rows against 4 keys: 12 accumulators,
// the 3 rows' 8 floats held, a key's 8 floats loaded once for all of them. Each dot is summed
// in the same order whatever R: 8-lane partial sums along D, the lanes (hadd), then the
// columns past the last multiple of 8 one by one.
template <class Pg, int R>
inline void dots_tile(const float* const* qr, const typename Pg::T* const* keys, int64_t D, float (*dots)[kLanes],
                      int j0) {
  __m256 acc[R][4];
#pragma GCC unroll 3
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= D; c += 8) {
    __m256 qv[R];
#pragma GCC unroll 3
    for (int i = 0; i < R; ++i) {
      qv[i] = _mm256_loadu_ps(qr[i] + c);
      jspec_cpu::pin(qv[i]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256 kv = Pg::v8(keys[j] + c);
      jspec_cpu::pin(kv);
#pragma GCC unroll 3
      for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(qv[i], kv, acc[i][j]);
    }
  }
#pragma GCC unroll 3  // unrolled, so that acc stays in registers (not stored every step)
  for (int i = 0; i < R; ++i) {
    // [a0 a1 a2 a3] lanes 0-3 | 4-7, then the halves added: the 4 sums at once
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
    float out[4];
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int64_t t = c; t < D; ++t)
      for (int j = 0; j < 4; ++j) out[j] = std::fma(qr[i][t], Pg::one(keys[j] + t), out[j]);
    std::memcpy(dots[i] + j0, out, sizeof out);
  }
}

// acc[r][d .. d + 8 NV] += sum over keys [from, to) of p[r * n + pos - from] v(pos)[d ..] for
// RG <= 3 rows, the accumulators (RG x NV <= 12) held in registers through the keys, v(pos) =
// vrows[pos - from]; the same fused multiply-add per element as the per-row tail in `unit`.
template <class Pg, int RG, int NV>
void value_block_avx2(const float* p, int64_t n, int64_t from, int64_t to, int64_t d,
                      const typename Pg::T* const* vrows, float (&acc)[kRowGroup][256]) {
  __m256 a[RG][NV];
#pragma GCC unroll 3
  for (int r = 0; r < RG; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_loadu_ps(acc[r] + d + 8 * i);
  for (int64_t pos = from; pos < to; ++pos) {
    const auto* v = vrows[pos - from] + d;
    if (pos + kLanes < to) _mm_prefetch(reinterpret_cast<const char*>(vrows[pos - from + kLanes] + d), _MM_HINT_T0);
    __m256 pr[RG];
#pragma GCC unroll 3
    for (int r = 0; r < RG; ++r) {
      pr[r] = _mm256_broadcast_ss(p + r * n + pos - from);
      jspec_cpu::pin(pr[r]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) {
      __m256 vv = Pg::v8(v + 8 * i);
      jspec_cpu::pin(vv);
#pragma GCC unroll 3
      for (int r = 0; r < RG; ++r) a[r][i] = _mm256_fmadd_ps(pr[r], vv, a[r][i]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < RG; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc[r] + d + 8 * i, a[r][i]);
}

template <class Pg, int NV>
void value_rows_avx2(const float* p, int64_t n, int64_t rows, int64_t from, int64_t to, int64_t d,
                     const typename Pg::T* const* vrows, float (&acc)[kRowGroup][256]) {
  static_assert(kRowGroup == 3, "one case per group size");
  switch (rows) {
    case 3: value_block_avx2<Pg, 3, NV>(p, n, from, to, d, vrows, acc); break;
    case 2: value_block_avx2<Pg, 2, NV>(p, n, from, to, d, vrows, acc); break;
    case 1: value_block_avx2<Pg, 1, NV>(p, n, from, to, d, vrows, acc); break;
    default: break;
  }
}
#endif

// One unit: sequence b, KV head kvh, keys [k0, k1). Its rows are the G query heads of the KV
// head times the T query rows (row r = t * G + g), so each K and V row is read once for all of
// them. Row r (position first_pos + t) sees keys <= first_pos + t. Writes per row the chunk's
// max score m, sum of exp(score - m) and sum of exp(score - m) v (unnormalised) to `part`. The
// pages hold Pg's elements (paged_attention_cpu.h), read as float32.
template <class Pg>
void unit(const Shapes& s, const float* q, const typename Pg::T* kp, const typename Pg::T* vp, const int32_t* table,
          int64_t b, int64_t kvh, int64_t rows_t, int64_t first_pos, int64_t k0, int64_t k1,
          std::vector<float>& scores, float* part) {
  using E = typename Pg::T;
  const int64_t D = s.D, S = s.S, G = s.G;
  const int64_t R = rows_t * G, n = k1 - k0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float ninf = -std::numeric_limits<float>::infinity();
  scores.assign(static_cast<size_t>(R * n), ninf);
  auto qrow = [&](int64_t r) { return q + ((b * s.T + r / G) * s.Hq + kvh * G + r % G) * D; };
  auto page_of = [&](const E* pages, int64_t slot) {  // first row of table slot `slot`
    int64_t page = table[slot];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), s.P - 1);  // memory-safe on a bad table
    return pages + (kvh * s.P + page) * S * D;
  };
  auto prefetch_page = [&](const E* page, int64_t keys) {
    for (int64_t i = 0; i < keys * D; i += kLanes) __builtin_prefetch(page + i);
  };
#ifdef JSPEC_AVX2_TILES
  // The key rows of the block kAheadBlocks ahead into L1, its value rows into L2 (the value pass
  // reads them once the chunk's scores are done): a block's scores take less time than a read
  // from memory, so asking for the next block only (as the AVX-512 code does) leaves it waiting.
  auto prefetch_block = [&](int64_t pos) {
    if (pos >= k1) return;
    const int64_t keys = std::min<int64_t>(std::min<int64_t>(kLanes, k1 - pos), S - pos % S);  // in pos's page
    const E* kr = page_of(kp, pos / S) + (pos % S) * D;
    const E* vr = page_of(vp, pos / S) + (pos % S) * D;
    for (int64_t i = 0; i < keys * D; i += kLanes) {
      __builtin_prefetch(kr + i, 0, 3);
      __builtin_prefetch(vr + i, 0, 2);
    }
  };
  for (int64_t i = 0; i < kAheadBlocks; ++i) prefetch_block(k0 + i * kLanes);
#endif
  // scores of every row against the keys it sees, 16 keys at a time: a row's 16 dot products are
  // accumulated as 16 vectors and summed across lanes together (reduce16), not one by one
  for (int64_t p0 = k0; p0 < k1; p0 += kLanes) {
    const int64_t nb = std::min<int64_t>(kLanes, k1 - p0);
    const E* keys[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t pos = p0 + std::min(j, nb - 1);
      keys[j] = page_of(kp, pos / S) + (pos % S) * D;
    }
#ifdef JSPEC_AVX2_TILES
    prefetch_block(p0 + kAheadBlocks * kLanes);
#else
    if (p0 + kLanes < k1) {  // the next block's key rows
      const int64_t pos = p0 + kLanes;
      prefetch_page(page_of(kp, pos / S) + (pos % S) * D, std::min<int64_t>(kLanes, S - pos % S));
    }
#endif
#ifdef JSPEC_AVX2_TILES
    for (int64_t r0 = std::max<int64_t>(0, p0 - first_pos) * G; r0 < R; r0 += 3) {  // 3 rows at a time
      const int64_t nr = std::min<int64_t>(3, R - r0);
      const float* qr[3] = {qrow(r0), qrow(r0 + (nr > 1)), qrow(r0 + 2 * (nr > 2))};
      float dots[3][kLanes];
      for (int j0 = 0; j0 < kLanes; j0 += 4) {
        if (nr == 3) dots_tile<Pg, 3>(qr, keys + j0, D, dots, j0);
        else if (nr == 2) dots_tile<Pg, 2>(qr, keys + j0, D, dots, j0);
        else dots_tile<Pg, 1>(qr, keys + j0, D, dots, j0);
      }
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        for (float& x : dots[i]) x *= scale;
        const int64_t seen = std::min(nb, first_pos + r / G + 1 - p0);  // keys of the block the row sees
        std::memcpy(scores.data() + r * n + (p0 - k0), dots[i], sizeof(float) * seen);
      }
    }
#else
    auto score_rows = [&](auto pages, const auto* const* ks) {  // ks: the block's key rows, of pages' type
      using P = decltype(pages);
      for (int64_t r = std::max<int64_t>(0, p0 - first_pos) * G; r < R; ++r) {
        const float* qr = qrow(r);
        v16 acc[kLanes];
        for (auto& a : acc) a = v16{};
        int64_t c = 0;
        for (; c + kLanes <= D; c += kLanes) {
          const v16 qv = load(qr + c);
          for (int j = 0; j < kLanes; ++j) acc[j] += qv * P::v16s(ks[j] + c);
        }
        v16 dots = reduce16(acc);
        for (; c < D; ++c)
          for (int j = 0; j < kLanes; ++j) dots[j] = std::fma(qr[c], P::one(ks[j] + c), dots[j]);
        dots *= splat(scale);
        const int64_t seen = std::min(nb, first_pos + r / G + 1 - p0);  // keys of the block the row sees
        std::memcpy(scores.data() + r * n + (p0 - k0), &dots, sizeof(float) * seen);
      }
    };
    if constexpr (std::is_same_v<Pg, F32Pages>) {
      score_rows(F32Pages{}, keys);
    } else if (R - std::max<int64_t>(0, p0 - first_pos) * G <= 1) {
      score_rows(Pg{}, keys);
    } else {  // several rows: the block's keys widened once, into L1, not once per row (the same values)
      alignas(64) float widened[kLanes][256];  // D <= 256
      const float* wk[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        widen_row<Pg>(keys[j], widened[j], D);
        wk[j] = widened[j];
      }
      score_rows(F32Pages{}, wk);
    }
#endif
  }
  // per row: m, then p = exp(score - m) in place, l = sum p
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores.data() + r * n;
    const int64_t seen = std::min(n, first_pos + r / G + 1 - k0);  // keys of this chunk the row sees
    float* out = part + r * (D + 2);
    if (seen <= 0) {
      out[0] = ninf;
      out[1] = 0.f;
      continue;
    }
#ifdef JSPEC_AVX2_TILES
    float m;
    const float l = softmax_row_avx2(sr, seen, m);
#else
    // m: 16 lanes of maxima, then across them and the last seen % 16 (a chain of scalar maxima
    // through the scores, each waiting for the one before, took 14% of the kernel's time at 1,000
    // keys). The maximum is exact in any order, and each select keeps m on a NaN score as
    // std::max(m, score) does, so m is the scalar loop's bit for bit.
    v16 mv = splat(ninf);
    int64_t i0 = 0;
    for (; i0 + kLanes <= seen; i0 += kLanes) {
      const v16 x = load(sr + i0);
      mv = x > mv ? x : mv;
    }
    float m = ninf;
    for (int j = 0; j < kLanes; ++j) m = std::max(m, mv[j]);
    for (; i0 < seen; ++i0) m = std::max(m, sr[i0]);
    v16 sum = v16{};
    int64_t i = 0;
    for (; i + kLanes <= seen; i += kLanes) {
      const v16 p = vexp(load(sr + i) - splat(m));
      store(sr + i, p);
      sum += p;
    }
    float l = hsum(sum);
    if (i < seen) {
      v16 x = splat(ninf);
      for (int64_t j = i; j < seen; ++j) x[j - i] = sr[j] - m;
      const v16 p = vexp(x);
      for (int64_t j = i; j < seen; ++j) {
        sr[j] = p[j - i];
        l += p[j - i];
      }
    }
#endif
    out[0] = m;
    out[1] = l;
  }
  // values, kRowGroup rows at a time: acc[r] = sum over seen keys of p[r, key] v[key]. The keys
  // every row of the group sees run with the accumulators in registers, 64 floats of them at a
  // time (value_block; AVX2: 32, value_block_avx2); the group's last few keys, which only some
  // of its rows see, one row at a time. Either way each row adds its keys in order with the same operations.
  auto vrow = [&](int64_t pos) { return page_of(vp, pos / S) + (pos % S) * D; };
  auto value_pass = [&](auto pages, const auto& row_of) {  // row_of(pos): key pos's value row, of pages' type
    using P = decltype(pages);
    using PE = typename P::T;
#ifdef JSPEC_AVX2_TILES
    const PE* vrows[kChunkKeys + kLanes];  // row_of(k0 + i), and the last row again past the end
    for (int64_t i = 0; i < n + kLanes; ++i) vrows[i] = row_of(k0 + std::min(i, n - 1));
#endif
    for (int64_t g0 = 0; g0 < R; g0 += kRowGroup) {
      const int64_t g1 = std::min(R, g0 + kRowGroup);
      float acc[kRowGroup][256];  // D <= 256 (checked by the caller)
      for (int64_t r = g0; r < g1; ++r) std::fill(acc[r - g0], acc[r - g0] + D, 0.0f);
      const int64_t last = std::min(k1, first_pos + (g1 - 1) / G + 1);  // keys the group's last row sees
      const int64_t all = std::max(k0, std::min(last, first_pos + g0 / G + 1));  // keys its first row sees
      const float* p = scores.data() + g0 * n;  // p[r * n + pos - k0]: row g0 + r's weight of key pos
      int64_t d = 0;
#ifdef JSPEC_AVX2_TILES
      for (; d + 32 <= D; d += 32) value_rows_avx2<P, 4>(p, n, g1 - g0, k0, all, d, vrows, acc);
      switch ((D - d) / 8) {
        case 3: value_rows_avx2<P, 3>(p, n, g1 - g0, k0, all, d, vrows, acc); break;
        case 2: value_rows_avx2<P, 2>(p, n, g1 - g0, k0, all, d, vrows, acc); break;
        case 1: value_rows_avx2<P, 1>(p, n, g1 - g0, k0, all, d, vrows, acc); break;
        default: break;
      }
      for (d = D / 8 * 8; d < D; ++d)  // the columns past the last multiple of 8
        for (int64_t pos = k0; pos < all; ++pos)
          for (int64_t r = 0; r < g1 - g0; ++r)
            acc[r][d] = std::fma(p[r * n + pos - k0], P::one(vrows[pos - k0] + d), acc[r][d]);
#else
      for (; d + 4 * kLanes <= D; d += 4 * kLanes) value_block<P, 4>(p, n, g1 - g0, k0, all, d, row_of, acc);
      switch ((D - d) / kLanes) {
        case 3: value_block<P, 3>(p, n, g1 - g0, k0, all, d, row_of, acc); break;
        case 2: value_block<P, 2>(p, n, g1 - g0, k0, all, d, row_of, acc); break;
        case 1: value_block<P, 1>(p, n, g1 - g0, k0, all, d, row_of, acc); break;
        default: break;
      }
      for (d = D / kLanes * kLanes; d < D; ++d)  // the columns past the last full vector
        for (int64_t pos = k0; pos < all; ++pos)
          for (int64_t r = 0; r < g1 - g0; ++r)
            acc[r][d] = std::fma(p[r * n + pos - k0], P::one(row_of(pos) + d), acc[r][d]);
#endif
      for (int64_t pos = all; pos < last; ++pos) {
        const PE* v = row_of(pos);
        const int64_t from = std::max<int64_t>(g0, std::max<int64_t>(0, pos - first_pos) * G);
        for (int64_t r = from; r < g1; ++r) {
          const float pr = p[(r - g0) * n + pos - k0];
          float* a = acc[r - g0];
          int64_t c = 0;
#ifdef JSPEC_AVX2_TILES
          for (; c + 8 <= D; c += 8)
            _mm256_storeu_ps(a + c, _mm256_fmadd_ps(_mm256_set1_ps(pr), P::v8(v + c), _mm256_loadu_ps(a + c)));
#else
          for (; c + kLanes <= D; c += kLanes) store(a + c, load(a + c) + splat(pr) * P::v16s(v + c));
#endif
          for (; c < D; ++c) a[c] = std::fma(pr, P::one(v + c), a[c]);  // scalar tails: one fused op whatever Pg
        }
      }
      for (int64_t r = g0; r < g1; ++r) std::memcpy(part + r * (D + 2) + 2, acc[r - g0], sizeof(float) * D);
    }
  };
#ifndef JSPEC_AVX2_TILES
  if constexpr (!std::is_same_v<Pg, F32Pages>) {
    if (R > kRowGroup) {  // several row groups: the chunk's value rows widened once (the same values)
      thread_local std::vector<float> widened;
      const int64_t keys = std::min(k1, first_pos + (R - 1) / G + 1) - k0;  // the keys the last row sees
      widened.resize(static_cast<size_t>(std::max<int64_t>(keys, 0) * D));
      for (int64_t i = 0; i < keys; ++i) widen_row<Pg>(vrow(k0 + i), widened.data() + i * D, D);
      value_pass(F32Pages{}, [&](int64_t pos) { return static_cast<const float*>(widened.data() + (pos - k0) * D); });
      return;
    }
  }
#endif
  value_pass(Pg{}, vrow);
}

}  // namespace

namespace jspec_cpu {

AttentionPlan::AttentionPlan(const AttentionShapes& shapes, const float* q, const void* k_pages,
                             const void* v_pages, PageType type, const int32_t* block_tables, const int32_t* kv_lens,
                             const int32_t* q_lens)
    : s(shapes), q(q), kp(k_pages), vp(v_pages), type(type), tables(block_tables), seqs(shapes.B) {
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t kv_len = std::min<int64_t>(kv_lens[b], s.W * s.S);
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(q_lens[b], 0), s.T);
    const int64_t first_pos = kv_len - q_lens[b];
    const int64_t keys = rows > 0 ? std::max<int64_t>(0, std::min(kv_len, first_pos + rows)) : 0;
    const int64_t chunks = (keys + kChunkKeys - 1) / kChunkKeys;
    seqs[b] = {rows, first_pos, keys, chunks, num_units};
    num_units += s.KVH * chunks;
    max_chunks = std::max(max_chunks, chunks);
  }
  R = s.T * s.G;
  stride = s.D + 2;
  // partials [B, KVH, max_chunks, R, D + 2]: m, l, acc
  parts.resize(static_cast<size_t>(s.B * s.KVH * max_chunks * R * stride));
}

float* AttentionPlan::part_of(int64_t b, int64_t kvh, int64_t c) {
  return parts.data() + ((b * s.KVH + kvh) * max_chunks + c) * R * stride;
}

void AttentionPlan::run(int64_t u) {
  thread_local std::vector<float> scores;
  int64_t b = 0;
  while (u >= seqs[b].first_unit + s.KVH * seqs[b].chunks) ++b;
  const Seq& sq = seqs[b];
  const int64_t kvh = (u - sq.first_unit) / sq.chunks, c = (u - sq.first_unit) % sq.chunks;
  const int64_t k0 = c * kChunkKeys, k1 = std::min(sq.keys, (c + 1) * kChunkKeys);
  float* part = part_of(b, kvh, c);
  auto run_as = [&](auto pages) {  // the unit on pages of decltype(pages)'s elements
    using Pg = decltype(pages);
    using E = typename Pg::T;
    unit<Pg>(s, q, static_cast<const E*>(kp), static_cast<const E*>(vp), tables + b * s.W, b, kvh, sq.rows,
             sq.first_pos, k0, k1, scores, part);
  };
  switch (type) {
    case PageType::kF32: run_as(F32Pages{}); break;
    case PageType::kF16: run_as(F16Pages{}); break;
    case PageType::kBF16: run_as(BF16Pages{}); break;
    case PageType::kE4M3: run_as(E4M3Pages{}); break;
    case PageType::kE5M2: run_as(E5M2Pages{}); break;
  }
}

// combine the chunks of every row, in chunk order (so a row's bits do not depend on the rows
// beside it: chunks it does not see add exact zeros)
void AttentionPlan::combine(float* op) {
  std::memset(op, 0, sizeof(float) * s.B * s.T * s.Hq * s.D);  // padding rows stay zero
  for (int64_t b = 0; b < s.B; ++b) {
    const Seq& sq = seqs[b];
    for (int64_t kvh = 0; kvh < s.KVH; ++kvh) {
      for (int64_t r = 0; r < sq.rows * s.G; ++r) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < sq.chunks; ++c) m = std::max(m, part_of(b, kvh, c)[r * stride]);
        if (!(m > -std::numeric_limits<float>::infinity())) continue;  // sees no key: zeros
        float l = 0.f;
        float* o = op + ((b * s.T + r / s.G) * s.Hq + kvh * s.G + r % s.G) * s.D;
        for (int64_t c = 0; c < sq.chunks; ++c) {
          const float* pc = part_of(b, kvh, c) + r * stride;
          if (pc[1] == 0.f) continue;
          const float w = std::exp(pc[0] - m);
          l += pc[1] * w;
          for (int64_t d = 0; d < s.D; ++d) o[d] += pc[2 + d] * w;
        }
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < s.D; ++d) o[d] *= inv;
      }
    }
  }
}

ffi::Error attention_shapes(const ffi::Buffer<ffi::F32>& q, const ffi::AnyBuffer& k_pages,
                            const ffi::AnyBuffer& v_pages, const ffi::Buffer<ffi::S32>& block_tables, AttentionShapes& s,
                            PageType& type) {
  const auto et = k_pages.element_type();
  if (v_pages.element_type() != et || v_pages.element_count() != k_pages.element_count()) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: k_pages and v_pages differ in dtype or size");
  }
  if (!page_type(et, type)) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: pages must be float32, float16, bfloat16 or 8-bit floats");
  }
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: expected q [B, T, Hq, D], pages [KVH, P, S, D], "
                                       "block_tables [B, W]");
  }
  s = AttentionShapes{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], td[1], 0};
  if (kd[3] != s.D || s.D > 256 || s.KVH == 0 || s.Hq % s.KVH || td[0] != s.B) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: shapes disagree (or head_dim > 256)");
  }
  s.G = s.Hq / s.KVH;
  return ffi::Error::Success();
}

}  // namespace jspec_cpu

namespace {

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
                              ffi::ResultBuffer<ffi::F32> out) {
  AttentionShapes s;
  jspec_cpu::PageType type;
  if (auto e = jspec_cpu::attention_shapes(q, k_pages, v_pages, block_tables, s, type); e.failure()) return e;
  jspec_cpu::AttentionPlan plan(s, q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(), type,
                                block_tables.typed_data(), kv_lens.typed_data(), q_lens.typed_data());
  jspec_cpu::parallel_for(pool, plan.num_units, [&](int64_t u) { plan.run(u); });
  plan.combine(out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pages [KVH, P, S, D]: f32, f16, bf16, f8
                                  .Arg<ffi::AnyBuffer>()          // v_pages [KVH, P, S, D]: k_pages' dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_lens [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // out [B, T, Hq, D]
