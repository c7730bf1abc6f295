"""Recipes by name: ``clozax train --recipe NAME`` turns a run's config into a published one,
or into the one measured to pay at a small budget.

``budget``: what measured to pay for a run of minutes on a CPU (the demo's recipe): masking at
40 % (Wettig et al. 2023, "Should you mask 15 % in masked language modeling?"; here +12.7 pp on
the probe at 600 steps against 15 %, which needed 900 steps to match it) and two microbatches
(the same numbers, half the step's activation memory). Everything else stays the preset's; use
it with ``--minutes N``. A choice joins it only when ``benchmarks/budget.py`` measures it paying
downstream at equal wall-clock; what was tried and did not pay is in the downstream table
(docs/tutorials/finetune.md).

``modernbert`` (Warner et al. 2024, "Smarter, Better, Faster, Longer", and its released
trainer configs), scaled from ModernBERT's 1.7T tokens to the run's ``train.steps``:

- StableAdamW, peak 8e-4, betas 0.9 / 0.98, eps 1e-6, weight decay 1e-5 (decoupled; biases,
  norms and embeddings excluded as in every clozax optimizer), no gradient clipping (the
  update clipping replaces it);
- masking at 30 % throughout;
- a batch-size ramp: ModernBERT grows 768 -> 4,608 sequences over its first ~3 % of tokens;
  here ``batch_size / 4`` -> ``batch_size`` over the first 10 % of the updates (a short run
  needs a longer share to have a ramp at all), in 4 stages;
- warmup-stable-decay: the run's ``optim.warmup_steps`` of warm-up, the peak, and a final phase
  of 10 % of the updates decaying as ``1 - sqrt`` to 0.02 of the peak (ModernBERT: 1-sqrt to
  0.02-0.04 of the peak at the end of each of its phases).

Its context-extension phase (8,192 tokens, global RoPE theta 160k, peak 3e-4) needs a second
prepared dataset; add it as a ``[[phases]]`` table of your own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from clozax.train.config import RunConfig
from clozax.train.phase_config import PhaseConfig

RECIPE_NAMES = ("modernbert", "budget")
BUDGET_MASK_RATE = 0.4
BUDGET_MICROBATCHES = 2


def apply_recipe(name: str, config: RunConfig,
                 explicit: Mapping[str, str] | None = None) -> RunConfig:
    """``config`` with recipe ``name``'s optimizer, masking and phases. What the user set
    (``explicit``: dotted key -> where, e.g. ``"--set masking.rate=0.3"``) and the recipe sets
    otherwise is refused in one line naming both, as a run's own ``[[phases]]`` is: a recipe's
    settings are its own, and it once replaced the user's without a word."""
    if name not in RECIPE_NAMES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPE_NAMES)}")
    if config.phases:
        raise ValueError("--recipe and [[phases]] both given; a recipe writes the phases: drop "
                         "one of them")
    applied = budget_recipe(config) if name == "budget" else _modernbert(config)
    for key, where in (explicit or {}).items():
        section, _, field = key.partition(".")
        before, after = (getattr(getattr(c, section, None), field, None) for c in (config, applied))
        if before != after:
            raise ValueError(f"--recipe {name} sets {key} to {after!r}, and {where} sets it to "
                             f"{before!r}; drop one of them (to change a recipe's setting, drop "
                             "--recipe and give its settings with --set)")
    return applied


def _modernbert(config: RunConfig) -> RunConfig:
    """``config`` with the ``modernbert`` recipe's choices (see the module docstring)."""
    steps, batch = config.train.steps, config.train.batch_size
    decay = max(1, steps // 10)
    stable = steps - decay
    if stable < 2 or batch < 4:
        raise ValueError("--recipe modernbert needs at least 3 steps and a batch of 4 (got "
                         f"train.steps={steps}, train.batch_size={batch})")
    ramp = min(max(1, steps // 10), stable - 1)
    optim = dataclasses.replace(config.optim, optimizer="stable_adamw", learning_rate=8e-4,
                                b1=0.9, b2=0.98, eps=1e-6, weight_decay=1e-5, clip_norm=0.0,
                                warmup_steps=min(config.optim.warmup_steps, stable - 1),
                                schedule="1-sqrt", decay_fraction=1.0, end_lr_fraction=0.02)
    masking = dataclasses.replace(config.masking, rate=0.3, rate_end=None, ramp_steps=0)
    phases = (PhaseConfig(name="stable", steps=stable, batch_start=batch // 4,
                          batch_ramp_steps=ramp, decay="none"),
              PhaseConfig(name="decay", steps=decay, decay="1-sqrt"))
    return dataclasses.replace(config, optim=optim, masking=masking, phases=phases)


def budget_recipe(config: RunConfig) -> RunConfig:
    """``config`` with the ``budget`` recipe's choices (see the module docstring)."""
    masking = dataclasses.replace(config.masking, rate=BUDGET_MASK_RATE, rate_end=None,
                                  ramp_steps=0)
    train = dataclasses.replace(config.train, microbatches=BUDGET_MICROBATCHES)
    return dataclasses.replace(config, masking=masking, train=train)
