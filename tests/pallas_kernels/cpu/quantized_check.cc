// The quantized tiles against the packed float32 ones, built for a chosen -march (the test builds it
// for the AVX2 + FMA tiles and the plain 16-lane vectors as well as for this CPU's own): for random
// Q4_1 and Q8_0 blocks, the product from the records must equal the product from the same weights
// dequantized and packed, bit for bit, for 1 .. 9 rows of x; the int8 dot layouts must equal their
// scalar definition (check_dot). Prints "ok" or the first difference.
//
//   g++ -O2 -std=c++17 -march=... -I$(jax include) -Ipallas_kernels/cpu quantized_check.cc -o check
#include "small_rows.cc"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

int check(jspec_cpu::Layout layout, int64_t N, int64_t K) {
  const bool q41 = layout == jspec_cpu::Layout::kQ4_1;
  const int64_t RB = q41 ? jspec_cpu::kQ4_1Record : jspec_cpu::kQ8_0Record, NB = K / 32;
  std::vector<uint8_t> rec(N * NB * RB);  // [N / 4, NB, 4, RB]
  std::vector<float> packed(N * K);       // [N / 4, K / 16, 4, 16]
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t b = 0; b < NB; ++b) {
      uint8_t* r = &rec[((n / 4 * NB + b) * 4 + n % 4) * RB];
      const float d = jspec_cpu::half_float(jspec_cpu::float_half((std::rand() % 2000 - 1000) * 3e-5f));
      const float m = jspec_cpu::half_float(jspec_cpu::float_half(-(std::rand() % 1000) * 2e-4f - 1e-3f));
      std::memcpy(r, &d, 4);
      if (q41) std::memcpy(r + 4, &m, 4);
      for (int64_t i = q41 ? 8 : 4; i < RB; ++i) r[i] = std::rand() & 0xff;
      for (int64_t i = 0; i < 32; ++i) {
        const float w = q41 ? d * float(i < 16 ? r[8 + i] & 15 : r[8 + i - 16] >> 4) + m
                            : d * float(static_cast<int8_t>(r[4 + i]));
        const int64_t k = b * 32 + i;
        packed[((n / 4 * (K / 16) + k / 16) * 4 + n % 4) * 16 + k % 16] = w;
      }
    }
  }
  for (int64_t M = 1; M <= 9; ++M) {
    std::vector<float> x(M * K), y1(M * N), y2(M * N);
    for (auto& v : x) v = (std::rand() % 2001 - 1000) * 1e-3f;
    rows(x.data(), {rec.data(), layout}, y1.data(), M, K, N, 0, N);
    rows(x.data(), {packed.data(), jspec_cpu::Layout::kPacked}, y2.data(), M, K, N, 0, N);
    for (int64_t i = 0; i < M * N; ++i) {
      if (std::memcmp(&y1[i], &y2[i], 4)) {
        std::printf("%s M=%ld N=%ld K=%ld output %ld: %.9g != %.9g\n", q41 ? "q4_1" : "q8_0", long(M), long(N),
                    long(K), long(i), y1[i], y2[i]);
        return 1;
      }
    }
  }
  return 0;
}

// The int8 dot layouts against their definition, written here as plain scalar code: each row of x
// quantized a block of 32 (d = max |x| / 127, a = x (127 / max |x|) to nearest even), the block's
// integer sums, then y += fma(sum, dw d, y) (+ fma(m, d sum(a), y) for Q4_1), block after block.
// Every build (the VNNI tiles, AVX2's vpmaddubsw, the 32-bit multiplies elsewhere) must give these bits.
int check_dot(jspec_cpu::Layout layout, int64_t N, int64_t K) {
  const bool q41 = layout == jspec_cpu::Layout::kQ4_1Dot;
  const int64_t NB = K / 32, GB = 16 * (q41 ? jspec_cpu::kQ4_1Record : jspec_cpu::kQ8_0Record);
  std::vector<uint8_t> w(N / 16 * NB * GB);  // [N / 16, NB, GB]
  for (int64_t g = 0; g < N / 16 * NB; ++g) {
    uint8_t* r = &w[g * GB];
    for (int j = 0; j < 16; ++j) {
      const float d = jspec_cpu::half_float(jspec_cpu::float_half((std::rand() % 2000 - 1000) * 3e-5f));
      const float m = jspec_cpu::half_float(jspec_cpu::float_half(-(std::rand() % 1000) * 2e-4f - 1e-3f));
      std::memcpy(r + 4 * j, &d, 4);
      if (q41) std::memcpy(r + 64 + 4 * j, &m, 4);
    }
    for (int64_t i = q41 ? 128 : 64; i < GB; ++i) r[i] = std::rand() & 0xff;
  }
  // the largest sums a block can have: rows 0-15's first block all 0xff (nibbles 15, Q8_0's q 127)
  for (int64_t i = q41 ? 128 : 64; i < GB; ++i) w[i] = 0xff;
  for (int64_t M = 1; M <= 19; M += (M < 10 ? 1 : 9)) {
    std::vector<float> x(M * K), y1(M * N), y2(M * N);
    for (auto& v : x) v = (std::rand() % 2001 - 1000) * 1e-3f * (std::rand() % 8 == 0 ? 30.f : 1.f);
    for (int64_t k = 0; k < K; k += 97) x[k] = 0.f;  // a few zeros; a whole zero block in row 0:
    for (int64_t k = 32; k < 64 && k < K; ++k) x[k] = 0.f;
    for (int64_t k = 0; k < 32; ++k) {  // ... against x's first block all 127 (row 0) and all -127 (row 1)
      x[k] = 1.f;
      if (M > 1) x[K + k] = -1.f;
    }
    jspec_cpu::QuantRows xq;
    xq.quantize_all(x.data(), M, K);
    rows(x.data(), {w.data(), layout}, y1.data(), M, K, N, 0, N, &xq);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        float acc = 0.f;
        for (int64_t b = 0; b < NB; ++b) {
          const float* xb = &x[m * K + b * 32];
          float amax = 0.f;
          for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
          const float id = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
          int a[32], sa = 0;
          for (int i = 0; i < 32; ++i) sa += a[i] = static_cast<int>(std::nearbyint(xb[i] * id));
          const uint8_t* r = &w[(n / 16 * NB + b) * GB];
          const int j = n % 16;
          float dw, mw = 0.f;
          std::memcpy(&dw, r + 4 * j, 4);
          int sum = 0;
          if (q41) {
            std::memcpy(&mw, r + 64 + 4 * j, 4);
            for (int t = 0; t < 4; ++t)
              for (int u = 0; u < 4; ++u) {
                const uint8_t byte = r[128 + 64 * t + 4 * j + u];
                sum += (byte & 15) * a[4 * t + u] + (byte >> 4) * a[16 + 4 * t + u];
              }
          } else {
            for (int t = 0; t < 8; ++t)
              for (int u = 0; u < 4; ++u) sum += (static_cast<int>(r[64 + 64 * t + 4 * j + u]) - 128) * a[4 * t + u];
          }
          acc = std::fma(static_cast<float>(sum), dw * d, acc);
          if (q41) acc = std::fma(mw, d * static_cast<float>(sa), acc);
        }
        y2[m * N + n] = acc;
      }
    }
    for (int64_t i = 0; i < M * N; ++i) {
      if (std::memcmp(&y1[i], &y2[i], 4)) {
        std::printf("%s (int8 dot) M=%ld N=%ld K=%ld output %ld: %.9g != %.9g\n", q41 ? "q4_1" : "q8_0", long(M),
                    long(N), long(K), long(i), y1[i], y2[i]);
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace

int main() {
  std::srand(1);
  for (auto layout : {jspec_cpu::Layout::kQ4_1, jspec_cpu::Layout::kQ8_0})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{8, 64}, {132, 576}, {64, 1536}})
      if (check(layout, N, K)) return 1;
  for (auto layout : {jspec_cpu::Layout::kQ4_1Dot, jspec_cpu::Layout::kQ8_0Dot})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{16, 64}, {128, 576}, {64, 1536}})
      if (check_dot(layout, N, K)) return 1;
  std::printf("ok\n");
  return 0;
}
