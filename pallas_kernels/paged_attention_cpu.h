// The paged attention kernel's work as a plan, for a kernel call that runs it among other work
// (layer_tail.cc) as well as for its own target (paged_attention_cpu.cc, which defines it):
//
//   AttentionPlan plan(shapes, q, k_pages, v_pages, block_tables, kv_lens, q_lens);
//   plan.run(u) for every u in [0, plan.num_units), on any threads, in any order;
//   plan.combine(out) once they are all done: out [B, T, Hq, D], padding rows zero.
#pragma once

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jspec_cpu {

struct AttentionShapes {
  int64_t B, T, Hq, D, KVH, P, S, W, G;
};

// Checks q [B, T, Hq, D], k_pages [KVH, P, S, D] and block_tables [B, W]; fills s.
xla::ffi::Error attention_shapes(const xla::ffi::Buffer<xla::ffi::F32>& q,
                                 const xla::ffi::Buffer<xla::ffi::F32>& k_pages,
                                 const xla::ffi::Buffer<xla::ffi::S32>& block_tables, AttentionShapes& s);

class AttentionPlan {
 public:
  AttentionPlan(const AttentionShapes& s, const float* q, const float* k_pages, const float* v_pages,
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
  const float *q, *kp, *vp;
  const int32_t* tables;
  std::vector<Seq> seqs;
  int64_t max_chunks = 0, R = 0, stride = 0;
  std::vector<float> parts;  // [B, KVH, max_chunks, R, D + 2]: m, l, acc
};

}  // namespace jspec_cpu
