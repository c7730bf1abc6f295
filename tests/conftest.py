"""Shared, session-scoped fixtures: the built-in corpus prepared (64- and 32-token rows) and one
tiny trained run.

Everything is built from the built-in corpus (stdlib docstrings) into pytest's temporary
directory, so tests never depend on a developer's data/ or runs/ folders.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import suite_profile

# The tests, the commands they start and pytest-xdist's workers share one compilation cache of
# their own (never the user's), kept between sessions in .pytest_cache/: every program is
# stored, so a second `make test-fast` loads what an unchanged code path compiled before
# (tests/README.md). `pytest --cache-clear` (or CLOZAX_COMPILATION_CACHE=DIR) starts cold.
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".pytest_cache" / "clozax-jax"
CACHE_BOUND = 2 << 30  # bytes; past it, a session starts with an empty cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "CLOZAX_COMPILATION_CACHE" not in os.environ:
    # Bounded here, once a session, not by JAX's LRU bound: that one lists the directory on
    # every write (test_masking.py took 36 s instead of 23 s).
    if "PYTEST_XDIST_WORKER" not in os.environ and CACHE.is_dir() and sum(
            f.stat().st_size for f in CACHE.iterdir()) > CACHE_BOUND:
        shutil.rmtree(CACHE, ignore_errors=True)
    os.environ["CLOZAX_COMPILATION_CACHE"] = str(CACHE)

# XLA:CPU's backend at -O0 for the suite, its subprocesses included: compiling is 38 % of the
# suite's time and the programs are tiny and run a few steps. The tiny train step compiles in
# 2.3 s instead of 4.5 s and runs 8 ms a step instead of 2.5 (tests/README.md). Every number a
# test compares is computed at the same level; the lesson's recorded digits hold at both.
# Production code and the benchmarks keep XLA's default, and the page-fault test
# (test_hostmem.py) runs at it; XLA_FLAGS naming another level is left as it is, e.g.
# XLA_FLAGS=--xla_backend_optimization_level=2 make test runs the suite at the default level.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def simulated_devices(count: int) -> dict:
    """The environment of a subprocess with ``count`` simulated CPU devices (the suite's
    XLA_FLAGS kept)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}")}


def pytest_configure(config):
    """The in-process trainings, evaluations and probes share that cache too, as every command
    does: the suite compiles each tiny program once, not once per test."""
    from clozax.train import compile_cache

    compile_cache.enable()
    if os.environ.get(suite_profile.ENV):  # benchmarks/suite_profile.py: where the time goes
        config.pluginmanager.register(suite_profile.Recorder(os.environ[suite_profile.ENV]),
                                      "clozax-suite-profile")


# The files that take longest (each over a minute of a worker's time; measured 2026-12-06),
# longest first. ``--dist loadfile`` hands a worker its next file when it finishes one, in
# collection order: started first, no long file is left to one worker while the other idles.
LONG_FILES = ("test_gpu_check.py", "test_distributed.py", "test_embed.py",
              "test_crash_consistency.py", "test_demo.py", "test_finetune.py",
              "test_reliability.py", "test_modern.py", "test_phases.py", "test_train.py",
              "test_embed_negatives.py", "test_hostmem.py")


def pytest_collection_modifyitems(config, items):
    """The long files first (``LONG_FILES``), the rest in their order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


TINY_OVERRIDES = [
    "train.batch_size=8",
    "train.steps=6",
    "train.eval_every=3",
    "train.save_every=3",
    "train.eval_rows=32",
    "train.log_every=3",
    "optim.warmup_steps=2",
]


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """The built-in corpus prepared with a small vocabulary (about 4 s)."""
    from clozax.data import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(out, corpus="stdlib", vocab_size=1024, seq_len=64, quiet=True)
    return out


@pytest.fixture(scope="session")
def data32(stdlib_data, tmp_path_factory) -> Path:
    """The built-in corpus in 32-token rows with ``stdlib_data``'s (64-token) tokenizer."""
    from clozax.data import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib32"
    prepare(out, corpus="stdlib", seq_len=32, tokenizer=stdlib_data / "tokenizer.json",
            quiet=True)
    return out


@pytest.fixture(scope="session")
def tiny_run(stdlib_data, tmp_path_factory) -> Path:
    """A tiny-preset run trained for a few steps on ``stdlib_data`` (read-only: copy it)."""
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib

    out = tmp_path_factory.mktemp("runs") / "tiny"
    cfg = config_lib.resolve(preset="tiny", overrides=TINY_OVERRIDES)
    train_lib.train(stdlib_data, out, cfg)
    return out


@pytest.fixture
def tiny_run_copy(tiny_run, tmp_path) -> Path:
    """A private, writable copy of the tiny run."""
    dst = tmp_path / "run"
    shutil.copytree(tiny_run, dst)
    return dst


def perturb_torch(model, seed: int):
    """Move a torch model's parameters off their init (N(0, 0.2) noise), so parity tests
    compare weights that are not symmetric or zero."""
    import torch  # only the interop tests need it

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def assert_sparse_block_matches_full(params, config, batch: dict, tol: float):
    """The sparse last block (``apply(positions=)``) gives the gathered full forward's hidden
    states and parameter gradients within ``tol``; returns the sparse hidden states."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from clozax.core import model

    args = (jnp.asarray(batch["inputs"]), jnp.asarray(batch["mask"]),
            jnp.asarray(batch["segments"]))
    positions = jnp.asarray(batch["positions"])

    def full(p):
        return model.gather(model.apply(p, config, *args), positions)

    def sparse(p):
        return model.apply(p, config, *args, positions=positions)

    def loss(f):
        return jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.sin(f(p)))))

    a, b = jax.jit(full)(params), jax.jit(sparse)(params)
    np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
    (la, ga), (lb, gb) = loss(full)(params), loss(sparse)(params)
    np.testing.assert_allclose(lb, la, rtol=tol)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ga))
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(y, x, atol=tol * scale)
    return b


def two_document_batch(vocab: int, lengths, count: int, seed: int = 0) -> dict:
    """Right-padded rows of ``lengths`` real tokens (the longest fills the row), two packed
    documents each (segments 1 then 2, 0 on padding), ``count`` distinct selected positions
    per row."""
    import numpy as np

    rng = np.random.default_rng(seed)
    seq = int(max(lengths))
    inputs = rng.integers(0, vocab, size=(len(lengths), seq), dtype=np.int32)
    mask = np.arange(seq)[None, :] < lengths[:, None]
    segments = np.where(np.arange(seq)[None, :] < lengths[:, None] // 2, 1, 2)
    segments = np.where(mask, segments, 0).astype(np.int32)
    positions = np.stack([rng.choice(n, count, replace=False) for n in lengths]).astype(np.int32)
    return {"inputs": inputs, "mask": mask, "segments": segments, "positions": positions}
