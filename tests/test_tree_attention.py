"""Verification attention over a token tree: every implementation (the reference, the xla path,
the Pallas kernel in interpret mode, the cpu dispatch) against a dense oracle that lists each
row's visible keys by hand; a chain's mask is the causal contract; the kernel with a tree mask
lowers for ROCm (gfx942) and CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import attention
from jspec.speculative import tree as tree_lib
from pallas_kernels.paged_verify_attention import paged_verify_attention, paged_verify_attention_reference
from attention_cases import Case, make_inputs

# three sequences: a tree of 6 nodes at a page boundary, a chain of 3 nodes, a lone root
PARENTS = [[-1, -1, 0, 2, 1, 0], [-1, 0, 1, -1, -1, -1], [-1] * 6]
NUM_NODES = [6, 3, 0]
PREFIX = [13, 4, 30]


def _tree_case(group=2, dtype=jnp.float32):
    t = len(PARENTS[0]) + 1
    q_lens = tuple(n + 1 for n in NUM_NODES)
    kv_lens = tuple(p + q for p, q in zip(PREFIX, q_lens))
    case = Case(t=t, group=group, head_dim=16, page_size=8, kv_lens=kv_lens, q_lens=q_lens, dtype=dtype)
    bits = tree_lib.ancestor_bits(jnp.asarray(PARENTS, jnp.int32))
    return case, bits


def _oracle(ref_args, bits):
    """Dense attention: row t sees the prefix and the new rows j whose bit j its mask sets."""
    q, k_pages, v_pages, table, kv_lens, q_lens = (np.asarray(a, np.float32) if a is not None else None
                                                   for a in ref_args)
    table = table.astype(int)
    b, t, hq, d = q.shape
    kvh, _, s, _ = k_pages.shape
    out = np.zeros_like(q)
    for i in range(b):
        start = int(kv_lens[i] - q_lens[i])
        pos = np.arange(int(kv_lens[i]))
        k = k_pages[:, table[i, pos // s], pos % s]  # [KVH, L, D]
        v = v_pages[:, table[i, pos // s], pos % s]
        for row in range(int(q_lens[i])):
            mask = int(bits[i][row]) & 0xFFFFFFFF
            seen = list(range(start)) + [start + j for j in range(32) if mask >> j & 1]
            for h in range(hq):
                kk, vv = k[h // (hq // kvh), seen], v[h // (hq // kvh), seen]
                sc = kk @ q[i, row, h] / np.sqrt(d)
                w = np.exp(sc - sc.max())
                out[i, row, h] = (w / w.sum()) @ vv
    return out


IMPLS = {
    "reference": paged_verify_attention_reference,
    "xla": attention.paged_attention_xla,
    "cpu": attention.paged_attention_cpu_or_xla,
    "interpret": lambda *a, **kw: paged_verify_attention(*a, interpret=True, **kw),
    "interpret-split": lambda *a, **kw: paged_verify_attention(*a, interpret=True, num_splits=3, block_k=16, **kw),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_tree_rows_see_their_ancestors_only(impl):
    case, bits = _tree_case()
    kernel_args, ref_args = make_inputs(case)
    args = ref_args if impl in ("reference",) else kernel_args  # NaN-poisoned pages for the fast paths
    got = np.asarray(IMPLS[impl](*args, tree_mask=bits))
    want = _oracle(ref_args, np.asarray(bits))
    # the oracle's rows by hand: node 3 (row 4) sees the root, nodes 0 and 2, and itself
    assert [j for j in range(7) if int(bits[0, 4]) >> j & 1] == [0, 1, 3, 4]
    for i, n in enumerate(NUM_NODES):
        np.testing.assert_allclose(got[i, :n + 1], want[i, :n + 1], atol=2e-5, rtol=2e-5)
        assert not np.any(got[i, n + 1:])  # padding rows are zeros
    # the tree changes the answer: without the mask, row 2 (node 1) would see node 0
    causal = np.asarray(paged_verify_attention_reference(*ref_args))
    assert np.abs(causal[0, 2] - want[0, 2]).max() > 1e-3


def test_any_mask_of_rows_is_honoured():
    """The contract reads the bits as given: rows without a common root (a forest) included."""
    case = Case(t=6, group=2, head_dim=16, page_size=4, kv_lens=(11, 20), q_lens=(6, 4))
    kernel_args, ref_args = make_inputs(case, seed=3)
    rng = np.random.default_rng(4)
    bits = np.zeros((2, 6), np.int64)
    for t in range(6):
        bits[:, t] = (1 << t) | (rng.integers(0, 1 << max(t, 1), 2) & ((1 << t) - 1))
    bits = jnp.asarray(bits.astype(np.int32))
    want = _oracle(ref_args, np.asarray(bits))
    for impl in ("reference", "xla", "interpret"):
        got = np.asarray(IMPLS[impl](*(ref_args if impl == "reference" else kernel_args), tree_mask=bits))
        for i, q in enumerate((6, 4)):
            np.testing.assert_allclose(got[i, :q], want[i, :q], atol=2e-5, rtol=2e-5)


def test_a_chains_mask_is_the_causal_contract():
    case = Case(t=5, group=2, head_dim=16, page_size=4, kv_lens=(9, 17), q_lens=(5, 3))
    _, ref_args = make_inputs(case)
    bits = tree_lib.ancestor_bits(tree_lib.chain_parents(2, 4))
    for impl in ("reference", "xla", "interpret"):
        np.testing.assert_allclose(np.asarray(IMPLS[impl](*ref_args, tree_mask=bits)),
                                   np.asarray(IMPLS[impl](*ref_args)), atol=1e-6)


def test_bad_tree_masks_are_refused():
    case, bits = _tree_case()
    _, ref_args = make_inputs(case)
    with pytest.raises(ValueError, match="tree_mask must be int32"):
        paged_verify_attention_reference(*ref_args, tree_mask=bits[:, :3])
    with pytest.raises(ValueError, match="tree_mask must be int32"):
        paged_verify_attention_reference(*ref_args, tree_mask=bits.astype(jnp.float32))


@pytest.mark.parametrize("platform, kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H100 80GB HBM3")])
def test_the_tree_kernel_lowers_for_gpus(platform, kind):
    import jaxlib

    if tuple(int(x) for x in jaxlib.__version__.split(".")[:3]) > (0, 10, 2):
        from jax._src.lib import triton

        if not triton.has_compilation_handler(platform):
            pytest.skip(f"this jaxlib cannot compile Triton for {platform}")
    sds = jax.ShapeDtypeStruct
    b, t, kvh, g, d = 8, 17, 8, 8, 128
    args = (sds((b, t, kvh * g, d), jnp.bfloat16), sds((kvh, 256, 16, d), jnp.bfloat16),
            sds((kvh, 256, 16, d), jnp.bfloat16), sds((b, 64), jnp.int32), sds((b,), jnp.int32),
            sds((b,), jnp.int32), sds((b, t), jnp.int32))
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    fn = lambda q, k, v, bt, kl, ql, tm: paged_verify_attention(q, k, v, bt, kl, ql, tree_mask=tm)  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "triton" in text
