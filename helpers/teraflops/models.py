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


class GPT(nn.Module):
    """A small GPT-style language model (GPT-2 layout: token + learned position embeddings, pre-LN
    blocks, final LayerNorm, output head tied to the token embedding).

    Args:
        vocab_size: tokens in the vocabulary.
        d_model, n_layers, n_heads: width, depth, heads (``d_model`` divisible by ``n_heads``).
        max_seq_len: longest sequence the position embedding covers.

    ``forward(tokens)``: ``tokens`` int64 ``(batch, seq_len)`` with ``seq_len ≤ max_seq_len`` →
    logits float ``(batch, seq_len, vocab_size)``. Raises :class:`ShapeError` / ``TypeError`` for
    wrong shapes or dtypes. Parameter count: :meth:`num_params`.
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                 max_seq_len: int = 64):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        for emb in (self.tok, self.pos):  # GPT-2's initialisation; N(0, 1) would make logits huge
            nn.init.normal_(emb.weight, std=0.02)

    def num_params(self) -> int:
        """Distinct parameter elements (the tied head counted once): Ψ in the ZeRO paper."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long:
            raise TypeError(f"GPT expects int64 token ids, got {getattr(tokens, 'dtype', type(tokens).__name__)}")
        if tokens.dim() != 2 or tokens.shape[1] > self.max_seq_len:
            raise ShapeError(f"GPT expects (batch, seq_len ≤ {self.max_seq_len}) token ids, got {tuple(tokens.shape)}")
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats); ``logits (B, N, V)``, ``targets`` int64 ``(B, N)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
