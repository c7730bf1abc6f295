"""The encoder: pure functions over a parameter pytree (no module classes).

``init(config, key) -> params``; ``apply(params, config, inputs, attention_mask, segments)``
returns the final hidden states; ``gather`` picks the selected positions and ``mlm_logits`` runs
the MLM head only there, so the vocabulary projection never sees unselected positions.
``apply(..., positions=)`` returns the hidden states at the selected positions directly and
computes the last block only there (what training uses).

Axis names: ``batch`` sequences of ``seq`` positions, ``hidden`` features, ``heads`` attention
heads of ``head_dim`` features, ``count`` selected slots per sequence, ``vocab`` token ids,
``layers`` stacked blocks.

Architecture: token embeddings + learned absolute positions (0..seq-1) -> embedding LayerNorm ->
``layers`` residual blocks (bidirectional multi-head self-attention, exact-erf GELU MLP) run with
``jax.lax.scan`` over stacked parameters. ``layer_norm="post"`` is original BERT
(``x = LN(x + attn(x)); x = LN(x + mlp(x))``); ``layer_norm="pre"`` is RoBERTa-PreLayerNorm
(``x = x + attn(LN(x)); x = x + mlp(LN(x))``, then a final LayerNorm after the last block).
Options (``ModelConfig``; the ``modern-*`` presets set ModernBERT's): RoPE instead of the
position table (``clozax.core.positions``), a GeGLU MLP (``clozax.core.layers``), no biases,
no embedding or final norm, no attention norm in layer 0, and sliding-window attention on the
layers that are not global (``clozax.core.pattern``).

Parameters are nested dicts (see ``init``); per-block leaves are stacked on a leading
``layers`` axis and kernels are stored ``(in, out)``. ``clozax.interop.families`` maps
every leaf to its Hugging Face tensor. Attention itself (masks and implementations) is in
``clozax.core.attention``; the CPU matmul kernels are in ``clozax.core.kernels``.

Dtypes: parameters are always float32. With ``compute_dtype="bfloat16"`` matmul operands
(activations and kernels) are cast to bfloat16 while the residual stream, LayerNorm statistics,
GELU and the attention softmax stay float32 (both attention paths take their softmax
in float32). On CPU every matmul accumulates and returns float32 (``clozax.core.kernels``, which
XLA:CPU needs to run bf16 on its fast path); elsewhere dense results are in the compute dtype.
``apply`` returns float32 hidden states for either compute dtype; ``mlm_logits`` returns
float32 logits.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from clozax.core import kernels, layers, pattern
from clozax.core import positions as positions_lib
from clozax.core.model_config import ModelConfig

Params = dict[str, Any]
# cuDNN's fused attention refuses an odd query length in training; the sparse last block's
# query slots are padded to a multiple of this (a multiple of 8 also suits tensor cores).
CUDNN_QUERY_MULTIPLE = 8


# ----------------------------------------------------------------------------- init


def init(config: ModelConfig, key: jax.Array) -> Params:
    """Fresh float32 parameters: N(0, init_std) kernels and embeddings (or ModernBERT's
    truncated, depth-scaled rule: ``model.init``), zero biases, unit scales.

    Deterministic in ``key``; every tensor draws from its own named key.
    """
    c = config
    L, H, I, V = c.layers, c.hidden, c.intermediate, c.vocab_size
    names = ("word", "position", "query", "key", "value", "attn_out", "inter", "out", "head")
    keys = dict(zip(names, jax.random.split(key, len(names)), strict=True))

    # ModernBERT's rule (model_config.init): output projections scaled down by depth
    out_std = c.init_std / math.sqrt(2.0 * L)
    std = {name: out_std if c.init == "modernbert" and name in ("attn_out", "out", "head")
           else c.init_std for name in names}

    def normal(name, shape):
        if c.init == "modernbert":  # N(0, std) truncated at +-init_cutoff std, as torch's
            cut = c.init_cutoff
            return std[name] * jax.random.truncated_normal(keys[name], -cut, cut, shape,
                                                           jnp.float32)
        return c.init_std * jax.random.normal(keys[name], shape, jnp.float32)

    def dense(name, fan_in, fan_out, stacked):
        lead = (L,) if stacked else ()
        p = {"kernel": normal(name, (*lead, fan_in, fan_out))}
        if c.bias:
            p["bias"] = jnp.zeros((*lead, fan_out), jnp.float32)
        return p

    def norm(stacked):
        shape = (L, H) if stacked else (H,)
        p = {"scale": jnp.ones(shape, jnp.float32)}
        if c.bias:
            p["bias"] = jnp.zeros(shape, jnp.float32)
        return p

    inter = 2 * I if c.mlp == "geglu" else I  # GeGLU: input half, then gate half
    embeddings = {"word": normal("word", (V, H))}
    if c.positions == "learned":
        embeddings["position"] = normal("position", (c.max_positions, H))
    if c.embedding_norm:
        embeddings["layer_norm"] = norm(stacked=False)
    params = {
        "embeddings": embeddings,
        "layers": {
            "attention": {
                "query": dense("query", H, H, stacked=True),
                "key": dense("key", H, H, stacked=True),
                "value": dense("value", H, H, stacked=True),
                "output": dense("attn_out", H, H, stacked=True),
            },
            # With first_attention_norm=false, layer 0's row is unused (zero gradient) and
            # keeps its init; exports leave it out.
            "attention_norm": norm(stacked=True),
            "intermediate": dense("inter", H, inter, stacked=True),
            "output": dense("out", I, H, stacked=True),
            "mlp_norm": norm(stacked=True),
        },
        "head": {
            "transform": dense("head", H, H, stacked=False),
            "layer_norm": norm(stacked=False),
            "bias": jnp.zeros((V,), jnp.float32),  # the decoder's bias, kept without biases
        },
    }
    if c.layer_norm == "pre" and c.final_norm:
        params["final_norm"] = norm(stacked=False)
    return params


# ----------------------------------------------------------------------------- pieces


def _block(x, p, shared, config: ModelConfig, rows=None):
    """One residual block. x: (batch, seq, hidden) float32 residual stream.

    ``shared`` holds what every block reads (``pattern.shared``): the attention visibility
    ``vis`` and the dense masks the plan's dense paths take, and the RoPE tables. Per-layer
    flags in ``p`` choose between layer kinds (``pattern.fused_layers``).

    With ``rows`` (batch, count) int, only those query positions are computed: keys and values
    still come from every position, and the block returns (batch, count, hidden), equal to
    the full block's output gathered at ``rows``. The last block of ``apply(..., positions=)``
    runs this way.
    """
    c = config
    dtype, eps, pre = c.dtype, c.layer_norm_eps, c.layer_norm == "pre"
    batch, seq, hidden = x.shape

    # Attention, one fused QKV matmul (or Q at the rows and KV everywhere).
    h = layers.layer_norm(x, p["attention_norm"], eps) if pre else x
    if "attention_norm_on" in p:  # first_attention_norm=false: layer 0 sees x itself
        h = jnp.where(p["attention_norm_on"], h, x)
    if rows is None:
        qkv = layers.dense(h, p["qkv"], dtype).reshape(batch, seq, 3, c.heads, c.head_dim)
        q, k, v = layers.split_qkv(qkv)  # (batch, seq, heads, head_dim) each
    else:
        q_part = {n: a[..., :hidden] for n, a in p["qkv"].items()}
        kv_part = {n: a[..., hidden:] for n, a in p["qkv"].items()}
        kv = layers.dense(h, kv_part, dtype).reshape(batch, seq, 2, c.heads, c.head_dim)
        k, v = kv[:, :, 0], kv[:, :, 1]  # (batch, seq, heads, head_dim)
        x, h = gather(x, rows), gather(h, rows)  # (batch, count, hidden)
        q = layers.dense(h, q_part, dtype).reshape(batch, -1, c.heads, c.head_dim)
    if c.positions == "rope":
        cos, sin = shared["rope_global"]  # (batch, seq, head_dim) each
        if "is_global" in p:
            cos, sin = (jnp.where(p["is_global"], g, loc)
                        for g, loc in zip(shared["rope_global"], shared["rope_local"],
                                          strict=True))
        k = positions_lib.rotate(k, cos, sin)
        if rows is not None:
            cos, sin = gather(cos, rows), gather(sin, rows)  # (batch, count, head_dim)
        q = positions_lib.rotate(q, cos, sin)
    ctx = pattern.layer_attention(q, k, v, p, shared, c, rows)  # (batch, q, heads, hd) f32
    attn = layers.dense(ctx.reshape(*q.shape[:2], hidden), p["attention_output"], dtype)
    x = x + layers.dropout(attn.astype(jnp.float32), p.get("dropout_key"), 0, c.dropout)
    if not pre:
        x = layers.layer_norm(x, p["attention_norm"], eps)

    # MLP.
    h = layers.layer_norm(x, p["mlp_norm"], eps) if pre else x
    x = x + layers.dropout(layers.mlp(h, p["intermediate"], p["output"], c.mlp, dtype),
                           p.get("dropout_key"), 1, c.dropout)
    if not pre:
        x = layers.layer_norm(x, p["mlp_norm"], eps)
    return x


def _remat(block, policy: str):
    """``block`` under ``jax.checkpoint`` for ``model.remat`` (speed and memory only)."""
    if policy == "none":
        return block
    saveable = {"block": jax.checkpoint_policies.nothing_saveable,
                "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]
    return jax.checkpoint(block, policy=saveable, static_argnums=(3,))


def _check_inputs(config: ModelConfig, inputs, attention_mask, segments):
    if inputs.ndim != 2:
        raise ValueError(
            f"model inputs have shape {inputs.shape}; pass token ids shaped (batch, seq)"
        )
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
        raise ValueError(f"model inputs have dtype {inputs.dtype}; pass integer token ids")
    if attention_mask.shape != inputs.shape:
        raise ValueError(
            f"attention_mask shape {attention_mask.shape} differs from inputs shape "
            f"{inputs.shape}; pass one flag per token (True = real token)"
        )
    if attention_mask.dtype != jnp.bool_ and not jnp.issubdtype(attention_mask.dtype, jnp.integer):
        raise ValueError(
            f"attention_mask has dtype {attention_mask.dtype}; pass a bool mask (True = real "
            "token), not an additive float mask"
        )
    seq = inputs.shape[1]
    if seq > config.max_positions:
        raise ValueError(
            f"sequence length {seq} exceeds model.max_positions={config.max_positions}; "
            "shorten the sequences or raise model.max_positions"
        )
    if config.attention_within_segments:
        if segments is None:
            raise ValueError(
                "model.attention_within_segments=true but no segments were given; pass "
                "segment ids shaped (batch, seq) or set attention_within_segments=false"
            )
        if segments.shape != inputs.shape:
            raise ValueError(
                f"segments shape {segments.shape} differs from inputs shape {inputs.shape}; "
                "pass one segment id per token (0 = padding)"
            )


# ----------------------------------------------------------------------------- public


def apply(
    params: Params,
    config: ModelConfig,
    inputs: jax.Array,
    attention_mask: jax.Array,
    segments: jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
    unroll: int | bool | None = None,
    query_multiple: int | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """Final hidden states, float32 for either compute dtype.

    inputs: (batch, seq) int token ids; attention_mask: (batch, seq) bool, True = real token;
    segments: (batch, seq) int document ids (0 = padding), used only when
    ``config.attention_within_segments``. Returns (batch, seq, hidden) float32.
    Padding keys never influence any query; the hidden states at padded positions are
    well-defined but meaningless.

    With ``positions`` (batch, count) int, returns only the hidden states there, (batch, count,
    hidden), equal to ``gather(apply(...), positions)`` up to float32 rounding: the last block
    computes queries, attention output and MLP at those positions only (its keys and values
    still come from every position), which is all an MLM loss at selected positions needs.
    For the small preset that skips 18 % of the encoder's matmul work.

    ``unroll`` (default ``config.unroll``) is passed to ``jax.lax.scan`` over the layers:
    ``True`` unrolls every block, so XLA schedules and fuses across layers (on 2-core CPU the
    small preset's train step ran 13 % faster, measured side by side with
    ``benchmarks/compare_hf.py``; compile time grows with depth); ``1`` keeps one compiled block
    (fast compile for deep models). Results agree to float32 rounding, not bitwise.
    ``config.remat`` recomputes activations in the backward (``jax.checkpoint``), same values.

    ``query_multiple`` pads the last block's query slots to a multiple of it (default 8 where
    the cudnn path runs, whose training kernel refuses an odd query count, e.g. 19 slots at
    rate 0.15 of 128): the padded slots repeat position 0 and their outputs are dropped, so
    values and gradients are those of the unpadded block.

    ``dropout_key`` (fine-tuning) turns on ``config.dropout`` after the embeddings and each
    block's attention and MLP outputs, and ``config.attention_dropout`` on each block's
    attention probabilities; without it (pretraining, evaluation) there is none. A
    key per row (shape (batch,): the contrastive stage) gives each row the masks it would get
    alone in a batch of one with its key."""
    inputs, attention_mask = jnp.asarray(inputs), jnp.asarray(attention_mask)
    segments = None if segments is None else jnp.asarray(segments)
    _check_inputs(config, inputs, attention_mask, segments)
    c = config
    seq = inputs.shape[1]
    attention_mask = attention_mask.astype(jnp.bool_)
    shared = pattern.shared(c, attention_mask, segments)

    emb = params["embeddings"]
    x = emb["word"][inputs]  # (batch, seq, hidden) float32
    if c.positions == "learned":  # restarting at every packed document's first token
        x = x + (emb["position"][positions_lib.document_positions(segments)]
                 if c.attention_within_segments else emb["position"][None, :seq])
    if c.embedding_norm:
        x = layers.layer_norm(x, emb["layer_norm"], c.layer_norm_eps)
    stacked = pattern.fused_layers(params["layers"], c)
    if dropout_key is not None and c.drops:  # a key per layer, scanned with it
        keys = (jax.random.split(dropout_key, c.layers + 1) if dropout_key.ndim == 0 else
                jax.vmap(jax.random.split, (0, None), 1)(dropout_key, c.layers + 1))
        x, stacked = layers.dropout(x, keys[-1], 0, c.dropout), {
            **stacked, "dropout_key": keys[:-1]}

    block = _remat(_block, c.remat)
    unroll = (True if c.unroll is None else c.unroll) if unroll is None else unroll

    def step(x, p):
        return block(x, p, shared, c), None

    if positions is None:
        x, _ = jax.lax.scan(step, x, stacked, unroll=unroll)
    else:
        positions = jnp.asarray(positions)
        if positions.ndim != 2 or positions.shape[0] != inputs.shape[0]:
            raise ValueError(
                f"positions have shape {positions.shape}; pass (batch, count) int positions "
                f"for inputs of shape {inputs.shape}"
            )
        if c.layers > 1:
            first = jax.tree_util.tree_map(lambda a: a[:-1], stacked)
            x, _ = jax.lax.scan(step, x, first, unroll=unroll)
        last = jax.tree_util.tree_map(lambda a: a[-1], stacked)
        count = positions.shape[1]
        cudnn = "cudnn" in pattern.attention_plan(c, seq, rows=True).paths()
        multiple = query_multiple or (CUDNN_QUERY_MULTIPLE if cudnn else 1)
        rows = jnp.pad(positions, ((0, 0), (0, -count % multiple)))  # padded slots: position 0
        x = block(x, last, shared, c, rows)[:, :count]
    if c.layer_norm == "pre" and c.final_norm:
        x = layers.layer_norm(x, params["final_norm"], c.layer_norm_eps)
    return x


def gather(hidden: jax.Array, positions: jax.Array) -> jax.Array:
    """Hidden states at selected positions.

    hidden: (batch, seq, hidden); positions: (batch, count) int. Returns (batch, count, hidden).
    """
    if hidden.ndim != 3 or positions.ndim != 2 or positions.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"gather got hidden {hidden.shape} and positions {positions.shape}; pass "
            "(batch, seq, hidden) and (batch, count) with the same batch"
        )
    return jnp.take_along_axis(hidden, positions[:, :, None], axis=1)


def mlm_logits(params: Params, config: ModelConfig, hidden_sel: jax.Array) -> jax.Array:
    """MLM head on gathered hidden states: dense -> GELU -> LayerNorm -> tied decoder + bias.

    hidden_sel: (batch, count, hidden). Returns (batch, count, vocab) float32.
    """
    head, dtype = params["head"], config.dtype
    h = layers.gelu(layers.dense(hidden_sel, head["transform"], dtype))
    h = layers.layer_norm(h, head["layer_norm"], config.layer_norm_eps)  # (batch, count, hidden)
    word = params["embeddings"]["word"]  # (vocab, hidden), contracted on hidden (no transpose)
    decode = kernels.decode if kernels.on_cpu() else kernels.plain_decode
    return decode(h, word, dtype) + head["bias"]  # (batch, count, vocab) float32


def logits_at(params: Params, config: ModelConfig, inputs: jax.Array, segments: jax.Array,
              positions: jax.Array) -> jax.Array:
    """MLM logits at ``positions``: the forward every judge uses, with the last block computed
    only there (``apply(..., positions=)``, as in training).

    inputs, segments: (batch, seq) int, segment 0 = padding (``segments > 0`` is the attention
    mask); positions: (batch, count) int. Returns (batch, count, vocab) float32.
    """
    segments = jnp.asarray(segments)
    hidden = apply(params, config, inputs, segments > 0, segments, positions=positions)
    return mlm_logits(params, config, hidden)  # (batch, count, vocab)


def decay_mask(params: Params) -> Params:
    """Same-structure pytree of bool, True only for dense kernels (for ``optax.adamw(mask=)``).

    Biases, LayerNorm scales/biases and embeddings are not decayed.
    """

    def is_kernel(path, _):
        last = path[-1]
        return getattr(last, "key", None) == "kernel"

    return jax.tree_util.tree_map_with_path(is_kernel, params)


def param_count(params: Params) -> int:
    """Number of scalars in ``params`` (works on ``jax.eval_shape`` output too)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))
