// The CPU small-row kernel without JAX: its rows() called directly, to compare two versions of
// pallas_kernels/cpu/small_rows.cc side by side (measured 2026-12-04).
//
//   INC=$(python -c "import jax; print(jax.ffi.include_dir())")
//   g++ -O3 -march=native -std=c++17 -fno-math-errno -I$INC -Ipallas_kernels \
//       -DKERNEL='"/path/to/small_rows.cc"' benchmarks/small_rows_harness.cc -o harness -lpthread
//   ./harness hot M [K]      one thread, a 64 x K packed weight (in L2) 20,000 times: G FMA/s
//   ./harness stream M       two threads, SmolLM2-135M's 30 layers of packed projections and its
//                            plain 49,152 x 576 LM head (538 MB): ms per pass, best of 5
//   ./harness qstream M      the same products from the GGUF's own layouts: Q4_1 layers, a Q8_0
//                            LM head (96 MB)
//   ./harness dstream M      the same blocks in the int8 dot layouts, x quantized (quantized_activations)
//   ./harness astream M      dstream's products on AMX tiles (tdpbsud; a CPU with AMX-INT8 and a kernel
//                            that grants it): a probe (measured 2026-12-05), not
//                            in the kernel (no faster at a verification's rows)
//   ./harness MODE M resident  the 30 layers' products (no LM head) on one layer's weights, which stay in
//                            the two cores' L2 (2.7 MB in the int8 dot layout): the arithmetic alone, no
//                            memory traffic; against MODE M without it, whether a row count is bound by
//                            the bytes or by the arithmetic (measured 2026-12-06)
//
// Build one binary per version of the kernel and run them alternately: the VM's speed drifts.
#include KERNEL

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

struct Product {
  jspec_cpu::Weight w;
  int64_t K, N;
};

std::vector<float> random_floats(size_t n, float scale) {
  std::vector<float> v(n);
  for (auto& f : v) f = (std::rand() % 1000) * scale;
  return v;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int hot(int M, int64_t K) {
  const int64_t N = 64;
  const int reps = 20000;
  auto w = random_floats(N * K, 1e-5f), x = random_floats(M * K, 1e-3f);
  std::vector<float> y(M * N);
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    const auto t = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) rows(x.data(), {w.data(), jspec_cpu::Layout::kPacked}, y.data(), M, K, N, 0, N);
    best = std::min(best, seconds_since(t));
  }
  std::printf("hot M=%d K=%ld: %.2f G FMA/s\n", M, long(K), double(reps) * N * K * M / 8 / best / 1e9);
  return 0;
}


#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
// y rows m < M (<= 16) of weight rows n0 .. n1 in an int8 dot layout, on AMX tiles: per block of 32,
// tile A = x's M rows of signed bytes (M x 32), tile B = the 16 weight rows' unsigned bytes as the
// layout stores them (8 rows of 64: row t holds weights 4t .. 4t + 3 of each; Q4_1's nibbles
// unpacked into a scratch copy a block ahead, as a tile load waits for stores to reach the cache),
// C = A B (tdpbsud, M x 16 int32, stored and finished a block later) then the dot kernel's float
// steps: the same integer sums and operations, so the same bits.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <jspec_cpu::Layout L>
void amx_rows(const jspec_cpu::QuantRows& xq, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  constexpr bool q41 = L == jspec_cpu::Layout::kQ4_1Dot;
  constexpr int64_t GB = 16 * (q41 ? jspec_cpu::kQ4_1Record : jspec_cpu::kQ8_0Record);
  const int64_t nb = K / 32;
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = M, cfg.colsb[0] = cfg.colsb[1] = 32;                // A
  cfg.rows[2] = cfg.rows[3] = 8, cfg.colsb[2] = cfg.colsb[3] = 64;                // B
  cfg.rows[4] = cfg.rows[5] = M, cfg.colsb[4] = cfg.colsb[5] = 64;                // C
  _tile_loadconfig(&cfg);
  alignas(64) uint8_t wb[2][512];
  alignas(64) int32_t cs[2][16][16];
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* wt = w + (n / 16) * nb * GB;
    jspec_cpu::v16 acc[16];
    for (int64_t i = 0; i < M; ++i) acc[i] = jspec_cpu::v16{};
    auto unpack = [&](int64_t b, uint8_t* out) {
      const uint8_t* r = wt + b * GB + 128;
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(r + 64 * t);
        _mm512_store_si512(out + 64 * t, _mm512_and_si512(v, _mm512_set1_epi8(15)));
        _mm512_store_si512(out + 256 + 64 * t, _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)));
      }
    };
    auto finish = [&](int64_t b, int32_t (*c)[16]) {
      const uint8_t* r = wt + b * GB;
      const jspec_cpu::v16 dw = jspec_cpu::load(reinterpret_cast<const float*>(r));
      const jspec_cpu::v16 mw = q41 ? jspec_cpu::load(reinterpret_cast<const float*>(r + 64)) : jspec_cpu::v16{};
      for (int64_t i = 0; i < M; ++i) {
        const int64_t at = i * nb + b;
        __m512i s = _mm512_load_si512(c[i]);
        if constexpr (!q41) s = _mm512_sub_epi32(s, _mm512_set1_epi32(xq.s128[at]));
        acc[i] = vfma(reinterpret_cast<jspec_cpu::v16>(_mm512_cvtepi32_ps(s)), dw * jspec_cpu::splat(xq.d[at]), acc[i]);
        if constexpr (q41) acc[i] = vfma(mw, jspec_cpu::splat(xq.ds[at]), acc[i]);
      }
    };
    if constexpr (q41) unpack(0, wb[0]);
    for (int64_t b = 0; b < nb; ++b) {
      const int cur = b & 1;
      for (int64_t p = 0; p < GB; p += 64) __builtin_prefetch(wt + b * GB + 8192 + p, 0, 2);
      if constexpr (q41)
        if (b + 1 < nb) unpack(b + 1, wb[cur ^ 1]);
      const uint8_t* bsrc = q41 ? wb[cur] : wt + b * GB + 64;
      if (cur == 0) {  // two sets of tiles, alternate blocks
        _tile_loadd(0, xq.a.data() + b * 32, K);
        _tile_loadd(2, bsrc, 64);
        _tile_zero(4);
        _tile_dpbsud(4, 0, 2);
        _tile_stored(4, cs[0], 64);
      } else {
        _tile_loadd(1, xq.a.data() + b * 32, K);
        _tile_loadd(3, bsrc, 64);
        _tile_zero(5);
        _tile_dpbsud(5, 1, 3);
        _tile_stored(5, cs[1], 64);
      }
      if (b > 0) finish(b - 1, cs[cur ^ 1]);
    }
    finish(nb - 1, cs[(nb - 1) & 1]);
    for (int64_t i = 0; i < M; ++i) jspec_cpu::store(y + i * N + n, acc[i]);
  }
  _tile_release();
}

bool amx_granted() {  // Linux: a process asks for the tile state before its first tile instruction
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}
#endif

enum class Mode { kPacked, kQuant, kDot, kAmx };

int stream(int M, Mode mode, bool resident) {
  using jspec_cpu::Layout;
  const int64_t D = 576, FF = 1536, V = 49152;
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<uint8_t>> records;
  std::vector<Product> products;
  const bool quantized = mode != Mode::kPacked, dot = mode == Mode::kDot || mode == Mode::kAmx;
  auto add = [&](int64_t K, int64_t N, Layout layout) {  // packed: [N / 4, K / 16, 4, 16], the same bytes
    if (layout != Layout::kPacked && layout != Layout::kPlain) {  // random q, d and m small
      const bool q41 = layout == Layout::kQ4_1 || layout == Layout::kQ4_1Dot;
      const int64_t rb = q41 ? jspec_cpu::kQ4_1Record : jspec_cpu::kQ8_0Record;
      // the scales: a record's d (and m) first; in a dot layout a block's 16 rows' d [16] (and m [16])
      const int64_t rows = dot ? 16 : 1, m_at = dot ? 64 : 4;
      records.emplace_back(N * (K / jspec_cpu::kQuantBlock) * rb);
      auto& r = records.back();
      for (size_t i = 0; i < r.size(); ++i) r[i] = std::rand() & 0xff;
      for (size_t i = 0; i < r.size(); i += rb * rows) {
        const float d = 1e-3f, m = -8e-3f;
        for (int64_t j = 0; j < rows; ++j) {
          std::memcpy(&r[i + 4 * j], &d, 4);
          if (q41) std::memcpy(&r[i + m_at + 4 * j], &m, 4);
        }
      }
      products.push_back({{r.data(), layout}, K, N});
    } else {
      weights.push_back(random_floats(N * K, 1e-5f));
      products.push_back({{weights.back().data(), layout}, K, N});
    }
  };
  const Layout layers = dot ? Layout::kQ4_1Dot : quantized ? Layout::kQ4_1 : Layout::kPacked;
  for (int layer = 0; layer < (resident ? 1 : 30); ++layer) {
    add(D, 960, layers), add(D, D, layers), add(D, 2 * FF, layers), add(FF, D, layers);
  }
  if (resident) {  // layers 2 .. 30 are layer 1 again
    const std::vector<Product> first(products.begin(), products.end());
    for (int layer = 1; layer < 30; ++layer) products.insert(products.end(), first.begin(), first.end());
  } else {
    add(D, V, dot ? Layout::kQ8_0Dot : quantized ? Layout::kQ8_0 : Layout::kPlain);
  }
  auto x = random_floats(M * FF, 1e-3f);
  jspec_cpu::QuantRows xd, xf;  // x's first D or FF columns quantized (the int8 dot layouts)
  xd.quantize_all(x.data(), M, D), xf.quantize_all(x.data(), M, FF);
  std::vector<float> y(M * V);
  // two threads take chunks of weight rows from a shared counter, as XLA's pool does
  std::atomic<int64_t> next{0}, generation{0}, finished{0};
  std::atomic<const Product*> current{nullptr};
  std::atomic<bool> stop{false};
  auto work = [&] {
    const Product& p = *current.load();
    const int64_t chunks = (p.N + kChunkRows - 1) / kChunkRows;
    const jspec_cpu::QuantRows* xq = p.K == D ? &xd : &xf;
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t n0 = c * kChunkRows, n1 = std::min(p.N, (c + 1) * kChunkRows);
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
      if (mode == Mode::kAmx) {
        const auto* wb = static_cast<const uint8_t*>(p.w.data);
        if (p.w.layout == Layout::kQ4_1Dot) amx_rows<Layout::kQ4_1Dot>(*xq, wb, y.data(), M, p.K, p.N, n0, n1);
        else amx_rows<Layout::kQ8_0Dot>(*xq, wb, y.data(), M, p.K, p.N, n0, n1);
        continue;
      }
#endif
      rows(x.data(), p.w, y.data(), M, p.K, p.N, n0, n1, xq);
    }
  };
  std::thread helper([&] {
    for (int64_t seen = 0; !stop.load();) {
      const int64_t g = generation.load();
      if (g != seen && !stop.load()) {
        seen = g;
        work();
        finished.fetch_add(1);
      }
    }
  });
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    const auto t = std::chrono::steady_clock::now();
    for (const Product& p : products) {
      current = &p;
      next = 0;
      finished = 0;
      generation.fetch_add(1);
      work();
      while (finished.load() < 1) {
      }
    }
    best = std::min(best, seconds_since(t));
  }
  stop = true;
  helper.join();
  static const char* names[] = {"stream", "qstream", "dstream", "astream"};
  double check = 0;  // the last product's outputs (the LM head), to compare dstream and astream
  for (int64_t i = 0; i < M * V; ++i) check += y[i] * (1 + i % 7);
  std::printf("%s M=%d%s: %.2f ms (check %.9g)\n", names[static_cast<int>(mode)], M, resident ? " resident" : "",
              best * 1e3, check);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* modes[] = {"stream", "qstream", "dstream", "astream"};
  int mode = -1;
  for (int i = 0; argc >= 3 && i < 4; ++i)
    if (!std::strcmp(argv[1], modes[i])) mode = i;
  if (argc < 3 || (mode < 0 && std::strcmp(argv[1], "hot"))) {
    std::fprintf(stderr, "usage: %s hot M [K] | stream M | qstream M | dstream M | astream M  [resident]\n", argv[0]);
    return 2;
  }
  const int M = std::atoi(argv[2]);
  if (!std::strcmp(argv[1], "hot")) return hot(M, argc > 3 ? std::atoll(argv[3]) : 576);
  if (mode == 3) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (M > 16 || !amx_granted()) {
      std::fprintf(stderr, "astream: M <= 16 and a kernel that grants AMX\n");
      return 2;
    }
#else
    std::fprintf(stderr, "astream: built without AMX-INT8\n");
    return 2;
#endif
  }
  return stream(M, static_cast<Mode>(mode), argc > 3 && !std::strcmp(argv[3], "resident"));
}
