// The CPU small-row kernel without JAX: its rows() called directly, to compare two versions of
// pallas_kernels/small_rows.cc side by side (BENCHMARKS.md, nineteenth session).
//
//   INC=$(python -c "import jax; print(jax.ffi.include_dir())")
//   g++ -O3 -march=native -std=c++17 -fno-math-errno -I$INC -Ipallas_kernels \
//       -DKERNEL='"/path/to/small_rows.cc"' benchmarks/small_rows_harness.cc -o harness -lpthread
//   ./harness hot M [K]      one thread, a 64 x K packed weight (in L2) 20,000 times: G FMA/s
//   ./harness stream M       two threads, SmolLM2-135M's 30 layers of packed projections and its
//                            plain 49,152 x 576 LM head (538 MB): ms per pass, best of 5
//   ./harness qstream M      the same products from the GGUF's own layouts: Q4_1 layers, a Q8_0
//                            LM head (96 MB)
//
// Build one binary per version of the kernel and run them alternately: the VM's speed drifts.
#include KERNEL

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

int stream(int M, bool quantized) {
  using jspec_cpu::Layout;
  const int64_t D = 576, FF = 1536, V = 49152;
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<uint8_t>> records;
  std::vector<Product> products;
  auto add = [&](int64_t K, int64_t N, Layout layout) {  // packed: [N / 4, K / 16, 4, 16], the same bytes
    if (layout == Layout::kQ4_1 || layout == Layout::kQ8_0) {  // random q, d and m small
      const int64_t rb = layout == Layout::kQ4_1 ? jspec_cpu::kQ4_1Record : jspec_cpu::kQ8_0Record;
      records.emplace_back(N * (K / jspec_cpu::kQuantBlock) * rb);
      auto& r = records.back();
      for (size_t i = 0; i < r.size(); ++i) r[i] = std::rand() & 0xff;
      for (size_t i = 0; i < r.size(); i += rb) {
        const float d = 1e-3f, m = -8e-3f;
        std::memcpy(&r[i], &d, 4);
        if (layout == Layout::kQ4_1) std::memcpy(&r[i + 4], &m, 4);
      }
      products.push_back({{r.data(), layout}, K, N});
    } else {
      weights.push_back(random_floats(N * K, 1e-5f));
      products.push_back({{weights.back().data(), layout}, K, N});
    }
  };
  const Layout layers = quantized ? Layout::kQ4_1 : Layout::kPacked;
  for (int layer = 0; layer < 30; ++layer) {
    add(D, 960, layers), add(D, D, layers), add(D, 2 * FF, layers), add(FF, D, layers);
  }
  add(D, V, quantized ? Layout::kQ8_0 : Layout::kPlain);
  auto x = random_floats(M * FF, 1e-3f);
  std::vector<float> y(M * V);
  // two threads take chunks of weight rows from a shared counter, as XLA's pool does
  std::atomic<int64_t> next{0}, generation{0}, finished{0};
  std::atomic<const Product*> current{nullptr};
  std::atomic<bool> stop{false};
  auto work = [&] {
    const Product& p = *current.load();
    const int64_t chunks = (p.N + kChunkRows - 1) / kChunkRows;
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      rows(x.data(), p.w, y.data(), M, p.K, p.N, c * kChunkRows, std::min(p.N, (c + 1) * kChunkRows));
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
  std::printf("%s M=%d: %.2f ms\n", quantized ? "qstream" : "stream", M, best * 1e3);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::strcmp(argv[1], "hot") && std::strcmp(argv[1], "stream") && std::strcmp(argv[1], "qstream"))) {
    std::fprintf(stderr, "usage: %s hot M [K] | stream M | qstream M\n", argv[0]);
    return 2;
  }
  const int M = std::atoi(argv[2]);
  if (!std::strcmp(argv[1], "hot")) return hot(M, argc > 3 ? std::atoll(argv[3]) : 576);
  return stream(M, !std::strcmp(argv[1], "qstream"));
}
