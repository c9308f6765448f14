"""Tiny models defined in the package (nothing is downloaded).

``TransformerBlock`` is a pre-LayerNorm GPT block (Radford et al. 2019, GPT-2): multi-head
causal self-attention and a 4× MLP with GELU, each with a residual connection.
Input and output: ``(batch, seq_len, d_model)`` float tensors.

:class:`KVCache` adds the static key/value cache used for token-by-token decoding (Unit 4): one
preallocated ``(batch, heads, max_seq_len, head_dim)`` tensor of keys and one of values per layer,
written at the current positions, with attention masked to the positions ``≤`` the query's own
(the pattern of pytorch-labs/gpt-fast, whose shapes never change from one token to the next, so a
compiled decode step is not recompiled per token). Without a cache, every call behaves as before.

:class:`Llama` is a small LLaMA-style decoder (Touvron et al. 2023, arXiv:2302.13971): pre-norm
:class:`RMSNorm`, rotary position embeddings (:func:`apply_rope`, Su et al. 2021, RoFormer), a SwiGLU
MLP (Shazeer 2020, "GLU Variants Improve Transformer"), no biases, untied output head, with the same
cache interface as :class:`GPT`. Its glue (the norm, the rotation, the gate) is written as several
small elementwise operators, not fused library calls: exactly what ``torch.compile`` fuses
(Unit 4's decode model).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from teraflops.errors import ShapeError


def _numel(p: torch.Tensor) -> int:
    """A parameter's full element count, also when DeepSpeed ZeRO-3 has partitioned it away (then
    ``p.numel()`` is 0 and DeepSpeed keeps the full count as ``p.ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


class TransformerBlock(nn.Module):
    """One GPT-style block.

    Args:
        d_model: width; must be divisible by ``n_heads``.
        n_heads: attention heads.
        attention: ``"sdpa"`` (``F.scaled_dot_product_attention``), or a function
            ``(q, k, v, causal=True) -> out`` on ``[batch, heads, seq_len, head_dim]`` tensors, e.g.
            Unit 1's :func:`teraflops.model_definition.attention.naive_attention` (materialises the
            ``seq_len × seq_len`` scores).

    Raises:
        ShapeError: ``d_model`` not divisible by ``n_heads``.
        ValueError: ``attention`` neither ``"sdpa"`` nor callable.
    """

    def __init__(self, d_model: int, n_heads: int, attention="sdpa"):
        super().__init__()
        if d_model % n_heads:
            raise ShapeError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        if attention != "sdpa" and not callable(attention):
            raise ValueError(f"attention must be 'sdpa' or a function (q, k, v, causal=True), got {attention!r}")
        self.n_heads, self.head_dim, self.attention = n_heads, d_model // n_heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def _attend(self, x: torch.Tensor, cache: "LayerKV | None" = None, input_pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x)
        # heads from the projection's width, not the constructor: under tensor parallelism (Megatron-LM
        # §3, teraflops.parallelization.tensor_parallel) a rank's qkv holds only its n_heads / tp heads
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, n, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:
            # Write this call's keys/values at their positions, then attend over the whole
            # (static-shape) cache; positions not yet written are masked out by ``mask``.
            k, v = cache.update(input_pos, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = self.attention(q, k, v, causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, heads * self.head_dim))

    def forward(self, x: torch.Tensor, cache: "LayerKV | None" = None, input_pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.qkv.in_features:
            raise ShapeError(f"TransformerBlock expects (batch, seq_len, {self.qkv.in_features}), got {tuple(x.shape)}")
        x = x + self._attend(self.ln1(x), cache, input_pos, mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LayerKV(nn.Module):
    """Static key/value cache of one attention layer: buffers ``k`` and ``v``, each
    ``(batch, heads, max_seq_len, head_dim)`` (zeros until written). Buffers, not arguments, so that
    a compiled step (and a CUDA graph) sees them as static memory updated in place."""

    def __init__(self, batch: int, heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype, device):
        super().__init__()
        shape = (batch, heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` ``(batch, heads, T, head_dim)`` at positions ``input_pos`` (int64 ``(T,)``)
        along dimension 2 (in place); return the whole cache ``(k, v)``."""
        if k.dtype != self.k.dtype:  # a Python-level test: no no-op ``aten::to`` in every step
            k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class KVCache(nn.Module):
    """Static KV cache for a :class:`GPT`: one :class:`LayerKV` per block, ``layers[i].k`` and
    ``layers[i].v`` each ``(batch, n_heads, max_seq_len, head_dim)``.

    Memory: ``2 · n_layers · batch · max_seq_len · d_model`` elements (keys and values).
    Make one with :meth:`GPT.new_cache`; :meth:`reset` zeroes it for a new prompt.
    """

    def __init__(self, n_layers: int, batch: int, heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__()
        self.batch, self.max_seq_len = batch, max_seq_len
        self.layers = nn.ModuleList(LayerKV(batch, heads, max_seq_len, head_dim, dtype, device)
                                    for _ in range(n_layers))

    def reset(self) -> None:
        for layer in self.layers:
            layer.k.zero_()
            layer.v.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes of all keys and values."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


class CachedLM(nn.Module):
    """What :class:`GPT` and :class:`Llama` share: a token embedding ``tok``, ``blocks`` (each with
    ``n_heads``), ``max_seq_len``, and a static KV cache (:class:`KVCache`)."""

    def new_cache(self, batch: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_seq_len`` (default: the
        model's) positions, on the model's device, in its dtype unless ``dtype`` is given."""
        max_seq_len = max_seq_len or self.max_seq_len
        if max_seq_len > self.max_seq_len:
            raise ShapeError(f"a cache of {max_seq_len} positions is longer than the model's max_seq_len="
                             f"{self.max_seq_len}")
        w = self.tok.weight
        heads = self.blocks[0].n_heads if len(self.blocks) else 1
        return KVCache(len(self.blocks), batch, heads, max_seq_len, self.tok.embedding_dim // heads,
                       dtype or w.dtype, w.device)

    def _check_tokens(self, tokens: torch.Tensor, cache: KVCache | None, input_pos: torch.Tensor | None) -> None:
        name = type(self).__name__
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long:
            raise TypeError(f"{name} expects int64 token ids, got {getattr(tokens, 'dtype', type(tokens).__name__)}")
        if tokens.dim() != 2 or tokens.shape[1] > self.max_seq_len:
            raise ShapeError(f"{name} expects (batch, seq_len ≤ {self.max_seq_len}) token ids, got {tuple(tokens.shape)}")
        if cache is not None and input_pos is None:
            raise ShapeError(f"{name} with a cache needs input_pos, the int64 positions (seq_len,) of the tokens")

    @staticmethod
    def _cache_mask(cache: KVCache, input_pos: torch.Tensor) -> torch.Tensor:
        """Query at position p sees cached positions ≤ p: a (seq_len, cache_len) boolean mask,
        broadcast over batch and heads by scaled_dot_product_attention."""
        return torch.arange(cache.max_seq_len, device=input_pos.device) <= input_pos[:, None]


class GPT(CachedLM):
    """A small GPT-style language model (GPT-2 layout: token + learned position embeddings, pre-LN
    blocks, final LayerNorm, output head tied to the token embedding).

    Args:
        vocab_size: tokens in the vocabulary.
        d_model, n_layers, n_heads: width, depth, heads (``d_model`` divisible by ``n_heads``).
        max_seq_len: longest sequence the position embedding covers.

    ``forward(tokens)``: ``tokens`` int64 ``(batch, seq_len)`` with ``seq_len ≤ max_seq_len`` →
    logits float ``(batch, seq_len, vocab_size)``. Raises :class:`ShapeError` / ``TypeError`` for
    wrong shapes or dtypes. Parameter count: :meth:`num_params`.

    ``forward(tokens, cache=cache, input_pos=pos)`` (decoding, Unit 4): ``tokens`` are at positions
    ``pos`` (int64 ``(seq_len,)``, e.g. ``arange(P)`` for a prefill, ``tensor([t])`` for one new
    token); their keys/values are written into ``cache`` (:meth:`new_cache`) and each attends to
    every cached position ``≤`` its own. Same logits as the uncached forward over the whole prefix.
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
        """Distinct parameter elements (the tied head counted once): Ψ in the ZeRO paper. Under
        DeepSpeed ZeRO-3 a partitioned parameter's ``numel()`` reads 0; its full size is ``ds_numel``."""
        return sum(_numel(p) for p in self.parameters())

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        self._check_tokens(tokens, cache, input_pos)
        if cache is None:
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))
        mask = self._cache_mask(cache, input_pos)
        x = self.tok(tokens) + self.pos(input_pos)
        for block, layer in zip(self.blocks, cache.layers):
            x = block(x, layer, input_pos, mask)
        return self.head(self.ln_f(x))


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as in LLaMA: ``x · rsqrt(mean(x²) + eps) · weight``
    over the last dimension; no mean subtraction, no bias. Written as separate operators on purpose
    (pow, mean, add, rsqrt, mul, mul): six launches in eager mode, one fused kernel when compiled."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation angles ``positions[:, None] · inv_freq[None]`` → ``(cos, sin)``, each
    ``(seq_len, head_dim // 2)`` in ``dtype``. ``inv_freq[i] = base^(-2i / head_dim)`` (RoFormer §3.2.2).
    Computed from the positions in every forward (as Hugging Face's Llama does), so that one
    decode step needs no table lookup; shared by all layers."""
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = angles.cos(), angles.sin()
    if dtype != cos.dtype:  # a Python-level test: no no-op ``aten::to`` in a float32 step
        cos, sin = cos.to(dtype), sin.to(dtype)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021): rotate each consecutive pair
    ``(x[2i], x[2i+1])`` of ``x`` ``(batch, heads, seq_len, head_dim)`` by the angle of its position
    and frequency ``i`` (``cos, sin`` from :func:`rope_cos_sin`, broadcast over batch and heads).
    The pairing of Meta's LLaMA code (there as complex multiplication)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).view(x.shape)


class LlamaBlock(nn.Module):
    """One LLaMA block: ``x + attn(rmsnorm(x))`` then ``h + w2(silu(w1 h') ⊙ w3 h')`` with
    ``h' = rmsnorm(h)``. Queries and keys are rotated (RoPE) before attention; no biases anywhere.

    Args:
        d_model: width; divisible by ``n_heads``, and ``d_model // n_heads`` even (RoPE pairs).
        n_heads: attention heads.
        hidden: SwiGLU width (default ``4 · d_model``; LLaMA uses ``⅔ · 4 · d_model`` rounded).
    """

    def __init__(self, d_model: int, n_heads: int, hidden: int | None = None):
        super().__init__()
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ShapeError(f"d_model={d_model} must be divisible by n_heads={n_heads} into an even head_dim")
        hidden = hidden or 4 * d_model
        self.n_heads = n_heads
        self.attn_norm, self.mlp_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate (through SiLU)
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKV | None = None,
                input_pos: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, n, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(input_pos, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, n, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(CachedLM):
    """A small LLaMA-style language model (Touvron et al. 2023): token embedding (no position
    embedding: positions enter through RoPE), pre-norm :class:`LlamaBlock` s, final :class:`RMSNorm`,
    and an output head *not* tied to the embedding (as in LLaMA).

    Args:
        vocab_size, d_model, n_layers, n_heads: as :class:`GPT` (``d_model // n_heads`` even).
        max_seq_len: longest sequence (and default KV-cache length).
        rope_base: RoPE frequency base (10000, as in RoFormer and LLaMA).
        seed: weights are drawn from a generator seeded with it (N(0, 0.02) for every linear and
            embedding weight, ones for the norms): the same model whatever the global RNG state.

    ``forward(tokens)`` and ``forward(tokens, cache=..., input_pos=...)``: exactly as :class:`GPT`
    (uncached = causal forward over the whole sequence; cached = write keys/values at ``input_pos``
    and attend to cached positions ``≤`` each query's). Logits float ``(batch, seq_len, vocab_size)``.
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                 max_seq_len: int = 64, rope_base: float = 10000.0, seed: int = 0):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(LlamaBlock(d_model, n_heads) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        head_dim = d_model // n_heads
        inv_freq = rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)

    def num_params(self) -> int:
        """Parameter elements (embedding and head counted separately: they are not tied); ZeRO-3
        partitioned parameters by their ``ds_numel`` (see :meth:`GPT.num_params`)."""
        return sum(_numel(p) for p in self.parameters())

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        self._check_tokens(tokens, cache, input_pos)
        x = self.tok(tokens)
        if cache is None:
            cos, sin = rope_cos_sin(torch.arange(tokens.shape[1], device=tokens.device), self.inv_freq, x.dtype)
            for block in self.blocks:
                x = block(x, cos, sin)
            return self.head(self.norm(x))
        cos, sin = rope_cos_sin(input_pos, self.inv_freq, x.dtype)
        mask = self._cache_mask(cache, input_pos)
        for block, layer in zip(self.blocks, cache.layers):
            x = block(x, cos, sin, layer, input_pos, mask)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats); ``logits (B, N, V)``, ``targets`` int64 ``(B, N)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
