"""clozax.hostmem: the train step's scratch stays mapped instead of being faulted in each step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_XLA_FLAGS

PROBE = r"""
import json, resource
from clozax.train import hostmem
applied = hostmem.keep_freed_memory()  # first, as clozax train does
import jax, jax.numpy as jnp, numpy as np
from clozax.core import model as M
from clozax.core.keys import Keys
from clozax.core.train_state import TrainState
from clozax.core import optim as optim_lib
from clozax.core.vocab import Vocabulary
from clozax.train import config as C, step as step_lib

# The small preset's train step at batch 16: XLA:CPU keeps ~360 MB of scratch per step.
cfg = C.resolve(preset="small", overrides=["model.vocab_size=2048", "train.batch_size=16"])
vocab = Vocabulary(2048, {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4})
keys = Keys.from_seed(0)
params = M.init(cfg.model, keys.init)
optimizer, schedule = optim_lib.make_optimizer(cfg.optim, 100, params)
state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
step = jax.jit(step_lib.make_train_step(cfg, vocab, 128, optimizer, schedule), donate_argnums=0)
rng = np.random.default_rng(0)
batch = {"tokens": jnp.asarray(rng.integers(5, 2048, (16, 128)), jnp.int32),
         "segments": jnp.ones((16, 128), jnp.int32),
         "word_starts": jnp.ones((16, 128), bool)}
for _ in range(8):  # the heap settles over the first few steps (fragmentation)
    state, metrics = step(state, batch, keys.mask)
jax.block_until_ready(metrics)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    state, metrics = step(state, batch, keys.mask)
jax.block_until_ready(metrics)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 4
print(json.dumps({"applied": applied, "faults_per_step": faults}))
"""


def _probe(**env) -> dict:
    """The probe in a fresh process, at XLA's default optimisation level (production's, not
    the suite's)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    full.pop("CLOZAX_HOST_MALLOC", None)
    full["XLA_FLAGS"] = full.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip()
    full.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True,
                         text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_importing_clozax_keeps_the_train_steps_scratch_mapped_between_steps():
    default = _probe(CLOZAX_HOST_MALLOC="default")
    # glibc's default maps and unmaps the scratch every step: ~90,000 faults of 4 KiB, or
    # ~180 of 2 MiB where the kernel backs every mapping with transparent huge pages.
    huge = "[always]" in _read(Path("/sys/kernel/mm/transparent_hugepage/enabled"))
    assert default["faults_per_step"] > (100 if huge else 20_000), default
    # With clozax.hostmem it stays mapped: a tenth of the default's faults at most, and never
    # the thousand that a few stray 4 KiB scratch buffers would cost.
    bound = min(1_000, default["faults_per_step"] / 10)
    # Faults come from this process's allocator and also from outside it: beside the other
    # test worker the kept setting measured 31,511 faults a step once (a clean-clone run,
    # 2026-12-03) where it measures 0 alone (3 of 3), most likely the kernel reclaiming pages
    # between slowed steps. Outside faults only add, so the fewest of up to three probes is the
    # allocator's own figure; a broken setting faults on every probe.
    kept = _probe()
    for _ in range(2):
        if kept["faults_per_step"] < bound:
            break
        kept = min(kept, _probe(), key=lambda r: r["faults_per_step"])
    assert kept["applied"] and not default["applied"]
    assert kept["faults_per_step"] < bound, (kept, default)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # no such setting: not a transparent-huge-page kernel
        return ""


def test_keep_freed_memory_declines_once_jax_is_imported():
    import jax  # noqa: F401  (the rest of the suite has imported it anyway)

    from clozax.train import hostmem

    hostmem._applied = None
    try:
        assert hostmem.keep_freed_memory() is False
    finally:
        hostmem._applied = None
