// The small-row product's pieces, for kernel calls that run it among other work (layer_tail.cc)
// as well as for its own targets (small_rows.cc, which defines them).
#pragma once

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jspec_cpu {

constexpr int64_t kChunkRows = 64;  // weight rows per unit of work handed to a thread

inline int64_t product_chunks(int64_t N) { return (N + kChunkRows - 1) / kChunkRows; }

// How a weight [N, K] (its rows) lies in memory (pallas_kernels.cpu.small_rows):
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
//   kQ4_1Dot uint8 [N / 16, K / 32, 16, 24] and kQ8_0Dot uint8 [N / 16, K / 32, 16, 36]: the same
//            blocks arranged for integer dot products (pallas_kernels.cpu.small_rows.pack_int8_dot), 16
//            rows a block at a time. Q4_1: float32 d [16], float32 m [16], then 4 vectors of 64
//            bytes, vector t's byte 4 j + u = q_j[4 t + u] | q_j[16 + 4 t + u] << 4 (row j's
//            weights); Q8_0: float32 d [16], then 8 vectors, byte 4 j + u of vector t = q_j[4 t + u]
//            + 128. The product quantizes each row of x to int8 in blocks of 32 (QuantRows, as
//            llama.cpp's Q8_1: x ~ dx a) and sums integer products exactly: per block
//            y += (dw dx) sum(q a) [+ m (dx sum(a))]. Not the float32 weight's result: x is rounded
//            to 8 bits a block (~0.4% of the block's largest entry), but each row's result is the
//            same whatever rows it is computed with (the integer sums are exact, the block sums
//            added in one order).
enum class Layout : int { kPlain, kPacked, kQ4_1, kQ8_0, kQ4_1Dot, kQ8_0Dot };

inline bool int8_dot(Layout l) { return l == Layout::kQ4_1Dot || l == Layout::kQ8_0Dot; }

struct Weight {
  const void* data;
  Layout layout;
};

constexpr int64_t kQuantBlock = 32;  // weights of one quantized block (along K)
constexpr int64_t kQ4_1Record = 24;  // bytes of a Q4_1 block's record
constexpr int64_t kQ8_0Record = 36;  // bytes of a Q8_0 block's record
constexpr int64_t kDotRows = 16;     // weight rows a block at a time in the int8 dot layouts

// Bytes of a weight [N, K] in its layout.
inline int64_t weight_bytes(Weight w, int64_t N, int64_t K) {
  switch (w.layout) {
    case Layout::kQ4_1:
    case Layout::kQ4_1Dot: return N * (K / kQuantBlock) * kQ4_1Record;
    case Layout::kQ8_0:
    case Layout::kQ8_0Dot: return N * (K / kQuantBlock) * kQ8_0Record;
    default: return N * K * static_cast<int64_t>(sizeof(float));
  }
}

// The weight a buffer holds and its [N, K] (N a multiple of 4 for the packed layouts); false where
// the buffer is none of the layouts above.
bool weight_of(const xla::ffi::AnyBuffer& w, Weight& out, int64_t& N, int64_t& K);

// Rows of x [M, K] quantized for the int8 dot layouts, per block of 32: int8 a with x ~ d a
// (d = max |x| / 127, a = x (127 / max |x|) rounded to nearest even), d, d sum(a) (Q4_1's min
// term) and 128 sum(a) (Q8_0's offset: its weights are stored + 128, unsigned).
struct QuantRows {
  int64_t K = 0;
  std::vector<int8_t> a;         // [M, K]
  std::vector<float> d, ds;      // [M, K / 32]
  std::vector<int32_t> s128;     // [M, K / 32]
  void resize(int64_t M, int64_t k);
  // row m's blocks b0 .. b1 from its floats row [K]; the whole of x [M, K] (resized to fit)
  void quantize(const float* row, int64_t m, int64_t b0, int64_t b1);
  void quantize_all(const float* x, int64_t M, int64_t k);
};

// Chunk c of y = x w^T (+ r): y[m, n] for the weight rows n in [c kChunkRows, (c + 1) kChunkRows)
// and every row m of x [M, K]; r [M, N] (a residual added once the outputs are summed) or null.
// An int8 dot layout reads x as xq (x quantized, QuantRows; x itself is then not read).
void product_chunk(const float* x, Weight w, float* y, const float* r, int64_t M, int64_t K, int64_t N, int64_t c,
                   const QuantRows* xq = nullptr);

// out [M, K] = RMSNorm of x [M, K0] with gain g [K0] (g null: x as it is), zero-padded to K >= K0.
// Each row summed in one order whatever M is.
void rms_norm_rows(const float* x, const float* g, float* out, int64_t M, int64_t K0, int64_t K, float eps);

}  // namespace jspec_cpu
