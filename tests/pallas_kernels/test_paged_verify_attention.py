"""The Pallas paged verification-attention kernel against its plain-jnp reference.

Everything runs on the CPU: the kernel in Pallas interpret mode, and its Triton lowering for
CUDA (H100/H200) and ROCm (gfx942, MI300X) through an abstract device -- lowering only, nothing
is compiled or run for a GPU here.

Poisoning: every page no sequence owns, and every slot past kv_len in a sequence's last page,
holds NaN in the arrays the kernel gets; block-table slots past a sequence's pages hold invalid
ids (-1, 2^30) or, in the "mixed" cases, also the ids of NaN pages and of other sequences'
pages. The reference runs on a clean copy (zeros there, page 0 in unused slots), which has the
same correct answer under the contract. A kernel that reads any of those values, or follows
those ids, returns NaN or garbage. Interpret mode fills output buffers with NaN before the
kernel runs, so an output element (or a split partial the merge reads) that no program writes
shows up as NaN too.

Tolerances: float32 is compared at 1e-5 (both sides accumulate in f32; the reference uses
HIGHEST-precision einsums). bfloat16 at 2e-2 absolute/relative: the kernel feeds P to the second
dot in bfloat16 (as flash attention does) and both results are rounded to bfloat16 (2^-8
relative) at the end.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import TOL, Case, make_inputs
from pallas_kernels import tuning
from pallas_kernels.paged_verify_attention import (
    paged_verify_attention,
    paged_verify_attention_reference,
    plan_for,
)

def check_case(case: Case, **extra_tiles):
    kernel_args, ref_args = make_inputs(case)
    kw = dict(sm_scale=case.sm_scale, soft_cap=case.soft_cap, sliding_window=case.sliding_window)
    out = paged_verify_attention(*kernel_args, interpret=True, **kw, **dict(case.tiles), **extra_tiles)
    ref = paged_verify_attention_reference(*ref_args, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype == case.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "kernel read a poisoned value or left an output unwritten"
    np.testing.assert_allclose(out, ref, **TOL[case.dtype])
    q_lens = case.q_lens or (case.t,) * len(case.kv_lens)
    for i, ql in enumerate(q_lens):  # rows past q_len are exactly zero
        assert not out[i, ql:].any()
    return out


# Every value of every axis appears at least once: T {1,2,5,8,16,17}, GQA {1,3,8}, D {32,64,
# 128, 80}, page_size {16,32}, f32 and bf16 (and a bf16 q over an f32 cache); ragged kv_lens
# crossing page and split boundaries; ragged q_lens including 0 (with kv_len 0 too); one split
# (the kernel writes the result) and several (partials + merge), with splits that have no keys;
# block tables 3-4x wider than the context with garbage ids past the live pages; several q
# blocks; T x G = 17 x 8 in one row block; a head_dim that is not a power of two.
CASES = {
    "decode_t1_g1_d64_p16_f32": Case(1, 1, 64, 16, (1, 17, 50), tiles=(("num_splits", 3),)),
    "t2_g3_d128_p32_bf16_one_split": Case(2, 3, 128, 32, (33, 64, 2), dtype=jnp.bfloat16,
                                          tiles=(("num_splits", 1),)),
    "t5_g8_d64_p16_f32_ragged_q": Case(5, 8, 64, 16, (5, 48, 97), q_lens=(5, 3, 0)),
    "t8_g3_d64_p32_bf16_ragged_q": Case(8, 3, 64, 32, (8, 70, 31), q_lens=(8, 1, 6),
                                       dtype=jnp.bfloat16),
    "t16_g1_d128_p16_f32": Case(16, 1, 128, 16, (16, 40, 130), kv_heads=3),
    "t16_g8_d64_p16_bf16_128_rows": Case(16, 8, 64, 16, (16, 77), kv_heads=1,
                                         dtype=jnp.bfloat16),
    # split edges every 32 keys (block_k 16, 2 steps per split): kv_lens on and around them
    "split_edges_t5_g3_d64_p16": Case(5, 3, 64, 16, (32, 64, 33, 31, 95), max_pages=8,
                                      tiles=(("block_k", 16), ("num_splits", 4))),
    "long_t1_g8_d128_p32_bf16_splits": Case(1, 8, 128, 32, (300, 129), kv_heads=1,
                                            dtype=jnp.bfloat16, tiles=(("num_splits", 5),)),
    "chunked_3_q_blocks_t5_g8": Case(5, 8, 64, 16, (40, 21), q_lens=(5, 4),
                                     tiles=(("block_q", 16),)),
    "chunked_3_q_blocks_t5_g8_splits": Case(5, 8, 64, 16, (40, 21), q_lens=(5, 4), max_pages=6,
                                            tiles=(("block_q", 16), ("block_k", 16),
                                                   ("num_splits", 3))),
    "head_dim_80_t2_g3": Case(2, 3, 80, 16, (20, 45)),
    "soft_cap_sm_scale_t2_g1": Case(2, 1, 64, 32, (3, 90), sm_scale=0.3, soft_cap=5.0),
    # a local layer's window (Gemma): inside one page, across splits, with the cap and a scale
    "sliding_window_t5_g3_ragged_q": Case(5, 3, 64, 16, (5, 48, 97), q_lens=(5, 3, 2), sliding_window=7),
    "sliding_window_splits_soft_cap": Case(5, 2, 64, 16, (40, 100, 5), max_pages=10, garbage="mixed",
                                           sliding_window=33, soft_cap=4.0, sm_scale=0.2,
                                           tiles=(("block_k", 16), ("num_splits", 4))),
    # several q blocks: each block's page loop starts at the window of its own first row
    "sliding_window_3_q_blocks": Case(5, 8, 64, 16, (70, 21), q_lens=(5, 4), sliding_window=3,
                                      tiles=(("block_q", 16), ("block_k", 16))),
    # a window far shorter than the context: the splits share the window's keys
    "sliding_window_long_context_splits": Case(5, 2, 64, 16, (300, 41, 5), q_lens=(5, 3, 5), max_pages=24,
                                               garbage="mixed", sliding_window=20,
                                               tiles=(("block_k", 16), ("num_splits", 4))),
    "bf16_q_over_f32_cache": Case(5, 3, 64, 16, (9, 60), dtype=jnp.bfloat16,
                                  cache_dtype=jnp.float32),
    # a float32 model over 16-bit pages (EngineConfig.kv_cache_dtype)
    "f32_q_over_f16_cache": Case(5, 3, 64, 16, (9, 60, 33), dtype=jnp.float32, cache_dtype=jnp.float16,
                                 garbage="mixed", tiles=(("num_splits", 2),)),
    "f32_q_over_bf16_cache": Case(1, 3, 64, 16, (1, 60, 100), dtype=jnp.float32, cache_dtype=jnp.bfloat16),
    # block tables much wider than the live context, real and invalid ids past the live pages
    "wide_table_mixed_garbage_splits": Case(5, 3, 64, 16, (20, 70, 5), q_lens=(5, 2, 5),
                                            max_pages=20, garbage="mixed",
                                            tiles=(("block_k", 16),)),
    "wide_table_mixed_garbage_one_split": Case(5, 3, 64, 16, (20, 70, 5), q_lens=(5, 2, 5),
                                               max_pages=20, garbage="mixed",
                                               tiles=(("num_splits", 1),)),
    # T x G = 17 x 8 = 136 rows: one 256-row block, pages read once
    "t17_g8_d64_bf16_one_row_block": Case(17, 8, 64, 16, (17, 50), q_lens=(17, 9), kv_heads=1,
                                          dtype=jnp.bfloat16, garbage="mixed",
                                          tiles=(("num_splits", 1),)),
    "t17_g8_d32_f32_one_row_block_splits": Case(17, 8, 32, 16, (40, 100), q_lens=(12, 17),
                                                kv_heads=1, max_pages=12,
                                                tiles=(("block_k", 16), ("num_splits", 4))),
    # q_len = 0 rows (kv_len 0 and > 0) and splits with no keys, into NaN-poisoned outputs
    "q_len_0_and_empty_splits": Case(4, 2, 64, 16, (0, 37, 9, 64), q_lens=(0, 0, 3, 4),
                                     max_pages=10, garbage="mixed",
                                     tiles=(("block_k", 16), ("num_splits", 6))),
    "q_len_0_one_split": Case(4, 2, 64, 16, (0, 37, 9, 64), q_lens=(0, 0, 3, 4), max_pages=10,
                              garbage="mixed", tiles=(("num_splits", 1),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    check_case(CASES[name])


def test_t17_g8_is_one_row_block_on_every_gpu():
    # T = 17 (16 drafts + 1) at GQA 8: 136 rows in one program, pages read once
    for _, _, entry in tuning.TABLE:
        plan = tuning.plan_tiles(batch=1, kv_heads=8, rows=17 * 8, head_dim=128, capacity=4096,
                                 itemsize=2, entry=entry)
        assert (plan.num_q_blocks, plan.block_q) == (1, 256), entry.name
    kernel_args, _ = make_inputs(CASES["t17_g8_d64_bf16_one_row_block"])
    assert plan_for(kernel_args[0], kernel_args[1], kernel_args[3]).num_q_blocks == 1


def test_a_local_layers_splits_divide_its_window():
    """At 300 keys and a 20-key window, 4 splits of 16-key steps: without a window each split
    takes 80 keys (one of them holds the whole window); with it the splits start at the window
    (276: the first key the first of 5 rows sees) and take 16 each."""
    from pallas_kernels.paged_verify_attention import _split_keys

    assert [int(x) for x in _split_keys(jnp.int32(300), jnp.int32(5), 4, 16, 16, None)] == [0, 300, 80]
    assert [int(x) for x in _split_keys(jnp.int32(300), jnp.int32(5), 4, 16, 16, 20)] == [276, 300, 16]
    assert [int(x) for x in _split_keys(jnp.int32(300), jnp.int32(0), 4, 16, 16, 20)] == [0, 0, 16]


def test_split_count_and_block_k_do_not_change_the_result():
    case = Case(8, 3, 64, 16, (60, 130, 9), q_lens=(8, 2, 1), max_pages=12, garbage="mixed")
    one = check_case(case, num_splits=1, block_k=32)
    for tiles in (dict(num_splits=3, block_k=16), dict(num_splits=12, block_k=16)):
        # 12 splits: the short sequences leave most of their splits without keys
        np.testing.assert_allclose(check_case(case, **tiles), one, atol=1e-5, rtol=1e-5)


def test_inside_jit_with_traced_lengths():
    case = Case(2, 3, 64, 16, (20, 3), q_lens=(2, 1))
    (q, k, v, table, kv_lens, q_lens), ref_args = make_inputs(case)
    ref = paged_verify_attention_reference(*ref_args)
    for tiles in (dict(num_splits=1), dict(num_splits=2, block_k=16)):
        fn = jax.jit(lambda *a, tiles=tiles: paged_verify_attention(*a, interpret=True, **tiles))
        np.testing.assert_allclose(fn(q, k, v, table, kv_lens, q_lens), ref, atol=1e-5, rtol=1e-5)


def test_dispatch_interpret_uses_the_kernel():
    from jspec import attention

    case = Case(2, 1, 64, 16, (18,))
    kernel_args, ref_args = make_inputs(case)
    out = attention.get("interpret")(*kernel_args)  # NaN-poisoned pages: the kernel path
    np.testing.assert_allclose(out, paged_verify_attention_reference(*ref_args), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ bad inputs


def _good():
    return dict(
        q=jnp.zeros((2, 3, 4, 64)),
        k_pages=jnp.zeros((2, 8, 16, 64)),
        v_pages=jnp.zeros((2, 8, 16, 64)),
        block_tables=jnp.zeros((2, 4), jnp.int32),
        kv_lens=jnp.array([3, 10], jnp.int32),
        q_lens=jnp.array([3, 1], jnp.int32),
    )


@pytest.mark.parametrize("change, pattern", [
    (dict(q=jnp.zeros((2, 3, 64))), r"^q must be"),
    (dict(k_pages=jnp.zeros((8, 16, 64)), v_pages=jnp.zeros((8, 16, 64))), r"^k_pages"),
    (dict(v_pages=jnp.zeros((2, 8, 16, 32))), r"^v_pages"),
    (dict(q=jnp.zeros((2, 3, 5, 64))), r"q heads \(5\).*k_pages heads \(2\)"),
    (dict(q=jnp.zeros((2, 3, 4, 64), jnp.int32)), r"^q must be float32"),
    (dict(k_pages=jnp.zeros((2, 8, 16, 64), jnp.float8_e4m3fn),
          v_pages=jnp.zeros((2, 8, 16, 64), jnp.float8_e4m3fn)),
     r"^k_pages must be one of float32, bfloat16, float16, got float8"),  # the CPU paths read 8 bits, Triton not
    (dict(v_pages=jnp.zeros((2, 8, 16, 64), jnp.bfloat16)), r"^v_pages dtype"),
    (dict(block_tables=jnp.zeros((2, 4), jnp.float32)), r"^block_tables must be int32"),
    (dict(block_tables=jnp.zeros((3, 4), jnp.int32)), r"^block_tables must be \[B"),
    (dict(kv_lens=jnp.array([3, 10], jnp.float32)), r"^kv_lens must be int32"),
    (dict(kv_lens=jnp.array([2, 10], jnp.int32)), r"^kv_lens .* must be >= q_lens"),
    (dict(kv_lens=jnp.array([3, 65], jnp.int32)), r"^kv_lens .* exceed"),
    (dict(q_lens=jnp.array([4, 1], jnp.int32)), r"^q_lens .* must lie in"),
    (dict(q_lens=jnp.array([3], jnp.int32)), r"^q_lens must be \[B"),
])
def test_bad_arguments_raise_value_error_naming_them(change, pattern):
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=pattern):
        paged_verify_attention(**args, interpret=True)


@pytest.mark.parametrize("tiles, name", [
    (dict(block_k=24), "block_k"), (dict(block_k=8), "block_k"),
    (dict(block_q=8), "block_q"), (dict(num_splits=0), "num_splits"),
    (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages"),
])
def test_bad_tiles_raise_value_error_naming_them(tiles, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        paged_verify_attention(**_good(), interpret=True, **tiles)


# ------------------------------------------------------------------------------ tuning table


@pytest.mark.parametrize("platform, kind, expected", [
    ("cuda", "NVIDIA H200", "cuda-hopper"),
    ("cuda", "NVIDIA H100 80GB HBM3", "cuda-hopper"),
    ("cuda", "NVIDIA A100-SXM4-80GB", "cuda-ampere"),
    ("cuda", "NVIDIA GeForce RTX 4090", "cuda-default"),
    ("rocm", "gfx942", "rocm-gfx942"),
    ("rocm", "AMD Instinct MI300X", "rocm-gfx942"),
    ("gpu", "gfx942:sramecc+:xnack-", "rocm-gfx942"),
    ("rocm", "gfx90a", "rocm-gfx90a"),
    ("rocm", "AMD Instinct MI355X", "rocm-gfx950"),
    ("rocm", "gfx1100", "rocm-gfx11"),
    ("rocm", "something new", "rocm-default"),
    ("cpu", "cpu", "default"),
])
def test_tuning_lookup(platform, kind, expected):
    assert tuning.lookup(platform, kind).name == expected


def test_launch_knobs_per_vendor_and_cdna_generation():
    for entry in (tuning.HOPPER, tuning.AMPERE, tuning.CUDA_DEFAULT, tuning.RDNA3):
        assert entry.warp_size == 32
    stages = {e.name: e.num_stages for e in (tuning.CDNA2, tuning.CDNA3, tuning.CDNA4)}
    assert stages == {"rocm-gfx90a": 1, "rocm-gfx942": 2, "rocm-gfx950": 2}
    for entry in (tuning.CDNA2, tuning.CDNA3, tuning.CDNA4):
        assert entry.warp_size == 64
        assert entry.warps_for(32) * 64 == 128  # 2 wavefronts: as many lanes as 4 CUDA warps


@pytest.mark.parametrize("entry", sorted({e for _, _, e in tuning.TABLE}, key=lambda e: e.name),
                         ids=lambda e: e.name)
def test_smem_budget_is_per_resident_program_and_warps_grow_with_rows(entry):
    assert entry.smem_budget == min(entry.smem_per_core // entry.resident_programs,
                                    entry.smem_per_program)
    threads = []
    for rows in (4, 20, 36, 68, 136):  # T x G = 1x4, 5x4, 9x4, 17x4, 17x8
        for d in (64, 128):
            plan = tuning.plan_tiles(batch=1, kv_heads=8, rows=rows, head_dim=d, capacity=8192,
                                     itemsize=2, entry=entry)
            loop = tuning.loop_smem(plan.block_q, plan.block_k, plan.head_dim_padded, 2,
                                    plan.num_stages)
            assert loop <= entry.smem_budget, (rows, d, plan)
            if plan.block_q * plan.head_dim_padded * 2 <= entry.smem_budget:
                assert plan.smem_bytes <= entry.smem_budget, (rows, d, plan)
        threads.append(plan.num_warps * entry.warp_size)
        # f32 accumulator [block_q, 128] at most 64 registers a thread (no spills by design)
        assert plan.block_q * 128 // (plan.num_warps * entry.warp_size) <= 64, (rows, plan)
    assert threads == sorted(threads) and threads[-1] > threads[0]


def test_fit_tiles_lowers_block_k_and_stages_to_the_budget():
    # MI300X: 32 KiB of LDS per program (2 resident): two 16-key stages at D = 128, two
    # 32-key stages at D = 64; MI210 (1 stage) keeps 32 keys; H200 (114 KiB): the full 64-key,
    # 3-stage ring for Llama verification rows, 2 stages for 256 rows
    assert tuning.fit_tiles(tuning.CDNA3, 32, 128, 2) == (16, 2)
    assert tuning.fit_tiles(tuning.CDNA3, 32, 64, 2) == (32, 2)
    assert tuning.fit_tiles(tuning.CDNA2, 32, 128, 2) == (32, 1)
    assert tuning.fit_tiles(tuning.HOPPER, 32, 128, 2) == (64, 3)
    assert tuning.fit_tiles(tuning.HOPPER, 256, 128, 2) == (64, 2)
    assert tuning.fit_tiles(tuning.HOPPER, 256, 128, 2, block_k=16, num_stages=4) == (16, 4)


@pytest.mark.parametrize("entry, low, high, full_batch", [(tuning.HOPPER, 1.9, 4.0, 64),
                                                          (tuning.CDNA3, 1.6, 4.0, 128)],
                         ids=["hopper", "gfx942"])
def test_splits_follow_live_lengths_at_batch_1(entry, low, high, full_batch):
    # Llama-8B heads, batch 1, 4k live keys in a 32k-wide table: splits come from kv_len, not
    # from the table width, and fill 2-4 programs per core (partial traffic permitting)
    for t in (1, 5):
        plan = tuning.plan_tiles(batch=1, kv_heads=8, rows=t * 4, head_dim=128, capacity=32768,
                                 itemsize=2, entry=entry)
        per_core = plan.live_programs([4096], [t]) / entry.num_cores
        assert low <= per_core <= high, (t, per_core, plan)
        # a 256-key sequence in the same table: a few programs, not a grid's worth
        assert plan.live_programs([256], [t]) == 8 * -(-256 // plan.min_keys_per_split)
        assert plan.live_programs([4096], [0]) == 0  # nothing to attend: every program exits
    # a batch that fills every core with 2 programs needs no splits: one launch, no partials
    assert tuning.plan_tiles(batch=full_batch, kv_heads=8, rows=20, head_dim=128, capacity=32768,
                             itemsize=2, entry=entry).num_splits == 1


def test_keys_per_split_partitions_the_live_keys():
    live = jnp.arange(0, 700, 7, dtype=jnp.int32)
    for splits, block_k, min_keys in ((1, 16, 16), (5, 16, 48), (33, 64, 128), (7, 32, 32)):
        per = np.asarray(tuning.keys_per_split(live, splits, block_k, min_keys))
        assert (per % block_k == 0).all() and (per >= min_keys).all()
        used = -(-np.asarray(live) // per)
        assert (used <= splits).all() and (used * per >= np.asarray(live)).all()


# ------------------------------------------------------------------------------ GPU lowering

B, T, KVH, G, D, PAGE, PAGES, MAX_PAGES = 4, 16, 8, 8, 128, 16, 512, 128


def _lower_for(platform: str, device_kind: str, batch: int = B, t: int = T, group: int = G,
               d: int = D, pages: int = PAGES, max_pages: int = MAX_PAGES, dtype=jnp.bfloat16, cache_dtype=None,
               **options):
    """The kernel lowered for ``platform`` via an abstract device (bf16 unless said; ``options``:
    the attention options, such as a sliding window)."""
    import jaxlib

    jaxlib_version = tuple(int(x) for x in jaxlib.__version__.split(".")[:3])
    if jaxlib_version > (0, 10, 2):
        # Newer jaxlibs compile the Triton IR during lowering: that needs the vendor compiler.
        from jax._src.lib import triton

        if not triton.has_compilation_handler(platform):
            pytest.skip(f"this jaxlib cannot compile Triton for {platform}")
    sds = jax.ShapeDtypeStruct
    cache_dtype = cache_dtype or dtype
    args = (sds((batch, t, KVH * group, d), dtype),
            sds((KVH, pages, PAGE, d), cache_dtype),
            sds((KVH, pages, PAGE, d), cache_dtype),
            sds((batch, max_pages), jnp.int32),
            sds((batch,), jnp.int32),
            sds((batch,), jnp.int32))
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        fn = functools.partial(paged_verify_attention, **options)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))


def _triton_modules(monkeypatch, *lower_args, **lower_kwargs) -> list[str]:
    """Triton IR (MLIR text) of each kernel built while lowering (private jax API: skip if moved)."""
    try:
        from jax._src.pallas.triton import lowering as triton_lowering

        build = triton_lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError):
        pytest.skip("jax's private Triton lowering module moved")
    modules = []

    def spy(*args, **kwargs):
        result = build(*args, **kwargs)
        assert result.module.operation.verify()
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", spy)
    jax.clear_caches()  # a shape lowered by an earlier test would not be built again
    _lower_for(*lower_args, **lower_kwargs)
    return modules


@pytest.mark.parametrize("platform, kind, entry", [
    ("cuda", "NVIDIA H200", tuning.HOPPER),
    ("cuda", "NVIDIA H100 80GB HBM3", tuning.HOPPER),
    ("rocm", "gfx942", tuning.CDNA3),
    ("rocm", "AMD Instinct MI300X", tuning.CDNA3),
])
def test_lowers_to_a_triton_call_with_the_device_tuning_entry(platform, kind, entry):
    _check_triton_call(_lower_for(platform, kind).as_text(), entry)


@pytest.mark.parametrize("platform, kind, entry", [("cuda", "NVIDIA H200", tuning.HOPPER),
                                                   ("rocm", "gfx942", tuning.CDNA3)])
def test_a_gemma_local_layer_lowers_to_one_triton_call(platform, kind, entry):
    """A sliding window with soft-capped scores and Gemma's score scale (query_pre_attn_scalar
    256 at head_dim 128): the same single kernel launch, the options compiled in."""
    text = _lower_for(platform, kind, sliding_window=1024, soft_cap=50.0, sm_scale=256 ** -0.5).as_text()
    _check_triton_call(text, entry)


@pytest.mark.parametrize("platform, kind, entry", [("cuda", "NVIDIA H200", tuning.HOPPER),
                                                   ("rocm", "gfx942", tuning.CDNA3)])
def test_a_float32_model_over_float16_pages_lowers_to_one_triton_call(platform, kind, entry):
    """EngineConfig.kv_cache_dtype="float16" under a float32 model: float32 queries, 16-bit pages."""
    text = _lower_for(platform, kind, dtype=jnp.float32, cache_dtype=jnp.float16).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
    assert len(calls) == 1 and "triton" in calls[0], calls


def _check_triton_call(text: str, entry):
    calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
    assert len(calls) == 1 and "triton" in calls[0], calls  # one kernel launch
    [name] = re.findall(r'name = "(paged_verify_attention[^"]*)"', text)
    plan = tuning.plan_tiles(batch=B, kv_heads=KVH, rows=T * G, head_dim=D,
                             capacity=MAX_PAGES * PAGE, itemsize=2, entry=entry)
    assert name == (f"paged_verify_attention_{entry.name.replace('-', '_')}_bq{plan.block_q}"
                    f"_bk{plan.block_k}_s{plan.num_splits}_w{plan.num_warps}_st{plan.num_stages}")
    if "__gpu$xla.gpu.triton" in calls[0]:  # jaxlib <= 0.10.2: launch parameters in plain text
        assert f"num_warps = {plan.num_warps} : i32" in text
        assert f"num_stages = {plan.num_stages} : i32" in text
        grid = [int(g) for g in re.findall(r"grid_[xyz] = (\d+)", text)]
        # no program per query token or query head: B x KVH x splits
        assert np.prod(grid) == B * KVH * plan.num_splits == plan.programs


@pytest.mark.parametrize("batch, one_split", [(64, True), (1, False)])
def test_q_read_in_place_and_no_merge_when_one_split(batch, one_split):
    text = _lower_for("cuda", "NVIDIA H200", batch=batch, t=5, group=4).as_text()
    assert len(re.findall(r"stablehlo\.custom_call", text)) == 1
    assert "stablehlo.transpose" not in text and "stablehlo.pad" not in text  # q in place
    if one_split:  # the kernel writes [B, T, Hq, D] bf16 itself: nothing else runs
        assert "stablehlo.reduce" not in text
        assert re.search(r"-> tensor<64x5x32x128xbf16>", text)
    else:  # partials f32 [S, B, T, Hq, D] and an XLA merge over the splits
        assert "stablehlo.reduce" in text


@pytest.mark.parametrize("platform, kind, exp2", [("cuda", "NVIDIA H200", "__nv_exp2f"),
                                                  ("rocm", "gfx942", "__ocml_exp2_f32")])
@pytest.mark.parametrize("batch, t, group", [(128, 17, 8), (1, 17, 8), (1, 5, 4)],
                         ids=["t17_g8_one_split", "t17_g8_splits", "t5_g4_splits"])
def test_triton_module_is_one_page_loop_over_one_row_block(monkeypatch, platform, kind, exp2,
                                                           batch, t, group):
    [asm] = _triton_modules(monkeypatch, platform, kind, batch=batch, t=t, group=group)
    block_q = max(16, 1 << (t * group - 1).bit_length())
    assert asm.count("scf.for") == 1  # one loop over the pages ...
    dots = re.findall(r"tt\.dot .* -> tensor<(\d+)x(\d+)xf32>", asm)
    assert len(dots) == 2  # ... with Q K^T and P V ...
    assert all(int(m) == block_q for m, _ in dots)  # ... over all T x G rows at once
    # next page ids are loaded in the loop and carried: iter_args end with tensor<block_k x i32>
    [carry] = re.findall(r"scf\.for .* -> \((.*)\)\s+: i32", asm)
    assert re.search(r"tensor<\d+xi32>$", carry), carry
    assert exp2 in asm and "exp_f32" not in asm.replace("exp2_f32", "") and "__nv_expf" not in asm
    if batch == 1:  # split-k: programs without keys skip everything (scf.if), partials in f32
        assert "scf.if" in asm and "tt.ptr<f32>" in asm
    else:
        assert "tt.ptr<f32>" not in asm  # no partials: the bf16 result is stored directly


def test_caches_past_2_31_elements_use_64_bit_offsets(monkeypatch):
    # 8 x 140000 x 16 x 128 bf16 = 2.3e9 elements (4.6 GB): lowered, never allocated
    [big] = _triton_modules(monkeypatch, "cuda", "NVIDIA H200", batch=1, t=5, group=4,
                            pages=140_000)
    monkeypatch.undo()
    [small] = _triton_modules(monkeypatch, "cuda", "NVIDIA H200", batch=1, t=5, group=4)
    kv_ptrs = r"tt\.addptr %\S+, %\S+ : tensor<\d+x128x!tt\.ptr<bf16>>, tensor<\d+x128x(i\d+)>"
    # the q gather (a small array) and the K and V gathers
    assert sorted(re.findall(kv_ptrs, big)) == ["i32", "i64", "i64"]
    assert sorted(re.findall(kv_ptrs, small)) == ["i32", "i32", "i32"]
