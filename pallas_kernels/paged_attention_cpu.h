// The paged attention kernel's work as a plan, for a kernel call that runs it among other work
// (layer_tail.cc) as well as for its own target (paged_attention_cpu.cc, which defines it):
//
//   AttentionPlan plan(shapes, q, k_pages, v_pages, block_tables, kv_lens, q_lens);
//   plan.run(u) for every u in [0, plan.num_units), on any threads, in any order;
//   plan.combine(out) once they are all done: out [B, T, Hq, D], padding rows zero.
//
// The pages hold float32, float16 or bfloat16 (PageType); the queries, the arithmetic and the
// result are float32 whatever the pages hold: a page's element becomes a float32 as it is read
// (every float16 and bfloat16 value is a float32 exactly), so a row's result is the one the
// float32 kernel gives on the pages' values widened.
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

enum class PageType { kF32, kF16, kBF16 };

// Checks q [B, T, Hq, D], k_pages and v_pages [KVH, P, S, D] of one page type and block_tables
// [B, W]; fills s and type.
xla::ffi::Error attention_shapes(const xla::ffi::Buffer<xla::ffi::F32>& q, const xla::ffi::AnyBuffer& k_pages,
                                 const xla::ffi::AnyBuffer& v_pages,
                                 const xla::ffi::Buffer<xla::ffi::S32>& block_tables, AttentionShapes& s,
                                 PageType& type);

// 16 values of 16 bits as float32, one at a time (builds without the vector conversions).
template <float (*Widen)(uint16_t)>
inline v16 widen16(const uint16_t* p) {
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
    return widen16<half_float>(p);
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
    return widen16<bf16_float>(p);
#endif
  }
#ifdef JSPEC_AVX2_TILES
  static __m256 v8(const T* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
#endif
};

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
