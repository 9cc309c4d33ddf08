"""Tile tables for the Pallas Triton kernels, keyed by (backend, device kind), and the planner
that turns a table entry and a call's static shapes into the tiles of one launch.

One :class:`TileConfig` per GPU family. :func:`plan_tiles` reads it when a kernel's static tile
arguments are left as ``None``; pass the arguments explicitly to override (benchmarks, sweeps).

Units: ``num_warps`` is what Triton calls warps, i.e. groups of ``warp_size`` threads. On CDNA
(gfx90a/gfx942/gfx950) a "warp" is a 64-lane wavefront, so ``num_warps=2`` is 128 lanes there,
as many as ``num_warps=4`` on CUDA; on RDNA (gfx11xx) Triton compiles for wave32. The only
launch knobs Pallas' Triton lowering exposes (on both vendors) are ``num_warps`` and
``num_stages``; ROCm-only Triton options (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``)
cannot be set through Pallas.

The ``cuda-hopper`` entry was swept and checked on an NVIDIA H200 (2026-11-30; BENCHMARKS.md,
docs/gpu-kernel.md); the other entries, the ROCm ones included, are starting points reasoned from
the hardware limits written next to them and have not run on their hardware.
benchmarks/gpu_attention.py sweeps them.

Picking an entry:
    lookup("cuda", "NVIDIA H200")      explicit platform / device kind (tests, offline lowering)
    lookup("rocm", "gfx942")           ROCm kinds may be product names or gfx names
    current()                          the device being compiled for: the abstract device of
                                       the ambient ``jax.sharding.use_abstract_mesh`` if it has
                                       one, else ``jax.devices()[0]``
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

KiB = 1024


@dataclasses.dataclass(frozen=True)
class TileConfig:
    name: str  # table key, for logs, kernel names and tests
    warp_size: int  # threads per warp / wavefront
    num_cores: int  # SMs / CUs
    smem_per_core: int  # shared memory (LDS) of one SM / CU, bytes
    smem_per_program: int  # most one program (CTA / workgroup) may allocate, bytes
    num_stages: int  # Triton software-pipelining depth of the page loop (lowered to fit smem)
    block_k: int  # most keys per page-loop step (power of two >= 16; lowered to fit smem)
    # (most query rows, num_warps): more warps for larger row blocks, so the f32 accumulator
    # [block_q, head_dim] and score tile [block_q, block_k] stay in registers.
    warps: tuple[tuple[int, int], ...]
    max_block_q: int = 256  # T*G rows above this form several q blocks (pages re-read)
    resident_programs: int = 2  # programs per core the smem budget leaves room for
    # Split-k aims for this many programs per core at small batch: one wave of resident
    # programs on CUDA; more on CDNA, whose scheduler refills CUs as short programs finish.
    target_programs_per_core: int = 2
    # Split-k writes f32 partials (o, m, l) per valid row and reads them back to merge. A split
    # gets at least enough keys that this traffic stays below this fraction of its K/V bytes.
    partial_traffic: float = 0.5

    def __post_init__(self):
        for field in ("block_k", "max_block_q"):
            v = getattr(self, field)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{field} must be a power of two >= 16, got {v}")
        if self.warp_size not in (32, 64):
            raise ValueError(f"warp_size must be 32 or 64, got {self.warp_size}")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if not self.warps or self.warps[-1][0] < self.max_block_q:
            raise ValueError(f"warps must cover block_q up to max_block_q={self.max_block_q}")
        if self.resident_programs < 1 or self.target_programs_per_core < 1:
            raise ValueError("resident_programs and target_programs_per_core must be >= 1")

    @property
    def smem_budget(self) -> int:
        """Shared memory / LDS one program may plan for while ``resident_programs`` share a core."""
        return min(self.smem_per_core // self.resident_programs, self.smem_per_program)

    def warps_for(self, block_q: int) -> int:
        for rows, num_warps in self.warps:
            if block_q <= rows:
                return num_warps
        return self.warps[-1][1]


# ---------------------------------------------------------------------------------------------
# CUDA: 32-wide warps. Verification attention is bound by HBM reads of the K/V pages; the dots
# are small ([T*G, D] x [D, block_k]). Warps: <= 64 rows -> 4 warps (128 threads hold a [64, 128]
# f32 accumulator in 64 registers each); 128 rows -> 8; 256 rows (T*G = 17 x 8 = 136 padded)
# -> 16 warps, so the accumulator is 64 registers a thread and 512 threads x <= 128 registers
# still fit the 64K-register file.
# ---------------------------------------------------------------------------------------------
CUDA_WARPS = ((64, 4), (128, 8), (256, 16))
HOPPER = TileConfig(
    name="cuda-hopper",  # H100 / H200 (sm_90)
    warp_size=32,
    num_cores=132,  # H100 SXM / H200 SXM
    smem_per_core=228 * KiB,  # 228 KiB per SM ...
    smem_per_program=227 * KiB,  # ... 227 KiB usable by one CTA
    num_stages=3,  # cp.async ring over the page loop: 3 K/V tiles in flight per program
    block_k=64,  # 64 keys x 128 dims x 2 B = 16 KiB per K (and V) tile: fat, coalesced reads
    warps=CUDA_WARPS,
)
AMPERE = TileConfig(
    name="cuda-ampere",  # A100 (sm_80)
    warp_size=32,
    num_cores=108,
    smem_per_core=164 * KiB,
    smem_per_program=163 * KiB,
    num_stages=2,  # cp.async double buffering
    block_k=64,
    warps=CUDA_WARPS,
)
CUDA_DEFAULT = dataclasses.replace(
    AMPERE,
    name="cuda-default",  # consumer / other NVIDIA parts (sm_86/89: 100 KiB per SM)
    num_cores=64,
    smem_per_core=100 * KiB,
    smem_per_program=99 * KiB,
)

# ---------------------------------------------------------------------------------------------
# ROCm CDNA: 64-wide wavefronts, 4 SIMDs per CU, 512 VGPRs per lane. Warps: <= 32 rows -> 2
# wavefronts (128 lanes, what AMD's own decode-attention configs use), 64 and 128 rows -> 4
# (256 lanes: a [128, 128] f32 accumulator is 64 VGPRs a lane), 256 rows -> 8. The grid aims for
# 4 programs per CU (AMD's guidance for MI300X is >= 1024 workgroups), and to get there a split
# may cost partial traffic up to its K/V bytes (partial_traffic 1.0). num_stages per generation:
#   gfx90a  1  64 KiB LDS and no stream pipeliner worth the LDS: latency hidden by occupancy
#   gfx942  2  the stream pipeliner double-buffers K/V through LDS; within 32 KiB per program
#              that means block_k 16 at D = 128 (32 at D = 64): 2 x 16 keys in flight, as many
#              as one 32-key stage, but overlapped with the dots
#   gfx950  2  160 KiB LDS: double-buffered 64-key tiles for verification rows of D = 128
# ---------------------------------------------------------------------------------------------
CDNA_WARPS = ((32, 2), (128, 4), (256, 8))
CDNA3 = TileConfig(
    name="rocm-gfx942",  # MI300X / MI325X (304 CUs)
    warp_size=64,
    num_cores=304,
    smem_per_core=64 * KiB,  # 64 KiB LDS per CU, all of it addressable by one workgroup
    smem_per_program=64 * KiB,
    num_stages=2,
    block_k=64,
    warps=CDNA_WARPS,
    target_programs_per_core=4,
    partial_traffic=1.0,
)
CDNA2 = dataclasses.replace(
    CDNA3,
    name="rocm-gfx90a",  # MI210 (104 CUs) / one MI250X GCD (110 CUs)
    num_cores=104,
    num_stages=1,
)
CDNA4 = dataclasses.replace(
    CDNA3,
    name="rocm-gfx950",  # MI350X / MI355X (256 CUs)
    num_cores=256,
    smem_per_core=160 * KiB,  # gfx950 raised LDS to 160 KiB per CU
    smem_per_program=160 * KiB,
    num_stages=2,
)

# ---------------------------------------------------------------------------------------------
# ROCm RDNA (gfx11xx, Radeon RX 7000 / W7000): Triton compiles wave32 there; 64 KiB of LDS per
# workgroup; WMMA dots need 16x16 tiles (every dot side here is >= 16). Warps as on CUDA.
# ---------------------------------------------------------------------------------------------
RDNA3 = TileConfig(
    name="rocm-gfx11",
    warp_size=32,
    num_cores=96,  # RX 7900 XTX
    smem_per_core=64 * KiB,
    smem_per_program=64 * KiB,
    num_stages=1,
    block_k=32,  # smaller register file per SIMD than CDNA: keep the score tile small
    warps=CUDA_WARPS,
)
ROCM_DEFAULT = dataclasses.replace(CDNA2, name="rocm-default")

# Unknown devices and the CPU (interpret mode): conservative tiles that fit everywhere.
DEFAULT = TileConfig(
    name="default",
    warp_size=32,
    num_cores=8,
    smem_per_core=64 * KiB,
    smem_per_program=64 * KiB,
    num_stages=1,
    block_k=32,
    warps=CUDA_WARPS,
)

# (backend, device-kind substring) -> entry; the first match wins, so specific before generic.
# Device kinds are lower-cased before matching. ROCm reports either a product name ("AMD
# Instinct MI300X") or a gfx target ("gfx942:sramecc+:xnack-"), so both are listed.
TABLE: tuple[tuple[str, str, TileConfig], ...] = (
    ("cuda", "h100", HOPPER),
    ("cuda", "h200", HOPPER),
    ("cuda", "h800", HOPPER),
    ("cuda", "gh200", HOPPER),
    ("cuda", "a100", AMPERE),
    ("cuda", "a800", AMPERE),
    ("cuda", "", CUDA_DEFAULT),
    ("rocm", "gfx942", CDNA3),
    ("rocm", "mi300", CDNA3),
    ("rocm", "mi325", CDNA3),
    ("rocm", "gfx950", CDNA4),
    ("rocm", "mi350", CDNA4),
    ("rocm", "mi355", CDNA4),
    ("rocm", "gfx90a", CDNA2),
    ("rocm", "mi210", CDNA2),
    ("rocm", "mi250", CDNA2),
    ("rocm", "gfx11", RDNA3),
    ("rocm", "radeon", RDNA3),
    ("rocm", "", ROCM_DEFAULT),
)


def lookup(platform: str, device_kind: str = "") -> TileConfig:
    """The entry for ``platform`` ("cuda", "rocm", "gpu", "cpu", ...) and ``device_kind``."""
    platform = platform.lower()
    kind = device_kind.lower()
    if platform == "gpu":  # jax's generic alias: tell the vendors apart by the kind string
        platform = "rocm" if any(s in kind for s in ("gfx", "amd", "instinct", "radeon")) else "cuda"
    for backend, needle, entry in TABLE:
        if backend == platform and needle in kind:
            return entry
    return DEFAULT


def _ambient_abstract_device():
    """The abstract device of the ambient ``use_abstract_mesh`` context, if any."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # older/newer jax without it: fall back to the real device
        return None
    return getattr(mesh, "abstract_device", None)


def current(device: Optional[jax.Device] = None) -> TileConfig:
    """The entry for ``device``, else the ambient abstract device, else ``jax.devices()[0]``."""
    if device is None:
        abstract = _ambient_abstract_device()
        if abstract is not None:
            return lookup(abstract.platform, abstract.device_kind)
        device = jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    # jax reports GPUs of both vendors as platform "gpu"; on ROCm compute_capability is the
    # gfx target ("gfx942"), which lookup() recognises.
    if device.platform in ("gpu", "rocm"):
        kind = f"{kind} {getattr(device, 'compute_capability', '')}"
    return lookup(device.platform, kind)


# ------------------------------------------------------------------------------ planning


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def loop_smem(block_q: int, block_k: int, head_dim_padded: int, itemsize: int,
              num_stages: int) -> int:
    """Bytes of shared memory / LDS live inside the page loop: one K and one V tile per
    pipeline stage, and the probability tile P converted for the second dot."""
    return itemsize * (num_stages * 2 * block_k * head_dim_padded + block_q * block_k)


def smem_estimate(block_q: int, block_k: int, head_dim_padded: int, itemsize: int,
                  num_stages: int) -> int:
    """Peak shared memory / LDS of one program. The q tile passes through shared memory once,
    before the loop (Triton converts it to the dot-operand layout and keeps it in registers),
    so it counts only when it alone is larger than the loop's tiles."""
    return max(itemsize * block_q * head_dim_padded,
               loop_smem(block_q, block_k, head_dim_padded, itemsize, num_stages))


def fit_tiles(entry: TileConfig, block_q: int, head_dim_padded: int, itemsize: int,
              block_k: Optional[int] = None, num_stages: Optional[int] = None) -> tuple[int, int]:
    """(block_k, num_stages) whose page-loop tiles fit ``entry.smem_budget``: block_k a power of
    two in [16, entry.block_k], num_stages in [1, entry.num_stages], the pair with the most keys
    in flight (block_k x num_stages), ties to the deeper pipeline. Explicit values are kept.
    (A q tile larger than the budget -- 256 rows of D = 128 on 64 KiB of LDS -- leaves one
    program per core whatever the loop tiles; registers limit such row blocks anyway.)"""
    bks = [block_k] if block_k is not None else [
        entry.block_k >> i for i in range(entry.block_k.bit_length()) if entry.block_k >> i >= 16]
    stages = [num_stages] if num_stages is not None else list(range(entry.num_stages, 0, -1))
    fits = [(bk * ns, ns, bk) for bk in bks for ns in stages
            if loop_smem(block_q, bk, head_dim_padded, itemsize, ns) <= entry.smem_budget]
    if not fits:  # nothing fits: the smallest tiles (explicit ones are kept)
        return bks[-1], stages[-1]
    _, ns, bk = max(fits)
    return bk, ns


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The static tiles of one launch (see :func:`plan_tiles`)."""

    entry: str  # tuning entry name
    block_q: int  # query rows per program (T*G rows, padded to a power of two >= 16)
    num_q_blocks: int  # 1 unless T*G > max_block_q (then each q block re-reads the pages)
    block_k: int  # keys per page-loop step
    head_dim_padded: int
    num_splits: int  # programs per (sequence, KV head, q block); 1: no partials, no merge
    min_keys_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int
    smem_bytes: int  # smem_estimate of this plan
    grid: tuple[int, int, int, int]  # (B, KVH, q blocks, splits)

    @property
    def programs(self) -> int:
        b, h, q, s = self.grid
        return b * h * q * s

    def live_programs(self, kv_lens, q_lens) -> int:
        """Programs that have keys to read for these lengths (the rest return at once)."""
        b, h, q, s = self.grid
        if s == 1:
            return self.programs
        live = jnp.where(jnp.asarray(q_lens) > 0, jnp.asarray(kv_lens), 0).astype(jnp.int32)
        per = keys_per_split(live, s, self.block_k, self.min_keys_per_split)
        return int(jnp.sum(lax.div(live + per - 1, per))) * h * q


def keys_per_split(live_keys, num_splits: int, block_k: int, min_keys: int):
    """Keys each split of a sequence reads, from its live key count (int32, traced or not).

    The live keys are shared out over ``num_splits`` splits in whole ``block_k`` steps, but no
    split gets fewer than ``min_keys``: a short sequence uses fewer splits, and splits past
    ``cdiv(live_keys, keys_per_split)`` have nothing to do. The kernel, its merge and
    :meth:`TilePlan.live_programs` all use this one function.
    """
    per = lax.div(live_keys + (num_splits - 1), jnp.int32(num_splits))
    per = lax.div(per + (block_k - 1), jnp.int32(block_k)) * block_k
    return jnp.maximum(per, jnp.int32(min_keys))


def plan_tiles(
    *,
    batch: int,
    kv_heads: int,
    rows: int,
    head_dim: int,
    capacity: int,
    itemsize: int,
    entry: TileConfig,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    num_splits: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> TilePlan:
    """Static tiles for one call; explicit arguments win, the rest come from ``entry``.

    rows = T * G query rows per (sequence, KV head); capacity = max_pages_per_seq * page_size
    (the most keys any sequence can have: splits beyond what it needs are never planned).

    Split-k: when B * KVH programs (one per sequence and KV head) cannot keep
    ``resident_programs`` programs on every core, each sequence's keys are shared by
    ``num_splits`` programs so the grid holds about ``target_programs_per_core`` per core. The
    split *sizes* are decided in the kernel from each sequence's live length
    (:func:`keys_per_split`), so a block table wider than the context costs nothing.
    """
    if block_q is None:
        block_q = min(max(16, next_pow2(rows)), entry.max_block_q)
    if block_q < 16 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two >= 16, got {block_q}")
    if block_k is not None and (block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_warps is not None and (num_warps < 1 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    dp = max(16, next_pow2(head_dim))
    block_k, num_stages = fit_tiles(entry, block_q, dp, itemsize, block_k, num_stages)
    num_q_blocks = -(-rows // block_q)

    # Fewest keys per split: partial traffic (8 bytes per valid row and dim: f32 written, then
    # read) within `partial_traffic` of the split's K/V bytes (2 * keys * dim * itemsize).
    min_keys = 4 * rows / (entry.partial_traffic * itemsize)
    min_keys = max(block_k, -(-int(min_keys) // block_k) * block_k)
    if num_splits is not None:
        min_keys = block_k  # an explicit split count is taken as asked (sweeps, tests)
    else:
        base = batch * kv_heads * num_q_blocks
        if base >= entry.num_cores * entry.resident_programs:
            num_splits = 1
        else:
            num_splits = -(-entry.num_cores * entry.target_programs_per_core // base)
    num_splits = max(1, min(num_splits, -(-max(capacity, 1) // min_keys)))
    return TilePlan(
        entry=entry.name, block_q=block_q, num_q_blocks=num_q_blocks, block_k=block_k,
        head_dim_padded=dp, num_splits=num_splits, min_keys_per_split=min_keys,
        num_warps=entry.warps_for(block_q) if num_warps is None else num_warps,
        num_stages=num_stages, smem_bytes=smem_estimate(block_q, block_k, dp, itemsize, num_stages),
        grid=(batch, kv_heads, num_q_blocks, num_splits))
