"""PyTorch pieces of the published EAGLE heads' architecture, written here from the papers and
the published code's structure (one sequence, positions 0..T-1), and the causal attention a
:class:`~jspec.models.llama.DenseContext` takes."""

import math

import jax
import jax.numpy as jnp
import torch


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):  # [T, heads, D], rotate-half convention, positions 0..T-1
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None], torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def causal(q, k, v):  # DenseContext attention: [B, T, heads, D], causal, grouped KV heads
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def attention(attn, x, heads: int, kv_heads: int, d: int, theta: float):
    """A Llama attention module's (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) causal output
    over rows x [T, in]."""
    t = x.shape[0]
    q = rope(attn.q_proj(x).view(t, heads, d), theta)
    k = rope(attn.k_proj(x).view(t, kv_heads, d), theta)
    v = attn.v_proj(x).view(t, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return attn.o_proj(torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(t, -1))


def mlp(m, x):
    return m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))


def variant(good, directory, change) -> str:
    """A copy of the checkpoint directory ``good`` (config.json, model.safetensors) at
    ``directory`` with its tensors passed through ``change`` (a function editing the dict)."""
    from jspec.loading.drafts import load_tensors, save_tensors

    directory.mkdir()
    (directory / "config.json").write_text((good / "config.json").read_text())
    tensors = load_tensors(good / "model.safetensors")
    change(tensors)
    save_tensors(directory / "model.safetensors", tensors)
    return str(directory)
