// The paged attention kernel's work as a plan, for a kernel call that runs it among other work
// (layer_tail.cc) as well as for its own target (paged_attention_cpu.cc, which defines it):
//
//   AttentionPlan plan(shapes, q, k_pages, v_pages, block_tables, kv_lens, q_lens);
//   plan.run(u) for every u in [0, plan.num_units), on any threads, in any order;
//   plan.combine(out) once they are all done: out [B, T, Hq, D], padding rows zero.
//
// The pages hold float32, float16, bfloat16 or 8-bit floats (E4M3, E5M2) (PageType); the
// queries, the arithmetic and the result are float32 whatever the pages hold: a page's element
// becomes a float32 as it is read (every value of those formats is a float32 exactly), so a row's
// result is the one the float32 kernel gives on the pages' values widened.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace jspec_cpu {

struct AttentionShapes {
  int64_t B, T, Hq, D, KVH, P, S, W, G;
};

enum class PageType { kF32, kF16, kBF16, kE4M3, kE5M2 };

// Checks q [B, T, Hq, D], k_pages and v_pages [KVH, P, S, D] of one page type and block_tables
// [B, W]; fills s and type.
xla::ffi::Error attention_shapes(const xla::ffi::Buffer<xla::ffi::F32>& q, const xla::ffi::AnyBuffer& k_pages,
                                 const xla::ffi::AnyBuffer& v_pages,
                                 const xla::ffi::Buffer<xla::ffi::S32>& block_tables, AttentionShapes& s,
                                 PageType& type);

// 16 values of 16 (8) bits as float32, one at a time (builds without the vector conversions).
template <class T, float (*Widen)(T)>
inline v16 widen16(const T* p) {
  v16 v;
  for (int i = 0; i < kLanes; ++i) v[i] = Widen(p[i]);
  return v;
}

// A page element type: T as stored, one(p) a value as float32, v16s(p) 16 values as a float32
// vector (and v8(p), 8 values, for the AVX2 tiles).
struct F32Pages {
  using T = float;
  static float one(const T* p) { return *p; }
  static v16 v16s(const T* p) { return load(p); }
#ifdef JSPEC_AVX2_TILES
  static __m256 v8(const T* p) { return _mm256_loadu_ps(p); }
#endif
};

struct F16Pages {
  using T = uint16_t;
  static float one(const T* p) { return half_float(*p); }
  static v16 v16s(const T* p) {
#if defined(__AVX512F__)
    return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
    return widen16<uint16_t, half_float>(p);
#endif
  }
#ifdef JSPEC_AVX2_TILES
  static __m256 v8(const T* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = half_float(p[i]);
    return _mm256_load_ps(f);
#endif
  }
#endif
};

struct BF16Pages {
  using T = uint16_t;
  static float one(const T* p) { return bf16_float(*p); }
  static v16 v16s(const T* p) {
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<v16>(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#else
    return widen16<uint16_t, bf16_float>(p);
#endif
  }
#ifdef JSPEC_AVX2_TILES
  static __m256 v8(const T* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
#endif
};

// 8-bit floats as float16 bits in 16-bit lanes: E5M2 is float16's top byte; E4M3's byte sign-
// extended and shifted by 7 is a float16 2^8 times too small (subnormals included) once the copy
// of the sign at bit 14 is cleared, and its NaN code (which would land on the finite 1.875) is
// made float16's NaN 0xffff. Widened by the float16 conversion, E4M3 scaled back by 2^8 (exact).
#if defined(__AVX2__)
inline __m128i e4m3_halves(__m128i sext) {  // 8 lanes
  const __m128i h = _mm_and_si128(_mm_slli_epi16(sext, 7), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
  return _mm_or_si128(h, nan);
}
inline __m256i e4m3_halves(__m256i sext) {  // 16 lanes
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(sext, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
  return _mm256_or_si256(h, nan);
}
#endif
#if defined(__AVX512F__)
inline v16 fp8_v16s(const uint8_t* p, bool e4m3) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (!e4m3) return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8)));
  const __m512 f = _mm512_cvtph_ps(e4m3_halves(_mm256_cvtepi8_epi16(b)));
  return reinterpret_cast<v16>(_mm512_mul_ps(f, _mm512_set1_ps(256.0f)));
}
#endif
#if defined(JSPEC_AVX2_TILES) && defined(__F16C__)
inline __m256 fp8_v8(const uint8_t* p, bool e4m3) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (!e4m3) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(e4m3_halves(_mm_cvtepi8_epi16(b))), _mm256_set1_ps(256.0f));
}
#endif

template <bool kE4M3>
struct Fp8Pages {
  using T = uint8_t;
  static float one(const T* p) { return kE4M3 ? e4m3_float(*p) : e5m2_float(*p); }
  static v16 v16s(const T* p) {
#if defined(__AVX512F__)
    return fp8_v16s(p, kE4M3);
#else
    return widen16<uint8_t, kE4M3 ? e4m3_float : e5m2_float>(p);
#endif
  }
#ifdef JSPEC_AVX2_TILES
  static __m256 v8(const T* p) {
#if defined(__F16C__)
    return fp8_v8(p, kE4M3);
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = one(p + i);
    return _mm256_load_ps(f);
#endif
  }
#endif
};
using E4M3Pages = Fp8Pages<true>;
using E5M2Pages = Fp8Pages<false>;

// The page type of an XLA element type; false for any other.
inline bool page_type(xla::ffi::DataType et, PageType& type) {
  using xla::ffi::DataType;
  switch (et) {
    case DataType::F32: type = PageType::kF32; return true;
    case DataType::F16: type = PageType::kF16; return true;
    case DataType::BF16: type = PageType::kBF16; return true;
    case DataType::F8E4M3FN: type = PageType::kE4M3; return true;
    case DataType::F8E5M2: type = PageType::kE5M2; return true;
    default: return false;
  }
}

// Writes D float32 values at element `at` of pages of `type`, each rounded to nearest even (the
// 8-bit formats saturated first: cpu_common.h).
inline void write_page_row(PageType type, void* pages, int64_t at, const float* src, int64_t D) {
  auto each = [&](auto* dst, auto narrow) {
    for (int64_t d = 0; d < D; ++d) dst[at + d] = narrow(src[d]);
  };
  switch (type) {
    case PageType::kF32: std::memcpy(static_cast<float*>(pages) + at, src, sizeof(float) * D); break;
    case PageType::kF16: each(static_cast<uint16_t*>(pages), float_half); break;
    case PageType::kBF16: each(static_cast<uint16_t*>(pages), float_bf16); break;
    case PageType::kE4M3: each(static_cast<uint8_t*>(pages), float_e4m3); break;
    case PageType::kE5M2: each(static_cast<uint8_t*>(pages), float_e5m2); break;
  }
}

class AttentionPlan {
 public:
  // k_pages, v_pages: the pages' elements, of `type`
  AttentionPlan(const AttentionShapes& s, const float* q, const void* k_pages, const void* v_pages, PageType type,
                const int32_t* block_tables, const int32_t* kv_lens, const int32_t* q_lens);
  void run(int64_t u);      // one unit: (sequence, KV head, chunk of keys) -> its partials
  void combine(float* out);  // the partials of every row, in chunk order -> out

  int64_t num_units = 0;

 private:
  struct Seq {  // per sequence: its rows, row 0's position, the keys its last row sees, its chunks
    int64_t rows, first_pos, keys, chunks, first_unit;
  };
  float* part_of(int64_t b, int64_t kvh, int64_t c);

  AttentionShapes s;
  const float* q;
  const void *kp, *vp;
  PageType type;
  const int32_t* tables;
  std::vector<Seq> seqs;
  int64_t max_chunks = 0, R = 0, stride = 0;
  std::vector<float> parts;  // [B, KVH, max_chunks, R, D + 2]: m, l, acc
};

}  // namespace jspec_cpu
