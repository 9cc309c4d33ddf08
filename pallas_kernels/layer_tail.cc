// A decoder layer after its K/V write, in one XLA FFI call on the CPU:
//
//   a   = attention(q, pages)                          (the paged attention kernel's plan)
//   h   = x + a o^T                                     (o_proj, the attention's residual)
//   gu  = rmsnorm(h; gain, eps) gate_up^T               (gate_up_proj)
//   out = h + (silu(gu[:, :I]) * gu[:, I:]) down^T      (down_proj, the MLP's residual)
//
// q [B, T, Hq, D], k_pages / v_pages [KVH, P, S, D], block_tables int32 [B, W], kv_lens and
// q_lens int32 [B] as paged_attention_cpu.cc takes them; x [M, H] with M = B T; the weights packed
// (pallas_kernels.small_rows.pack_rows, K a multiple of 16 and N of 4, not padded): o
// [H / 4, Hq D / 16, 4, 16], gate_up [2 I / 4, H / 16, 4, 16], down [H / 4, I / 16, 4, 16];
// gain [H]. Out [M, H].
//
// The same arithmetic as the separate calls it replaces (the attention kernel, three small-row
// products, XLA's silu): only the calls go. A decode step of SmolLM2-135M made ~150 kernel calls,
// and at each one the pool's helper thread had to be woken (or was not yet awake) and the last
// chunk waited for; here the helper is scheduled once for the seven phases (jspec_cpu::run_phases),
// and a thread left without work at the end of a phase reads the next weight ahead.
// Reference: pallas_kernels.layer_tail.layer_tail_reference.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_common.h"
#include "paged_attention_cpu.h"
#include "small_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSiluBlock = 256;  // floats of one row per unit of the silu phase

// silu(g) u = g u / (1 + exp(-g)), 16 lanes at a time (the vector exp of the attention kernel).
void silu_times(const float* g, const float* u, float* out, int64_t n) {
  using jspec_cpu::v16;
  int64_t i = 0;
  for (; i + jspec_cpu::kLanes <= n; i += jspec_cpu::kLanes) {
    const v16 gv = jspec_cpu::load(g + i);
    const v16 e = jspec_cpu::vexp(-gv);
    jspec_cpu::store(out + i, gv * jspec_cpu::load(u + i) / (jspec_cpu::splat(1.0f) + e));
  }
  for (; i < n; ++i) out[i] = g[i] * u[i] / (1.0f + std::exp(-g[i]));
}

struct Packed {  // a packed weight's true [N, K]
  int64_t N, K;
};

bool packed_shape(const ffi::Buffer<ffi::F32>& w, Packed& p) {
  const auto d = w.dimensions();
  if (d.size() != 4 || d[2] != 4 || d[3] != jspec_cpu::kLanes) return false;
  p = {d[0] * 4, d[1] * jspec_cpu::kLanes};
  return true;
}

ffi::Error LayerTailImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                         ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_tables,
                         ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> o_w, ffi::Buffer<ffi::F32> gain, ffi::Buffer<ffi::F32> gate_up_w,
                         ffi::Buffer<ffi::F32> down_w, ffi::ResultBuffer<ffi::F32> out, float eps) {
  jspec_cpu::AttentionShapes s;
  if (auto e = jspec_cpu::attention_shapes(q, k_pages, block_tables, s); e.failure()) return e;
  const auto xd = x.dimensions();
  Packed o, gu, dn;
  if (xd.size() != 2 || !packed_shape(o_w, o) || !packed_shape(gate_up_w, gu) || !packed_shape(down_w, dn)) {
    return ffi::Error::InvalidArgument("layer_tail: expected x [M, H] and packed o, gate_up and down weights");
  }
  const int64_t M = xd[0], H = xd[1], QS = s.Hq * s.D, I = gu.N / 2;
  if (M != s.B * s.T || o.N != H || o.K != QS || gu.K != H || gu.N % 2 || dn.N != H || dn.K != I ||
      gain.element_count() != H) {
    return ffi::Error::InvalidArgument("layer_tail: shapes disagree: x [B T, H], o [H, Hq D], gate_up [2 I, H], "
                                       "down [H, I], gain [H]");
  }
  jspec_cpu::AttentionPlan plan(s, q.typed_data(), k_pages.typed_data(), v_pages.typed_data(),
                                block_tables.typed_data(), kv_lens.typed_data(), q_lens.typed_data());
  std::vector<float> attn(M * QS), h(M * H), hn(M * H), gate_up(M * 2 * I), act(M * I);
  const float* xp = x.typed_data();
  float* yp = out->typed_data();
  const int64_t silu_blocks = (I + kSiluBlock - 1) / kSiluBlock;
  using jspec_cpu::Phase;
  using jspec_cpu::product_chunk;
  using jspec_cpu::product_chunks;
  jspec_cpu::run_phases(pool, {
      Phase{plan.num_units, [&](int64_t u) { plan.run(u); }},
      Phase{1, [&](int64_t) { plan.combine(attn.data()); }},
      Phase{product_chunks(H),
            [&](int64_t c) { product_chunk(attn.data(), o_w.typed_data(), h.data(), xp, M, QS, H, true, c); },
            o_w.typed_data(), static_cast<int64_t>(o_w.size_bytes())},
      Phase{1, [&](int64_t) { jspec_cpu::rms_norm_rows(h.data(), gain.typed_data(), hn.data(), M, H, H, eps); }},
      Phase{product_chunks(2 * I),
            [&](int64_t c) { product_chunk(hn.data(), gate_up_w.typed_data(), gate_up.data(), nullptr, M, H, 2 * I,
                                           true, c); },
            gate_up_w.typed_data(), std::min<int64_t>(gate_up_w.size_bytes(), 1 << 20)},
      Phase{M * silu_blocks,
            [&](int64_t u) {
              const int64_t m = u / silu_blocks, i0 = (u % silu_blocks) * kSiluBlock;
              const float* row = gate_up.data() + m * 2 * I;
              silu_times(row + i0, row + I + i0, act.data() + m * I + i0, std::min(kSiluBlock, I - i0));
            }},
      Phase{product_chunks(H),
            [&](int64_t c) { product_chunk(act.data(), down_w.typed_data(), yp, h.data(), M, I, H, true, c); },
            down_w.typed_data(), std::min<int64_t>(down_w.size_bytes(), 1 << 20)},
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecLayerTail, LayerTailImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_pages [KVH, P, S, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_pages [KVH, P, S, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_lens [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, H]: the residual stream
                                  .Arg<ffi::Buffer<ffi::F32>>()   // o_proj, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gain [H]: post-attention RMSNorm
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gate_up_proj, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()   // down_proj, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, H]
                                  .Attr<float>("eps"));
