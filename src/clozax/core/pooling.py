"""A sentence embedding from an encoder's final hidden states: the mean of the real tokens'
states (``mean``, sentence-transformers' default and the contrastive stage's) or the first
token's (``cls``), optionally scaled to unit length (cosine similarity as a dot product)."""

from __future__ import annotations

import jax.numpy as jnp

POOLINGS = ("mean", "cls")


def pool(hidden: jnp.ndarray, mask: jnp.ndarray, pooling: str = "mean",
         normalize: bool = False) -> jnp.ndarray:
    """``hidden`` [B, S, H] float, ``mask`` [B, S] (true at real tokens) -> [B, H]."""
    if pooling == "mean":
        weights = mask.astype(hidden.dtype)[..., None]  # [B, S, 1]
        summed = (hidden * weights).sum(axis=1)  # [B, H]
        out = summed / jnp.maximum(weights.sum(axis=1), 1.0)  # a row of no token: zeros
    elif pooling == "cls":
        out = hidden[:, 0]
    else:
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    if normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out
