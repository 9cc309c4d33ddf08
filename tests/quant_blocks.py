"""GGUF Q4_1 / Q8_0 blocks for the small-row kernel's tests (test_quantized_rows.py,
test_int8_dot.py): random blocks with every scale magnitude a real file has, packed for the kernel
beside the float32 rows the ``gguf`` package dequantizes them to."""

import gguf
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.small_rows import GGUF_BLOCK_BYTES, pack_quantized

GGUF_TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF blocks [n, k / 32 * block bytes] of random q, with float16 scales of both signs and
    every magnitude a real file has (subnormal ones included) and, for Q4_1, negative mins."""
    rng = np.random.default_rng(seed)
    nb, size = k // 32, GGUF_BLOCK_BYTES[qtype]
    b = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 3e-2, size=(n, nb)) * rng.choice([-1.0, 1.0], size=(n, nb))
    d.flat[::7] = 3e-6  # subnormal in float16
    b[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if qtype == "q4_1":
        b[..., 2:4] = rng.uniform(-0.2, 0.05, size=(n, nb)).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return b.reshape(n, nb * size)


def weights(qtype: str, n: int, k: int, seed: int = 0):
    """(the quantized-layout weight, the same weight as float32 rows [n, k] as gguf dequantizes it)."""
    raw = random_blocks(qtype, n, k, seed)
    rows = gguf.quants.dequantize(raw, GGUF_TYPES[qtype]).reshape(n, k)
    return jnp.asarray(pack_quantized(raw, qtype)), jnp.asarray(rows)


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def fused_operands(n: int, k: int, m: int, norm: bool, add: bool, seed: int = 4):
    """x [m, k] and fused_small_rows' keywords: an RMSNorm gain [k] (if ``norm``), eps, a residual
    [m, n] (if ``add``)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    kw = dict(scale=jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.float32) if norm else None, eps=1e-5,
              residual=jnp.asarray(rng.standard_normal((m, n)), jnp.float32) if add else None)
    return x, kw


def verify_step_operands(hidden: int = 576):
    """A decoder layer's operands besides its weights for a verification of 5 rows over a ragged
    pair of sequences (SmolLM2's attention: 9 query heads, 3 KV heads of 64): x [10, hidden],
    in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, gain."""
    from attention_cases import Case, make_inputs

    case = Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(300, 40), q_lens=(5, 3), kv_heads=3)
    _, k, v, tables, kv_lens, _ = make_inputs(case, seed=5)[0]
    q_lens = jnp.asarray(case.q_lens, jnp.int32)
    start = kv_lens - q_lens
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((10, hidden)), jnp.float32)
    in_gain, gain = (jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.float32) for _ in range(2))
    angles = (np.asarray(start)[:, None] + np.arange(5)[None, :]).reshape(-1, 1) * 0.1 ** np.arange(32)
    cos, sin = (jnp.asarray(np.concatenate([fn(angles)] * 2, -1), jnp.float32) for fn in (np.cos, np.sin))
    return x, in_gain, cos, sin, k, v, tables, start, q_lens, gain
