// The small-row product's pieces, for kernel calls that run it among other work (layer_tail.cc)
// as well as for its own targets (small_rows.cc, which defines them).
#pragma once

#include <cstdint>

namespace jspec_cpu {

constexpr int64_t kChunkRows = 64;  // weight rows per unit of work handed to a thread

inline int64_t product_chunks(int64_t N) { return (N + kChunkRows - 1) / kChunkRows; }

// Chunk c of y = x w^T (+ r): y[m, n] for the weight rows n in [c kChunkRows, (c + 1) kChunkRows)
// and every row m of x [M, K]; w [N, K], or packed [N / 4, K / 16, 4, 16] (packed = true);
// r [M, N] (a residual added once the outputs are summed) or null.
void product_chunk(const float* x, const float* w, float* y, const float* r, int64_t M, int64_t K, int64_t N,
                   bool packed, int64_t c);

// out [M, K] = RMSNorm of x [M, K0] with gain g [K0] (g null: x as it is), zero-padded to K >= K0.
// Each row summed in one order whatever M is.
void rms_norm_rows(const float* x, const float* g, float* out, int64_t M, int64_t K0, int64_t K, float eps);

}  // namespace jspec_cpu
