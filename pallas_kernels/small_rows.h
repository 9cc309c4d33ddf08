// The small-row product's pieces, for kernel calls that run it among other work (layer_tail.cc)
// as well as for its own targets (small_rows.cc, which defines them).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jspec_cpu {

constexpr int64_t kChunkRows = 64;  // weight rows per unit of work handed to a thread

inline int64_t product_chunks(int64_t N) { return (N + kChunkRows - 1) / kChunkRows; }

// How a weight [N, K] (its rows) lies in memory (pallas_kernels.small_rows):
//   kPlain   float32 [N, K];
//   kPacked  float32 [N / 4, K / 16, 4, 16]: 4 rows interleaved 16 floats at a time (pack_rows);
//   kQ4_1    uint8 [N / 4, K / 32, 4, 24]: 4 rows interleaved one 32-weight block at a time, each
//            block a record of float32 d, float32 m and 16 bytes of 4-bit q (weight i = d q_i + m,
//            q_i the low nibble of byte i for i < 16, the high nibble of byte i - 16 after): GGUF's
//            Q4_1 with its float16 d and m widened (pack_quantized);
//   kQ8_0    uint8 [N / 4, K / 32, 4, 36]: the same for GGUF's Q8_0, records of float32 d and 32
//            int8 q (weight i = d q_i).
// A quantized weight's values are exactly the float32 ones its GGUF file dequantizes to (d q is
// exact in float32: 11 by at most 8 significant bits), and a product sums them in the order it sums
// the packed floats, so it gives the packed float32 weight's result bit for bit, reading 0.75
// (Q4_1) or 1.125 (Q8_0) bytes per weight instead of 4.
enum class Layout : int { kPlain, kPacked, kQ4_1, kQ8_0 };

struct Weight {
  const void* data;
  Layout layout;
};

constexpr int64_t kQuantBlock = 32;  // weights of one quantized block (along K)
constexpr int64_t kQ4_1Record = 24;  // bytes of a Q4_1 block's record
constexpr int64_t kQ8_0Record = 36;  // bytes of a Q8_0 block's record

// Bytes of a weight [N, K] in its layout.
inline int64_t weight_bytes(Weight w, int64_t N, int64_t K) {
  switch (w.layout) {
    case Layout::kQ4_1: return N * (K / kQuantBlock) * kQ4_1Record;
    case Layout::kQ8_0: return N * (K / kQuantBlock) * kQ8_0Record;
    default: return N * K * static_cast<int64_t>(sizeof(float));
  }
}

// The weight a buffer holds and its [N, K] (N a multiple of 4 for the packed layouts); false where
// the buffer is none of the layouts above.
bool weight_of(const xla::ffi::AnyBuffer& w, Weight& out, int64_t& N, int64_t& K);

// Chunk c of y = x w^T (+ r): y[m, n] for the weight rows n in [c kChunkRows, (c + 1) kChunkRows)
// and every row m of x [M, K]; r [M, N] (a residual added once the outputs are summed) or null.
void product_chunk(const float* x, Weight w, float* y, const float* r, int64_t M, int64_t K, int64_t N, int64_t c);

// out [M, K] = RMSNorm of x [M, K0] with gain g [K0] (g null: x as it is), zero-padded to K >= K0.
// Each row summed in one order whatever M is.
void rms_norm_rows(const float* x, const float* g, float* out, int64_t M, int64_t K0, int64_t K, float eps);

}  // namespace jspec_cpu
