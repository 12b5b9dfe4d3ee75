"""Exact per-head rotations of Whisper's attention weights (issue 38, item 2: ``quantize --rotate heads``).

Incoherence processing spreads a weight matrix's outliers over many coordinates before it is rounded. For Whisper the
rotations below change no output of the model in any runtime, because each one is undone inside the same attention
head by arithmetic every runtime already does:

* query/key: a head's score is q_h · k_h, and (R q_h) · (R k_h) = q_h · k_h for an orthogonal R. Both projections'
  rows of the head (and the query's bias) are rotated by the same R.
* value/output: a head's output is W_o[:, h] · Σ_t a_t v_h(t); with v_h → R v_h and W_o[:, h] → W_o[:, h] Rᵀ the sum
  is unchanged (the attention weights a_t mix positions, not coordinates). The value's rows and bias are rotated by
  R, the output projection's columns of the head by Rᵀ. A second R, independent of the query/key one.

So q, k, v gain mixed rows and out_proj gains mixed input columns inside every 64-wide head: exactly the columns a
group of 32 or a super-block of 256 shares. R is a Hadamard matrix with random signs (QuIP#'s choice: every entry of
magnitude 1/√d, so no coordinate keeps an outlier) where the head width is a power of two, else a random orthogonal
matrix; both drawn from ``seed``.

What cannot be rotated exactly in a stock runtime (measured as a precise negative, not built):
* the encoder's residual stream: its first value is GELU(conv2(·)) + positions, and an orthogonal Q that commutes
  with GELU is a permutation, so rotating conv2's output changes the model;
* the decoder's residual stream: the final LayerNorm's γ meets the tied token embedding, which is also the input;
* fc1/fc2: GELU between them again admits only permutations, which spread nothing.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["attention_modules", "random_orthogonal", "rotate_heads"]


def hadamard(d: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order d (a power of two), in float64, entries ±1."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_orthogonal(d: int, generator: torch.Generator) -> torch.Tensor:
    """A d x d orthogonal matrix in float64: H·diag(±1)/√d where d is a power of two, else Q of a Gaussian's QR
    (signs fixed by R's diagonal, so the draw is Haar)."""
    if d & (d - 1) == 0:
        signs = torch.randint(0, 2, (d,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
        return hadamard(d) * signs / d ** 0.5
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attention of a transformers Whisper model (encoder self, decoder self and cross), by module name."""
    return [(name, m) for name, m in model.named_modules()
            if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "out_proj"))]


def _rotate_rows(linear: nn.Linear, rotation: torch.Tensor, heads: int) -> None:
    """Rows of each head h of ``linear`` (and its bias) → R_h · rows."""
    out_features, in_features = linear.weight.shape
    d = out_features // heads
    w = linear.weight.detach().to(torch.float64).reshape(heads, d, in_features)
    linear.weight.data.copy_(torch.einsum("hij,hjk->hik", rotation, w).reshape(out_features, in_features))
    if linear.bias is not None:
        b = linear.bias.detach().to(torch.float64).reshape(heads, d)
        linear.bias.data.copy_(torch.einsum("hij,hj->hi", rotation, b).reshape(out_features))


def _rotate_columns(linear: nn.Linear, rotation: torch.Tensor, heads: int) -> None:
    """Input columns of each head h of ``linear`` → columns · R_hᵀ (the inverse of _rotate_rows on its input)."""
    out_features, in_features = linear.weight.shape
    d = in_features // heads
    w = linear.weight.detach().to(torch.float64).reshape(out_features, heads, d)
    linear.weight.data.copy_(torch.einsum("ohj,hij->ohi", w, rotation).reshape(out_features, in_features))


@torch.no_grad()
def rotate_heads(model: nn.Module, seed: int = 0) -> dict:
    """Rotate every attention head of ``model`` in place (the module docstring); weights keep their dtype (the
    products are formed in float64 and rounded once). Returns what was done, for the checkpoint's manifest."""
    generator = torch.Generator().manual_seed(seed)
    modules = attention_modules(model)
    if not modules:
        raise ValueError("no attention with q_proj, k_proj, v_proj and out_proj: --rotate heads is for Whisper")
    for _, attention in modules:
        heads, d = attention.num_heads, attention.head_dim
        qk = torch.stack([random_orthogonal(d, generator) for _ in range(heads)])
        vo = torch.stack([random_orthogonal(d, generator) for _ in range(heads)])
        _rotate_rows(attention.q_proj, qk, heads)
        _rotate_rows(attention.k_proj, qk, heads)
        _rotate_rows(attention.v_proj, vo, heads)
        _rotate_columns(attention.out_proj, vo, heads)
    widths = {attention.head_dim for _, attention in modules}
    kind = "hadamard-random-signs" if all(d & (d - 1) == 0 for d in widths) else "haar"
    return {"rotate": "heads", "seed": seed, "attentions": len(modules), "kind": kind}
