// Paged verification attention for XLA's CPU backend, as an XLA FFI custom call.
//
// The contract of pallas_kernels/paged_verify_attention.py, float32:
//   q [B, T, Hq, D], k_pages / v_pages [KVH, P, S, D], block_tables int32 [B, W],
//   kv_lens int32 [B], q_lens int32 [B]  ->  out [B, T, Hq, D]
// Sequence b has q_lens[b] new query rows whose K/V are already in the pages; row t sits at
// position kv_lens[b] - q_lens[b] + t and sees the keys at positions <= its own; rows
// t >= q_lens[b] come out as zeros. Only the pages a row can see are read (never a table slot
// past kv_lens[b]), so stale, NaN or garbage pages beyond a sequence's length cannot leak in.
//
// One unit of work is one (sequence, KV head, chunk of 256 keys): the scores of all the rows of
// the KV head's query heads against the chunk's keys (each key row read once for all of them),
// a softmax per row within the chunk, then the values (each value row read once); the next page
// is prefetched while one is read. The chunks of a row are combined at the end (split-K, as
// flash-decoding does), so a single sequence's keys keep both cores busy. The XLA path
// (jspec/attention.py) gathers every page of a block of 256 keys into a copy first; here the
// pages are read in place. Each row's result is computed in the same order whatever the other
// rows, so a decode step's row equals the same row inside a verification step's.
//
// Built with pallas_kernels/small_rows.cc into one library (pallas_kernels/cpu_kernels.py).
// Reference: pallas_kernels.paged_verify_attention.paged_verify_attention_reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jspec_cpu::hsum;
using jspec_cpu::kLanes;
using jspec_cpu::load;
using jspec_cpu::splat;
using jspec_cpu::store;
using jspec_cpu::v16;

namespace {

constexpr int kRowGroup = 4;  // rows of one head accumulated together in the value pass

typedef int32_t i16v __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

// exp over 16 lanes (Cephes-style: 2^n * polynomial on [-ln2/2, ln2/2], ~2 ulp); -inf -> 0.
inline v16 vexp(v16 x) {
  const v16 hi = splat(88.3762626647949f), lo = splat(-87.3365478515625f);
  v16 xc = x > hi ? hi : x;  // lane-wise selects (GCC vector extension)
  const auto under = xc < lo;
  xc = under ? lo : xc;
  const v16 fx = xc * splat(1.44269504088896341f) + splat(0.5f);
  v16 n = __builtin_convertvector(__builtin_convertvector(fx, i16v), v16);  // toward zero
  n = n > fx ? n - splat(1.0f) : n;                                        // floor(fx + 1/2)
  v16 r = xc - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v16 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  const i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof scale);
  y = y * scale;
  return under ? v16{} : y;
}

struct Shapes {
  int64_t B, T, Hq, D, KVH, P, S, W, G;
};

constexpr int64_t kChunkKeys = 256;  // keys per unit of work (split-K, combined at the end)

// One unit: sequence b, KV head kvh, keys [k0, k1). Its rows are the G query heads of the KV
// head times the T query rows (row r = t * G + g), so each K and V row is read once for all of
// them. Row r (position first_pos + t) sees keys <= first_pos + t. Writes per row the chunk's
// max score m, sum of exp(score - m) and sum of exp(score - m) v (unnormalised) to `part`.
void unit(const Shapes& s, const float* q, const float* kp, const float* vp, const int32_t* table,
          int64_t b, int64_t kvh, int64_t rows_t, int64_t first_pos, int64_t k0, int64_t k1,
          std::vector<float>& scores, float* part) {
  const int64_t D = s.D, S = s.S, G = s.G;
  const int64_t R = rows_t * G, n = k1 - k0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float ninf = -std::numeric_limits<float>::infinity();
  scores.assign(static_cast<size_t>(R * n), ninf);
  auto qrow = [&](int64_t r) { return q + ((b * s.T + r / G) * s.Hq + kvh * G + r % G) * D; };
  auto page_of = [&](const float* pages, int64_t slot) {  // first row of table slot `slot`
    int64_t page = table[slot];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), s.P - 1);  // memory-safe on a bad table
    return pages + (kvh * s.P + page) * S * D;
  };
  auto prefetch_page = [&](const float* page, int64_t keys) {
    for (int64_t i = 0; i < keys * D; i += kLanes) __builtin_prefetch(page + i);
  };
  // scores of every row against the keys it sees (rows before `from` do not see key pos)
  for (int64_t p0 = k0 - k0 % S; p0 < k1; p0 += S) {
    const float* page = page_of(kp, p0 / S);
    if (p0 + S < k1) prefetch_page(page_of(kp, p0 / S + 1), S);
    for (int64_t pos = std::max(p0, k0); pos < std::min(k1, p0 + S); ++pos) {
      const float* k = page + (pos - p0) * D;
      const int64_t from = std::max<int64_t>(0, pos - first_pos) * G;
      for (int64_t r = from; r < R; ++r) {
        const float* qr = qrow(r);
        v16 acc = v16{};
        int64_t c = 0;
        for (; c + kLanes <= D; c += kLanes) acc += load(qr + c) * load(k + c);
        float dot = hsum(acc);
        for (; c < D; ++c) dot += qr[c] * k[c];
        scores[r * n + pos - k0] = dot * scale;
      }
    }
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
    float m = ninf;
    for (int64_t i = 0; i < seen; ++i) m = std::max(m, sr[i]);
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
    out[0] = m;
    out[1] = l;
  }
  // values, kRowGroup rows at a time: acc[r] = sum over seen keys of p[r, key] v[key]
  for (int64_t g0 = 0; g0 < R; g0 += kRowGroup) {
    const int64_t g1 = std::min(R, g0 + kRowGroup);
    float acc[kRowGroup][256];  // D <= 256 (checked by the caller)
    for (int64_t r = g0; r < g1; ++r) std::fill(acc[r - g0], acc[r - g0] + D, 0.0f);
    const int64_t last = std::min(k1, first_pos + (g1 - 1) / G + 1);  // keys the group's last row sees
    for (int64_t p0 = k0 - k0 % S; p0 < last; p0 += S) {
      const float* page = page_of(vp, p0 / S);
      if (g0 == 0 && p0 + S < last) prefetch_page(page_of(vp, p0 / S + 1), S);
      for (int64_t pos = std::max(p0, k0); pos < std::min(last, p0 + S); ++pos) {
        const float* v = page + (pos - p0) * D;
        const int64_t from = std::max<int64_t>(g0, std::max<int64_t>(0, pos - first_pos) * G);
        for (int64_t r = from; r < g1; ++r) {
          const float p = scores[r * n + pos - k0];
          float* a = acc[r - g0];
          int64_t c = 0;
          for (; c + kLanes <= D; c += kLanes) store(a + c, load(a + c) + splat(p) * load(v + c));
          for (; c < D; ++c) a[c] += p * v[c];
        }
      }
    }
    for (int64_t r = g0; r < g1; ++r) std::memcpy(part + r * (D + 2) + 2, acc[r - g0], sizeof(float) * D);
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                              ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: expected q [B, T, Hq, D], pages [KVH, P, S, D], "
                                       "block_tables [B, W]");
  }
  Shapes s{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], td[1], 0};
  if (kd[3] != s.D || s.D > 256 || s.KVH == 0 || s.Hq % s.KVH || td[0] != s.B) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: shapes disagree (or head_dim > 256)");
  }
  s.G = s.Hq / s.KVH;
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  const int32_t* tables = block_tables.typed_data();
  const int32_t* kvl = kv_lens.typed_data();
  const int32_t* ql = q_lens.typed_data();
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * s.B * s.T * s.Hq * s.D);  // padding rows stay zero
  // per sequence: its rows, row 0's position, the keys its last row sees, its chunks
  struct Seq {
    int64_t rows, first_pos, keys, chunks, first_unit;
  };
  std::vector<Seq> seqs(s.B);
  int64_t units = 0, max_chunks = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t kv_len = std::min<int64_t>(kvl[b], s.W * s.S);
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(ql[b], 0), s.T);
    const int64_t first_pos = kv_len - ql[b];
    const int64_t keys = rows > 0 ? std::max<int64_t>(0, std::min(kv_len, first_pos + rows)) : 0;
    const int64_t chunks = (keys + kChunkKeys - 1) / kChunkKeys;
    seqs[b] = {rows, first_pos, keys, chunks, units};
    units += s.KVH * chunks;
    max_chunks = std::max(max_chunks, chunks);
  }
  const int64_t R = s.T * s.G, stride = s.D + 2;
  // partials [B, KVH, max_chunks, R, D + 2]: m, l, acc
  std::vector<float> parts(static_cast<size_t>(s.B * s.KVH * max_chunks * R * stride));
  auto part_of = [&](int64_t b, int64_t kvh, int64_t c) {
    return parts.data() + ((b * s.KVH + kvh) * max_chunks + c) * R * stride;
  };
  jspec_cpu::parallel_for(pool, units, [&](int64_t u) {
    thread_local std::vector<float> scores;
    int64_t b = 0;
    while (u >= seqs[b].first_unit + s.KVH * seqs[b].chunks) ++b;
    const Seq& sq = seqs[b];
    const int64_t kvh = (u - sq.first_unit) / sq.chunks, c = (u - sq.first_unit) % sq.chunks;
    unit(s, qp, kp, vp, tables + b * s.W, b, kvh, sq.rows, sq.first_pos, c * kChunkKeys,
         std::min(sq.keys, (c + 1) * kChunkKeys), scores, part_of(b, kvh, c));
  });
  // combine the chunks of every row, in chunk order (so a row's bits do not depend on the rows
  // beside it: chunks it does not see add exact zeros)
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
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_pages [KVH, P, S, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_pages [KVH, P, S, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_lens [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // out [B, T, Hq, D]
