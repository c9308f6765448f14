"""Tiny models defined in the package (nothing is downloaded).

``TransformerBlock`` is a pre-LayerNorm GPT block (Radford et al. 2019, GPT-2): multi-head
causal self-attention and a 4× MLP with GELU, each with a residual connection.
Input and output: ``(batch, seq_len, d_model)`` float tensors.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import ShapeError


class TransformerBlock(nn.Module):
    """One GPT-style block.

    Args:
        d_model: width; must be divisible by ``n_heads``.
        n_heads: attention heads.
        attention: ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"naive"`` (materialises
            the ``seq_len × seq_len`` scores).
    """

    def __init__(self, d_model: int, n_heads: int, attention: str = "sdpa"):
        super().__init__()
        if d_model % n_heads:
            raise ShapeError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        if attention not in ("sdpa", "naive"):
            raise ValueError(f"attention must be 'sdpa' or 'naive', got {attention!r}")
        self.n_heads, self.attention = n_heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            from .attention import naive_attention

            y = naive_attention(q, k, v, causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.qkv.in_features:
            raise ShapeError(f"TransformerBlock expects (batch, seq_len, {self.qkv.in_features}), got {tuple(x.shape)}")
        x = x + self._attend(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
