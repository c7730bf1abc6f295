"""The contrastive step: InfoNCE over in-batch negatives, with gradient caching.

A batch is ``B`` (query, positive) pairs, optionally with a hard negative each. Embeddings are
pooled final hidden states (``core/pooling.py``), scaled to unit length, so a score is a cosine;
query ``i``'s candidates are every positive of the batch (and every negative), its own positive
the answer, at temperature ``τ``. The loss is a (sum, count): the cross-entropy summed over the
``B`` queries (and, ``symmetric``, over the ``B`` positives choosing among the queries), divided
once by the count.

The batch is a global array over the device mesh's ``data`` axis, so the ``B × B`` score matrix
``jit`` builds is the whole global batch's: the in-batch negatives are gathered over every
device and process, and the global batch is the contrastive batch whatever the layout.

Gradient caching (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"; ``CachedMultipleNegativesRankingLoss``): with ``chunks`` > 1 the encoder runs on
``B / chunks`` rows at a time — first without gradients, to get every embedding; then the loss
and its gradient *with respect to the embeddings* over the whole batch; then each chunk again,
its embeddings' gradient pulled back through the encoder (``jax.vjp``) and summed. The result is
the full-batch gradient (to float rounding) with one chunk's activations in memory at a time.
Chunk ``j`` takes rows ``j, j + chunks, ...`` so every chunk spans every device. Dropout draws a
key per side and *row of the batch* (``fold_in(fold_in(key, side), row)``; the encoder takes
the row keys and draws each row's masks from its own, ``core/layers.py`` ``dropout``), the
same in both passes and whatever chunk holds the row: so
``chunks`` changes no number beyond float rounding, with dropout or without (speed and memory
only; a stage may resume with other chunks).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from clozax.core import model as model_lib
from clozax.core.pooling import pool, pool_segments
from clozax.core.train_state import TrainState
from clozax.train.step import all_finite

SIDES = ("query", "positive", "negative")


def info_nce(queries: jax.Array, positives: jax.Array, negatives: jax.Array | None,
             temperature: float, symmetric: bool) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)`` of InfoNCE over unit-length embeddings ``queries``/``positives``
    [B, H] (and ``negatives`` [B, H] or None): query ``i`` picks positive ``i`` among all
    positives and negatives; ``symmetric`` adds positive ``i`` picking query ``i``."""
    candidates = positives if negatives is None else jnp.concatenate([positives, negatives])
    scores = queries @ candidates.T / temperature  # [B, B] or [B, 2B]
    answer = jnp.arange(queries.shape[0])
    total = optax.softmax_cross_entropy_with_integer_labels(scores, answer).sum()
    count = queries.shape[0]
    if symmetric:
        back = scores[:, :queries.shape[0]].T  # [B, B]: positive i over the queries
        total += optax.softmax_cross_entropy_with_integer_labels(back, answer).sum()
        count *= 2
    return total, jnp.asarray(count, jnp.int32)


def row_keys(key, side: str, rows):
    """Dropout keys of ``rows`` (their indices) of one side: ``fold_in(fold_in(key, side),
    row)``, each row's masks drawn from its own (``core/layers.py`` ``dropout``)."""
    side_key = jax.random.fold_in(key, SIDES.index(side))
    return jax.vmap(lambda r: jax.random.fold_in(side_key, r))(rows)


def make_embedder(model_config, pooling: str):
    """``(params, ids [N, L], key | None) -> [N, H]`` unit-length pooled embeddings; a key
    turns on ``model_config.dropout`` (and ``attention_dropout``). Padding is ``ids == pad``
    (the mask is given)."""

    def embed(params, ids, mask, key):
        hidden = model_lib.apply(params, model_config, ids, mask, mask.astype(jnp.int32),
                                 dropout_key=key)  # [N, L, H]
        return pool(hidden, mask, pooling, normalize=True)

    return embed


def make_packed_embedder(model_config, pooling: str):
    """``(params, ids [R, L], segments [R, L], where [N, 2], keys [R] | None) -> [N, H]``:
    texts packed several to a row (``data/pairs.py`` ``pack_texts``), each attending only to
    itself with positions from 0 (``model.attention_within_segments``), pooled per segment and
    gathered back in text order, unit length; ``keys`` (one per row) turn on dropout."""
    packed = dataclasses.replace(model_config, attention_within_segments=True)

    def hidden_of(params, ids, segments, key):
        return model_lib.apply(params, packed, ids, segments > 0, segments, dropout_key=key)

    def embed(params, ids, segments, where, keys):
        hidden = hidden_of(params, ids, segments, keys)  # [R, L, H]
        # A text is [CLS] ... [SEP], at least 2 tokens: at most L / 2 of them in a row
        per_segment = pool_segments(hidden, segments, ids.shape[1] // 2, pooling)  # [R, K, H]
        out = per_segment[where[:, 0], where[:, 1]]  # [N, H]
        return out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)

    return embed


def make_loss_and_grads(model_config, pooling: str, temperature: float, symmetric: bool,
                        chunks: int, pad: int, packed: bool = False):
    """``(params, batch, key) -> (sum, count, grad_sum)``; ``batch`` holds ``query`` and
    ``positive`` (and ``negative``) token rows [B, L]. ``chunks`` > 1: gradient caching.
    ``packed``: each side is ``pack_texts``' ``{side: ids, side_segments: …, side_where:
    …}`` instead (one pass, no gradient cache); without dropout, the numbers of the padded
    rows to float rounding (tested), and fewer rows to compute when texts are short."""
    def loss_of(embeddings):  # {side: [B, H]} -> (sum, (sum, count))
        total, count = info_nce(embeddings["query"], embeddings["positive"],
                                embeddings.get("negative"), temperature, symmetric)
        return total, (total, count)

    if packed:
        return _packed_loss_and_grads(model_config, pooling, loss_of)
    embed = make_embedder(model_config, pooling)

    def embed_rows(params, ids, rows, key, side):  # rows: each row's index in the batch
        if not model_config.drops:
            return embed(params, ids, ids != pad, None)
        return embed(params, ids, ids != pad, row_keys(key, side, rows))

    def whole(params, batch, key):  # chunks == 1: one forward, one backward
        def loss(p):
            return loss_of({s: embed_rows(p, ids, jnp.arange(ids.shape[0]), key, s)
                            for s, ids in batch.items()})
        grad_sum, (total, count) = jax.grad(loss, has_aux=True)(params)
        return total, count, grad_sum

    def split(x):  # [B, ...] -> [chunks, B / chunks, ...], chunk j = rows j, j + chunks, ...
        return x.reshape(x.shape[0] // chunks, chunks, *x.shape[1:]).swapaxes(0, 1)

    def unsplit(x):  # the inverse of split
        return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])

    def cached(params, batch, key):
        parts = {s: split(ids) for s, ids in batch.items()}  # {side: [chunks, b, L]}
        rows = split(jnp.arange(next(iter(batch.values())).shape[0]))  # [chunks, b]

        def first_pass(side):  # embeddings of every chunk, no gradient kept
            return unsplit(jax.lax.map(
                lambda a: embed_rows(params, a[1], a[0], key, side), (rows, parts[side])))

        embeddings = {s: jax.lax.stop_gradient(first_pass(s)) for s in parts}
        (_, (total, count)), cotangents = jax.value_and_grad(loss_of, has_aux=True)(embeddings)
        cotangents = {s: split(g) for s, g in cotangents.items()}

        def second_pass(grad_acc, a):  # one chunk again, its embeddings' gradient pulled back
            chunk_rows, chunk_ids, chunk_cot = a
            for side in parts:
                ids = chunk_ids[side]
                _, pull = jax.vjp(lambda p, ids=ids, side=side: embed_rows(
                    p, ids, chunk_rows, key, side), params)
                grad_acc = jax.tree.map(jnp.add, grad_acc, pull(chunk_cot[side])[0])
            return grad_acc, None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, _ = jax.lax.scan(second_pass, zeros, (rows, parts, cotangents))
        return total, count, grad_sum

    return whole if chunks == 1 else cached


def _packed_loss_and_grads(model_config, pooling: str, loss_of):
    """``make_loss_and_grads(packed=True)``: every side's packed rows embedded in one pass,
    ``loss_of`` (InfoNCE) over the texts in their batch order."""
    embed = make_packed_embedder(model_config, pooling)

    def loss_and_grads(params, batch, key):
        def embed_side(p, side):
            ids = batch[side]
            keys = (row_keys(key, side, jnp.arange(ids.shape[0]))
                    if model_config.drops else None)
            return embed(p, ids, batch[f"{side}_segments"], batch[f"{side}_where"], keys)

        def loss(p):
            return loss_of({side: embed_side(p, side) for side in SIDES if side in batch})

        grad_sum, (total, count) = jax.grad(loss, has_aux=True)(params)
        return total, count, grad_sum

    return loss_and_grads


def stage_rate(peak: float):
    """The stage's learning rate ``rate(count, total_steps)``: linear warm-up over the first
    tenth of the stage's length (at least 1 update, at most ``total_steps - 1``), then linear
    decay to 0 at ``total_steps`` — ``core/optim.py``'s ``learning_rate`` with that warm-up,
    computed from the length in the optimizer state, so a ``--minutes`` stage's warm-up is a
    tenth of the length its budget chose (a change of it recompiles nothing)."""

    def rate(count, total_steps):
        count = jnp.asarray(count, jnp.float32)
        tenth = jnp.maximum((jnp.asarray(total_steps, jnp.int32) + 9) // 10, 1)
        total = jnp.asarray(total_steps, jnp.float32)
        warmup = jnp.minimum(tenth.astype(jnp.float32), jnp.maximum(total - 1.0, 0.0))
        frac = jnp.clip((count - warmup) / jnp.maximum(total - warmup, 1.0), 0.0, 1.0)
        decayed = peak + (0.0 - peak) * frac
        warming = peak * count / jnp.maximum(warmup, 1.0)
        return jnp.where(count < warmup, warming, decayed)

    return rate


def make_embed_step(model_config, optimizer, schedule, pooling: str, temperature: float,
                    symmetric: bool, chunks: int, pad: int, packed: bool = False):
    """The pure step ``(state, batch, key) -> (state, metrics)``: the loss's gradient divided
    once by its count, then the optimizer's update. Dropout's key is ``fold_in(key, step)``.
    ``packed``: the batch is packed rows (``make_loss_and_grads``)."""
    loss_and_grads = make_loss_and_grads(model_config, pooling, temperature, symmetric,
                                         chunks, pad, packed)

    def step(state: TrainState, batch: dict, key):
        total, count, grad_sum = loss_and_grads(state.params, batch,
                                                jax.random.fold_in(key, state.step))
        denom = count.astype(jnp.float32)
        grads = jax.tree.map(lambda g: g / denom, grad_sum)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": total / denom, "grad_norm": grad_norm,
                   "lr": schedule(state.opt_state),
                   # the updated parameters too (an overflow): none may reach a checkpoint
                   "finite": jnp.isfinite(total) & jnp.isfinite(grad_norm) & all_finite(params)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return step
