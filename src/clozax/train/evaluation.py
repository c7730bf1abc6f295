"""Evaluation while training, and what stops a run that diverged.

``Evaluator`` holds the run's frozen held-out set (built or read once, the same on every
process), each phase's own set (a phase on another dataset is scored on its held-out rows), and
the compiled evaluation function of each model config it meets; it scores a keyed sample of the
set at every evaluation point. ``check_finite`` reads the metrics of the steps since the last
sync point and raises ``TrainingDiverged`` at the first non-finite one, before anything from it
is logged or saved.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from jax.sharding import NamedSharding

from clozax.core.masker import make_masker
from clozax.core.vocab import Vocabulary
from clozax.train import distributed, heldout
from clozax.train.config import RunConfig
from clozax.train.layout import phase_eval_stem
from clozax.train.mesh import from_host
from clozax.train.phases import Plan, segment_config


class TrainingDiverged(ValueError):
    """A non-finite loss or gradient norm; the last good checkpoint is kept."""


def check_finite(pending: list, fetched: list, checkpointer) -> None:
    """Stop at the first step since the last read whose loss, gradient norm or updated
    parameters were not finite (before anything from it is logged or saved)."""
    for (step, _), m in zip(pending, fetched, strict=True):
        # Impossible by construction (every row has an eligible token); checked cheaply.
        assert int(m["selected"]) > 0, f"empty selection at step {step}"
        if not bool(m["finite"]):
            raise TrainingDiverged(
                f"non-finite loss ({float(m['loss'])}), gradient norm "
                f"({float(m['grad_norm'])}) or updated parameters at step {step}; the last good "
                f"checkpoint (step {checkpointer.latest_step()}) is kept: lower "
                "optim.learning_rate or raise optim.warmup_steps"
            )


class Evaluator:
    """The held-out evaluation of one run while it trains (one instance per run).

    ``config`` is the run's as set up: a budget or an extension changes only its step counts,
    never the model, the masking or the evaluation settings read here.
    """

    def __init__(self, config: RunConfig, plan: Plan, datasets: dict, data_dir: Path,
                 run_dir: Path, vocab: Vocabulary, n_devices: int,
                 data_sharding: NamedSharding, primary: bool, say):
        self.config, self.plan, self.datasets = config, plan, datasets
        self.data_dir, self.run_dir, self.vocab = data_dir, run_dir, vocab
        self.dataset = datasets[Path(data_dir).absolute()]
        self.data_sharding, self.primary, self.say = data_sharding, primary, say
        self.masker = make_masker(config.masking, vocab, self.dataset.seq_len)
        self.eval_fns: dict = {}  # model config -> its compiled evaluation
        self.eval_batch = math.lcm(64, n_devices)
        self.phase_sets: dict = {}  # dataset directory -> (its frozen set, its sample)
        self.checkpointer = None  # once the run has one: a divergence names its latest step

    def build_masks(self) -> heldout.EvalMasks:
        """The frozen set built here, not yet written (a ``--minutes`` budget times it)."""
        t = self.config.train
        return heldout.build_eval_masks(self.dataset.heldout, self.masker, t.eval_seed,
                                        t.eval_rows)

    def run_eval_set(self, built) -> tuple[heldout.EvalMasks, object]:
        """The run's frozen held-out set (read, or written from ``built`` or built now) and the
        keyed sample of it that training scores: ``(eval_masks, sample)``."""
        t = self.config.train
        eval_masks, _ = heldout.ensure_eval_masks(self.run_dir, self.dataset, self.masker,
                                                  t.eval_seed, t.eval_rows, say=self.say,
                                                  write=self.primary, built=built)
        distributed.same_everywhere(heldout.eval_masks_sha256(eval_masks), "frozen held-out set")
        sample = heldout.sample_indices(eval_masks.rows.size, t.eval_sample, t.eval_seed)
        return eval_masks, sample

    def phase_eval_set(self, segment, run_masks, run_sample):
        """A phase on another dataset is scored on a frozen set of its own held-out rows
        (``eval_masks_NAME``, the run's masking at that phase's ``seq_len``), built once."""
        if segment.data == Path(self.data_dir).absolute():
            return run_masks, run_sample
        if segment.data not in self.phase_sets:
            other, t = self.datasets[segment.data], self.config.train
            masks, _ = heldout.ensure_eval_masks(
                self.run_dir, other, make_masker(self.config.masking, self.vocab, other.seq_len),
                t.eval_seed, t.eval_rows, say=self.say, write=self.primary,
                stem=phase_eval_stem(segment.name))
            distributed.same_everywhere(heldout.eval_masks_sha256(masks),
                                        f"phase {segment.name}'s held-out set")
            self.phase_sets[segment.data] = (masks, heldout.sample_indices(
                masks.rows.size, t.eval_sample, t.eval_seed))
        return self.phase_sets[segment.data]

    def evaluate(self, params, eval_masks, sample, segment=None) -> dict:
        """The frozen set's sample (the run's; a phase on another dataset: that phase's)."""
        model_config, split = self.config.model, self.dataset.heldout
        if segment is not None and self.plan.phased:
            model_config = segment_config(self.config, segment).model
            split = self.datasets[segment.data].heldout
            eval_masks, sample = self.phase_eval_set(segment, eval_masks, sample)
        if model_config not in self.eval_fns:
            self.eval_fns[model_config] = heldout.make_eval_fn(model_config)
        rows = eval_masks.rows.size if sample is None else len(sample)
        try:
            return {**heldout.evaluate_masks(
                params, model_config, split, eval_masks, self.eval_batch,
                self.eval_fns[model_config], sample,
                functools.partial(from_host, self.data_sharding)).metrics(), "rows": rows}
        except heldout.NonFiniteScores as e:
            checkpointer = self.checkpointer
            kept = checkpointer.latest_step() if checkpointer is not None else None
            raise TrainingDiverged(f"{e}; the last good checkpoint is step {kept}") from None
