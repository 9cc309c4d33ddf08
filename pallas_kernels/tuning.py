"""Tile tables for the Pallas Triton kernels, keyed by (backend, device kind).

One :class:`TileConfig` per GPU family. The kernels read it when their static tile arguments
are left as ``None``; pass the arguments explicitly to override (benchmarks, autotuning).

Units: ``num_warps`` is what Triton calls warps, i.e. groups of ``warp_size`` threads. On
CDNA (gfx90a/gfx942/gfx950) a "warp" is a 64-lane wavefront, so ``num_warps=4`` is 256
threads there and 128 on CUDA; on RDNA (gfx11xx) Triton compiles for wave32.

Nothing in this table was measured on hardware yet: the numbers are starting points reasoned
from the hardware limits written next to them (see benchmarks/attention_kernel_notes.md).

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


@dataclasses.dataclass(frozen=True)
class TileConfig:
    name: str  # table key, for logs and tests
    warp_size: int  # threads per warp / wavefront
    num_warps: int  # warps (wavefronts on CDNA) per program
    num_stages: int  # Triton software-pipelining depth of the inner page loop
    block_k: int  # keys per inner-loop step (power of two >= 16: a dot tile dimension)
    max_block_q: int  # most query rows (T * G, padded) one program holds in registers
    smem_bytes: int  # shared memory (LDS) one program may use; tiles are shrunk to fit
    num_cores: int  # SMs / CUs: the split-k heuristic aims for a few programs per core
    programs_per_core: int = 2  # >= 2 resident programs per core hide load latency
    min_keys_per_split: int = 256  # below this a split's merge costs more than it saves

    def __post_init__(self):
        for field in ("block_k", "max_block_q"):
            v = getattr(self, field)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{field} must be a power of two >= 16, got {v}")
        if self.warp_size not in (32, 64):
            raise ValueError(f"warp_size must be 32 or 64, got {self.warp_size}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("num_warps and num_stages must be >= 1")


# ---------------------------------------------------------------------------------------------
# CUDA: 32-wide warps. Decode / verification attention is bound by HBM reads of the K/V pages,
# so the tiles only need to be large enough to keep enough bytes in flight per SM; the dots are
# tiny ([T*G, D] x [D, block_k]).
# ---------------------------------------------------------------------------------------------
HOPPER = TileConfig(
    name="cuda-hopper",  # H100 / H200 (sm_90)
    warp_size=32,
    num_warps=4,  # 128 threads cover a [<=128, 64] score tile with <= 64 f32 regs/thread
    num_stages=3,  # 3-deep cp.async ring over the page loop keeps ~3 K/V tiles in flight
    block_k=64,  # 64 keys x 128 dims x 2 B = 16 KiB per K (and V) tile: fat, coalesced reads
    max_block_q=128,  # T*G <= 128 covers k+1 <= 16 drafts at GQA 8 in one program
    smem_bytes=227 * 1024,  # 228 KiB per SM, 227 KiB usable by one block on sm_90
    num_cores=132,  # H100 SXM / H200 SXM have 132 SMs
)
AMPERE = TileConfig(
    name="cuda-ampere",  # A100 (sm_80); also the fallback for other sm_8x parts
    warp_size=32,
    num_warps=4,
    num_stages=2,  # 2 stages: cp.async double buffering, leaves registers for the score tile
    block_k=64,
    max_block_q=128,
    smem_bytes=163 * 1024,  # 164 KiB per SM on A100, 163 KiB usable by one block
    num_cores=108,  # A100 has 108 SMs
)
CUDA_DEFAULT = dataclasses.replace(
    AMPERE,
    name="cuda-default",  # consumer / older NVIDIA parts: stay within 99 KiB (sm_86/89)
    smem_bytes=99 * 1024,
    num_cores=64,
)

# ---------------------------------------------------------------------------------------------
# ROCm CDNA: 64-wide wavefronts, so num_warps counts wavefronts (4 -> 256 threads, the
# largest workgroup that still lets 2 workgroups share a CU's 4 SIMDs well). num_stages=1:
# the AMD Triton backend's stream pipeliner stages through LDS, and at 64 KiB of LDS there is
# no room for a second K/V buffer at our tile sizes; latency is hidden by occupancy instead
# (many programs per CU).
# ---------------------------------------------------------------------------------------------
CDNA3 = TileConfig(
    name="rocm-gfx942",  # MI300X / MI300A / MI325X
    warp_size=64,
    num_warps=4,
    num_stages=1,
    block_k=64,  # q[64x128] + K,V[64x128] + P[64x64], bf16 = 56 KiB <= 64 KiB; larger
    # T*G shrinks block_k (see fit_block_k)
    max_block_q=128,
    smem_bytes=64 * 1024,  # 64 KiB LDS per CU on gfx942
    num_cores=304,  # MI300X has 304 CUs (MI325X too); many programs needed to fill it
)
CDNA2 = dataclasses.replace(
    CDNA3,
    name="rocm-gfx90a",  # MI210 / MI250(X) (per GCD)
    num_cores=104,  # MI210: 104 CUs; an MI250X GCD has 110
)
CDNA4 = dataclasses.replace(
    CDNA3,
    name="rocm-gfx950",  # MI350X / MI355X
    smem_bytes=160 * 1024,  # gfx950 raised LDS to 160 KiB per CU
    num_cores=256,  # MI355X has 256 CUs
)

# ---------------------------------------------------------------------------------------------
# ROCm RDNA (gfx11xx, Radeon RX 7000 / W7000): Triton compiles wave32 there, 64 KiB LDS per
# workgroup, WMMA dots need 16x16 tiles (our dot tiles are >= 16 on every side).
# ---------------------------------------------------------------------------------------------
RDNA3 = TileConfig(
    name="rocm-gfx11",
    warp_size=32,
    num_warps=4,
    num_stages=1,
    block_k=32,  # smaller register file per SIMD than CDNA: keep the score tile small
    max_block_q=64,
    smem_bytes=64 * 1024,
    num_cores=96,  # RX 7900 XTX: 96 CUs
)
ROCM_DEFAULT = dataclasses.replace(CDNA3, name="rocm-default", num_cores=104)

# Unknown devices and the CPU (interpret mode): conservative tiles that fit everywhere.
DEFAULT = TileConfig(
    name="default",
    warp_size=32,
    num_warps=4,
    num_stages=1,
    block_k=32,
    max_block_q=128,
    smem_bytes=64 * 1024,
    num_cores=8,
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


def fit_block_k(entry: TileConfig, block_q: int, head_dim: int, itemsize: int,
                block_k: Optional[int] = None) -> int:
    """Largest power-of-two ``block_k`` (<= the entry's, >= 16) whose tiles fit shared memory.

    Estimate of what one program stages through shared memory / LDS: the q tile, one K and
    one V tile per pipeline stage, and the probability tile P fed to the second dot.
    """
    bk = entry.block_k if block_k is None else block_k
    stages = max(1, entry.num_stages)

    def smem(bk):
        return itemsize * (block_q * head_dim + stages * 2 * bk * head_dim + block_q * bk)

    while bk > 16 and smem(bk) > entry.smem_bytes:
        bk //= 2
    return bk
