"""The layer pattern: which blocks attend globally and which through the sliding window
(``model.global_every``, ``model.local_window``), which block skips its attention norm
(``model.first_attention_norm``), and what every block reads (masks, RoPE tables).

The pattern reaches the ``jax.lax.scan`` over stacked blocks as data, per-layer bool flags next
to the parameters, so one compiled block serves every layer kind (``jnp.where`` picks the
layer's mask and tables). Without local layers or with layer 0's norm, no flag is added and
the block computes what it did before these options existed.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from clozax.core import attention as attention_lib
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


def shared(config: ModelConfig, attention_mask, segments) -> dict:
    """What every block reads: the attention masks, (batch, 1, q or 1, k) bool, and the RoPE
    (cos, sin) tables, (batch, seq, head_dim) float32, per layer kind."""
    c = config
    mask = attention_lib.visible(attention_mask, segments, c.attention_within_segments)
    shared = {"mask": mask}
    if c.has_local_layers:
        shared["local_mask"] = mask & attention_lib.window(attention_mask.shape[1],
                                                           c.local_window // 2)
        if blocked_local(c, attention_mask.shape[1]):  # what the blocked path reads instead
            shared["key_real"] = attention_mask
            shared["segments"] = segments if c.attention_within_segments else None
    if c.positions == "rope":
        seq = attention_mask.shape[1]
        positions = (positions_lib.document_positions(segments) if c.attention_within_segments
                     else jnp.broadcast_to(jnp.arange(seq), attention_mask.shape))
        shared["rope_global"] = positions_lib.rope_tables(positions, c.head_dim,
                                                          c.rope_theta_global)
        if c.has_local_layers:
            shared["rope_local"] = positions_lib.rope_tables(positions, c.head_dim,
                                                             c.rope_theta_local)
    return shared


def blocked_local(config: ModelConfig, seq: int) -> bool:
    """Whether local layers run ``attention.blocked_local_attend`` (O(seq * window)) rather
    than full attention under the window mask: when the row is at least four windows long, so
    that the blocked scores (1.5 windows per query) are under 3/8 of the full ones."""
    return config.has_local_layers and seq >= 4 * config.local_window
