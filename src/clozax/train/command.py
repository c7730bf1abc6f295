"""What ``clozax train``'s options resolve to, in stages: a decay branch (written now, or
resumed) or the config from defaults ← preset ← file ← overrides (the run's own model section
on a re-run), then a recipe; the combinations that cannot work refused in one line, before
anything is written or compiled. The command line only parses (``clozax.app.train``)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from clozax.train import config as config_lib
from clozax.train.run_dir import CONFIG_FILE, read_config


@dataclass(frozen=True)
class Options:
    """The options of ``clozax train`` that choose the run's config."""

    steps: int | None = None
    minutes: float | None = None
    preset: str | None = None
    config: Path | None = None
    set_: tuple[str, ...] = ()
    save_every: int | None = None
    eval_every: int | None = None
    resume: bool = False
    extend_to: int | None = None
    decay_from: Path | None = None
    step: int | None = None
    recipe: str | None = None


def resolve_command(out: Path, o: Options, say=print) -> config_lib.RunConfig:
    """The run config ``clozax train --out OUT`` with options ``o`` trains."""
    _refuse_combinations(out, o)
    if o.decay_from is not None or o.step is not None:
        return _branch(out, o, say)
    resolved = config_lib.resolve(o.config, o.preset, _overrides(o),
                                  run_model=_run_model(out))
    explicit = _explicit(o)
    steps = explicit.get("train.steps", "")
    if steps.startswith("--") and resolved.phases and o.recipe is None:
        raise ValueError(f"{steps} cannot be combined with [[phases]]: a run in "
                         "phases has the length its phases give; set each phase's steps "
                         "(or use --recipe, which scales its phases to --steps)")
    if o.recipe is not None:
        from clozax.train.recipes import apply_recipe

        resolved = apply_recipe(o.recipe, resolved, explicit)
    return resolved


def _explicit(o: Options) -> dict[str, str]:
    """The settings the user gave (dotted key -> where): the config file's tables, then
    ``--set`` and the options that set one (each overriding the file)."""
    given: dict[str, str] = {}
    if o.config is not None:
        for section, values in tomllib.loads(Path(o.config).read_text()).items():
            if section in config_lib.SECTIONS and isinstance(values, dict):
                given.update({f"{section}.{k}": f"config file {o.config} ([{section}] {k})"
                              for k in values if k != "preset"})
    for item in o.set_:
        given[item.partition("=")[0].strip().replace(" ", "")] = f"--set {item}"
    for name, value in _options(o):
        given[f"train.{name}"] = f"--{name.replace('_', '-')} {value}"
    return given


def _refuse_combinations(out: Path, o: Options) -> None:
    if o.resume and not (out / CONFIG_FILE).is_file():
        raise ValueError(f"--resume given but {out} is not a clozax run; drop --resume to start")
    if o.extend_to is not None and o.minutes is not None:
        raise ValueError("--extend-to and --minutes cannot be combined; give one of them")
    branch = o.decay_from is not None or o.step is not None
    if branch and (None in (o.decay_from, o.step, o.steps) or o.set_ or o.minutes or o.config
                   or o.preset):
        raise ValueError("a decay branch is --decay-from RUN --step S --steps N --out NEW "
                         "(no --set, --config, --preset or --minutes: it keeps RUN's)")
    if branch and o.recipe is not None:
        raise ValueError("--recipe and --decay-from cannot be combined: a branch keeps RUN's "
                         "recipe")


def _branch(out: Path, o: Options, say) -> config_lib.RunConfig:
    """A decay branch of RUN (``train/branch.py``): written now and said, or resumed."""
    from clozax.train.branch import decay_branch

    resolved, created = decay_branch(o.decay_from, o.step, o.steps, out)
    if created:  # a resume of the branch says nothing of it again
        say(f"branched {out} from {o.decay_from} step {o.step}: decaying over {o.steps} "
            "updates")
    return resolved


def _options(o: Options) -> list[tuple[str, object]]:
    """The options that set a ``train`` key, as (key, value), where given."""
    return [(name, value) for name, value in (
        ("steps", o.steps), ("minutes", o.minutes), ("save_every", o.save_every),
        ("eval_every", o.eval_every)) if value is not None]


def _overrides(o: Options) -> list[str]:
    return [*o.set_, *(f"train.{name}={value}" for name, value in _options(o))]


def _run_model(out: Path):
    """A run's model section comes from its saved config on every re-run."""
    return read_config(out)[0].model if (out / CONFIG_FILE).is_file() else None


def summary(out: Path, result) -> str:
    """The command's last line: what this invocation trained, and the held-out sample."""
    at = "" if result.trained == result.steps else f" (now at step {result.steps})"
    line = (f"trained {result.trained} steps into {out}{at}; final train loss "
            f"{result.final_loss:.4f}" if result.trained else
            f"{out} already has its {result.steps} steps: nothing trained")
    if result.eval:
        rows = f" ({result.eval['rows']:,} rows)" if "rows" in result.eval else ""
        line += (f"; held-out sample{rows} loss {result.eval['loss']:.4f}, accuracy "
                 f"{result.eval['accuracy']:.4f} (clozax evaluate: the whole set)")
    return line
