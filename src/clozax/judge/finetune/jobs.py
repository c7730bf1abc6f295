"""One fine-tuning job and what every job of a task shares: length-bucketed fixed-shape
batches, the jitted step and forward (compiled once per batch width for all jobs of a task),
predictions and metrics on a split. A job is a pure function of (encoder, task, protocol,
learning rate, seed), so seeds repeat bitwise. A job scores validation and test after every
epoch; the epoch kept is the one with the best validation score (``best_epoch``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clozax.core import model as model_lib
from clozax.judge.finetune import heads, tasks

WIDTH_MULTIPLE = 32
BUCKET_POOL = 50  # batches whose examples are sorted by length together (training order)
ADAM = {"b1": 0.9, "b2": 0.98, "eps": 1e-6}
# The learning-rate grid by encoder width (``default_learning_rates``): base-size encoders and
# up as the field tunes them (BERT's paper 2e-5–5e-5; run_glue.py 5e-5; ModernBERT's GLUE
# sweeps about 1e-5–8e-5); the narrow CPU presets, measured in docs/tutorials/finetune.md.
BASE_WIDTH = 768
BASE_LEARNING_RATES = (2e-5, 5e-5, 1e-4)
SMALL_LEARNING_RATES = (1e-4, 3e-4, 1e-3)


def default_learning_rates(model_config) -> tuple[float, ...]:
    return BASE_LEARNING_RATES if model_config.hidden >= BASE_WIDTH else SMALL_LEARNING_RATES


@dataclass(frozen=True)
class Protocol:
    """How every job of a task trains, and how many there are."""

    learning_rates: tuple[float, ...] | None = None  # None: by encoder width
    seeds: int = 3
    epochs: int = 3
    batch_size: int = 32
    warmup_fraction: float = 0.06
    weight_decay: float = 0.01
    dropout: float = 0.1
    pooling: str = "cls"  # "mean" for the modern head only (ModernBERT's classifier_pooling)
    control: bool = True  # also fine-tune the random-init encoder
    compute_dtype: str | None = None  # None: the run's
    max_train_examples: int | None = None  # a keyed choice of this many training examples
    layer_decays: tuple[float, ...] = (1.0,)  # layer-wise decay grid (``layer_rates``); 1: none
    reinit_top: int = 0  # the trained encoder's top blocks started from its random init

    def __post_init__(self):
        if self.learning_rates is not None and (not self.learning_rates or any(
                not (0 < lr < 1) for lr in self.learning_rates)):
            raise ValueError(f"learning rates {self.learning_rates} must be in (0, 1); pass "
                             "e.g. --lr 1e-4,3e-4")
        for name in ("seeds", "epochs", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0 <= self.warmup_fraction < 1 or not 0 <= self.dropout < 1:
            raise ValueError("warmup_fraction and dropout must be in [0, 1)")
        if self.pooling not in heads.POOLINGS:
            raise ValueError(f"pooling {self.pooling!r} is not one of {heads.POOLINGS}")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"compute dtype {self.compute_dtype!r} is not float32 or bfloat16")
        if self.max_train_examples is not None and self.max_train_examples < 2:
            raise ValueError("max_train_examples must be at least 2")
        if int(self.reinit_top) < 0:
            raise ValueError(f"reinit_top={self.reinit_top} must be 0 (none) or more blocks")
        if not self.layer_decays or any(not 0 < d <= 1 for d in self.layer_decays):
            raise ValueError(f"layer decays {self.layer_decays} must be in (0, 1]; pass e.g. "
                             "--layer-decay 0.8, or 1 for none, or a grid: --layer-decay 1,0.8")
        for option, grid in (("--lr", self.learning_rates or ()), ("--layer-decay",
                                                                   self.layer_decays)):
            if len(set(grid)) < len(grid):  # one job per (rate, decay, seed): never two
                raise ValueError(f"{option} lists a value twice ({', '.join(map(str, grid))}); "
                                 "give each once")


# --------------------------------------------------------------------------- batches


def _width(n: int, seq_len: int) -> int:
    return min(-(-n // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, seq_len)


def batches(split: tasks.Split, batch: int, seq_len: int, rng=None) -> list[np.ndarray]:
    """Index arrays, each of examples of similar length. With ``rng`` (training): shuffled,
    sorted by length within pools of ``BUCKET_POOL`` batches, batch order shuffled; without:
    sorted by length (evaluation)."""
    n = len(split)
    lengths = np.asarray([len(x) for x in split.ids])
    if rng is None:
        order = np.argsort(lengths, kind="stable")
        return [order[i: i + batch] for i in range(0, n, batch)]
    order = rng.permutation(n)
    out = []
    for start in range(0, n, batch * BUCKET_POOL):
        pool = order[start: start + batch * BUCKET_POOL]
        pool = pool[np.argsort(lengths[pool], kind="stable")]
        out += [pool[i: i + batch] for i in range(0, len(pool), batch)]
    return [out[i] for i in rng.permutation(len(out))]


def arrays(split: tasks.Split, idx: np.ndarray, batch: int, kind: str, pad: int,
           seq_len: int) -> dict:
    """One fixed-shape batch: inputs, mask (batch, width); y; weight (batch,) 0 for pad rows."""
    width = _width(max(len(split.ids[i]) for i in idx), seq_len)
    inputs = np.full((batch, width), pad, np.int32)
    mask = np.zeros((batch, width), bool)
    weight = np.zeros((batch,), np.float32)
    if kind == "tokens":
        y = np.full((batch, width), tasks.IGNORE, np.int32)
    else:
        y = np.zeros((batch,), np.float32 if kind == "regression" else np.int32)
    for r, i in enumerate(idx):
        ids = split.ids[i]
        inputs[r, : len(ids)] = ids
        mask[r, : len(ids)] = True
        weight[r] = 1.0
        if kind == "tokens":
            y[r, : len(ids)] = split.y[i]
        else:
            y[r] = split.y[i]
    return {"inputs": inputs, "mask": mask, "y": y, "weight": weight}


# --------------------------------------------------------------------------- jobs


def layer_rates(params, layers: int, decay: float):
    """Each parameter's learning-rate factor under layer-wise decay, BEiT's form of ELECTRA's
    (Bao et al. 2021; Clark et al. 2020): the task head and what sits above the last layer
    (the final norm) 1, layer i of L (0 the lowest) ``decay ** (L - i)``, the embeddings
    ``decay ** (L + 1)``. A pytree like ``params`` ({"encoder": ..., "head": ...}); the
    stacked layers' factors are (L, 1, ...), one per layer. ``decay`` may be traced (the
    fine-tuning step's argument, as its rate is); 1 gives factors of exactly 1."""
    decay = jnp.asarray(decay, jnp.float32)
    per_layer = decay ** jnp.arange(layers, 0, -1, dtype=jnp.float32)  # (L,) the lowest first

    def rate(path, leaf):
        where = [getattr(k, "key", None) for k in path[:2]]
        if where == ["encoder", "layers"]:
            return per_layer.reshape((layers,) + (1,) * (leaf.ndim - 1))
        if where == ["encoder", "embeddings"]:
            return decay ** jnp.float32(layers + 1)
        return jnp.float32(1.0)

    return jax.tree_util.tree_map_with_path(rate, params)


def reinit_top(encoder: dict, fresh: dict, count: int) -> dict:
    """``encoder``'s parameters with its top ``count`` blocks taken from ``fresh`` (the run's
    random init): Zhang et al. 2021's re-initialisation, for blocks that pretraining made
    specialists in its own objective. The embeddings, the lower blocks, the final norm and
    the MLM head (the modern task head starts from its transform) stay pretrained; 0 returns
    ``encoder`` itself."""
    layers = jax.tree.leaves(encoder["layers"])[0].shape[0]
    if not 0 <= count <= layers:
        raise ValueError(f"--reinit-top {count}: the encoder has {layers} blocks; pass 0 to "
                         f"{layers}")
    if count == 0:
        return encoder
    keep = layers - count
    mixed = jax.tree.map(lambda pre, new: jnp.concatenate([jnp.asarray(pre)[:keep],
                                                           jnp.asarray(new)[keep:]]),
                         encoder["layers"], fresh["layers"])  # (layers, ...) each
    return {**encoder, "layers": mixed}


@dataclass(frozen=True)
class Setup:
    """What every job of a task shares: its compiled functions and their shapes."""

    model_config: object
    style: str
    kind: str
    outputs: int
    protocol: Protocol
    steps: int
    pad: int
    seq_len: int
    step_fn: object
    logits_fn: object
    optimizer: object
    sharding: object


def make_setup(model_config, task: tasks.Task, protocol: Protocol, pad: int,
               seq_len: int) -> Setup:
    c = model_config
    if protocol.compute_dtype is not None:
        c = replace(c, compute_dtype=protocol.compute_dtype)
    style, kind = heads.style_for(c), task.kind
    if protocol.pooling == "mean" and style != "modern":
        raise ValueError(f"pooling 'mean' is ModernBERT's option; this {style}-style encoder "
                         "pools [CLS] (drop --pooling)")
    outputs = 1 if kind == "regression" else len(task.labels)
    per_epoch = -(-len(task.splits["train"]) // protocol.batch_size)
    steps = per_epoch * protocol.epochs
    warm = max(1, round(protocol.warmup_fraction * steps))

    def shape(count):  # linear warm-up to 1, linear decay to 0 at the last step
        up = (count + 1) / warm
        down = (steps - count) / max(steps - warm, 1)
        return jnp.clip(jnp.where(count < warm, up, down), 0.0, 1.0)

    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(**ADAM),
        optax.add_decayed_weights(protocol.weight_decay, mask=model_lib.decay_mask),
        optax.scale_by_schedule(shape),
    )

    def logits(params, batch, key):  # key None: evaluation, no dropout anywhere
        hidden = model_lib.apply(params["encoder"], c, batch["inputs"], batch["mask"],
                                 batch["mask"].astype(jnp.int32),  # (batch, width, hidden)
                                 dropout_key=None if key is None else jax.random.fold_in(key, 1))
        return heads.apply_head(params["head"], style, c, kind, hidden, batch["mask"],
                                pooling=protocol.pooling, dropout=protocol.dropout, key=key)

    def loss(params, batch, key):
        total, count = heads.loss_sum_count(kind, logits(params, batch, key), batch["y"],
                                            batch["weight"])
        return total / jnp.maximum(count, 1.0), (total, count)

    def step(params, opt_state, batch, key, lr, decay):  # one program for every (lr, decay)
        (_, (total, count)), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        rates = layer_rates(params, c.layers, decay)  # each parameter's share of lr
        updates = jax.tree.map(lambda u, r: -lr * r * u, updates, rates)
        return optax.apply_updates(params, updates), opt_state, total, count

    devices = jax.devices()
    sharding = None
    if len(devices) > 1 and protocol.batch_size % len(devices) == 0:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        sharding = NamedSharding(Mesh(np.asarray(devices), ("data",)), PartitionSpec("data"))
    return Setup(c, style, kind, outputs, protocol, steps, pad, seq_len,
                 jax.jit(step, donate_argnums=(0, 1)),
                 jax.jit(lambda p, b: logits(p, b, None)), optimizer, sharding)


def _device(setup: Setup, batch: dict) -> dict:
    if setup.sharding is None:
        return batch
    return {k: jax.device_put(v, setup.sharding) for k, v in batch.items()}


def predict(setup: Setup, params, split: tasks.Split, batch: int | None = None) -> list:
    """Per example: class id, value (regression), or per labelled position class ids
    (tokens; positions where ``split.y`` is not ``IGNORE``), with the logits."""
    batch = batch or setup.protocol.batch_size
    out = [None] * len(split)
    for idx in batches(split, batch, setup.seq_len):
        b = arrays(split, idx, batch, setup.kind, setup.pad, setup.seq_len)
        logits = np.asarray(setup.logits_fn(params, _device(setup, b)))
        for r, i in enumerate(idx):
            if setup.kind == "tokens":
                n = len(split.ids[i])
                out[i] = logits[r, :n]
            else:
                out[i] = logits[r]
    return out


def score(setup: Setup, task: tasks.Task, params, split_name: str) -> dict:
    split = task.splits[split_name]
    logits = predict(setup, params, split)
    if setup.kind == "tokens":
        keep = [np.asarray(y) >= 0 for y in split.y]
        y_true = [np.asarray(y)[k] for y, k in zip(split.y, keep, strict=True)]
        y_pred = [np.argmax(lg, -1)[k] for lg, k in zip(logits, keep, strict=True)]
    elif setup.kind == "regression":
        y_true, y_pred = split.y, [float(lg[0]) for lg in logits]
    else:
        y_true, y_pred = split.y, [int(np.argmax(lg)) for lg in logits]
    return heads.metrics(setup.kind, y_true, y_pred, task.labels)


def score_tests(setup: Setup, task: tasks.Task, params) -> dict:
    """The test split's metrics, and each further test split's (MNLI's ``test_mismatched``)
    under its suffix: ``mismatched_accuracy``."""
    out = score(setup, task, params, "test")
    for name in task.splits:
        if name.startswith("test_"):
            extra = score(setup, task, params, name)
            out.update({f"{name[len('test_'):]}_{k}": v for k, v in extra.items()})
    return out


def initial_params(setup: Setup, encoder: dict, seed: int) -> dict:
    key = jax.random.fold_in(jax.random.key(seed), 0)
    head = heads.init_head(setup.style, setup.model_config, setup.kind, setup.outputs, key,
                           mlm_head=encoder.get("head"))
    body = {k: v for k, v in encoder.items() if k != "head"}
    return {"encoder": jax.tree.map(jnp.array, body), "head": head}


def best_epoch(record: dict, metric: str) -> int:
    """The epoch (1-based) whose validation ``metric`` is best (ties: the earlier)."""
    scores = [e["validation"][metric] for e in record["per_epoch"]]
    return 1 + int(np.argmax(scores))


def run_job(setup: Setup, task: tasks.Task, encoder: dict, lr: float, seed: int,
            advance=None, until_epoch: int | None = None, keep_best: bool = False,
            decay: float = 1.0) -> tuple[dict, dict]:
    """Fine-tune ``encoder`` once at rate ``lr`` and layer decay ``decay``, scoring validation
    and test after every epoch; returns (record, params after the last epoch run) — or,
    ``keep_best``, a host copy of the params at the best-validation epoch (``best_epoch``: the
    model the job would be selected with).
    ``until_epoch`` stops after that epoch (the schedule still spans every epoch: the same
    weights the full job had then). ``advance(n)`` hears progress."""
    started = time.perf_counter()
    params = initial_params(setup, encoder, seed)
    # Committed to the devices from the start, as the step's outputs are: an uncommitted first
    # call would compile the step a second time.
    where = (jax.devices()[0] if setup.sharding is None else
             setup.sharding.update(spec=jax.sharding.PartitionSpec()))
    params = jax.device_put(params, where)
    opt_state = jax.device_put(setup.optimizer.init(params), where)
    dropout_key = jax.random.fold_in(jax.random.key(seed), 1)
    split, protocol = task.splits["train"], setup.protocol
    rate, by_layer = jnp.float32(lr), jnp.float32(decay)
    step, losses, per_epoch, best = 0, [], [], None
    for epoch in range(until_epoch or protocol.epochs):
        total = count = 0.0
        rng = np.random.default_rng([seed, epoch])
        for idx in batches(split, protocol.batch_size, setup.seq_len, rng):
            b = arrays(split, idx, protocol.batch_size, setup.kind, setup.pad, setup.seq_len)
            params, opt_state, s, n = setup.step_fn(params, opt_state, _device(setup, b),
                                                    jax.random.fold_in(dropout_key, step), rate,
                                                    by_layer)
            total, count = total + s, count + n
            step += 1
            if advance is not None:
                advance(1)
        losses.append(float(total) / max(float(count), 1.0))
        if not np.isfinite(losses[-1]):  # a result, not an error: the protocol goes on
            return {"learning_rate": lr, "layer_decay": decay, "seed": seed, "steps": step,
                    "train_loss_per_epoch": [x if np.isfinite(x) else str(x) for x in losses],
                    "diverged": {"epoch": epoch + 1, "step": step, "loss": str(losses[-1])},
                    "seconds": round(time.perf_counter() - started, 2)}, None
        per_epoch.append({"validation": score(setup, task, params, "validation"),
                          "test": score_tests(setup, task, params)})
        if keep_best and best_epoch({"per_epoch": per_epoch}, task.metric) == epoch + 1:
            best = jax.device_get(params)
    record = {"learning_rate": lr, "layer_decay": decay, "seed": seed, "steps": step,
              "train_loss_per_epoch": losses, "per_epoch": per_epoch,
              "seconds": round(time.perf_counter() - started, 2)}
    return record, best if keep_best else params
