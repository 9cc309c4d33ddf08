"""GGUF files (llama.cpp): metadata -> :class:`ModelConfig`, tensors -> dequantized float32.

Dequantization of Q8_0, Q4_0 and Q4_1 (the types llama.cpp's converter writes for small
models) runs here over whole row chunks, the same float32 arithmetic as the ``gguf`` package,
which works 16 rows at a time (SmolLM2-135M's Q4_1 file: 1.4 s there, a warm start's largest
share after tracing); every other type (F32, F16, BF16, Q5_0, Q5_1, Q2_K..Q6_K and more) goes to
the ``gguf`` package. llama.cpp's converter permutes the rows of the Q and K projections of ``llama``
models so that RoPE rotates interleaved pairs; jspec (like Hugging Face) rotates halves, so the
permutation is undone here.

Gemma 2 and Gemma 3 files (``gemma2``, ``gemma3``) follow llama.cpp's converter
(``convert_hf_to_gguf.py``) and its loader: the converter stores every RMSNorm weight plus one (llama.cpp
multiplies by the weight, Gemma by 1 + weight), so one is taken off here; ``ffn_norm`` is the norm
before the MLP and ``post_attention_norm`` / ``post_ffw_norm`` the ones after; the layer pattern
(Gemma 2 every other layer local, layer 0 first; Gemma 3 five local then one global), the local
layers' RoPE base (Gemma 3: 10,000) and the score scale (query_pre_attn_scalar: hidden / heads for
the 27B models, 46 and 62 layers, else head_dim) are not in the file: llama.cpp fixes them per
architecture and size, and so does jspec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jspec.config import ModelConfig
from jspec.errors import CheckpointError, ConfigError, UnsupportedModelError
from jspec.loading import schema
from jspec.loading.gguf_header import check_gguf_header
from pallas_kernels.cpu import small_rows

# llama.cpp name -> Hugging Face name ("{n}" is the layer index)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms per layer
_GEMMA_LAYER_NAMES = dict(_LAYER_NAMES, **{"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                                            "post_attention_norm.weight": "post_attention_layernorm.weight",
                                            "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
GEMMA_ARCHS = {"gemma2": "gemma2", "gemma3": "gemma3_text"}  # GGUF architecture -> jspec's
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B for each


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch in GEMMA_ARCHS else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{int(parts[1])}.{names[parts[2]]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`` of Q/K rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, innermost first (GGUF's order)
    n_elements: int
    data: np.ndarray


# GGML types stored as plain numpy items (the rest are blocks, read as bytes)
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


# ggml's block layouts of 32 weights: an f16 scale d, for Q4_1 an f16 minimum m, then the quants
# (Q8_0: 32 int8, x = d * q; Q4_0 / Q4_1: 16 bytes, weight j < 16 the low nibble of byte j and
# weight j + 16 its high nibble, x = d * (q - 8) / x = d * q + m)
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_CHUNK_BLOCKS = 1 << 16  # blocks per pass: bounds the temporaries at ~8 MiB of float32


def dequantize_blocks(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """float32 weights [n_blocks * 32] of ``blocks`` (uint8 [n_blocks, bytes of a block]) of the
    ggml type ``qtype`` (a key of ``_BLOCK_BYTES``), as ``gguf.quants.dequantize`` computes them."""
    n = blocks.shape[0]
    out = np.empty((n, 32), np.float32)
    for a in range(0, n, _CHUNK_BLOCKS):
        b = np.ascontiguousarray(blocks[a:a + _CHUNK_BLOCKS])
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        if qtype == "Q8_0":
            out[a:a + len(b)] = b[:, 2:].view(np.int8).astype(np.float32) * d
            continue
        qs = b[:, 4:] if qtype == "Q4_1" else b[:, 2:]
        q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)
        if qtype == "Q4_1":
            m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
            out[a:a + len(b)] = d * q.astype(np.float32) + m
        else:
            out[a:a + len(b)] = d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)
    return out.reshape(-1)


class GGUFFile:
    """A parsed GGUF file: schema-checked metadata and lazily dequantized tensors.

    The header is read with its counts and ranges checked against the file (:mod:`.gguf_header`),
    the tensors are views of the mapped file, and the metadata jspec reads goes through
    :func:`jspec.loading.schema.gguf_fields`.
    """

    def __init__(self, path: Path):
        self.path = path
        self.header = check_gguf_header(path)
        try:
            self._buf = np.memmap(path, np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
        arch = schema.check({"general.architecture": self.field("general.architecture")},
                            (schema.Field("general.architecture", "str", required=True),), str(path))
        self.arch = arch["general.architecture"]
        if self.arch not in schema.GGUF_ARCHITECTURES:
            raise UnsupportedModelError(f"{path}: unsupported GGUF architecture {self.arch!r} "
                                        f"(jspec reads {', '.join(schema.GGUF_ARCHITECTURES)} GGUF files)")
        self.tensors = {}  # GGUF name -> _Tensor
        self._by_hf: dict[str, str] = {}  # Hugging Face name -> GGUF name
        for t in map(self._tensor, self.header.tensors):
            hf = hf_name(t.name, self.arch)
            if hf is not None and hf in self._by_hf:
                raise CheckpointError(f"{path}: tensors {self._by_hf[hf]} and {t.name} are the same tensor")
            self.tensors[t.name] = t
            if hf is not None:
                self._by_hf[hf] = t.name

    def _tensor(self, info) -> "_Tensor":
        """A tensor entry with its data as ``gguf.GGUFReader`` shapes it (a view of the mapped
        file): outermost dimension first; a quantized type as uint8 [..., bytes of a row]."""
        import gguf

        ttype = gguf.GGMLQuantizationType(info.ggml_type)
        n = int(np.prod(info.dims))
        block, type_size = gguf.GGML_QUANT_SIZES[ttype]
        nbytes = n * type_size // block
        shape = tuple(reversed(info.dims))
        item = _PLAIN_TYPES.get(ttype.name)
        raw = self._buf[info.offset:info.offset + nbytes]
        if item is None:
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        else:
            data = raw.view(np.dtype(item).newbyteorder(self.header.order)).reshape(shape)
        return _Tensor(info.name, ttype, np.asarray(info.dims, np.uint64), n, data)

    def field(self, key: str, default=None):
        try:
            return self.header.field(key, self._buf, default)
        except Exception as e:
            raise CheckpointError(f"{self.path}: corrupt metadata field {key} ({str(e)[:200]})") from None

    def metadata(self) -> dict:
        """The metadata fields jspec reads, checked against their schema."""
        fields = schema.gguf_fields(self.arch)
        return schema.check({f.key: self.field(f.key) for f in fields}, fields, str(self.path))

    def config(self, dtype: str = "float32") -> ModelConfig:
        m, a = self.metadata(), f"{self.arch}."
        sizes = schema.gguf_consistency(m, self.arch, str(self.path))
        factors = None
        if "rope_freqs.weight" in self.tensors:
            t = self.tensors["rope_freqs.weight"]
            if int(t.n_elements) != sizes["head_dim"] // 2:
                raise CheckpointError(f"{self.path}: tensor rope_freqs.weight has {int(t.n_elements)} values, "
                                      f"expected head_dim/2 = {sizes['head_dim'] // 2}")
            factors = tuple(float(x) for x in self._dequantize("rope_freqs.weight").reshape(-1))
        eos = m["tokenizer.ggml.eos_token_id"]
        try:
            return ModelConfig(
                vocab_size=sizes["vocab_size"],
                hidden_size=m[a + "embedding_length"],
                intermediate_size=m[a + "feed_forward_length"],
                num_layers=m[a + "block_count"],
                num_heads=sizes["num_heads"],
                num_kv_heads=sizes["num_kv_heads"],
                head_dim=sizes["head_dim"],
                rms_norm_eps=m[a + "attention.layer_norm_rms_epsilon"],
                rope_theta=m[a + "rope.freq_base"],
                rope_freq_factors=factors,
                max_position_embeddings=m[a + "context_length"],
                tie_word_embeddings="output.weight" not in self.tensors,
                qkv_bias="blk.0.attn_q.bias" in self.tensors,
                qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
                architecture="llama" if self.arch == "mistral" else GEMMA_ARCHS.get(self.arch, self.arch),
                bos_token_id=m["tokenizer.ggml.bos_token_id"],
                eos_token_ids=() if eos is None else (eos,),
                dtype=dtype,
                **(self._gemma_fields(m, sizes) if self.arch in GEMMA_ARCHS else {}),
            )
        except ConfigError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def _gemma_fields(self, m: dict, sizes: dict) -> dict:
        """ModelConfig's Gemma fields from the file, and what llama.cpp fixes (module docstring)."""
        a, n = f"{self.arch}.", m[f"{self.arch}.block_count"]
        window = m[a + "attention.sliding_window"]
        if window is None:
            raise CheckpointError(f"{self.path}: missing field {a}attention.sliding_window")
        if self.arch == "gemma2":
            types = tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
        else:
            types = tuple("full" if i % 6 == 5 else "sliding" for i in range(n))
        big = n == _GEMMA_27B_LAYERS[self.arch]
        linear = m[a + "rope.scaling.type"] == "linear"
        if linear and m[a + "rope.scaling.factor"] is None:
            raise CheckpointError(f"{self.path}: missing field {a}rope.scaling.factor (linear RoPE scaling)")
        return dict(hidden_act="gelu_tanh", layer_types=types, sliding_window=window,
                    local_rope_theta=10000.0 if self.arch == "gemma3" else None,
                    rope_linear_factor=m[a + "rope.scaling.factor"] if linear else None,
                    query_pre_attn_scalar=float(m[a + "embedding_length"] // sizes["num_heads"] if big
                                                else sizes["head_dim"]),
                    attn_logit_softcap=m[a + "attn_logit_softcapping"],
                    final_logit_softcap=m[a + "final_logit_softcapping"])

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the model tensors under Hugging Face names, from the header (no data read)."""
        return {hf: tuple(int(x) for x in reversed(self.tensors[g].shape.tolist())) for hf, g in self._by_hf.items()}

    def _dequantize(self, name: str) -> np.ndarray:
        import gguf

        t = self.tensors[name]
        try:
            with np.errstate(all="ignore"):  # NaN/Inf are reported by the caller, naming the tensor
                qtype = t.tensor_type.name
                if qtype in _BLOCK_BYTES and t.data.dtype == np.uint8 and t.data.shape[-1] % _BLOCK_BYTES[qtype] == 0:
                    data = dequantize_blocks(t.data.reshape(-1, _BLOCK_BYTES[qtype]), qtype)
                else:
                    data = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name} uses unsupported type {t.tensor_type.name}") from None
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot dequantize {name} ({str(e)[:200]})") from None
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if data.size != int(np.prod(shape)):
            raise CheckpointError(f"{self.path}: tensor {name} holds {data.size} values, expected {shape}")
        return data.reshape(shape)

    def getter(self, config: ModelConfig):
        """``get(hf_name) -> array | None``: one tensor dequantized on demand, Q/K permutation undone."""
        def get(hf: str):
            name = self._by_hf.get(hf)
            if name is None:
                return None
            w = self._dequantize(name)
            if self.arch in GEMMA_ARCHS and hf.endswith("norm.weight"):
                return w - np.float32(1)  # the converter's weight + 1, back to Gemma's offset
            if self.arch in ("llama", "mistral"):
                if hf.endswith("q_proj.weight"):
                    w = unpermute_qk(w, config.num_heads)
                elif hf.endswith("k_proj.weight"):
                    w = unpermute_qk(w, config.num_kv_heads)
            return w

        return get

    def blocks_getter(self, config: ModelConfig):
        """``get(hf_name) -> (qtype, blocks) | None``: a tensor's own quantized blocks, uint8
        [rows, bytes of a row], for the types the CPU small-row kernel reads as they are ("q4_1",
        "q8_0": :mod:`pallas_kernels.cpu.small_rows`), Q/K row permutation undone; None for a tensor
        stored any other way (or absent). No copy: a view of the mapped file."""
        import gguf

        types = {gguf.GGMLQuantizationType.Q4_1: "q4_1", gguf.GGMLQuantizationType.Q8_0: "q8_0"}

        def get(hf: str):
            name = self._by_hf.get(hf)
            t = None if name is None else self.tensors[name]
            if t is None or t.tensor_type not in types or t.data.ndim != 2:
                return None
            blocks = t.data
            if self.arch in ("llama", "mistral"):
                if hf.endswith("q_proj.weight"):
                    blocks = unpermute_qk(blocks, config.num_heads)
                elif hf.endswith("k_proj.weight"):
                    blocks = unpermute_qk(blocks, config.num_kv_heads)
            return types[t.tensor_type], blocks

        return get

    def quantized_bytes(self, config: ModelConfig) -> int:
        """About what :meth:`blocks_getter`'s blocks take in the kernel's layout (records of 24
        bytes per 32 Q4_1 weights, 36 per 32 Q8_0; every such tensor counted, rows padded to 4 not),
        for a float32 load (none for another dtype): the memory check counts it."""
        import gguf

        if config.dtype != "float32":
            return 0
        per_block = {gguf.GGMLQuantizationType.Q4_1: small_rows.RECORD_BYTES["q4_1"],
                     gguf.GGMLQuantizationType.Q8_0: small_rows.RECORD_BYTES["q8_0"]}
        return sum(int(np.prod(t.shape)) // 32 * per_block[t.tensor_type] for t in self.tensors.values()
                   if t.tensor_type in per_block)

    def hf_tensors(self, config: ModelConfig) -> dict[str, np.ndarray]:
        """All model tensors under Hugging Face names, Q/K permutation undone."""
        get = self.getter(config)
        return {hf: get(hf) for hf in self._by_hf}

    def open(self, dtype: str = "float32") -> ModelConfig:
        """The config, checked against the tensors' shapes before any tensor is dequantized."""
        from jspec.loading.convert import check_checkpoint

        config = self.config(dtype)
        check_checkpoint(config, self.hf_shapes(), str(self.path), layers_field=f"{self.arch}.block_count")
        return config


def load_gguf(path: Path, dtype: str = "float32"):
    """(config, params) from a GGUF file."""
    from jspec.loading.convert import check_load_fits, params_from_hf

    f = GGUFFile(path)
    config = f.open(dtype)
    check_load_fits(config, str(path))
    return config, params_from_hf(config, f.getter(config), str(path))
