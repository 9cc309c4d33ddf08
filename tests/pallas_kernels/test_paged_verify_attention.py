"""The Pallas paged verification-attention kernel against its plain-jnp reference.

Everything runs on the CPU: the kernel in Pallas interpret mode, and its Triton lowering for
CUDA (H100/H200) and ROCm (gfx942, MI300X) through an abstract device -- lowering only, nothing
is compiled or run for a GPU here.

Poisoning: every page no sequence owns, and every slot past kv_len in a sequence's last page,
holds NaN in the arrays the kernel gets, and block-table slots past a sequence's pages hold
invalid page ids (-1, huge). The reference runs on a clean copy (zeros there, valid ids), which
has the same correct answer under the contract. A kernel that reads any of those values, or
follows those ids, returns NaN or garbage. The interpret mode also fills output buffers with NaN
before the kernel runs, so an output block that no program writes shows up as NaN too.

Tolerances: float32 is compared at 1e-5 (both sides accumulate in f32; the reference uses
HIGHEST-precision einsums). bfloat16 at 2e-2 absolute/relative: the kernel feeds P to the second
dot in bfloat16 (as flash attention does) and both results are rounded to bfloat16 (2^-8
relative) at the end.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning
from pallas_kernels.paged_verify_attention import (
    paged_verify_attention,
    paged_verify_attention_reference,
    plan_tiles,
)

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    t: int  # query rows per sequence (T)
    group: int  # Hq / KVH
    head_dim: int
    page_size: int
    kv_lens: tuple[int, ...]
    q_lens: Optional[tuple[int, ...]] = None
    kv_heads: int = 2
    dtype: type = jnp.float32
    max_pages: Optional[int] = None  # block-table width; default: what the longest needs + 1
    tiles: tuple = ()  # explicit static tile arguments, as (name, value) pairs
    sm_scale: Optional[float] = None
    soft_cap: Optional[float] = None


def make_inputs(case: Case, seed: int = 0):
    """(poisoned kernel inputs, clean reference inputs); pages shuffled over the pool."""
    rng = np.random.default_rng(seed)
    b = len(case.kv_lens)
    kv_lens = np.array(case.kv_lens, np.int32)
    need = -(-kv_lens // case.page_size)  # pages each sequence owns
    max_pages = case.max_pages or int(need.max()) + 1
    num_pages = int(need.sum()) + 3  # 3 pages nobody owns
    hq = case.kv_heads * case.group
    shape = (case.kv_heads, num_pages, case.page_size, case.head_dim)
    q = rng.standard_normal((b, case.t, hq, case.head_dim)).astype(np.float32)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)

    perm = rng.permutation(num_pages)
    table = np.zeros((b, max_pages), np.int32)  # clean: unused slots point at page 0
    bad_table = np.empty((b, max_pages), np.int32)
    bad_table[:] = np.where(rng.random((b, max_pages)) < 0.5, -1, 1 << 30)
    owned = np.zeros((num_pages, case.page_size), bool)  # which cache slots hold real keys
    start = 0
    for i in range(b):
        ids = perm[start:start + need[i]]
        start += need[i]
        table[i, :need[i]] = bad_table[i, :need[i]] = ids
        for j, page in enumerate(ids):
            owned[page, : min(case.page_size, kv_lens[i] - j * case.page_size)] = True

    clean_k = np.where(owned[None, :, :, None], k, 0.0)
    clean_v = np.where(owned[None, :, :, None], v, 0.0)
    bad_k = np.where(owned[None, :, :, None], k, np.nan)
    bad_v = np.where(owned[None, :, :, None], v, np.nan)
    q_lens = None if case.q_lens is None else jnp.array(case.q_lens, jnp.int32)
    cast = lambda x: jnp.asarray(x, case.dtype)
    common = (cast(q),)
    kernel_args = common + (cast(bad_k), cast(bad_v), jnp.asarray(bad_table), jnp.asarray(kv_lens), q_lens)
    ref_args = common + (cast(clean_k), cast(clean_v), jnp.asarray(table), jnp.asarray(kv_lens), q_lens)
    return kernel_args, ref_args


def check_case(case: Case, **extra_tiles):
    kernel_args, ref_args = make_inputs(case)
    kw = dict(sm_scale=case.sm_scale, soft_cap=case.soft_cap)
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


# Every value of every axis appears at least once: T {1,2,5,8,16}, GQA {1,3,8}, D {64,128},
# page_size {16,32}, f32 and bf16; ragged kv_lens crossing page and split boundaries (the
# explicit block_k / num_splits put split edges at known key positions), ragged q_lens
# including 0, several q blocks per head, a head_dim that is not a power of two.
CASES = {
    "decode_t1_g1_d64_p16_f32": Case(1, 1, 64, 16, (1, 17, 50), tiles=(("num_splits", 3),)),
    "t2_g3_d128_p32_bf16": Case(2, 3, 128, 32, (33, 64, 2), dtype=jnp.bfloat16),
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
    "head_dim_80_t2_g3": Case(2, 3, 80, 16, (20, 45)),
    "soft_cap_sm_scale_t2_g1": Case(2, 1, 64, 32, (3, 90), sm_scale=0.3, soft_cap=5.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    check_case(CASES[name])


def test_split_count_does_not_change_the_result():
    case = Case(8, 3, 64, 16, (60, 130, 9), q_lens=(8, 2, 1), max_pages=10)
    one = check_case(case, num_splits=1, block_k=16)
    many = check_case(case, num_splits=10, block_k=16)  # several splits see no keys at all
    np.testing.assert_allclose(one, many, atol=1e-5, rtol=1e-5)


def test_inside_jit_with_traced_lengths():
    case = Case(2, 3, 64, 16, (20, 3), q_lens=(2, 1))
    (q, k, v, table, kv_lens, q_lens), ref_args = make_inputs(case)
    fn = jax.jit(lambda *a: paged_verify_attention(*a, interpret=True))
    out = fn(q, k, v, table, kv_lens, q_lens)
    np.testing.assert_allclose(out, paged_verify_attention_reference(*ref_args), atol=1e-5, rtol=1e-5)


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


def test_cdna_tiles_fit_64_kib_lds():
    for entry in (tuning.CDNA3, tuning.CDNA2, tuning.RDNA3):
        for rows in (16, 32, 64, 128):
            for d in (64, 128):
                bk = tuning.fit_block_k(entry, min(rows, entry.max_block_q), d, 2)
                smem = 2 * (rows * d + entry.num_stages * 2 * bk * d + rows * bk)
                assert smem <= 64 * 1024, (entry.name, rows, d, bk)
    # 128 query rows of D=128 need a smaller key block on MI300X than on H200
    assert tuning.fit_block_k(tuning.CDNA3, 128, 128, 2) == 32
    assert tuning.fit_block_k(tuning.HOPPER, 128, 128, 2) == 64


def test_one_program_holds_all_query_rows_of_a_kv_head():
    # verification (T = k + 1 <= 16) at GQA 8: every row of a head in one q block, so the grid
    # is (B, KVH, 1, splits) and each page is read once per split, not once per token
    for t in (1, 2, 5, 8, 16):
        plan = plan_tiles(batch=4, kv_heads=8, rows=t * 8, head_dim=128, capacity=4096,
                          itemsize=2, entry=tuning.HOPPER)
        assert plan["num_q_blocks"] == 1 and plan["block_q"] >= t * 8


# ------------------------------------------------------------------------------ GPU lowering

B, T, KVH, G, D, PAGE, PAGES, MAX_PAGES = 4, 16, 8, 8, 128, 16, 512, 128


def _lower_for(platform: str, device_kind: str, t: int = T, group: int = G, d: int = D) -> str:
    """StableHLO text of the kernel lowered for ``platform`` via an abstract device."""
    import jaxlib

    jaxlib_version = tuple(int(x) for x in jaxlib.__version__.split(".")[:3])
    if jaxlib_version > (0, 10, 2):
        # Newer jaxlibs compile the Triton IR during lowering: that needs the vendor compiler.
        from jax._src.lib import triton

        if not triton.has_compilation_handler(platform):
            pytest.skip(f"this jaxlib cannot compile Triton for {platform}")
    sds = jax.ShapeDtypeStruct
    args = (sds((B, t, KVH * group, d), jnp.bfloat16),
            sds((KVH, PAGES, PAGE, d), jnp.bfloat16),
            sds((KVH, PAGES, PAGE, d), jnp.bfloat16),
            sds((B, MAX_PAGES), jnp.int32),
            sds((B,), jnp.int32),
            sds((B,), jnp.int32))
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(paged_verify_attention).trace(*args).lower(lowering_platforms=(platform,))
    return lowered.as_text()


@pytest.mark.parametrize("platform, kind, entry", [
    ("cuda", "NVIDIA H200", tuning.HOPPER),
    ("cuda", "NVIDIA H100 80GB HBM3", tuning.HOPPER),
    ("rocm", "gfx942", tuning.CDNA3),
    ("rocm", "AMD Instinct MI300X", tuning.CDNA3),
])
def test_lowers_to_a_triton_call_with_the_device_tuning_entry(platform, kind, entry):
    text = _lower_for(platform, kind)
    calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
    assert any("triton" in c for c in calls), calls  # the kernel is a Triton custom call
    [name] = re.findall(r'name = "(paged_verify_attention[^"]*)"', text)
    bk = tuning.fit_block_k(entry, T * G, D, 2)
    assert name.startswith(f"paged_verify_attention_{entry.name.replace('-', '_')}_bq128_bk{bk}_")
    if "__gpu$xla.gpu.triton" in calls[0]:  # jaxlib <= 0.10.2: launch parameters in plain text
        assert f"num_warps = {entry.num_warps} : i32" in text
        assert f"num_stages = {entry.num_stages} : i32" in text
        grid = [int(g) for g in re.findall(r"grid_[xyz] = (\d+)", text)]
        splits = int(name.rsplit("_s", 1)[1])
        assert np.prod(grid) == B * KVH * splits  # no program per query token or query head


def test_rocm_triton_module_is_one_page_loop_with_two_dots(monkeypatch):
    """Looks inside the Triton IR built for gfx942 (private jax API, hence the skip guard)."""
    try:
        from jax._src.pallas.triton import lowering as triton_lowering

        build = triton_lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError):
        pytest.skip("jax's private Triton lowering module moved")
    modules = []

    def spy(*args, **kwargs):
        result = build(*args, **kwargs)
        modules.append(result.module)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", spy)
    _lower_for("rocm", "gfx942", t=5, group=3, d=64)  # a shape no other test lowers
    [module] = modules
    assert module.operation.verify()
    asm = module.operation.get_asm()
    assert asm.count("scf.for") == 1  # one loop over the pages, not one per query token
    assert asm.count("tt.dot") == 2  # Q K^T and P V
    assert "__ocml_exp_f32" in asm  # exp lowered through the ROCm device library
