"""GGUF files (llama.cpp): metadata -> :class:`ModelConfig`, tensors -> dequantized float32.

Dequantization uses the ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K
and more). llama.cpp's converter permutes the rows of the Q and K projections of ``llama``
models so that RoPE rotates interleaved pairs; jspec (like Hugging Face) rotates halves, so the
permutation is undone here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jspec.config import ModelConfig
from jspec.errors import CheckpointError, UnsupportedModelError

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
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, n, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{n}.{_LAYER_NAMES[rest]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`` of Q/K rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """A parsed GGUF file: metadata fields and lazily dequantized tensors."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # truncated or corrupt: the reader raises many kinds
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.field("general.architecture")
        if self.arch not in ("llama", "qwen2", "mistral"):
            raise UnsupportedModelError(f"{path}: unsupported GGUF architecture {self.arch!r} "
                                        "(jspec runs llama, qwen2 and mistral)")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:
            raise CheckpointError(f"{self.path}: corrupt metadata field {key} ({e})") from None

    def _arch_field(self, key: str, default=None, required: bool = True):
        v = self.field(f"{self.arch}.{key}", default)
        if v is None and required:
            raise CheckpointError(f"{self.path}: missing metadata {self.arch}.{key}")
        return v

    def config(self, dtype: str = "float32") -> ModelConfig:
        heads = int(self._arch_field("attention.head_count"))
        hidden = int(self._arch_field("embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = self._arch_field("vocab_size", len(tokens) if tokens else None)
        head_dim = self._arch_field("attention.key_length", None, required=False) or hidden // heads
        factors = None
        if "rope_freqs.weight" in self.tensors:
            factors = tuple(float(x) for x in self._dequantize("rope_freqs.weight").reshape(-1))
        eos = self.field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._arch_field("feed_forward_length")),
            num_layers=int(self._arch_field("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._arch_field("attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._arch_field("rope.freq_base", 10000.0)),
            rope_freq_factors=factors,
            max_position_embeddings=int(self._arch_field("context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            architecture="llama" if self.arch == "mistral" else self.arch,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            dtype=dtype,
        )

    def _dequantize(self, name: str) -> np.ndarray:
        import gguf

        t = self.tensors[name]
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name} uses unsupported type {t.tensor_type.name}") from None
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot dequantize {name} ({e})") from None
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        if data.size != int(np.prod(shape)):
            raise CheckpointError(f"{self.path}: tensor {name} holds {data.size} values, expected {shape}")
        return data.reshape(shape)

    def hf_tensors(self, config: ModelConfig) -> dict[str, np.ndarray]:
        """All model tensors under Hugging Face names, Q/K permutation undone."""
        out = {}
        for name in self.tensors:
            hf = hf_name(name)
            if hf is None:
                continue
            w = self._dequantize(name)
            if self.arch in ("llama", "mistral"):
                if hf.endswith("q_proj.weight"):
                    w = unpermute_qk(w, config.num_heads)
                elif hf.endswith("k_proj.weight"):
                    w = unpermute_qk(w, config.num_kv_heads)
            out[hf] = w
        return out


def load_gguf(path: Path, dtype: str = "float32"):
    """(config, params) from a GGUF file."""
    from jspec.loading.convert import params_from_hf

    f = GGUFFile(path)
    config = f.config(dtype)
    tensors = f.hf_tensors(config)
    return config, params_from_hf(config, tensors.get, str(path))
