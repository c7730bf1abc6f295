"""A run in phases: its ``[[phases]]`` turned into a plan of segments, one compiled step each.

One run directory, one step counter, one continuous optimizer state: phase ``k`` covers the
updates ``[start_k, end_k)``. A phase with a batch ramp is several *segments* (one per batch
size); every segment has fixed shapes, so it is one compiled program, built when training
reaches it. What a segment trains with is a pure function of the config and the datasets:

- its rows: the phase's dataset read as an endless stream of epoch permutations
  (``data/loader.py`` ``stream_rows``), each dataset's stream continuing where its previous
  segment stopped, so batch ``i`` is a pure function of ``i`` and a resume (before, at or after
  a boundary) is bitwise the uninterrupted run;
- its masks: ``fold_in(mask_key, step)`` as always; a phase with its own masking rate ramps
  from its first update;
- its learning rate: the run's ``piecewise_rate`` (one ``RatePiece`` per phase), continuous
  across segments because it is a function of the optimizer's update count;
- its model: the run's, with the phase's RoPE bases;
- what it trains: every parameter, or the MLM head alone (``segment_trains``).

A run without phases is one segment (and keeps ``batch_rows``, so it trains as it always did).
The plan is recorded in ``run.json`` (``phases``: each phase's steps, ``seq_len`` and dataset);
readers take a checkpoint's model and trained length from it (``train/run_dir.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from clozax.core.optim import RatePiece, piece_rate
from clozax.train.config import RunConfig, phase_masking
from clozax.train.phase_config import PhaseConfig, phase_names


@dataclass(frozen=True)
class Segment:
    phase: int  # index into config.phases (0 for a run without phases)
    name: str  # the phase's name
    start: int  # its updates are [start, end), 0-based
    end: int
    phase_start: int  # its phase's updates are [phase_start, phase_end)
    phase_end: int
    batch_size: int
    data: Path  # the dataset's directory
    seq_len: int
    row_start: int  # the first row of its dataset's stream it reads (phased runs)


@dataclass(frozen=True)
class Plan:
    segments: tuple[Segment, ...]
    phased: bool
    pieces: tuple[RatePiece, ...]  # the learning rate, one piece per phase (phased runs)

    @property
    def total(self) -> int:
        return self.segments[-1].end

    def at(self, i: int) -> Segment:
        """The segment that computes update ``i`` (0-based; the last one past the end)."""
        for segment in self.segments:
            if i < segment.end:
                return segment
        return self.segments[-1]

    def tokens_through(self, step: int) -> int:
        """Training tokens (rows x seq_len) in the first ``step`` updates."""
        return sum(max(0, min(step, s.end) - s.start) * s.batch_size * s.seq_len
                   for s in self.segments)

    def phases(self) -> list[dict]:
        """What ``run.json`` records of each phase: name, updates, length, dataset, batches."""
        out: dict[int, dict] = {}
        for s in self.segments:
            entry = out.setdefault(s.phase, {"name": s.name, "start": s.phase_start,
                                             "end": s.phase_end, "seq_len": s.seq_len,
                                             "data": str(s.data), "batch_sizes": []})
            entry["batch_sizes"].append([s.start, s.batch_size])
        return [out[k] for k in sorted(out)]


def batch_stages(phase: PhaseConfig, batch_size: int) -> list[tuple[int, int]]:
    """``(updates, batch size)`` of the phase's ramp stages (then its full size): sizes evenly
    spaced from ``batch_start``, rounded down to a multiple of ``gcd(batch_start, batch_size)``;
    neighbouring stages of one size are one stage (one compiled program)."""
    if phase.batch_start is None:
        return []
    unit = math.gcd(phase.batch_start, batch_size)
    n, ramp = phase.batch_ramp_stages, phase.batch_ramp_steps
    stages: list[tuple[int, int]] = []
    for j in range(n):
        size = (phase.batch_start + (batch_size - phase.batch_start) * j // n) // unit * unit
        steps = ramp * (j + 1) // n - ramp * j // n
        if stages and stages[-1][1] == size:
            stages[-1] = (stages[-1][0] + steps, size)
        elif steps:
            stages.append((steps, size))
    return stages


def _phase_steps(phase: PhaseConfig, stages, batch_size: int, seq_len: int) -> int:
    """The phase's updates: ``steps``, or the fewest whose tokens reach ``tokens``."""
    if phase.steps is not None:
        return phase.steps
    left, steps = phase.tokens, 0
    for n, size in stages:
        if left <= n * size * seq_len:
            return steps + math.ceil(left / (size * seq_len))
        left, steps = left - n * size * seq_len, steps + n
    return steps + math.ceil(left / (batch_size * seq_len))


def rate_pieces(config: RunConfig, bounds: list[tuple[int, int]]) -> tuple[RatePiece, ...]:
    """One learning-rate piece per phase (``phase_config.py`` says what an unset key means)."""
    optim, pieces, begin = config.optim, [], 0.0
    last = len(config.phases) - 1
    for k, (phase, (start, end)) in enumerate(zip(config.phases, bounds, strict=True)):
        peak = phase.learning_rate if phase.learning_rate is not None else optim.learning_rate
        warmup = phase.warmup_steps if phase.warmup_steps is not None else (
            min(optim.warmup_steps, end - start - 1) if k == 0 else 0)
        decay = phase.decay or (optim.schedule if k == last else "none")
        fraction = phase.decay_fraction if phase.decay_fraction is not None else (
            optim.decay_fraction if k == last and phase.decay is None else 1.0)
        end_fraction = (phase.end_lr_fraction if phase.end_lr_fraction is not None
                        else optim.end_lr_fraction)
        piece = RatePiece(start, end - start, peak, warmup, decay, fraction,
                          peak * end_fraction, begin)
        pieces.append(piece)
        begin = float(piece_rate(piece, end - start))  # where the next warm-up starts
    return tuple(pieces)


def make_plan(config: RunConfig, data_dir: Path, open_dataset) -> tuple[Plan, dict]:
    """The run's plan and its datasets by directory (``open_dataset(path)`` opens one). Every
    phase's dataset must have the run's tokenizer and fit the model; checked here, in one line,
    before anything is compiled."""
    data_dir = Path(data_dir).absolute()
    datasets = {data_dir: open_dataset(data_dir)}
    if not config.phases:
        d = datasets[data_dir]
        b = config.train.batch_size
        return Plan((Segment(0, "", 0, config.train.steps, 0, config.train.steps, b, data_dir,
                             d.seq_len, 0),), False, ()), datasets
    main = datasets[data_dir]
    segments, bounds, rows_read, at = [], [], {}, 0
    for k, (phase, name) in enumerate(zip(config.phases, phase_names(config.phases),
                                          strict=True)):
        path = Path(phase.data).absolute() if phase.data else data_dir
        if path not in datasets:
            if not path.is_dir():
                raise ValueError(f"phase {name}'s dataset {path} does not exist; prepare it with "
                                 f"`clozax prepare --tokenizer {data_dir}/tokenizer.json`")
            datasets[path] = open_dataset(path)
        dataset = datasets[path]
        if dataset.tokenizer_sha256 != main.tokenizer_sha256:
            raise ValueError(f"phase {name}'s dataset {path} has another tokenizer than "
                             f"{data_dir}; prepare it with `clozax prepare --tokenizer {data_dir}/"
                             "tokenizer.json`")
        if dataset.seq_len > config.model.max_positions:
            raise ValueError(f"phase {name}'s rows are {dataset.seq_len} tokens, over "
                             f"model.max_positions={config.model.max_positions}; raise it")
        size = phase.batch_size or config.train.batch_size
        stages = batch_stages(phase, size)
        steps = _phase_steps(phase, stages, size, dataset.seq_len)
        if phase.batch_ramp_steps > steps:
            raise ValueError(f"phase {name}'s batch ramp ({phase.batch_ramp_steps} steps) is "
                             f"longer than the phase ({steps} steps)")
        ramped = sum(n for n, _ in stages)
        for n, b in [*stages, (steps - ramped, size)]:
            if n == 0:
                continue
            if dataset.train.rows < b:
                raise ValueError(f"phase {name}'s dataset {path} has {dataset.train.rows} "
                                 f"training rows, fewer than its batch of {b}; lower the "
                                 "phase's batch_size or prepare more data")
            segments.append(Segment(k, name, at, at + n, 0, 0, b, path, dataset.seq_len,
                                    rows_read.get(path, 0)))  # phase bounds: below
            rows_read[path] = rows_read.get(path, 0) + n * b
            at += n
        bounds.append((at - steps, at))
    # each segment knows its phase's bounds
    segments = [dataclasses.replace(s, phase_start=bounds[s.phase][0],
                                    phase_end=bounds[s.phase][1]) for s in segments]
    return Plan(tuple(segments), True, rate_pieces(config, bounds)), datasets


def segment_config(config: RunConfig, segment: Segment) -> RunConfig:
    """The config a segment's program is built from: the run's, with its phase's batch size,
    masking, RoPE bases and weight decay."""
    if not config.phases:
        return config
    phase = config.phases[segment.phase]
    model = config.model
    if phase.rope_theta_global is not None:
        model = dataclasses.replace(model, rope_theta_global=phase.rope_theta_global)
    if phase.rope_theta_local is not None:
        model = dataclasses.replace(model, rope_theta_local=phase.rope_theta_local)
    optim = config.optim
    if phase.weight_decay is not None:
        optim = dataclasses.replace(optim, weight_decay=phase.weight_decay)
    train = dataclasses.replace(config.train, batch_size=segment.batch_size)
    return config.replace(model=model, masking=phase_masking(config.masking, phase), optim=optim,
                          train=train)


def segment_trains(config: RunConfig, segment: Segment) -> str:
    """What a segment's updates move (``PhaseConfig.trains``): ``"all"``, or ``"head"``."""
    return config.phases[segment.phase].trains if config.phases else "all"


def mask_step_offset(config: RunConfig, segment: Segment) -> int:
    """The update a segment's masking ramp counts from: its phase's first when the phase sets
    its own masking rate, else 0 (the run's ramp)."""
    if config.phases and config.phases[segment.phase].rate is not None:
        return segment.phase_start
    return 0


def phase_at(info: dict, step: int) -> int:
    """The phase (index) whose updates produced checkpoint ``step`` (the first for step 0),
    from ``run.json``'s ``phases``."""
    phases = info.get("phases") or []
    for k, phase in enumerate(phases):
        if step <= phase["end"]:
            return k
    return max(len(phases) - 1, 0)


def trained_length_at(info: dict, step: int) -> int | None:
    """The longest row trained on in the first ``step`` updates of a run in phases (None for a
    run without phases: ``run.json``'s ``trained_length`` holds)."""
    phases = info.get("phases")
    if not phases:
        return None
    done = [p["seq_len"] for p in phases if p["start"] < step] or [phases[0]["seq_len"]]
    return max(max(done), int(info.get("source_trained_length") or 0))


def tokens_at(info: dict, step: int) -> int | None:
    """Training tokens in the first ``step`` updates of a run in phases, from ``run.json``'s
    ``phases`` (None for a run without phases: batch x seq_len x step holds)."""
    total = 0
    for phase in info.get("phases") or []:
        starts = [*phase["batch_sizes"][1:], [phase["end"], 0]]
        for (start, size), (end, _) in zip(phase["batch_sizes"], starts, strict=True):
            total += max(0, min(step, end) - start) * size * phase["seq_len"]
    return total if info.get("phases") else None


def model_at(config: RunConfig, info: dict, step: int):
    """The model config checkpoint ``step`` of a run in phases was trained with (its phase's
    RoPE bases); the run's own for a run without phases."""
    if not config.phases or not info.get("phases"):
        return config.model
    phase = config.phases[phase_at(info, step)]
    model = config.model
    for key in ("rope_theta_global", "rope_theta_local"):
        if getattr(phase, key) is not None:
            model = dataclasses.replace(model, **{key: getattr(phase, key)})
    return model


def stream_positions(segment: Segment, i: int) -> tuple[int, int]:
    """Update ``i``'s rows in its dataset's stream: ``(first row position, count)``."""
    return segment.row_start + (i - segment.start) * segment.batch_size, segment.batch_size


def step_fields(plan: Plan, segment: Segment, step: int) -> dict:
    """A metrics line's place: the step, the tokens trained so far, and in a run in phases the
    phase and the step within it."""
    fields = {"step": step, "tokens": plan.tokens_through(step)}
    if plan.phased:
        fields.update(phase=segment.name, phase_step=step - segment.phase_start)
    return fields


def run_records(plan: Plan, datasets: dict, run_dir: Path, recorded: list | None) -> list[dict]:
    """The plan's phases as ``run.json`` records them (with each dataset's fingerprint); on a
    resume (``recorded``: ``run.json``'s), refused unless they are the recorded ones (the same
    phases on the same data: fingerprints and row lengths compared, not paths, so a run's
    datasets may move)."""
    if not plan.phased:
        return []
    records = [{**p, "fingerprint": datasets[Path(p["data"])].fingerprint}
               for p in plan.phases()]

    def where_free(rs):  # a dataset is its fingerprint and row length, wherever it lies
        return [{k: v for k, v in r.items() if k != "data"} for r in rs]

    if recorded is not None and where_free(recorded) != where_free(records):
        old = {r["name"]: r for r in where_free(recorded)}
        changed = [r["name"] for r in where_free(records) if old.get(r["name"]) != r] or \
            ["the list"]
        raise ValueError(f"run {run_dir}'s phases were planned on other data or lengths "
                         f"(phase {changed[0]} differs); resume with the same datasets or "
                         "choose a new --out")
    return records
