"""Every program a command compiles closes over host constants only and calls no host.

A traced function's device array becomes a program constant by a copy to the host, which a GPU
refuses under the training loop's no-host-transfer guard: on 2026-12-04 `clozax train` did not
run on an H200 at all (the masker closed over its special-token table as a device array), and
no CPU test could see it, since on a CPU the copy is free. A host callback inside a program is
the same transfer every call. So each command here runs in-process with ``jax.jit`` recording
the jaxpr of every program it compiles (once per input signature), and the test fails on a
device array among a program's constants (its sub-programs' included) or on any callback
primitive: the train step and the in-training evaluation (classic with word masking, modern
with a masking-rate ramp), ``evaluate``'s, the probe's encoder, the fine-tuning step and its
evaluation, the contrastive step, and retrieval's encoder.
"""

from __future__ import annotations

import json

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import pytest

from commands import clozax
from conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow


class _Recorded:
    """A jitted function that records the closed jaxpr of each new input signature."""

    def __init__(self, jitted, fn, programs: dict):
        self._jitted, self._programs = jitted, programs
        self._name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
        self._seen = set()

    def __call__(self, *args, **kwargs):
        shapes = jax.tree.map(lambda a: (getattr(a, "shape", None), str(getattr(a, "dtype", a))),
                              (args, kwargs))
        signature = str(jax.tree.flatten(shapes))
        if signature not in self._seen:
            self._seen.add(signature)
            self._programs.setdefault(self._name, []).append(
                self._jitted.trace(*args, **kwargs).jaxpr)
        return self._jitted(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


@pytest.fixture
def programs(monkeypatch) -> dict:
    """``{module.function: [closed jaxpr, ...]}`` of every ``jax.jit`` made while the test runs
    (programs jitted at import time are out of reach, and need none of this: no command's
    data exists then)."""
    recorded: dict = {}
    real = jax.jit

    def jit(fn=None, **kwargs):
        if fn is None:  # used as @partial(jax.jit, ...)-style decorator factory
            return lambda f: jit(f, **kwargs)
        return _Recorded(real(fn, **kwargs), fn, recorded)

    monkeypatch.setattr(jax, "jit", jit)
    return recorded


def _problems(closed) -> list[str]:
    """Device-array constants and callbacks anywhere in a closed jaxpr."""
    found = [f"a device array constant {c.shape} {c.dtype}" for c in closed.consts
             if isinstance(c, jax.Array)]

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if "callback" in eqn.primitive.name:
                found.append(f"a host callback ({eqn.primitive.name})")
            for sub in jex.jaxprs_in_params(eqn.params):
                walk(sub)
            for value in eqn.params.values():
                for c in value if isinstance(value, tuple | list) else (value,):
                    if isinstance(c, jex.ClosedJaxpr):
                        found.extend(f"a device array constant {x.shape} {x.dtype}"
                                     for x in c.consts if isinstance(x, jax.Array))

    walk(closed.jaxpr)
    return found


def _assert_clean(programs: dict, expected: set[str]):
    """Every recorded program clean, and each of ``expected`` (module prefixes) recorded."""
    names = set(programs)
    missing = {m for m in expected if not any(n.startswith(m) for n in names)}
    assert not missing, f"no program of {sorted(missing)} was recorded; got {sorted(names)}"
    bad = {name: p for name, jaxprs in programs.items() for j in jaxprs if (p := _problems(j))}
    assert not bad, bad


def test_the_checker_finds_a_device_constant_and_a_callback(programs):
    """The two faults, planted: a device array closed over (the 2026-12-04 bug's shape) and a
    host callback."""
    table = jnp.ones(8, bool)  # a device array
    jax.jit(lambda x: x & table)(jnp.zeros(8, bool))
    jax.jit(lambda x: jax.pure_callback(lambda a: a, x, x))(jnp.zeros(3))
    problems = [p for js in programs.values() for j in js for p in _problems(j)]
    assert any("device array constant (8,) bool" in p for p in problems), problems
    assert any("pure_callback" in p for p in problems), problems


@pytest.mark.parametrize("preset, extra, attention", [
    ("tiny", ('masking.unit="word"',), "einsum"),
    ("modern-tiny", ("masking.rate=0.4", "masking.rate_end=0.15", "masking.ramp_steps=2"),
     "einsum (global), blocked (local)"),
])
def test_train_compiles_clean_programs_and_says_its_attention_paths(
        programs, capsys, stdlib_data, tmp_path, preset, extra, attention):
    """The train step and the in-training evaluation; word masking and a mask ramp trace the
    masker's other branches. The header line and ``run.json`` say which attention path each
    layer kind runs."""
    sets = [a for o in [*TINY_OVERRIDES, "train.steps=2", "train.eval_every=2", *extra]
            for a in ("--set", o)]
    ran = clozax(capsys, "train", "--data", stdlib_data, "--out", tmp_path / "run", "--preset",
                 preset, *sets)
    assert ran.code == 0, ran.err
    assert f"; attention {attention}; " in " ".join((ran.out + ran.err).split())
    record = json.loads((tmp_path / "run" / "run.json").read_text())["attention"]
    local = "blocked" if preset.startswith("modern") else None
    assert record == {"setting": "auto", "platform": "cpu",
                      "paths": [{"seq_len": 64, "global": "einsum", "local": local}]}
    _assert_clean(programs, {"clozax.train.step", "clozax.train.heldout"})


def test_evaluate_and_probe_compile_clean_programs(programs, capsys, tiny_run):
    assert clozax(capsys, "evaluate", tiny_run).code == 0
    assert clozax(capsys, "probe", tiny_run).code == 0
    _assert_clean(programs, {"clozax.train.heldout", "clozax.judge.probe"})


def test_finetune_compiles_clean_programs(programs, capsys, tiny_run_copy, tmp_path):
    task = tmp_path / "task.jsonl"
    words = ["alpha beta", "gamma delta", "epsilon zeta", "eta theta"]
    task.write_text("".join(json.dumps({"text": f"{words[i % 4]} {i}", "label": i % 2}) + "\n"
                            for i in range(40)))
    ran = clozax(capsys, "finetune", tiny_run_copy, "--task", task, "--lr", "3e-3",
                 "--seeds", "1", "--epochs", "1", "--no-control")
    assert ran.code == 0, ran.err
    _assert_clean(programs, {"clozax.judge.finetune.jobs"})


def test_embed_and_retrieval_compile_clean_programs(programs, capsys, tiny_run, tmp_path):
    """``retrieval`` trains the contrastive stage (``clozax embed``'s step and loop) on the
    trained and the random-init encoder, then encodes queries and documents. The programs a
    test before it in this process compiled for the same model are cached; cleared, so they are
    made (and recorded) again here."""
    from clozax.judge.retrieval import compare
    from clozax.train.contrastive import stage

    compare._jitted_encoder.cache_clear()
    stage._jitted_step.cache_clear()
    ran = clozax(capsys, "retrieval", tiny_run, "--seeds", "1", "--steps", "2",
                 "--batch-size", "8", "--seq-len", "24", "--max-queries", "20",
                 "--out", tmp_path / "retrieval.json")
    assert ran.code == 0, ran.err
    _assert_clean(programs, {"clozax.train.contrastive.step", "clozax.judge.retrieval.compare"})
