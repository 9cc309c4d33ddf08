// A decoder layer after its K/V write, in one XLA FFI call on the CPU:
//
//   a   = attention(q, pages)                          (the paged attention kernel's plan)
//   h   = x + a o^T                                     (o_proj, the attention's residual)
//   gu  = rmsnorm(h; gain, eps) gate_up^T               (gate_up_proj)
//   out = h + (silu(gu[:, :I]) * gu[:, I:]) down^T      (down_proj, the MLP's residual)
//
// q [B, T, Hq, D], k_pages / v_pages [KVH, P, S, D], block_tables int32 [B, W], kv_lens and
// q_lens int32 [B] as paged_attention_cpu.cc takes them; x [M, H] with M = B T; the weights packed
// (pallas_kernels.cpu.small_rows.pack_rows, K a multiple of 16 and N of 4, not padded): o
// [H / 4, Hq D / 16, 4, 16], gate_up [2 I / 4, H / 16, 4, 16], down [H / 4, I / 16, 4, 16],
// or any of them in a quantized layout (pallas_kernels.cpu.small_rows.pack_quantized: a GGUF file's
// Q4_1 / Q8_0 blocks; the same results bit for bit); gain [H]. Out [M, H].
//
// The same arithmetic as the separate calls it replaces (the attention kernel, three small-row
// products, XLA's silu): only the calls go. A decode step of SmolLM2-135M made ~150 kernel calls,
// and at each one the pool's helper thread had to be woken (or was not yet awake) and the last
// chunk waited for; here the helper is scheduled once for the seven phases (jspec_cpu::run_phases),
// and a thread left without work at the end of a phase reads the next weight ahead.
// Reference: pallas_kernels.cpu.layer_tail.layer_tail_reference.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_common.h"
#include "paged_attention_cpu.h"
#include "small_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSiluBlock = 256;  // floats of one row per unit of the silu phase (whole blocks of 32)

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

// A float32 product as rounded: the empty asm keeps the compiler from fusing it into an FMA with
// the add that follows (C++ builds contract a * b + c by default).
inline float rounded(float v) {
  asm("" : "+m"(v));
  return v;
}

// The same for 16 products at once (held in a register where the vector fits one).
inline jspec_cpu::v16 rounded(jspec_cpu::v16 v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  asm("" : "+m"(v));
#endif
  return v;
}

// Rotate-half RoPE of one head's D values: out[d] = x[d] c[d] - x[d + D/2] s[d], out[d + D/2] =
// x[d + D/2] c[d + D/2] + x[d] s[d + D/2], each product rounded to float32, then the sum, as
// pallas_kernels.cpu.layer_tail.rotate_reference computes it without FMAs; 16 lanes at a time, then
// the last D/2 % 16 one by one (the same operations on each element). The whole layer's call and
// the RoPE op (jspec_rope) both use it, so a row gets the same bits on either path; XLA's own
// elementwise code for the formula was contracted into FMAs in some compiled steps and not in
// others (a prefill's K an ulp apart between an engine with drafts and one without: measured
// 2026-12-05). (One product at a time through memory cost ~0.9 us a row and layer: 12 heads of 64;
// this way 0.1-0.2 us, measured 2026-12-06.)
inline void rotate_half(const float* in, const float* c, const float* sn, float* o, int64_t D) {
  using jspec_cpu::load;
  const int64_t half = D / 2;
  int64_t d = 0;
  for (; d + jspec_cpu::kLanes <= half; d += jspec_cpu::kLanes) {
    const jspec_cpu::v16 lo = load(in + d), hi = load(in + d + half);
    jspec_cpu::store(o + d, rounded(lo * load(c + d)) + rounded(-hi * load(sn + d)));
    jspec_cpu::store(o + d + half, rounded(hi * load(c + d + half)) + rounded(lo * load(sn + d + half)));
  }
  for (; d < half; ++d) {
    o[d] = rounded(in[d] * c[d]) + rounded(-in[d + half] * sn[d]);
    o[d + half] = rounded(in[d + half] * c[d + half]) + rounded(in[d] * sn[d + half]);
  }
}

struct Packed {  // a packed or quantized weight (jspec_cpu::weight_of) and its true [N, K]
  jspec_cpu::Weight w;
  int64_t N, K;
};

bool packed_shape(const ffi::AnyBuffer& buf, Packed& p) {
  return jspec_cpu::weight_of(buf, p.w, p.N, p.K) && p.w.layout != jspec_cpu::Layout::kPlain;
}

// The buffers of the layer's phases after the K/V write.
struct TailBuffers {
  std::vector<float> attn, h, hn, gate_up, act;
  jspec_cpu::QuantRows qattn, qhn, qact;  // the products' inputs quantized, for int8 dot layouts
  TailBuffers(int64_t M, int64_t QS, int64_t H, int64_t I)
      : attn(M * QS), h(M * H), hn(M * H), gate_up(M * 2 * I), act(M * I) {}
};

// Appends the phases from the attention to the end of the layer: out [M, H] = x + ... (above).
void tail_phases(std::vector<jspec_cpu::Phase>& phases, jspec_cpu::AttentionPlan& plan, TailBuffers& b,
                 const float* x, const Packed& o_w, const float* gain, const Packed& gate_up_w,
                 const Packed& down_w, float* out, int64_t M, int64_t QS, int64_t H, int64_t I, float eps) {
  using jspec_cpu::Phase;
  using jspec_cpu::product_chunk;
  using jspec_cpu::product_chunks;
  const jspec_cpu::Weight ow = o_w.w, guw = gate_up_w.w, dw = down_w.w;
  const int64_t silu_blocks = (I + kSiluBlock - 1) / kSiluBlock;
  const bool qo = jspec_cpu::int8_dot(ow.layout), qgu = jspec_cpu::int8_dot(guw.layout),
             qdn = jspec_cpu::int8_dot(dw.layout);
  if (qdn) b.qact.resize(M, I);  // filled by the silu phase's units, a block of 32 at a time
  phases.push_back(Phase{plan.num_units, [&plan](int64_t u) { plan.run(u); }});
  phases.push_back(Phase{1, [=, &plan, &b](int64_t) {
                           plan.combine(b.attn.data());
                           if (qo) b.qattn.quantize_all(b.attn.data(), M, QS);
                         }});
  phases.push_back(Phase{product_chunks(H),
                         [=, &b](int64_t c) { product_chunk(b.attn.data(), ow, b.h.data(), x, M, QS, H, c, &b.qattn); },
                         ow.data, jspec_cpu::weight_bytes(ow, H, QS)});
  phases.push_back(Phase{1, [=, &b](int64_t) {
                           jspec_cpu::rms_norm_rows(b.h.data(), gain, b.hn.data(), M, H, H, eps);
                           if (qgu) b.qhn.quantize_all(b.hn.data(), M, H);
                         }});
  phases.push_back(Phase{product_chunks(2 * I),
                         [=, &b](int64_t c) { product_chunk(b.hn.data(), guw, b.gate_up.data(), nullptr, M, H, 2 * I,
                                                            c, &b.qhn); },
                         guw.data, std::min<int64_t>(jspec_cpu::weight_bytes(guw, 2 * I, H), 1 << 20)});
  phases.push_back(Phase{M * silu_blocks, [=, &b](int64_t u) {
                           const int64_t m = u / silu_blocks, i0 = (u % silu_blocks) * kSiluBlock;
                           const int64_t len = std::min(kSiluBlock, I - i0);
                           const float* row = b.gate_up.data() + m * 2 * I;
                           silu_times(row + i0, row + I + i0, b.act.data() + m * I + i0, len);
                           if (qdn) b.qact.quantize(b.act.data() + m * I, m, i0 / jspec_cpu::kQuantBlock,
                                                    (i0 + len) / jspec_cpu::kQuantBlock);
                         }});
  phases.push_back(Phase{product_chunks(H),
                         [=, &b](int64_t c) { product_chunk(b.act.data(), dw, out, b.h.data(), M, I, H, c, &b.qact); },
                         dw.data, std::min<int64_t>(jspec_cpu::weight_bytes(dw, H, I), 1 << 20)});
}

// Checks the tail's operands against the attention's shapes; sets M, H, QS (= Hq D) and I.
ffi::Error tail_shapes(const jspec_cpu::AttentionShapes& s, const ffi::Buffer<ffi::F32>& x,
                       const ffi::AnyBuffer& o_w, const ffi::Buffer<ffi::F32>& gain, const ffi::AnyBuffer& gate_up_w,
                       const ffi::AnyBuffer& down_w, Packed& o, Packed& gu, Packed& dn, int64_t& M, int64_t& H,
                       int64_t& QS, int64_t& I) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || !packed_shape(o_w, o) || !packed_shape(gate_up_w, gu) || !packed_shape(down_w, dn)) {
    return ffi::Error::InvalidArgument("layer_tail: expected x [M, H] and packed (or quantized) o, gate_up and down weights");
  }
  M = xd[0], H = xd[1], QS = s.Hq * s.D, I = gu.N / 2;
  if (M != s.B * s.T || o.N != H || o.K != QS || gu.K != H || gu.N % 2 || dn.N != H || dn.K != I ||
      gain.element_count() != H) {
    return ffi::Error::InvalidArgument("layer_tail: shapes disagree: x [B T, H], o [H, Hq D], gate_up [2 I, H], "
                                       "down [H, I], gain [H]");
  }
  return ffi::Error::Success();
}

ffi::Error LayerTailImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                         ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                         ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::F32> x,
                         ffi::AnyBuffer o_w, ffi::Buffer<ffi::F32> gain, ffi::AnyBuffer gate_up_w,
                         ffi::AnyBuffer down_w, ffi::ResultBuffer<ffi::F32> out, float eps) {
  jspec_cpu::AttentionShapes s;
  jspec_cpu::PageType type;
  if (auto e = jspec_cpu::attention_shapes(q, k_pages, v_pages, block_tables, s, type); e.failure()) return e;
  int64_t M, H, QS, I;
  Packed o, gu, dn;
  if (auto e = tail_shapes(s, x, o_w, gain, gate_up_w, down_w, o, gu, dn, M, H, QS, I); e.failure()) return e;
  jspec_cpu::AttentionPlan plan(s, q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(), type,
                                block_tables.typed_data(), kv_lens.typed_data(), q_lens.typed_data());
  TailBuffers b(M, QS, H, I);
  std::vector<jspec_cpu::Phase> phases;
  tail_phases(phases, plan, b, x.typed_data(), o, gain.typed_data(), gu, dn, out->typed_data(), M, QS, H, I, eps);
  jspec_cpu::run_phases(pool, std::move(phases));
  return ffi::Error::Success();
}

// One decoder layer's operands, checked: its packed weights, gains and pages (read from `k_in` /
// `v_in`, written at `kp` / `vp`: the aliased results), and the shapes of its step.
struct LayerShapes {
  jspec_cpu::AttentionShapes s;
  jspec_cpu::PageType type;
  int64_t M, H, QS, KS, NQ, I;
};

struct LayerOperands {
  Packed qkv, o, gu, dn;
  const float *in_gain, *gain;
  const void *k_in, *v_in;
  void *kp, *vp;
  int64_t page_bytes;
};

ffi::Error layer_operands(const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& qkv_w,
                          const ffi::Buffer<ffi::F32>& in_gain, const ffi::Buffer<ffi::F32>& cos,
                          const ffi::Buffer<ffi::F32>& sin, const ffi::AnyBuffer& k_pages,
                          const ffi::AnyBuffer& v_pages, const ffi::Buffer<ffi::S32>& block_tables,
                          const ffi::Buffer<ffi::S32>& start, const ffi::Buffer<ffi::S32>& q_lens,
                          const ffi::AnyBuffer& o_w, const ffi::Buffer<ffi::F32>& gain,
                          const ffi::AnyBuffer& gate_up_w, const ffi::AnyBuffer& down_w, ffi::AnyBuffer& k_out,
                          ffi::AnyBuffer& v_out, LayerShapes& l, LayerOperands& op) {
  const auto kd = k_pages.dimensions(), td = block_tables.dimensions(), xd = x.dimensions();
  if (kd.size() != 4 || td.size() != 2 || xd.size() != 2 || cos.dimensions().size() != 2 ||
      !packed_shape(qkv_w, op.qkv)) {
    return ffi::Error::InvalidArgument("decoder_layer: expected x [M, H], packed qkv, cos [M, D], pages [KVH, P, S, D], "
                                       "block_tables [B, W]");
  }
  const int64_t KVH = kd[0], P = kd[1], S = kd[2], D = kd[3], B = td[0], W = td[1];
  const int64_t M = xd[0], H = xd[1], KS = KVH * D, QS = op.qkv.N - 2 * KS;
  if (B == 0 || M % B || QS <= 0 || QS % D || op.qkv.K != H || in_gain.element_count() != H || D % 2 || D > 256 ||
      cos.element_count() != M * D || sin.element_count() != M * D || start.element_count() != B ||
      q_lens.element_count() != B || v_pages.element_count() != k_pages.element_count() ||
      v_pages.element_type() != k_pages.element_type() || k_out.element_type() != k_pages.element_type() ||
      v_out.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument("decoder_layer: shapes or page dtypes disagree");
  }
  if (!jspec_cpu::page_type(k_pages.element_type(), l.type)) {
    return ffi::Error::InvalidArgument("decoder_layer: pages must be float32, float16, bfloat16 or 8-bit floats");
  }
  const int64_t T = M / B, Hq = QS / D;
  if (Hq % KVH) return ffi::Error::InvalidArgument("decoder_layer: query heads must be a multiple of KV heads");
  l.s = jspec_cpu::AttentionShapes{B, T, Hq, D, KVH, P, S, W, Hq / KVH};
  int64_t M2, H2, QS2;
  if (auto e = tail_shapes(l.s, x, o_w, gain, gate_up_w, down_w, op.o, op.gu, op.dn, M2, H2, QS2, l.I); e.failure()) {
    return e;
  }
  l.M = M, l.H = H, l.QS = QS, l.KS = KS, l.NQ = op.qkv.N;
  op.in_gain = in_gain.typed_data(), op.gain = gain.typed_data();
  op.k_in = k_pages.untyped_data(), op.v_in = v_pages.untyped_data();
  op.kp = k_out.untyped_data(), op.vp = v_out.untyped_data();
  op.page_bytes = static_cast<int64_t>(k_pages.size_bytes());
  return ffi::Error::Success();
}

// The buffers of a decoder layer's phases, shared by the layers of a stack (their phases run one
// after another).
struct LayerBuffers {
  std::vector<float> q, xn, qkv_rows;
  jspec_cpu::QuantRows xq;  // xn quantized, for an int8 dot layout
  TailBuffers tail;
  explicit LayerBuffers(const LayerShapes& l)
      : q(l.M * l.QS), xn(l.M * l.H), qkv_rows(l.M * l.NQ), tail(l.M, l.QS, l.H, l.I) {}
};

// What the layers of a step share: the rows' positions (cos / sin [M, D]) and the pages' tables.
struct StepRows {
  const float *cos, *sin;
  const int32_t *tables, *start, *q_lens;
};

// The pages written in place: copied first should XLA not have aliased them.
void alias_pages(const LayerOperands& op) {
  if (op.kp != op.k_in) std::memcpy(op.kp, op.k_in, op.page_bytes);
  if (op.vp != op.v_in) std::memcpy(op.vp, op.v_in, op.page_bytes);
}

// Appends a decoder layer's phases: x [M, H] -> out [M, H], k and v written into the pages (the
// plan's attention reads them after).
void layer_phases(std::vector<jspec_cpu::Phase>& phases, const LayerShapes& l, const LayerOperands& op,
                  const StepRows& r, LayerBuffers& b, jspec_cpu::AttentionPlan& plan, const float* x, float* out,
                  float eps) {
  using jspec_cpu::Phase;
  const int64_t M = l.M, H = l.H, NQ = l.NQ, QS = l.QS, KS = l.KS, D = l.s.D, T = l.s.T, Hq = l.s.Hq,
                KVH = l.s.KVH, P = l.s.P, S = l.s.S, W = l.s.W;
  const jspec_cpu::Weight wq = op.qkv.w;
  const float* g = op.in_gain;
  const jspec_cpu::PageType type = l.type;
  void *kp = op.kp, *vp = op.vp;
  phases.push_back(Phase{1, [=, &b](int64_t) {
                           jspec_cpu::rms_norm_rows(x, g, b.xn.data(), M, H, H, eps);
                           if (jspec_cpu::int8_dot(wq.layout)) b.xq.quantize_all(b.xn.data(), M, H);
                         }});
  phases.push_back(Phase{jspec_cpu::product_chunks(NQ),
                         [=, &b](int64_t c) {
                           jspec_cpu::product_chunk(b.xn.data(), wq, b.qkv_rows.data(), nullptr, M, H, NQ, c, &b.xq);
                         },
                         wq.data, jspec_cpu::weight_bytes(wq, NQ, H)});
  phases.push_back(Phase{M, [=, &b](int64_t m) {  // row m = (b, t): rotate q and k, write k and v
    const float* row = b.qkv_rows.data() + m * NQ;
    const float *c = r.cos + m * D, *sn = r.sin + m * D;
    auto rotate = [&](const float* in, float* o) { rotate_half(in, c, sn, o, D); };
    for (int64_t h = 0; h < Hq; ++h) rotate(row + h * D, b.q.data() + m * QS + h * D);
    const int64_t bi = m / T, t = m % T;
    if (t >= r.q_lens[bi]) return;
    const int64_t pos = r.start[bi] + t, slot = pos / S;
    if (pos < 0 || slot >= W) return;
    const int64_t page = r.tables[bi * W + slot];
    if (page < 0 || page >= P) return;
    float k_rot[256];  // D <= 256 (attention_shapes)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t at = ((h * P + page) * S + pos % S) * D;
      rotate(row + QS + h * D, k_rot);
      const float* v = row + QS + KS + h * D;
      jspec_cpu::write_page_row(type, kp, at, k_rot, D);
      jspec_cpu::write_page_row(type, vp, at, v, D);
    }
  }});
  tail_phases(phases, plan, b.tail, x, op.o, op.gain, op.gu, op.dn, out, M, QS, H, l.I, eps);
}

// The layers `ops` one after another in one run_phases: x [M, H] through each (layer i's output
// layer i + 1's input) into out [M, H]. A layer reads its input only before the phase that writes
// its output (the input norm first, the residual in the o_proj phase; the down product writes
// last), so the layers after the first read and write `out` in place.
void run_layers(ffi::ThreadPool& pool, const LayerShapes& l, const std::vector<LayerOperands>& ops,
                const StepRows& r, const float* x, float* out, float eps) {
  std::vector<int32_t> kv_lens(l.s.B);
  for (int64_t b = 0; b < l.s.B; ++b) kv_lens[b] = r.start[b] + r.q_lens[b];
  LayerBuffers b(l);
  std::vector<std::unique_ptr<jspec_cpu::AttentionPlan>> plans;
  std::vector<jspec_cpu::Phase> phases;
  for (size_t i = 0; i < ops.size(); ++i) {
    alias_pages(ops[i]);
    plans.push_back(std::make_unique<jspec_cpu::AttentionPlan>(l.s, b.q.data(), ops[i].kp, ops[i].vp, l.type,
                                                              r.tables, kv_lens.data(), r.q_lens));
    layer_phases(phases, l, ops[i], r, b, *plans.back(), i == 0 ? x : out, out, eps);
  }
  jspec_cpu::run_phases(pool, std::move(phases));
}

// The whole decoder layer: RMSNorm(x; in_gain) through the packed QKV product [(Hq + 2 KVH) D, H],
// RoPE on q and k (rotate-half, cos and sin [M, D] of each row's position), k and v written into
// the pages (rows t < q_lens[b], at position start[b] + t; a slot past the table or a page id
// outside the pool is dropped, as jspec.cache.paged.write_kv drops it), then the tail. The pages
// are updated in place (k_out, v_out alias k_pages, v_pages); pages of float16 or bfloat16 take
// k and v rounded to nearest even, as XLA's convert rounds them (jspec.cache.paged.write_kv).
ffi::Error DecoderLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qkv_w,
                            ffi::Buffer<ffi::F32> in_gain, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                            ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                            ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> start,
                            ffi::Buffer<ffi::S32> q_lens, ffi::AnyBuffer o_w, ffi::Buffer<ffi::F32> gain,
                            ffi::AnyBuffer gate_up_w, ffi::AnyBuffer down_w,
                            ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                            ffi::Result<ffi::AnyBuffer> v_out, float eps) {
  LayerShapes l;
  LayerOperands op;
  if (auto e = layer_operands(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, o_w, gain,
                              gate_up_w, down_w, *k_out, *v_out, l, op);
      e.failure()) {
    return e;
  }
  const StepRows r{cos.typed_data(), sin.typed_data(), block_tables.typed_data(), start.typed_data(),
                   q_lens.typed_data()};
  run_layers(pool, l, {op}, r, x.typed_data(), out->typed_data(), eps);
  return ffi::Error::Success();
}

// The decoder layers of a step, one after another, in one call: x [M, H] through L layers (each
// as DecoderLayerImpl, the same arithmetic and bits), the operands after the step's shared ones 8
// per layer (qkv_w, in_gain, o_w, gain, gate_up_w, down_w, k_pages, v_pages), the results after
// out 2 per layer (k_pages, v_pages, written in place). The pool's helper is scheduled once for
// the step's 30 x 10 phases, not once a layer, and a thread without work at a layer's end reads
// the next layer's first weight ahead.
ffi::Error DecoderStackImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                            ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> q_lens, ffi::RemainingArgs layers,
                            ffi::ResultBuffer<ffi::F32> out, ffi::RemainingRets pages, float eps) {
  const size_t L = layers.size() / 8;
  if (L == 0 || layers.size() % 8 || pages.size() != 2 * L) {
    return ffi::Error::InvalidArgument("decoder_stack: expected 8 operands and 2 results (the pages) per layer");
  }
  std::vector<LayerOperands> ops(L);
  LayerShapes l;
  for (size_t i = 0; i < L; ++i) {
    auto a = [&](size_t j) { return layers.get<ffi::AnyBuffer>(8 * i + j); };
    auto f = [&](size_t j) { return layers.get<ffi::Buffer<ffi::F32>>(8 * i + j); };
    auto qkv = a(0), o = a(2), gu = a(4), dn = a(5), kp = a(6), vp = a(7);
    auto in_gain = f(1), gain = f(3);
    auto ko = pages.get<ffi::AnyBuffer>(2 * i), vo = pages.get<ffi::AnyBuffer>(2 * i + 1);
    if (!qkv.has_value() || !in_gain.has_value() || !o.has_value() || !gain.has_value() || !gu.has_value() ||
        !dn.has_value() || !kp.has_value() || !vp.has_value() || !ko.has_value() || !vo.has_value()) {
      return ffi::Error::InvalidArgument("decoder_stack: a layer's operands are missing or its gains are not float32");
    }
    LayerShapes li;
    if (auto e = layer_operands(x, *qkv, *in_gain, cos, sin, *kp, *vp, block_tables, start, q_lens, *o, *gain, *gu,
                                *dn, **ko, **vo, li, ops[i]);
        e.failure()) {
      return e;
    }
    if (i == 0) {
      l = li;
    } else if (std::memcmp(&li.s, &l.s, sizeof(l.s)) || li.type != l.type || li.I != l.I || li.NQ != l.NQ) {
      return ffi::Error::InvalidArgument("decoder_stack: the layers' shapes or page dtypes differ");
    }
  }
  const StepRows r{cos.typed_data(), sin.typed_data(), block_tables.typed_data(), start.typed_data(),
                   q_lens.typed_data()};
  run_layers(pool, l, ops, r, x.typed_data(), out->typed_data(), eps);
  return ffi::Error::Success();
}

// RoPE of x [M, H, D] with cos / sin [M, D] of each row's position (rotate_half).
ffi::Error RopeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto d = x.dimensions();
  if (d.size() != 3 || d[2] % 2 || cos.dimensions().size() != 2 || cos.dimensions()[0] != d[0] ||
      cos.dimensions()[1] != d[2] || sin.element_count() != cos.element_count()) {
    return ffi::Error::InvalidArgument("rope: expected x [M, H, D] (D even), cos and sin [M, D]");
  }
  const int64_t M = d[0], H = d[1], D = d[2];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h)
      rotate_half(x.typed_data() + (m * H + h) * D, cos.typed_data() + m * D, sin.typed_data() + m * D,
                  out->typed_data() + (m * H + h) * D, D);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecRope, RopeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [M, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // out [M, H, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecLayerTail, LayerTailImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pages [KVH, P, S, D]: f32, f16 or bf16
                                  .Arg<ffi::AnyBuffer>()          // v_pages [KVH, P, S, D]: k_pages' dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_lens [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, H]: the residual stream
                                  .Arg<ffi::AnyBuffer>()          // o_proj, packed or quantized
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gain [H]: post-attention RMSNorm
                                  .Arg<ffi::AnyBuffer>()          // gate_up_proj, packed or quantized
                                  .Arg<ffi::AnyBuffer>()          // down_proj, packed or quantized
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, H]
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecDecoderLayer, DecoderLayerImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, H]: the layer's input
                                  .Arg<ffi::AnyBuffer>()          // qkv_proj, packed or quantized
                                  .Arg<ffi::Buffer<ffi::F32>>()   // in_gain [H]: input RMSNorm
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [M, D]
                                  .Arg<ffi::AnyBuffer>()          // k_pages [KVH, P, S, D]: f32, f16 or bf16
                                  .Arg<ffi::AnyBuffer>()          // v_pages [KVH, P, S, D]: k_pages' dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start [B]: cache lengths before
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_lens [B]
                                  .Arg<ffi::AnyBuffer>()          // o_proj, packed or quantized
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gain [H]: post-attention RMSNorm
                                  .Arg<ffi::AnyBuffer>()          // gate_up_proj, packed or quantized
                                  .Arg<ffi::AnyBuffer>()          // down_proj, packed or quantized
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, H]
                                  .Ret<ffi::AnyBuffer>()          // k_pages, written (aliased)
                                  .Ret<ffi::AnyBuffer>()          // v_pages, written (aliased)
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecDecoderStack, DecoderStackImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, H]: the first layer's input
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [M, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start [B]: cache lengths before
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_lens [B]
                                  .RemainingArgs()                // per layer: qkv, in_gain, o, gain, gate_up, down,
                                                                  //   k_pages, v_pages (as JspecDecoderLayer's)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [M, H]: the last layer's output
                                  .RemainingRets()                // per layer: k_pages, v_pages, written (aliased)
                                  .Attr<float>("eps"));
