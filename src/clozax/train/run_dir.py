"""The run directory: writing a new run's files, and reading its config, provenance and a
checkpoint's parameters.

A run directory (written by ``clozax train`` or ``clozax import-hf``) holds:
``config.json`` (resolved RunConfig), ``run.json`` (provenance: dataset path and fingerprint,
tokenizer sha256, specials, seeds; ``attention``: the ``model.attention`` setting, the platform
the run started on and the attention path of each layer kind at each row length, e.g.
``{"seq_len": 1024, "global": "flash", "local": "flash"}``), ``tokenizer.json`` (the frozen
tokenizer), ``checkpoints/`` (orbax; ``state`` = TrainState(step, params, opt_state) and
``meta`` JSON), ``eval_masks.npz`` + ``eval_masks.json`` (the frozen eval-mask set),
``metrics.jsonl``.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp

from clozax import __version__
from clozax.core import attention, files, locks
from clozax.core import model as model_lib
from clozax.core.model_config import runnable_here
from clozax.core.optim import make_optimizer
from clozax.core.train_state import TrainState
from clozax.data.dataset import Dataset, open_dataset
from clozax.train import checkpoint as ckpt
from clozax.train import config as config_lib
from clozax.train import distributed
from clozax.train.layout import CONFIG_FILE, RUN_FILE, TOKENIZER_FILE
from clozax.train.phase_config import optimizer_apart
from clozax.train.phases import model_at, trained_length_at


@dataclass
class LoadedRun:
    path: Path
    config: config_lib.RunConfig
    info: dict  # run.json
    step: int
    params: dict

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_FILE

    @property
    def specials(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.info["specials"].items()}

    @property
    def has_mlm_head(self) -> bool:
        """Whether the run's MLM head was trained with its encoder: false for a bare encoder
        imported without one (``clozax import-hf``) and for a contrastive stage."""
        return bool(self.info.get("has_mlm_head", True))

    @property
    def trained_length(self) -> int:
        """The longest row the run has trained on: positions past it were never trained (for
        learned positions, their table rows are still initial noise). A run records it in
        ``run.json`` (the longer of its dataset's ``seq_len`` and, with ``--init-from``, its
        source's); older runs and imports fall back to ``seq_len``. A run in phases: the longest
        of the phases that trained this checkpoint (``run.json``'s ``phases``)."""
        length = trained_length_at(self.info, self.step) or self.info.get(
            "trained_length", self.info.get("seq_len"))
        return min(int(length or self.config.model.max_positions),
                   self.config.model.max_positions)

    def check_length(self, tokens: int, what: str) -> None:
        """Refuse ``tokens`` positions past the trained length, in one line."""
        if tokens > self.trained_length:
            raise ValueError(
                f"{what} is {tokens} tokens with [CLS]/[SEP], longer than the "
                f"{self.trained_length} run {self.path} was trained on (positions past it "
                f"are untrained; model.max_positions is {self.config.model.max_positions}); "
                "shorten it, or train on longer rows first")

    def require_mlm_head(self, command: str) -> None:
        """Refuse MLM outputs of a run imported from a bare encoder (no trained MLM head)."""
        if not self.has_mlm_head and self.info.get("stage"):
            raise ValueError(
                f"run {self.path} is a contrastive stage (clozax embed): its MLM head was not "
                f"trained with its encoder, so `{command}` would report a stale head: use "
                f"`clozax retrieval` or `clozax probe`, or `{command}` its source run "
                f"{self.info['stage']['source_run']}")
        if not self.has_mlm_head:
            raise ValueError(
                f"run {self.path} was imported from a bare encoder (no MLM head), so `{command}` "
                "would report an untrained head: use `clozax probe`, or learn a head first with "
                f"`clozax train --init-from {self.path}`"
            )


def write_run_files(run_dir: Path, config: config_lib.RunConfig, info: dict) -> None:
    """``config.json`` (the resolved config) and ``run.json`` (``info`` plus the versions that
    wrote it), each atomically, for a new run (trained or imported)."""
    files.write_json(run_dir / CONFIG_FILE, config.to_dict(), sort_keys=True)
    files.write_json(run_dir / RUN_FILE, {"clozax_version": __version__,
                                          "jax_version": jax.__version__, **info},
                     sort_keys=True)


def check_compatible(run_dir: Path, config: config_lib.RunConfig, dataset,
                     extend_to: int | None = None) -> tuple[config_lib.RunConfig, bool, dict]:
    """Refuse to resume into a run whose results-relevant config, tokenizer or data differ.

    Returns the config to continue with, whether it extends the run, and the run's ``run.json``
    as read here: with ``extend_to``
    beyond the run's ``train.steps``, a finished run continues to ``extend_to`` steps with its
    schedule re-created for the new length (recorded in ``train.extended_from``).
    """
    saved = config_lib.load_json(run_dir / CONFIG_FILE)
    run = json.loads((run_dir / RUN_FILE).read_text())
    if config.train.minutes is not None and config.train.minutes == saved.train.minutes:
        # The step count was fixed from measured throughput when the run started (and maybe
        # revised once while it ran).
        config = replace(config, train=replace(config.train, steps=saved.train.steps,
                                               budget_revisions=saved.train.budget_revisions))
    extending = extend_to is not None and extend_to != saved.train.steps
    if extend_to is not None:
        if extend_to < saved.train.steps:
            raise ValueError(f"--extend-to {extend_to} is below the {saved.train.steps} steps run "
                             f"{run_dir} already has; pass a larger number")
        extended = replace(saved.train, steps=extend_to, extended_from=(
            *saved.train.extended_from, saved.train.steps) if extending else
            saved.train.extended_from)
        saved = replace(saved, train=extended)
        config = replace(config, train=replace(config.train, steps=extend_to,
                                               extended_from=extended.extended_from))
    diffs = config_lib.result_differences(saved, config)
    if diffs:
        raise ValueError(
            f"run {run_dir} was trained with a different config ({'; '.join(diffs[:3])}); "
            "resume with the same settings or choose a new --out directory"
        )
    apart = optimizer_apart(config.phases)
    if apart is not None and run.get("optimizer_apart") != apart:
        raise ValueError(
            f"run {run_dir} has a phase that trains the MLM head alone and was saved before "
            "clozax kept the head's Adam state apart from the encoder's (its checkpoints hold "
            "one state for both, which scaled the encoder's first updates after the phase); "
            "it cannot resume with this version: train it again with a new --out"
        )
    if run["tokenizer_sha256"] != dataset.tokenizer_sha256:
        raise ValueError(
            f"run {run_dir} used tokenizer {run['tokenizer_sha256'][:12]}, the dataset has "
            f"{dataset.tokenizer_sha256[:12]}; resume with the original dataset or a new --out"
        )
    if run["dataset_fingerprint"] != dataset.fingerprint:
        raise ValueError(
            f"run {run_dir} was trained on dataset {run['dataset_fingerprint'][:12]}, not "
            f"{dataset.path} {dataset.fingerprint[:12]} (re-prepared, or other data); resume "
            "with the original dataset or choose a new --out"
        )
    return config, extending, run


def lock_run(held: ExitStack, run_dir: Path, primary: bool, say) -> None:
    """One writer per run: process 0 holds the run's lock (``core/locks.py``) in ``held``;
    every process of a job learns whether it got it (``Locked`` on each when not)."""
    refused = None
    if primary:
        try:
            held.enter_context(locks.hold(run_dir, f"run {run_dir}", say=say))
        except locks.Locked as e:
            refused = e
    if not distributed.broadcast(0 if refused else 1):
        raise refused or locks.Locked(f"run {run_dir} is being written by another job "
                                      "(process 0 says which); wait for it to finish")


def resolve_run(run_dir: Path, config: config_lib.RunConfig, dataset, init_from: Path | None,
                extend_to: int | None, say) -> tuple[config_lib.RunConfig, bool, bool,
                                                      LoadedRun | None, dict | None]:
    """The config to train with in ``run_dir``: an existing run's own (checked against
    ``config``; ``extend_to`` may lengthen it), or a new run's (``init_from`` brings another
    run's model config and parameters). Returns ``(config, existing, extending, init_run,
    info)``: ``info`` is an existing run's ``run.json`` as read for the check (None for a new
    run)."""
    existing = (run_dir / CONFIG_FILE).is_file()
    init_run, extending, info = None, False, None
    if existing:
        config, extending, info = check_compatible(run_dir, config, dataset, extend_to)
        here = runnable_here(config.model)
        if here != config.model:
            say(f"model.attention={config.model.attention!r} cannot run on this machine; "
                f"using {here.attention!r} (the same maths)")
            config = config.replace(model=here)
        return config, existing, extending, init_run, info
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(
            f"output directory {run_dir} exists and is not a clozax run; choose a new --out"
        )
    if extend_to is not None:
        raise ValueError(f"--extend-to needs an existing run in {run_dir}; train it first")
    if init_from is not None:
        init_run = load_run(init_from)
        if init_run.info.get("tokenizer_sha256") != dataset.tokenizer_sha256:
            raise ValueError(
                f"--init-from {init_from} uses a different tokenizer than dataset "
                f"{dataset.path}; prepare the data with `clozax prepare --tokenizer "
                f"{init_from}/tokenizer.json`"
            )
        config = replace(config, model=init_run.config.model)
        say(f"--init-from {init_from}: {init_head(init_run)}")
    if runnable_here(config.model) != config.model:
        here = [impl for impl in attention.IMPLS if attention.runs_here(impl)]
        raise ValueError(f"model.attention={config.model.attention!r} "
                         f"({attention.NVIDIA_ONLY[config.model.attention]}) needs an NVIDIA GPU "
                         f"and this machine runs {jax.default_backend()}; choose one of "
                         f"{', '.join(map(repr, here))}")
    return config, existing, extending, init_run, info


def init_mlm_head(init_run: LoadedRun) -> str:
    """Which MLM head a run started ``--init-from`` ``init_run`` trains (``run.json``'s
    ``init_mlm_head``): ``"source"``, or ``"fresh"`` for a bare encoder imported without one
    (the head ``clozax import-hf`` wrote: identity transform, zero bias, over the tied word
    embeddings)."""
    return "source" if init_run.has_mlm_head else "fresh"


def init_head(init_run: LoadedRun) -> str:
    """What a run started ``--init-from`` ``init_run`` says it starts from (``init_mlm_head``)."""
    if init_mlm_head(init_run) == "source":
        return "starting from its encoder and its MLM head"
    return ("starting from its encoder; the MLM head starts fresh (the source has none: "
            "identity transform and zero bias over the tied word embeddings)")


def read_config(run_dir: Path) -> tuple[config_lib.RunConfig, dict]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist; train one with `clozax train`")
    cfg_path, info_path = run_dir / CONFIG_FILE, run_dir / RUN_FILE
    if not cfg_path.is_file() or not info_path.is_file():
        raise ValueError(
            f"{run_dir} is not a clozax run (no config.json/run.json); pass a directory written "
            "by `clozax train` or `clozax import-hf`"
        )
    try:
        config, info = config_lib.load_json(cfg_path), json.loads(info_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{cfg_path} or run.json is not valid JSON ({e}); the run is damaged"
        ) from None
    # Speed-only settings are the loading machine's business: a run trained anywhere loads
    # anywhere (e.g. model.attention="cudnn" runs as "auto" on a CPU).
    return config.replace(model=runnable_here(config.model)), info


def abstract_state(config: config_lib.RunConfig):
    """Shapes/dtypes of TrainState for ``config``, without allocating (for restore).

    Every array is placed whole on this process's first device, whatever the saving run's
    layout was (replicated or ``train.fsdp``-sharded over other devices): orbax needs a target
    sharding to restore onto a different topology.
    """
    params = jax.eval_shape(lambda: model_lib.init(config.model, jax.random.key(0)))
    optimizer, _ = make_optimizer(config.optim, config.train.steps, params,
                                  apart=optimizer_apart(config.phases))
    opt_state = jax.eval_shape(optimizer.init, params)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state)
    return ckpt.abstract_like(state, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))


def load_run(run_dir: Path, step: int | None = None) -> LoadedRun:
    """Load a run's config (speed-only settings resolved for this machine), provenance and the
    parameters of ``step`` (default: the newest committed checkpoint that is not damaged; a
    damaged newer one is skipped with one line on stderr). Read-only: it writes nothing in the
    run, so it may look at a run while it trains (and says which step it took)."""
    run_dir = Path(run_dir)
    config, info = read_config(run_dir)
    checkpointer = ckpt.Checkpointer(run_dir, read_only=True)
    try:
        steps = checkpointer.all_steps()
        if not steps:
            raise ValueError(
                f"run {run_dir} has no checkpoint yet; train it (or let a save complete) first"
            )
        # Only the parameters are read: the AdamW moments (twice their size) stay on disk.
        if step is None:
            state, _, chosen = checkpointer.restore_latest(abstract_state(config), say=warn,
                                                           params_only=True)
        elif step not in steps:
            raise ValueError(f"run {run_dir} has no checkpoint at step {step}; it has {steps}")
        else:
            chosen = step
            state, _ = checkpointer.restore(step, abstract_state(config), params_only=True)
        verified = checkpointer.verified(chosen)
    finally:
        checkpointer.close()
    holder = locks.current_holder(run_dir)
    if holder is not None:
        warn(f"run {run_dir} is training ({holder.describe()}); using its newest committed "
             f"checkpoint, step {chosen}" + ("" if verified else " (its digest is not "
                                               "recorded yet)"))
    # A run in phases: the model of the phase that trained this checkpoint (its RoPE bases)
    config = config.replace(model=model_at(config, info, chosen))
    return LoadedRun(run_dir, config, info, chosen, state.params)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def open_run_dataset(run: LoadedRun, path: Path | None = None, opener=open_dataset) -> Dataset:
    """The dataset a loaded run was trained on (or the one at ``path``), refused unless it is
    that same dataset: fingerprint (which covers the split, ``seq_len``, tokenizer and every
    data file), tokenizer, vocabulary and length must all agree with the run's provenance. An
    imported run has none: it takes any ``path`` prepared with its tokenizer (its domain)."""
    recorded = run.info.get("dataset")
    if path is None and not recorded:  # imported (clozax import-hf): no corpus of its own
        raise ValueError(
            f"run {run.path} has no dataset of its own (it was imported, not trained here); "
            "give the command its data where it takes some (a pair file, --beir, --data), or "
            f"continue pretraining it on a prepared dataset first (`clozax train --init-from "
            f"{run.path}`)"
        )
    path = Path(path if path is not None else recorded)
    if not path.is_dir():
        raise ValueError(
            f"run {run.path} was trained on dataset {str(recorded)!r}, which does not exist "
            "here; restore that directory (or re-run `clozax prepare` with the same options)"
            if recorded else f"--data {path} does not exist; prepare it with `clozax prepare "
            f"--tokenizer {run.tokenizer_path}` or name another directory"
        )
    dataset = opener(path)
    mismatches = []
    if recorded and run.info.get("dataset_fingerprint") != dataset.fingerprint:
        mismatches.append(f"fingerprint {str(run.info.get('dataset_fingerprint'))[:12]} vs "
                          f"{dataset.fingerprint[:12]}")
    if run.info.get("tokenizer_sha256") != dataset.tokenizer_sha256:
        mismatches.append(f"tokenizer sha256 {str(run.info.get('tokenizer_sha256'))[:12]} vs "
                          f"{dataset.tokenizer_sha256[:12]}")
    if run.config.model.vocab_size != dataset.vocab_size:
        mismatches.append(f"vocab_size {run.config.model.vocab_size} vs {dataset.vocab_size}")
    if dataset.seq_len > run.config.model.max_positions:
        mismatches.append(f"seq_len {dataset.seq_len} > max_positions "
                          f"{run.config.model.max_positions}")
    if mismatches and not recorded:  # an imported run: any data its tokenizer and length fit
        raise ValueError(
            f"--data {path} was prepared with another tokenizer or length than run {run.path} "
            f"takes ({'; '.join(mismatches)}); prepare it with `clozax prepare --tokenizer "
            f"{run.tokenizer_path}` and a --seq-len of at most {run.config.model.max_positions}"
        )
    if mismatches:
        raise ValueError(
            f"checkpoint whose config does not match the data: run {run.path} vs dataset {path} "
            f"({'; '.join(mismatches)}); use the dataset the run was trained on"
        )
    return dataset

