"""``clozax embed RUN --out EMB``: the contrastive stage, as a clozax run.

EMB is a run directory like any other (``config.json``, ``run.json``, ``tokenizer.json``,
``checkpoints/``, ``metrics.jsonl``), so ``load_run``, ``clozax status``, ``clozax export
--sentence-transformers`` and ``clozax retrieval`` read it; ``run.json``'s ``stage`` records
the stage's settings, its source run and step, and the digest of its pairs. It is written
under the run's lock and resumes bitwise: batch ``i`` is a pure function of ``(seed, i)`` (a
keyed permutation of the pairs per epoch) and the dropout key is ``fold_in(key, step)``. It
trains in the loop ``clozax train`` trains in (``train/drive.py``), handed the stage's job
(``_StageJob``: its one program, its batches, no held-out evaluation): so every step is
checked finite before anything of it is logged or saved, it saves every ``save_every`` steps
and every ``save_every_minutes``, its log lines carry the pace (tokens/s, MFU, data wait,
ETA), and SIGTERM/SIGINT saves the step it stops at. Its pairs as token rows: ``rows.py``.

The stage's config is a ``RunConfig``: the source's model with the stage's dropout, AdamW at
the stage's rate (``stage_rate``: linear warm-up over the first tenth of the stage's length,
linear decay to 0), and ``train.steps`` / ``batch_size`` / ``seed`` / ``microbatches`` (the
gradient-cache chunks, speed only). A ``--minutes`` stage fixes its length before its first
update, from steps timed on a throwaway copy of the state (``--steps`` plays no part), so its
warm-up is a tenth of that length; each length its budget chooses is recorded (``(0, length)``
first, then the re-estimates) in ``config.json`` and ``run.json``'s ``stage``, and a
re-training (``train_in_memory``, ``clozax retrieval``) replays them (``lengths.py``). The
step's mathematics is ``step.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clozax.core import files, flops, pattern
from clozax.core import model as model_lib
from clozax.core.keys import Keys
from clozax.core.optim import make_optimizer
from clozax.core.train_state import init_params, new_state, with_total_steps
from clozax.train import checkpoint as ckpt
from clozax.train import config as config_lib
from clozax.train import distributed
from clozax.train.budget import Budget
from clozax.train.contrastive.lengths import first_length, record_length
from clozax.train.contrastive.rows import (
    mined_negatives,
    packed_batch,
    packed_counts,
    pair_rows,
)
from clozax.train.contrastive.settings import NEGATIVES_FILE, OPTIONAL, StageSettings
from clozax.train.contrastive.step import make_embed_step, stage_rate
from clozax.train.drive import Job, Progress, drive
from clozax.train.evaluation import TrainingDiverged
from clozax.train.interrupts import Interrupts
from clozax.train.layout import CONFIG_FILE, RUN_FILE, TOKENIZER_FILE
from clozax.train.mesh import from_host, make_mesh, place
from clozax.train.observe import TrainLog
from clozax.train.run_dir import (
    LoadedRun,
    load_run,
    lock_run,
    open_run_dataset,
    read_config,
)


@dataclass
class Stage:
    """What one stage trains with: the encoder's config, the token rows of its pairs and the
    step. ``state`` is the train state on the mesh."""

    config: config_lib.RunConfig
    rows: dict  # side -> [N, L] int32
    digest: str
    source: str
    step_fn: object
    sharding: NamedSharding
    key: jax.Array
    settings: StageSettings
    specials: dict
    packed: dict | None = None  # --pack: each side's packed rows per batch


def make_stage(run: LoadedRun, settings: StageSettings, steps: int, mesh=None) -> Stage:
    """The stage's config, pairs and compiled step for ``steps`` updates."""
    run.check_length(settings.seq_len, "--seq-len")
    rows, source = pair_rows(run, settings)
    digest = hashlib.sha256(b"".join(rows[s].tobytes() for s in sorted(rows))).hexdigest()
    model = dataclasses.replace(run.config.model, dropout=settings.dropout,
                                attention_dropout=settings.attention_dropout)
    optim = config_lib.OptimConfig(learning_rate=settings.learning_rate,
                                   warmup_steps=max(1, math.ceil(steps / 10)),
                                   weight_decay=0.01, b2=0.999, eps=1e-8)
    train = config_lib.TrainConfig(steps=steps, batch_size=settings.batch_size,
                                   seed=settings.seed, microbatches=settings.chunks,
                                   minutes=settings.minutes, eval_rows=None, eval_sample=None,
                                   save_every=settings.save_every,
                                   save_every_minutes=settings.save_every_minutes)
    config = config_lib.RunConfig(model=model, optim=optim, train=train)
    mesh = mesh or make_mesh(None)
    if settings.batch_size % mesh.devices.size:
        raise ValueError(f"--batch-size {settings.batch_size} is not a multiple of the "
                         f"{mesh.devices.size} devices; choose a multiple")
    stage = Stage(config, rows, digest, source, None, NamedSharding(mesh, P("data")),
                  Keys.from_seed(settings.seed).mask, settings, run.specials)
    if settings.pack:  # the most rows any of its batches fills (the last length, replayed)
        end = max([steps, *(n for _, n in settings.budget_revisions)])
        stage.packed = packed_counts(rows, (pairs_at(stage, i) for i in range(end)),
                                     run.specials["pad"], mesh.devices.size)
    return stage


def compile_step(stage: Stage, params):
    """``stage.step_fn`` (jitted, the state donated) and the state at step 0 from ``params``."""
    s = stage.settings
    optimizer, stage.step_fn = _jitted_step(stage.config.model, stage.config.optim,
                                            stage.config.train.steps, s.pooling, s.temperature,
                                            s.symmetric, s.chunks, stage.specials["pad"],
                                            s.pack)
    replicated = NamedSharding(stage.sharding.mesh, P())
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)  # the step donates its own
    state = new_state(params, optimizer)
    return place(state, jax.tree.map(lambda _: replicated, state)), optimizer


@functools.lru_cache(maxsize=4)
def _jitted_step(model_config, optim, steps: int, pooling: str, temperature: float,
                 symmetric: bool, chunks: int, pad: int, packed: bool):
    """One jitted step per stage shape: ``clozax retrieval``'s seeds (and the random-init
    control, the same program) trace and compile it once."""
    shapes = jax.eval_shape(lambda: model_lib.init(model_config, jax.random.key(0)))
    optimizer, schedule = make_optimizer(optim, steps, shapes,
                                         schedule=stage_rate(optim.learning_rate))
    return optimizer, jax.jit(make_embed_step(model_config, optimizer, schedule, pooling,
                                              temperature, symmetric, chunks, pad, packed),
                              donate_argnums=0)


def batch_at(stage: Stage, i: int) -> dict:
    """Batch ``i``: a keyed permutation of the pairs per epoch, the remainder of an epoch left
    out; a pure function of ``(seed, i)``. ``--pack``: each side packed (``rows.py``)."""
    chosen = pairs_at(stage, i)
    arrays = ({s: stage.rows[s][chosen] for s in stage.rows} if stage.packed is None else
              packed_batch(stage.rows, chosen, stage.specials["pad"], stage.packed))
    keys = sorted(arrays)  # every process holds every pair: each builds its own shards
    return dict(zip(keys, from_host(stage.sharding, [arrays[k] for k in keys]), strict=True))


def pairs_at(stage: Stage, i: int) -> np.ndarray:
    """Batch ``i``'s pair indices [B] (what ``benchmarks/mnrl_parity.py`` feeds MNRL too)."""
    n, b = len(stage.rows["query"]), stage.settings.batch_size
    epoch, k = divmod(i, n // b)
    order = np.random.default_rng([stage.settings.seed, epoch, 17]).permutation(n)
    return order[k * b:(k + 1) * b]


def train_in_memory(run: LoadedRun, settings: StageSettings, mesh=None) -> tuple[dict, list]:
    """The stage on ``run``'s parameters (or, ``random_init``, its architecture at init), no
    checkpoint: ``(params, losses)``. What ``clozax retrieval`` runs per seed; the same steps
    as ``embed``, a ``--minutes`` stage's recorded lengths replayed (``budget_revisions``)."""
    lengths = dict(settings.budget_revisions)
    end = settings.budget_revisions[-1][1] if lengths else settings.steps
    stage = make_stage(run, settings, lengths.get(0, end), mesh)
    state, _ = compile_step(stage, _start_params(run, settings))
    losses = []
    for i in range(end):
        state, metrics = stage.step_fn(state, batch_at(stage, i), stage.key)
        losses.append(metrics)
        if i + 1 in lengths:
            state = with_total_steps(state, lengths[i + 1])
    fetched = jax.device_get(losses)
    for step, m in enumerate(fetched, 1):
        if not bool(m["finite"]):
            raise TrainingDiverged(_diverged(step))
    return state.params, [float(m["loss"]) for m in fetched]


def _start_params(run: LoadedRun, settings: StageSettings):
    if settings.random_init:
        return init_params(run.config.model, settings.seed)
    return run.params


def embed(source: Path, out: Path, settings: StageSettings, say=print,
          stop_after: int | None = None) -> dict:
    """The stage on run ``source`` into ``out`` (new, or resumed with the same settings);
    returns a summary. ``stop_after``: stop (saved) after that many updates (tests)."""
    started = time.perf_counter()
    out = Path(out)
    with ExitStack() as held:
        lock_run(held, out, distributed.is_primary(), say)
        # process 0 decides, so every process of a job takes the same branch
        existing = bool(distributed.broadcast(int((out / CONFIG_FILE).is_file())))
        run = load_run(source)
        saved = read_config(out)[0] if existing else None
        stage = make_stage(run, settings, settings.steps if saved is None else
                           saved.train.steps)
        distributed.same_everywhere(stage.digest, "set of pairs")
        info = _identity(run, source, stage)
        if existing:
            _check_same(out, info)
            stage.config = saved.replace(train=dataclasses.replace(  # its length as fixed and
                saved.train, save_every=settings.save_every,  # recorded, this command's saves
                save_every_minutes=settings.save_every_minutes))
        else:
            _write_new(out, run, stage, info)
        with Interrupts(jax.process_count(), early_exit=True) as interrupts:
            return _train(out, run, stage, interrupts, stop_after, started, say)


def _identity(run: LoadedRun, source: Path, stage: Stage) -> dict:
    return {"source_run": str(Path(source).absolute()), "source_step": run.step,
            "pairs_digest": stage.digest, "pairs_source": stage.source,
            "pair_count": len(stage.rows["query"]), **stage.settings.identity()}


def _check_same(out: Path, info: dict) -> None:
    recorded = (files.read_json(out / RUN_FILE) or {}).get("stage")
    if recorded is None:
        raise ValueError(f"{out} is a clozax run but not a contrastive stage; choose a new "
                         "--out")
    keys = set(info) | (set(recorded) & set(OPTIONAL))  # recorded only when set
    differ = sorted(k for k in keys if recorded.get(k) != info.get(k))
    if differ:
        raise ValueError(f"{out} is a stage with other settings ({', '.join(differ)} differ); "
                         "rerun it with its own settings, or choose a new --out")


def _write_new(out: Path, run: LoadedRun, stage: Stage, info: dict) -> None:
    """The new stage's files, by process 0 (which alone judges the directory)."""
    if not distributed.is_primary():
        return
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} exists and is not a clozax run; choose a "
                         "new --out")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run.tokenizer_path, out / TOKENIZER_FILE)
    # The source's phases describe the source's steps, not the stage's, so they stay in the
    # source's run.json; ``init_from`` names the source, as ``clozax train --init-from`` does,
    # so what the encoder pretrained on (judge/overlap.py) is found through it: every phase's
    # dataset and the source's own ``--init-from`` chain.
    given = {}  # an imported source's --data: the corpus this run read, as train records it
    if stage.settings.data is not None:
        data = open_run_dataset(run, Path(stage.settings.data))
        given = {"dataset": str(data.path), "dataset_fingerprint": data.fingerprint}
    files.write_json(out / RUN_FILE, {
        **{k: v for k, v in run.info.items() if k != "phases"}, **given,
        "init_from": str(Path(run.path).absolute()),
        "trained_length": run.trained_length, "has_mlm_head": False, "stage": info},
        sort_keys=True)
    files.write_json(out / CONFIG_FILE, stage.config.to_dict(), sort_keys=True)
    mined = mined_negatives(run, stage.settings)
    if mined is not None:  # what BM25 chose, to read beside the run
        files.write_jsonl(out / NEGATIVES_FILE, (
            {"query": q, "positive": p, "negative": n, "bm25_rank": rank}
            for q, p, n, (_, _, rank) in zip(mined.pairs.queries, mined.pairs.positives,
                                             mined.pairs.negatives, mined.records, strict=True)))


def _train(out: Path, run: LoadedRun, stage: Stage, interrupts: Interrupts, stop_after,
           started: float, say) -> dict:
    """Restore (or start), fix a ``--minutes`` stage's length, say what trains, then the loop
    (``train/drive.py``) with the stage's job; returns the summary."""
    config, s = stage.config, stage.settings
    state, _ = compile_step(stage, _start_params(run, s))
    checkpointer = ckpt.Checkpointer(out, keep=config.train.keep_checkpoints,
                                     primary=distributed.is_primary())
    log = TrainLog(out, enabled=distributed.is_primary())
    restored = checkpointer.restore_latest(ckpt.abstract_like(state), say=say, set_aside=True)
    start = 0 if restored is None else restored[2]
    if restored is not None:
        state = restored[0]
        log.forget_after(start)
    # the length in effect from here (a --minutes stage's choice, or a re-estimate of it)
    state = with_total_steps(state, config_lib.schedule_length(config.train, start))
    budget = None
    if config.train.minutes is not None:  # a new --minutes stage (a resume keeps its lengths)
        budget = Budget(config.train.minutes, started)
        config, state = first_length(
            out, lambda probe: stage.step_fn(probe, batch_at(stage, start), stage.key), config,
            state, budget, start, log)
    devices = stage.sharding.mesh.devices.size
    say(f"clozax embed: {len(stage.rows['query']):,} pairs ({stage.source}), batch "
        f"{s.batch_size} x {s.seq_len} tokens per side, {s.chunks} chunk(s), "
        f"{devices} device(s), attention "
        f"{pattern.attention_plan(config.model, s.seq_len).describe()}, "
        f"steps {start}->{config.train.steps}")
    peak = flops.peak_flops(jax.devices()[0].device_kind, config.model.compute_dtype, devices,
                            config.train.peak_tflops)[0]
    job = _StageJob(out, log, interrupts, checkpointer, started, peak, budget, stop_after,
                    stage)
    progress = Progress(config, state)
    del state  # the loop's from here: no reference here keeps a donated step's state alive
    step = drive(job, progress, start)
    return {"run": str(out), "steps": step, "trained": step - start, "loss": progress.loss,
            "pairs": len(stage.rows["query"]), "source": stage.source}


@dataclass
class _StageJob(Job):
    """The stage as the loop runs it: one program (the contrastive step), the pairs' batches,
    no held-out evaluation; a --minutes re-estimate recorded as ``lengths.py`` records it."""

    stage: Stage

    saves_at_stop_after = True  # a stage stopped early resumes from there (tests)

    def step(self, config, i: int, state, batch):
        return self.stage.step_fn(state, batch, self.stage.key)

    def batch(self, i: int):
        return batch_at(self.stage, i)

    def pace_shape(self, config, i: int) -> tuple[int, float]:
        """Every side's rows; the encoder's FLOPs per token, less the MLM head it has not."""
        h, v, n = config.model.hidden, config.model.vocab_size, self.stage.settings.seq_len
        return (len(self.stage.rows) * self.stage.settings.batch_size * n,
                flops.model_flops_per_token(config.model, n) - 3 * 2 * (h * h + h * v))

    def check(self, pending: list, fetched: list) -> None:
        for (step, _), m in zip(pending, fetched, strict=True):
            if not bool(m["finite"]):
                raise TrainingDiverged(_diverged(step))

    def checkpoint_meta(self, config) -> dict:
        return {"stage": True}

    def record_length(self, config, step: int, steps: int):
        return record_length(self.run_dir, config, step, steps)


def _diverged(step: int) -> str:
    return (f"the contrastive stage diverged at step {step} (a non-finite loss, gradient or "
            "updated parameters); nothing of it was saved — lower --learning-rate")
