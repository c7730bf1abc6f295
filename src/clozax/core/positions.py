"""Rotary position embeddings (RoPE, ``model.positions="rope"``) and the position of every
token in its document.

RoPE rotates each query and key feature pair by an angle ``position * theta^(-2i/head_dim)``,
so a query-key score depends on positions only through their difference (tested). The pairing
is HF's ``rotate_half`` layout (feature ``i`` with feature ``i + head_dim/2``), which is what
``ModernBertForMaskedLM`` computes; angles and rotations are float32.

Positions: 0..seq-1 along each row, or, when a row packs several documents and attention stays
inside them (``model.attention_within_segments``), restarting at 0 at every document's first
token. With attention inside documents the two give the same scores (only differences within a
document matter); restarting keeps every document's angles what they are for that document
alone, as ``transformers`` computes them for a single-document row. Learned position
embeddings (``model.positions="learned"``) are looked up at the same positions, so a document
packed into a row gets the hidden states it gets alone in one (what lets the contrastive stage
pack short texts; before, they were the row's positions, and a packed document's differed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def document_positions(segments: jax.Array) -> jax.Array:
    """Each token's index inside its run of equal segment ids. (batch, seq) int -> same.

    Packed rows hold each document as one contiguous run (``clozax.data.packing``); padding
    (segment 0) counts as a run of its own.
    """
    seq = segments.shape[1]
    index = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segments.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # (batch, seq)
    return index - first


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
    """(cos, sin), each (batch, seq, head_dim) float32, for int ``positions`` (batch, seq)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # (batch, seq, head_dim / 2)
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # (batch, seq, head_dim)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on queries or keys x (batch, seq, heads, head_dim) with tables (batch, seq,
    head_dim); returns float32, same shape."""
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
