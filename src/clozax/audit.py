"""The audit: the objective's invariants, checked on a run's real batches and data.

Each check is a small function returning a ``CheckResult``; ``run`` takes the pipeline's pieces
(masker, logits function, loss, train-step factory, emptiness boundary), each defaulting to
clozax's own, so a modified corruption function or model can be audited without editing clozax.
``audit_run`` and ``audit_data`` fill the defaults from a run or a dataset directory.

Checks, numbered as printed (``CHECKS``):

 1 no_leak                 changing the clean ids at replaced (mask/random) positions changes
                           neither the encoder inputs nor any logit, bit for bit
 2 corruption_mix          the fraction of selected inputs equal to their target lies in the
                           binomial 99.9 % interval of keep + random / |random pool|
 3 initial_loss            with a zeroed head the loss is log(V) to 1e-5
 4 unselected_zero_grad    unselected output logits get exactly zero gradient
 5 analytic_gradient       autodiff of the loss equals (softmax - onehot) * selected / count
 6 microbatch_accumulation k microbatches give the full batch's loss and gradient (rel 1e-5)
 7 device_accumulation     1 device gives N devices' loss and gradient (skipped when 1 visible)
 8 eligibility             over many batches: no pad or special position selected, the mask id
                           never a target, random replacements never special, unselected
                           inputs untouched, targets the clean ids
 9 data_disjoint           no group and no document hash in both splits
10 tokenizer               trained on train only; sha256 of the files equal the recorded ones
11 packing_accounting      read = kept + duplicates + skipped; rows x seq_len = tokens + pad;
                           the arrays and documents.jsonl agree with the manifest
12 eval_masks              the stored eval-mask set's sha256 matches, and rebuilding it from the
                           eval key reproduces it
13 empty_selection         an empty selection is rejected on the host with a clear ValueError
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clozax import __version__, masking, objective
from clozax import evaluate as eval_lib
from clozax import model as model_lib
from clozax.config import RunConfig
from clozax.data.dataset import ARRAYS, Dataset, Split, open_dataset
from clozax.data.loader import batch_rows, host_batch
from clozax.data.split import SPLITS
from clozax.data.tokenizer import file_sha256
from clozax.masking import Kind, MaskedBatch, Selection
from clozax.train import Keys, TrainState, Vocabulary, make_masker, make_train_step

AUDIT_FILE = "audit.json"
CHECKS = (
    "no_leak", "corruption_mix", "initial_loss", "unselected_zero_grad", "analytic_gradient",
    "microbatch_accumulation", "device_accumulation", "eligibility", "data_disjoint",
    "tokenizer", "packing_accounting", "eval_masks", "empty_selection",
)
DATA_CHECKS = ("data_disjoint", "tokenizer", "packing_accounting")
LOSS_TOL = 1e-5  # |loss - log V| with a zeroed head
ACCUMULATION_RTOL = 1e-5
GRAD_RTOL = 1e-5  # analytic vs autodiff, relative to the largest gradient entry
INTERVAL = 0.999  # binomial interval of the corruption-mix check


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    value: Any  # JSON-able measurement
    detail: str
    skipped: bool = False  # passed without running (e.g. one device visible); said in detail


# --------------------------------------------------------------------------- pipeline pieces


@functools.lru_cache(maxsize=8)
def default_logits_fn(model_config):
    """``(params, batch, masked, selection) -> (batch, count, vocab)``: encoder on the corrupted
    inputs only, MLM head at the selected slots (as in training)."""

    def logits_fn(params, batch, masked: MaskedBatch, selection: Selection):
        segments = batch["segments"]
        hidden = model_lib.apply(params, model_config, masked.inputs, segments > 0, segments)
        return model_lib.mlm_logits(params, model_config,
                                    model_lib.gather(hidden, selection.positions))

    return logits_fn


def default_zero_head(params):
    """Parameters whose MLM logits are exactly 0 everywhere: the head's LayerNorm scale and bias
    and the output bias are zeroed, so the normalised features are 0 and ``0 @ E.T + 0 = 0``.
    (Zeroing the transform alone is not enough: LayerNorm's bias would still reach the
    tied decoder.)"""
    head = dict(params["head"])
    head["layer_norm"] = jax.tree.map(jnp.zeros_like, head["layer_norm"])
    head["bias"] = jnp.zeros_like(head["bias"])
    return {**params, "head": head}


def default_boundary(tokens, selected) -> None:
    """The host-side check that guards the objective: raises ValueError on an empty selection."""
    objective.check_nonempty(selected)


def default_make_step(vocab: Vocabulary, seq_len: int):
    """``(config, optimizer, schedule, mesh) -> step``: clozax's own ``make_train_step``."""
    return _default_make_step(vocab.size, _specials_key(vocab), seq_len)


def default_masker(config: RunConfig, vocab: Vocabulary, seq_len: int):
    """The run's own masker, ``make_masker`` (cached, so repeated audits compile it once)."""
    return _default_masker(config.masking, vocab.size, _specials_key(vocab), seq_len)


def _specials_key(vocab: Vocabulary) -> tuple:
    return tuple(sorted(vocab.specials.items()))


# Default pieces are cached by value so that audits of the same shapes reuse compilations
# (jit caches by function identity).
@functools.lru_cache(maxsize=8)
def _default_masker(masking_config, size, specials, seq_len):
    return make_masker(masking_config, Vocabulary(size, dict(specials)), seq_len)


@functools.lru_cache(maxsize=8)
def _default_make_step(size, specials, seq_len):
    vocab = Vocabulary(size, dict(specials))

    @functools.lru_cache(maxsize=16)  # the same step object for the same arguments
    def make_step(config, optimizer, schedule, mesh):
        return make_train_step(config, vocab, seq_len, optimizer, schedule, mesh)

    return make_step


@dataclass(frozen=True)
class Pipeline:
    """What the audit exercises. Signatures (axis names as in ``masking``):

    masker(key, batch) -> (MaskedBatch, Selection), jittable; batch holds (batch, seq)
        ``tokens``/``segments``/``word_starts``.
    logits_fn(params, batch, masked, selection) -> (batch, count, vocab) float32.
    loss_fn(logits, targets, selected) -> (sum, count); the audit divides once.
    make_step(config, optimizer, schedule, mesh) -> step(state, batch, mask_key) -> (state,
        metrics with "loss"), pure; the gradient reaches ``optimizer.update``.
    boundary(tokens, selected) -> None; raises ValueError when the selection is unusable.
    zero_head(params) -> params whose logits are constant.
    """

    config: RunConfig
    vocab: Vocabulary
    seq_len: int
    params: dict
    masker: Callable
    logits_fn: Callable
    loss_fn: Callable
    make_step: Callable
    boundary: Callable
    zero_head: Callable


def _take_rows(tree, n: int):
    # On the host: slicing device arrays eagerly would compile one small program per leaf.
    return jax.tree.map(lambda x: np.asarray(x)[:n], tree)


def _train_batches(dataset: Dataset, config: RunConfig, keys: Keys, n: int):
    """Batches ``0..n-1`` of the training order with their step keys, exactly as train sees them."""
    for i in range(n):
        rows = batch_rows(keys.data, i, dataset.train.rows, config.train.batch_size)
        yield jax.random.fold_in(keys.mask, i), host_batch(dataset.train, rows)


# --------------------------------------------------------------------------- model checks


def check_no_leak(pipe: Pipeline, items) -> CheckResult:
    """Clean ids at replaced positions must not reach the inputs or the logits."""
    masker, logits_fn = jax.jit(pipe.masker), jax.jit(pipe.logits_fn)
    special = pipe.vocab.special_table()
    pool = masking.allowed_random_ids(pipe.vocab.size, pipe.vocab.special_ids)
    changed = input_diffs = logit_diffs = selection_diffs = 0
    for key, batch in items:
        masked, selection = masker(key, batch)
        tokens = batch["tokens"]
        kind = np.asarray(masked.kind)
        # Only non-special clean ids are changed, to other non-special ids, so eligibility
        # (and with it the selection) must stay the same.
        replaced = (np.asarray(masked.selected) & ~special[tokens]
                    & ((kind == Kind.MASK) | (kind == Kind.RANDOM)))
        other = pool[(np.searchsorted(pool, tokens) + 1) % pool.size]
        modified = {**batch, "tokens": np.where(replaced, other, tokens).astype(tokens.dtype)}
        masked2, selection2 = masker(key, modified)
        changed += int(replaced.sum())
        input_diffs += int((np.asarray(masked.inputs) != np.asarray(masked2.inputs)).sum())
        selection_diffs += int(
            (np.asarray(selection.positions) != np.asarray(selection2.positions)).sum()
            + (np.asarray(masked.kind) != np.asarray(masked2.kind)).sum()
        )
        a = np.asarray(logits_fn(pipe.params, batch, masked, selection))
        b = np.asarray(logits_fn(pipe.params, modified, masked2, selection2))
        logit_diffs += int((a.shape != b.shape) or (a != b).sum())
    value = {"changed_positions": changed, "input_diffs": input_diffs,
             "logit_diffs": logit_diffs, "selection_diffs": selection_diffs}
    if changed == 0:
        return CheckResult("no_leak", False, value, "no selected position was replaced; the "
                           "check could not change any clean id (is masking.mask 0?)")
    passed = input_diffs == logit_diffs == selection_diffs == 0
    detail = (f"changed {changed} clean ids at replaced positions: inputs, selection and logits "
              "identical bit for bit" if passed else
              f"changing {changed} clean ids at replaced positions changed {input_diffs} input "
              f"ids, {selection_diffs} selections/kinds and {logit_diffs} logits: clean ids leak")
    return CheckResult("no_leak", passed, value, detail)


def make_batch_stats(pipe: Pipeline):
    """Jitted per-batch counts used by the eligibility and corruption-mix checks."""
    return _batch_stats(pipe.masker, pipe.vocab.size, _specials_key(pipe.vocab))


@functools.lru_cache(maxsize=8)
def _batch_stats(masker, size, specials):
    special = jnp.asarray(Vocabulary(size, dict(specials)).special_table())
    mask_id = int(dict(specials)["mask"])

    def stats(key, batch):
        masked, _ = masker(key, batch)
        tokens, sel, kind = batch["tokens"], masked.selected, masked.kind
        random = sel & (kind == Kind.RANDOM)
        return {
            "selected": jnp.sum(sel),
            "pad_selected": jnp.sum(sel & (batch["segments"] == 0)),
            "special_selected": jnp.sum(sel & special[tokens]),
            "mask_target": jnp.sum(sel & (masked.targets == mask_id)),
            "targets_not_clean": jnp.sum(masked.targets != tokens),
            "unselected_changed": jnp.sum(~sel & (masked.inputs != tokens)),
            "random": jnp.sum(random),
            "random_special": jnp.sum(random & special[masked.inputs]),
            "keep": jnp.sum(sel & (kind == Kind.KEEP)),
            "input_equals_target": jnp.sum(sel & (masked.inputs == tokens)),
        }

    return jax.jit(stats)


def sample_stats(pipe: Pipeline, items) -> dict:
    stats = make_batch_stats(pipe)
    totals: dict[str, int] = {}
    n = 0
    for key, batch in items:
        for name, value in stats(key, batch).items():
            totals[name] = totals.get(name, 0) + int(value)
        n += 1
    return {"batches": n, **totals}


def check_eligibility(stats: dict) -> CheckResult:
    bad = {name: stats[name] for name in ("pad_selected", "special_selected", "mask_target",
                                          "random_special", "unselected_changed",
                                          "targets_not_clean") if stats[name]}
    value = {k: stats[k] for k in ("batches", "selected", "pad_selected", "special_selected",
                                    "mask_target", "random_special", "unselected_changed",
                                    "targets_not_clean")}
    if stats["selected"] == 0:
        return CheckResult("eligibility", False, value,
                           f"{stats['batches']} batches had no selected position at all")
    if bad:
        detail = f"over {stats['batches']} batches: " + ", ".join(f"{k}={v}" for k, v in
                                                                   bad.items())
        return CheckResult("eligibility", False, value, detail)
    return CheckResult("eligibility", True, value,
                       f"{stats['selected']} selected positions in {stats['batches']} batches: "
                       "no pad/special selected, mask id never a target, random ids never "
                       "special, unselected inputs untouched")


def check_corruption_mix(stats: dict, pipe: Pipeline) -> CheckResult:
    from scipy.stats import binom

    policy = pipe.config.masking.policy
    pool = masking.allowed_random_ids(pipe.vocab.size, pipe.vocab.special_ids).size
    n, equal = stats["selected"], stats["input_equals_target"]
    p = policy.keep + policy.random / pool
    lo, hi = (int(x) for x in binom.interval(INTERVAL, n, p)) if n else (0, 0)
    passed = n > 0 and lo <= equal <= hi
    value = {"selected": n, "input_equals_target": equal, "fraction": equal / max(n, 1),
             "expected": p, "interval": [lo / max(n, 1), hi / max(n, 1)],
             "random_fraction": stats["random"] / max(n, 1),
             "keep_fraction": stats["keep"] / max(n, 1)}
    detail = (f"{equal}/{n} = {equal / max(n, 1):.4f} of selected inputs equal the target; "
              f"expected {p:.4f}, 99.9 % interval [{lo}, {hi}]")
    return CheckResult("corruption_mix", passed, value, detail)


def check_initial_loss(pipe: Pipeline, key, batch) -> CheckResult:
    masked, selection = jax.jit(pipe.masker)(key, batch)
    params = pipe.zero_head(pipe.params)
    logits = jax.jit(pipe.logits_fn)(params, batch, masked, selection)
    positions = np.asarray(selection.positions)
    targets = np.take_along_axis(np.asarray(batch["tokens"]), positions, axis=-1)
    # Sequence by sequence: the property is the uniform start, and a float32 sum over a whole
    # batch of ~log(V)-sized terms (1,632 of them at rate 0.4) would itself drift past 1e-5.
    loss_fn = jax.jit(pipe.loss_fn)
    valid = np.asarray(selection.valid)
    losses = []
    for r in range(targets.shape[0]):
        if valid[r].any():
            total, count = loss_fn(logits[r : r + 1], targets[r : r + 1], valid[r : r + 1])
            losses.append(float(total) / float(count))
    expected = math.log(pipe.config.model.vocab_size)
    worst = max(losses, key=lambda x: abs(x - expected))
    diff = abs(worst - expected)
    return CheckResult("initial_loss", diff <= LOSS_TOL,
                       {"loss": worst, "log_vocab": expected, "abs_diff": diff,
                        "sequences": len(losses)},
                       f"zeroed-head loss {worst:.7f} (worst of {len(losses)} sequences) vs "
                       f"log({pipe.config.model.vocab_size}) = {expected:.7f} "
                       f"(|diff| {diff:.1e}, tolerance {LOSS_TOL:g})")


def dense_logit_gradients(pipe: Pipeline, key, batch, rows: int = 4):
    """Logits at every position of ``rows`` sequences, autodiff and analytic gradients of the
    token-weighted mean loss with respect to them. Returns (grad, analytic, selected)."""
    masked, selection = jax.jit(pipe.masker)(key, batch)
    batch, masked = _take_rows(batch, rows), _take_rows(masked, rows)
    n, seq = masked.inputs.shape
    everywhere = Selection(np.broadcast_to(np.arange(seq, dtype=np.int32), (n, seq)),
                           np.ones((n, seq), bool))
    logits = jax.jit(pipe.logits_fn)(pipe.params, batch, masked, everywhere)  # (rows, seq, vocab)
    targets, selected = np.asarray(batch["tokens"]), masked.selected
    grad = _mean_loss_grad(pipe.loss_fn)(logits, targets, selected)
    analytic = _analytic_gradient(logits, targets, selected)
    return np.asarray(grad), np.asarray(analytic), np.asarray(selected)


_analytic_gradient = jax.jit(objective.analytic_logit_gradient)


@functools.lru_cache(maxsize=8)
def _mean_loss_grad(loss_fn):
    def mean_loss(logits, targets, selected):
        total, count = loss_fn(logits, targets, selected)
        return total / count

    return jax.jit(jax.grad(mean_loss))


def check_unselected_zero_grad(grad, selected) -> CheckResult:
    outside = np.abs(grad[~selected])
    nonzero = int(np.count_nonzero(outside))
    largest = float(outside.max()) if outside.size else 0.0
    return CheckResult("unselected_zero_grad", nonzero == 0,
                       {"nonzero": nonzero, "max_abs": largest,
                        "unselected_positions": int((~selected).sum())},
                       f"{nonzero} nonzero gradient entries (max |g| {largest:.1e}) over "
                       f"{int((~selected).sum())} unselected positions x vocab")


def check_analytic_gradient(grad, analytic) -> CheckResult:
    scale = float(np.abs(analytic).max())
    diff = float(np.abs(grad - analytic).max())
    rel = diff / scale if scale else diff
    return CheckResult("analytic_gradient", rel <= GRAD_RTOL,
                       {"max_abs_diff": diff, "max_abs": scale, "rel": rel},
                       f"max |autodiff - analytic| {diff:.2e} = {rel:.1e} of the largest entry "
                       f"(tolerance {GRAD_RTOL:g}) on dense {grad.shape} logits")


def _capture_gradients() -> optax.GradientTransformation:
    """An 'optimizer' that leaves parameters alone and stores the gradient as its state."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(updates, state, params=None):
        return jax.tree.map(jnp.zeros_like, updates), updates

    return optax.GradientTransformation(init, update)


def uneven_batch(batch: dict, rows, keep: int = 4) -> dict:
    """``rows`` cut to ``keep`` real tokens, so that selected counts differ between the parts a
    batch is split into (a per-part mean then differs from the token-weighted mean)."""
    out = {name: np.array(x) for name, x in batch.items()}
    out["tokens"][rows, keep:] = 0
    out["segments"][rows, keep:] = 0
    out["word_starts"][rows, keep:] = False
    return out


CAPTURE = _capture_gradients()


def _no_schedule(step):
    return jnp.zeros((), jnp.float32)


@functools.lru_cache(maxsize=16)
def _jitted_step(make_step, config: RunConfig, mesh):
    step = make_step(config, CAPTURE, _no_schedule, mesh)
    if mesh is None:
        return jax.jit(step)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated = NamedSharding(mesh, P())
    return jax.jit(step, out_shardings=(replicated, replicated))


def _one_step(pipe: Pipeline, config: RunConfig, batch, mask_key, mesh=None):
    """Loss and gradient of one step of ``pipe.make_step`` (the gradient captured exactly)."""
    zeros = jax.tree.map(np.zeros_like, pipe.params)  # host zeros: no per-leaf compiles
    state = TrainState(np.zeros((), np.int32), pipe.params, zeros)
    if mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        state = jax.device_put(state, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    state, metrics = _jitted_step(pipe.make_step, config, mesh)(state, batch, mask_key)
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.opt_state)


def _compare(name, a, b, what: str) -> CheckResult:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    loss_rel = abs(loss_a - loss_b) / max(abs(loss_a), 1e-30)
    diff = math.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in
                         zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True)))
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in jax.tree.leaves(grads_a)))
    grad_rel = diff / max(norm, 1e-30)
    passed = loss_rel <= ACCUMULATION_RTOL and grad_rel <= ACCUMULATION_RTOL
    return CheckResult(name, passed,
                       {"loss": [loss_a, loss_b], "loss_rel": loss_rel, "grad_rel": grad_rel},
                       f"{what}: loss {loss_a:.6f} vs {loss_b:.6f} (rel {loss_rel:.1e}), "
                       f"gradient rel {grad_rel:.1e}, tolerance {ACCUMULATION_RTOL:g}")


def check_microbatch_accumulation(pipe: Pipeline, batch, mask_key) -> CheckResult:
    size = batch["tokens"].shape[0]
    k = next((k for k in (4, 3, 2) if size % k == 0), None)
    if k is None:
        return CheckResult("microbatch_accumulation", True, "skipped",
                           f"SKIP: batch of {size} cannot be split into microbatches",
                           skipped=True)
    batch = uneven_batch(batch, np.arange(0, size, k))  # microbatch 0 takes rows 0, k, 2k, ...
    train = pipe.config.train

    def with_k(m):
        return dataclasses.replace(pipe.config,
                                   train=dataclasses.replace(train, microbatches=m, devices=None))

    full = _one_step(pipe, with_k(1), batch, mask_key)
    split = _one_step(pipe, with_k(k), batch, mask_key)
    return _compare("microbatch_accumulation", full, split,
                    f"1 vs {k} microbatches (uneven selected counts)")


def check_device_accumulation(pipe: Pipeline, batch, mask_key, devices=None) -> CheckResult:
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    size = batch["tokens"].shape[0]
    n = max((d for d in range(2, len(devices) + 1) if size % d == 0), default=1)
    if n < 2:
        return CheckResult("device_accumulation", True, "skipped",
                           f"SKIP: {len(devices)} device visible" if len(devices) < 2 else
                           f"SKIP: batch of {size} does not divide over {len(devices)} devices",
                           skipped=True)
    batch = uneven_batch(batch, np.arange(size // n))  # device 0 holds the first rows
    config = dataclasses.replace(
        pipe.config, train=dataclasses.replace(pipe.config.train, microbatches=1, devices=None))
    one = _one_step(pipe, config, batch, mask_key, Mesh(np.array(devices[:1]), ("data",)))
    many = _one_step(pipe, config, batch, mask_key, Mesh(np.array(devices[:n]), ("data",)))
    return _compare("device_accumulation", one, many, f"1 vs {n} devices (uneven counts)")


def check_empty_selection(pipe: Pipeline, batch) -> CheckResult:
    """An all-False selection must be refused on the host, naming the problem."""
    tokens = np.asarray(batch["tokens"])
    empty = np.zeros(tokens.shape, bool)
    outcomes = {}
    for name, call in (
        ("boundary", lambda: pipe.boundary(tokens, empty)),
        ("mask_tokens", lambda: masking.mask_tokens(
            jax.random.key(0), tokens, eligible=empty, mask_id=int(pipe.vocab.specials["mask"]),
            vocab_size=pipe.vocab.size, special_ids=pipe.vocab.special_ids)),
    ):
        try:
            call()
            outcomes[name] = "accepted"
        except ValueError as e:
            message = str(e)
            outcomes[name] = "rejected" if "no " in message and "position" in message else \
                f"unclear error: {message}"
    passed = all(v == "rejected" for v in outcomes.values())
    detail = ("an all-False selection is rejected with ValueError by the boundary and by "
              "mask_tokens" if passed else
              "; ".join(f"{k}: {v}" for k, v in outcomes.items() if v != "rejected"))
    return CheckResult("empty_selection", passed, outcomes, detail)


def check_eval_masks(pipe: Pipeline, dataset: Dataset, run_dir: Path) -> CheckResult:
    """Recompute with the run's configured masker: the one ``train`` built the set with."""
    try:
        stored, meta = eval_lib.load_eval_masks(run_dir)
    except ValueError as e:
        return CheckResult("eval_masks", False, None, str(e))
    config = pipe.config
    masker = default_masker(config, pipe.vocab, pipe.seq_len)
    rebuilt = eval_lib.build_eval_masks(dataset.heldout, masker, config.train.eval_seed,
                                        config.train.eval_rows)
    stored_sha = eval_lib.eval_masks_sha256(stored)
    rebuilt_sha = eval_lib.eval_masks_sha256(rebuilt)
    passed = stored_sha == meta["sha256"] == rebuilt_sha
    return CheckResult("eval_masks", passed,
                       {"recorded": meta["sha256"], "stored": stored_sha, "rebuilt": rebuilt_sha},
                       f"sha256 {stored_sha[:12]} recorded and rebuilt from eval_seed "
                       f"{config.train.eval_seed}" if passed else
                       f"recorded {meta['sha256'][:12]}, stored {stored_sha[:12]}, rebuilt "
                       f"{rebuilt_sha[:12]}: the set is not the one eval_seed gives")


# --------------------------------------------------------------------------- data checks


def _documents(dataset: Dataset, split: str) -> list[dict]:
    path = dataset.path / f"{split}.documents.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check_data_disjoint(dataset: Dataset) -> CheckResult:
    docs = {split: _documents(dataset, split) for split in SPLITS}
    groups = [{d["group"] for d in docs[s]} for s in SPLITS]
    ids = [{d["id"] for d in docs[s]} for s in SPLITS]
    shared_groups, shared_ids = groups[0] & groups[1], ids[0] & ids[1]
    value = {"shared_groups": len(shared_groups), "shared_documents": len(shared_ids)}
    if shared_groups or shared_ids:
        examples = sorted(map(str, shared_groups))[:2] + sorted(shared_ids)[:2]
        return CheckResult("data_disjoint", False, value,
                           f"{len(shared_groups)} group(s) and {len(shared_ids)} document "
                           f"hash(es) are in both splits, e.g. {examples}")
    return CheckResult("data_disjoint", True, value,
                       f"{len(groups[0])}/{len(groups[1])} groups and {len(ids[0])}/"
                       f"{len(ids[1])} document hashes (train/held-out), none shared")


def check_tokenizer(dataset: Dataset, run_dir: Path | None = None) -> CheckResult:
    tok = dataset.manifest["tokenizer"]
    problems = []
    if tok.get("trained_on") not in ("train", "given"):
        problems.append(f"manifest says the tokenizer was trained on {tok.get('trained_on')!r}")
    data_sha = file_sha256(dataset.tokenizer_path)
    value = {"trained_on": tok.get("trained_on"), "manifest": tok["sha256"], "dataset": data_sha}
    if data_sha != tok["sha256"]:
        problems.append(f"dataset tokenizer file sha256 {data_sha[:12]} != manifest "
                        f"{tok['sha256'][:12]}")
    if run_dir is not None:
        info = json.loads((run_dir / "run.json").read_text())
        run_sha = file_sha256(run_dir / "tokenizer.json")
        value |= {"run_recorded": info.get("tokenizer_sha256"), "run_file": run_sha}
        if run_sha != info.get("tokenizer_sha256"):
            problems.append(f"run tokenizer.json sha256 {run_sha[:12]} != run.json "
                            f"{str(info.get('tokenizer_sha256'))[:12]}")
        if info.get("tokenizer_sha256") != tok["sha256"]:
            problems.append("run.json tokenizer sha256 differs from the dataset's")
    if problems:
        return CheckResult("tokenizer", False, value, "; ".join(problems))
    where = "dataset and run" if run_dir is not None else "dataset"
    return CheckResult("tokenizer", True, value,
                       f"trained on {tok.get('trained_on')}; sha256 {data_sha[:12]} matches in "
                       f"{where}")


def check_packing_accounting(dataset: Dataset) -> CheckResult:
    m = dataset.manifest
    seq_len = dataset.seq_len
    problems = []
    d = m["documents"]
    if d["read"] != d["kept"] + d["duplicates"] + d["skipped"]:
        problems.append(f"read {d['read']} != kept {d['kept']} + duplicates {d['duplicates']} "
                        f"+ skipped {d['skipped']}")
    kept = 0
    for name in SPLITS:
        s, split = m["splits"][name], getattr(dataset, name)
        kept += s["documents"]
        if s["rows"] * seq_len != s["tokens"] + s["pad_tokens"]:
            problems.append(f"{name}: rows x seq_len {s['rows'] * seq_len} != tokens "
                            f"{s['tokens']} + pad {s['pad_tokens']}")
        real = int(np.count_nonzero(np.asarray(split.segments)))
        if split.rows != s["rows"] or real != s["tokens"]:
            problems.append(f"{name}: arrays hold {split.rows} rows / {real} real tokens, "
                            f"manifest {s['rows']} / {s['tokens']}")
        docs = _documents(dataset, name)
        if len(docs) != s["documents"]:
            problems.append(f"{name}: {len(docs)} documents listed, manifest {s['documents']}")
    if kept != d["kept"]:
        problems.append(f"split documents sum to {kept}, manifest kept {d['kept']}")
    value = {"documents": d, "splits": {n: {k: m["splits"][n][k] for k in
                                              ("rows", "tokens", "pad_tokens", "documents")}
                                          for n in SPLITS}}
    if problems:
        return CheckResult("packing_accounting", False, value, "; ".join(problems))
    return CheckResult("packing_accounting", True, value,
                       f"read {d['read']} = kept {d['kept']} + duplicates {d['duplicates']} + "
                       f"skipped {d['skipped']}; rows x {seq_len} = tokens + pad in both "
                       "splits; arrays and documents.jsonl agree with the manifest")


# --------------------------------------------------------------------------- running


def open_dataset_for_audit(path: Path) -> Dataset:
    """``open_dataset``, except that a tokenizer file not matching the manifest is left to the
    tokenizer check to report instead of refusing to open."""
    try:
        return open_dataset(path)
    except ValueError as e:
        if "does not match the sha256" not in str(e):
            raise
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    splits = {s: Split(**{a: np.load(path / f"{s}.{a}.npy", mmap_mode="r") for a in ARRAYS})
              for s in SPLITS}
    return Dataset(path=path, manifest=manifest, **splits)


def _safe(name: str, fn) -> CheckResult:
    try:
        return fn()
    except Exception as e:  # a broken custom piece is a failed check, not a crashed audit
        return CheckResult(name, False, None, f"error: {type(e).__name__}: {e}")


def run(
    config: RunConfig,
    dataset: Dataset,
    *,
    params=None,
    masker: Callable | None = None,
    logits_fn: Callable | None = None,
    loss_fn: Callable | None = None,
    make_step: Callable | None = None,
    boundary: Callable | None = None,
    zero_head: Callable | None = None,
    run_dir: Path | None = None,
    devices=None,
    batches: int = 200,
    leak_batches: int = 4,
    only: Collection[str] | None = None,
) -> dict:
    """Run the audit's checks on the pieces given (defaults: clozax's own for ``config``).

    ``params`` default to a fresh init from the run's init key. ``run_dir`` enables the
    run-file checks (tokenizer copy, eval masks). ``batches`` training batches feed the
    eligibility and corruption-mix counts, the first ``leak_batches`` the leak check.
    ``only`` restricts the checks run (names from ``CHECKS``). Returns the report dict:
    ``{"passed": bool, "checks": [{"number", "name", "passed", "value", "detail", "skipped"}]}``.
    """
    unknown = sorted(set(only or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown audit check(s) {unknown}; valid: {', '.join(CHECKS)}")
    wanted = [c for c in CHECKS if only is None or c in only]
    vocab = Vocabulary(dataset.vocab_size, dataset.specials)
    keys = Keys.from_seed(config.train.seed)
    pipe = Pipeline(
        config=config, vocab=vocab, seq_len=dataset.seq_len,
        params=params if params is not None else model_lib.init(config.model, keys.init),
        masker=masker or default_masker(config, vocab, dataset.seq_len),
        logits_fn=logits_fn or default_logits_fn(config.model),
        loss_fn=loss_fn or objective.masked_nll,
        make_step=make_step or default_make_step(vocab, dataset.seq_len),
        boundary=boundary or default_boundary,
        zero_head=zero_head or default_zero_head,
    )
    items = list(_train_batches(dataset, config, keys, max(batches, leak_batches, 1)))
    key0, batch0 = items[0]
    lazy: dict[str, Any] = {}

    def stats():
        if "stats" not in lazy:
            lazy["stats"] = sample_stats(pipe, items[:max(batches, 1)])
        return lazy["stats"]

    def grads():
        if "grads" not in lazy:
            lazy["grads"] = dense_logit_gradients(pipe, key0, batch0)
        return lazy["grads"]

    run_dir = Path(run_dir) if run_dir is not None else None
    checks = {
        "no_leak": lambda: check_no_leak(pipe, items[:leak_batches]),
        "corruption_mix": lambda: check_corruption_mix(stats(), pipe),
        "initial_loss": lambda: check_initial_loss(pipe, key0, batch0),
        "unselected_zero_grad": lambda: check_unselected_zero_grad(grads()[0], grads()[2]),
        "analytic_gradient": lambda: check_analytic_gradient(grads()[0], grads()[1]),
        "microbatch_accumulation": lambda: check_microbatch_accumulation(pipe, batch0, keys.mask),
        "device_accumulation": lambda: check_device_accumulation(pipe, batch0, keys.mask,
                                                                 devices),
        "eligibility": lambda: check_eligibility(stats()),
        "data_disjoint": lambda: check_data_disjoint(dataset),
        "tokenizer": lambda: check_tokenizer(dataset, run_dir),
        "packing_accounting": lambda: check_packing_accounting(dataset),
        "eval_masks": lambda: (check_eval_masks(pipe, dataset, run_dir) if run_dir is not None
                               else CheckResult("eval_masks", True, "skipped",
                                                "SKIP: no run directory given", skipped=True)),
        "empty_selection": lambda: check_empty_selection(pipe, batch0),
    }
    return _report([_safe(name, checks[name]) for name in wanted],
                   run=run_dir, data=dataset.path)


def _report(results: list[CheckResult], **paths) -> dict:
    checks = [{"number": CHECKS.index(r.name) + 1, **dataclasses.asdict(r)} for r in results]
    return {
        "passed": all(r.passed for r in results),
        "checks": json.loads(json.dumps(checks, default=_jsonable)),
        **{k: str(v) if v is not None else None for k, v in paths.items()},
        "devices": len(jax.devices()),
        "clozax_version": __version__,
        "jax_version": jax.__version__,
    }


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _write(report: dict, directory: Path) -> Path:
    path = Path(directory) / AUDIT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    return path


def audit_run(run_dir: Path, data: Path | None = None, *, batches: int = 200,
              devices=None) -> dict:
    """Audit a trained run with clozax's own pieces; writes ``RUN/audit.json``.

    The dataset is the one recorded in ``run.json`` unless ``data`` is given.
    """
    from clozax.run import load_run

    start = time.perf_counter()
    loaded = load_run(Path(run_dir))
    data = Path(data) if data is not None else Path(loaded.info["dataset"])
    if not data.is_dir():
        raise ValueError(f"run {run_dir} was trained on {data}, which does not exist; pass "
                         "--data DIR with the same prepared dataset")
    dataset = open_dataset_for_audit(data)
    report = run(loaded.config, dataset, params=loaded.params, run_dir=loaded.path,
                 batches=batches, devices=devices)
    report["step"] = loaded.step
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["written"] = str(_write(report, loaded.path))
    return report


def audit_data(data_dir: Path, out: Path | None = None) -> dict:
    """Data-only checks (before training); writes ``out/audit.json`` when ``out`` is given."""
    start = time.perf_counter()
    dataset = open_dataset_for_audit(Path(data_dir))
    results = [_safe(name, fn) for name, fn in (
        ("data_disjoint", lambda: check_data_disjoint(dataset)),
        ("tokenizer", lambda: check_tokenizer(dataset)),
        ("packing_accounting", lambda: check_packing_accounting(dataset)),
    )]
    report = _report(results, run=None, data=dataset.path)
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["written"] = str(_write(report, out)) if out is not None else None
    return report


def print_report(report: dict, console=None) -> None:
    """The checks as a table, one PASS/FAIL/SKIP line each, numbered."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    title = f"clozax audit of {report.get('run') or report.get('data')}"
    table = Table(title=title, title_justify="left")
    for column in ("#", "check", "result", "detail"):
        table.add_column(column, overflow="fold")
    for c in report["checks"]:
        status = ("[yellow]SKIP[/]" if c.get("skipped") else
                  "[green]PASS[/]" if c["passed"] else "[bold red]FAIL[/]")
        table.add_row(str(c["number"]), c["name"], status, c["detail"])
    console.print(table)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    verdict = "[green]all checks passed[/]" if not failed else \
        f"[bold red]{len(failed)} check(s) failed:[/] {', '.join(failed)}"
    written = report.get("written")
    console.print(verdict + (f"; wrote {written}" if written else ""))
