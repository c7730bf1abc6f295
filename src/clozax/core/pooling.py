"""A sentence embedding from an encoder's final hidden states: the mean of the real tokens'
states (``mean``, sentence-transformers' default and the contrastive stage's) or the first
token's (``cls``), optionally scaled to unit length (cosine similarity as a dot product);
``pool_segments`` gives the same for each document of rows that pack several."""

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


def pool_segments(hidden: jnp.ndarray, segments: jnp.ndarray, count: int, pooling: str = "mean",
                  normalize: bool = False) -> jnp.ndarray:
    """``pool`` of each packed document: ``hidden`` [R, S, H] float, ``segments`` [R, S] int
    (document ``k`` of a row holds segment id ``k + 1``; 0 is padding) -> [R, count, H], the
    embedding of row r's document k at ``[r, k]`` (zeros where a row has fewer). ``cls``: the
    document's first token's state."""
    ids = jnp.arange(1, count + 1, dtype=segments.dtype)
    member = (segments[..., None] == ids).astype(hidden.dtype)  # [R, S, count]
    if pooling == "mean":
        summed = jnp.einsum("rsk,rsh->rkh", member, hidden)  # [R, count, H]
        out = summed / jnp.maximum(member.sum(axis=1), 1.0)[..., None]
    elif pooling == "cls":
        first = jnp.argmax(member, axis=1)  # [R, count]: each document's first token
        out = jnp.take_along_axis(hidden, first[..., None], axis=1)
    else:
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    if normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out
