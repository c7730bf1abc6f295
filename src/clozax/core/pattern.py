"""The layer pattern: which blocks attend globally and which through the sliding window
(``model.global_every``, ``model.local_window``), which attention path each kind runs on this
device (``attention_plan``, ``layer_attention``), which block skips its attention norm
(``model.first_attention_norm``), and what every block reads (visibility, masks, RoPE tables).

The pattern reaches the ``jax.lax.scan`` over stacked blocks as data, per-layer bool flags next
to the parameters, so one compiled block serves every layer kind (``jnp.where`` picks the
layer's mask and tables). Without local layers or with layer 0's norm, no flag is added and
the block computes what it did before these options existed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from clozax.core import attention as attention_lib
from clozax.core import layers
from clozax.core import positions as positions_lib
from clozax.core.model_config import ModelConfig

Params = dict[str, Any]


def fused_layers(stacked: Params, config: ModelConfig) -> Params:
    """Stacked per-layer parameters for the scan, with query/key/value fused along ``out``,
    and the per-layer flags of the config's layer pattern: ``is_global`` (layers,) bool when
    some layers attend locally, ``attention_norm_on`` (layers,) bool when layer 0 has none."""
    att = stacked["attention"]
    qkv = {
        part: jnp.concatenate([att[n][part] for n in ("query", "key", "value")], axis=-1)
        for part in att["query"]
    }  # kernel (layers, hidden, 3 * hidden), bias (layers, 3 * hidden)
    fused = {
        "qkv": qkv,
        "attention_output": att["output"],
        "attention_norm": stacked["attention_norm"],
        "intermediate": stacked["intermediate"],
        "output": stacked["output"],
        "mlp_norm": stacked["mlp_norm"],
    }
    index = range(config.layers)
    if config.has_local_layers:
        fused["is_global"] = jnp.array([config.is_global(i) for i in index])
    if config.layer_norm == "pre" and not config.first_attention_norm:
        fused["attention_norm_on"] = jnp.array([i > 0 for i in index])
    return fused


def device() -> tuple[str, str]:
    """The platform and device kind programs are traced for: this machine's default backend
    (a test that lowers for ``cuda`` on a CPU host replaces it)."""
    return jax.default_backend(), jax.devices()[0].device_kind


def attention_plan(config: ModelConfig, seq: int, rows: bool = False) -> attention_lib.Plan:
    """Which attention path each layer kind runs on ``device()`` (``attention.choose``), for
    rows of ``seq`` keys; ``rows``: the queries are the selected positions only."""
    c = config
    platform, kind = device()
    return attention_lib.choose(
        c.attention, platform=platform, device_kind=kind,
        within_segments=c.attention_within_segments,
        local_half=c.local_window // 2 if c.has_local_layers else None, seq=seq,
        bf16=c.compute_dtype == "bfloat16", rows=rows, head_dim=c.head_dim)


def shared(config: ModelConfig, attention_mask, segments) -> dict:
    """What every block reads: ``vis`` (``attention.Visibility`` of the full rows), the dense
    masks the plan's dense paths take, (batch, 1, q or 1, k) bool (``mask`` for global layers,
    ``local_mask`` under the window; None where the path takes none), and the RoPE (cos, sin)
    tables, (batch, seq, head_dim) float32, per layer kind."""
    c = config
    seq = attention_mask.shape[1]
    plan = attention_plan(c, seq)
    vis = attention_lib.full_rows(attention_mask,
                                  segments if c.attention_within_segments else None)
    shared = {"vis": vis}
    shared["mask"], shared["local_mask"] = _dense_masks(vis, plan, c.local_window // 2)
    if c.positions == "rope":
        positions = (positions_lib.document_positions(segments) if c.attention_within_segments
                     else jnp.broadcast_to(jnp.arange(seq), attention_mask.shape))
        shared["rope_global"] = positions_lib.rope_tables(positions, c.head_dim,
                                                          c.rope_theta_global)
        if c.has_local_layers:
            shared["rope_local"] = positions_lib.rope_tables(positions, c.head_dim,
                                                             c.rope_theta_local)
    return shared


def _dense_masks(vis, plan: attention_lib.Plan, half: int):
    """(global mask, local mask): ``attention.dense_mask`` for each layer kind whose path takes
    one, None for the others."""
    return tuple(attention_lib.dense_mask(vis, h) if path in attention_lib.DENSE else None
                 for path, h in ((plan.global_, None), (plan.local, half)))


def layer_attention(q, k, v, p, shared, config: ModelConfig, rows=None):
    """A block's attention by the plan's path for its kind (``attention_plan``): global layers
    without a window, local layers with ``local_window // 2``. q: (batch, q, heads, head_dim),
    at the positions ``rows`` (batch, q) when given; k, v: (batch, seq, heads, head_dim); ``p``
    the layer's parameters and flags; ``shared`` as ``shared`` gives it. Returns float32.

    Where both kinds run one dense path, one call takes the layer's mask (``jnp.where`` on the
    flag); otherwise ``jax.lax.cond`` runs only the layer's path, both compiled once. With a
    dropout key in ``p`` and ``attention_dropout`` > 0, ``_dropped_attention`` instead."""
    c = config
    vis = shared["vis"] if rows is None else attention_lib.at_rows(shared["vis"], rows)
    if p.get("dropout_key") is not None and c.attention_dropout > 0:
        return _dropped_attention(q, k, v, p, vis, c)
    plan = attention_plan(c, k.shape[1], rows is not None)
    half = c.local_window // 2
    masks = ((shared["mask"], shared["local_mask"]) if rows is None
             else _dense_masks(vis, plan, half))  # the selected queries' rows: (b, 1, count, k)

    def global_layer():
        return attention_lib.attend(q, k, v, vis, plan.global_, None, c.dtype, masks[0],
                                    plan.interpret)

    def local_layer():
        return attention_lib.attend(q, k, v, vis, plan.local, half, c.dtype, masks[1],
                                    plan.interpret)

    if plan.local is None:
        return global_layer()
    if plan.global_ == plan.local and plan.global_ in attention_lib.DENSE:
        mask = jnp.where(p["is_global"], masks[0], masks[1])
        return attention_lib.attend(q, k, v, vis, plan.global_, None, c.dtype, mask)
    return jax.lax.cond(p["is_global"], global_layer, local_layer)


def _dropped_attention(q, k, v, p, vis, config: ModelConfig):
    """``layer_attention`` with attention-probability dropout (a dropout key and
    ``attention_dropout`` > 0): the ``einsum`` path under the layer's dense mask, whatever the
    plan, since no fused path draws dropout. The keep mask is ``fold_in(layer key, 2)``'s
    (0 and 1 are the block's hidden dropouts), per row with a key per row."""
    c = config
    mask = attention_lib.dense_mask(vis)
    if c.has_local_layers:
        mask = jnp.where(p["is_global"], mask, attention_lib.dense_mask(vis, c.local_window // 2))
    shape = (q.shape[0], c.heads, q.shape[1], k.shape[1])  # (batch, heads, q, k)
    keep = layers.keep_mask(p["dropout_key"], 2, c.attention_dropout, shape)
    return attention_lib.einsum(q, k, v, mask, c.dtype, keep, c.attention_dropout)

