"""The recipe comparison: today's recipe against the 2024-25 pieces added one at a time, at equal
training wall-clock on the built-in corpus, scored on one fixed-15 % held-out set and by
fine-tuning.

    python benchmarks/recipes.py --minutes 3 --seeds 0 1
    python benchmarks/recipes.py --minutes 1 --seeds 0 --recipes a e   # a quick look

Recipes (the ``small`` preset, the demo's data: built-in corpus, vocabulary 8,192, 128-token
rows, batch 32, two microbatches):

- (a) today's: the demo's recipe (AdamW 1e-3, 50 warm-up updates, linear decay to 0, rate 0.4);
- (b) + warmup-stable-decay with a ``1 - sqrt`` decay over the last 20 % to 0.02 of the peak,
  and StableAdamW (no gradient clipping);
- (c) + masking 30 % -> 15 % over the first half of the run;
- (d) + a batch ramp 8 -> 32 over the first 20 % (4 stages);
- (e) + a context-extension phase: the last 20 % of the updates on 512-token rows of the same
  corpus and tokenizer, batch 8 (the same tokens per update), decaying over the phase.

Equal wall-clock: a pilot measures each (batch, row length)'s seconds per update (tokens/s of
the log lines after the compiling step), and each recipe gets the updates its phases' shares
fit into ``--minutes`` of training. The training seconds each run really spent (log lines'
elapsed, compile excluded) are printed beside, so the equality is checked, not assumed.

Scores: ``clozax evaluate``'s fixed-15 % set (the same held-out rows and masks for every run,
whatever its training rate) and the built-in fine-tuning task (learning rate 3e-4, 3 seeds, 3
epochs: the demo's protocol, without its random-init control). Writes
``benchmarks/out/recipes/recipes.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from clozax.data import prepare  # noqa: E402
from clozax.judge.evaluate import evaluate_run  # noqa: E402
from clozax.judge.finetune import protocol as finetune_lib  # noqa: E402
from clozax.train import compile_cache  # noqa: E402
from clozax.train import config as config_lib  # noqa: E402
from clozax.train import loop as train_lib  # noqa: E402
from clozax.train.phase_config import PhaseConfig  # noqa: E402
from clozax.train.phases import batch_stages  # noqa: E402

BATCH, RAMP_START = 32, 8
DATA = {"corpus": "stdlib", "vocab_size": 8192, "seq_len": 128}
BASE = ["train.batch_size=32", "train.microbatches=2", "masking.rate=0.4",
        "optim.warmup_steps=50"]
WSD = ["optim.optimizer=stable_adamw", "optim.clip_norm=0", "optim.schedule=1-sqrt",
       "optim.decay_fraction=0.2", "optim.end_lr_fraction=0.02"]
RECIPES = "abcde"


def shapes(recipe: str) -> list[tuple[float, int, int]]:
    """``(share of the updates, batch, row length)`` of the recipe's segments."""
    if recipe in "abc":
        return [(1.0, BATCH, 128)]
    # the ramp's stages as the trainer cuts them (20 % of the updates from 8 to 32)
    probe = PhaseConfig(name="main", steps=100, batch_start=RAMP_START, batch_ramp_steps=20,
                        batch_size=BATCH)
    ramp = [(n / 100, size, 128) for n, size in batch_stages(probe, BATCH)]
    if recipe == "d":
        return [*ramp, (0.8, BATCH, 128)]
    return [*ramp, (0.6, BATCH, 128), (0.2, 8, 512)]


def recipe_config(recipe: str, steps: int, seed: int, data512: Path) -> config_lib.RunConfig:
    overrides = [*BASE, f"train.steps={steps}", f"train.seed={seed}",
                 f"train.eval_every={steps}", f"train.save_every={steps}", "train.log_every=10"]
    if recipe >= "b":
        overrides += WSD
    if recipe >= "c":
        overrides += ["masking.rate=0.3", "masking.rate_end=0.15",
                      f"masking.ramp_steps={steps // 2}"]
    cfg = config_lib.resolve(preset="small", overrides=overrides)
    if recipe < "d":
        return cfg
    # phases: the batch ramp (and the extension); the WSD decay as the last phase's piece
    ext = steps // 5 if recipe == "e" else 0
    main = PhaseConfig(name="main", steps=steps - ext, batch_start=RAMP_START,
                       batch_ramp_steps=steps // 5, batch_size=BATCH, rate=0.3, rate_end=0.15,
                       ramp_steps=steps // 2, **({"decay": "none"} if ext else {}))
    phases = (main,) if not ext else (
        main, PhaseConfig(name="long", data=str(data512), steps=ext, batch_size=8,
                          decay="1-sqrt", decay_fraction=1.0))
    # the run's own masking is the held-out set's (15 %); each phase says what it trains at
    return dataclasses.replace(cfg, phases=phases, masking=dataclasses.replace(
        cfg.masking, rate=0.15, rate_end=None, ramp_steps=0))


def seconds_per_step(out: Path, data: dict[int, Path]) -> dict[tuple[int, int], float]:
    """Each (batch, row length)'s training seconds per update, from a 16-update pilot."""
    found = {}
    for batch, seq in sorted({(b, s) for r in RECIPES for _, b, s in shapes(r)}):
        run = out / "pilot" / f"b{batch}-s{seq}"
        if not (run / "metrics.jsonl").is_file():
            cfg = config_lib.resolve(preset="small", overrides=[
                f"train.batch_size={batch}", "train.microbatches=2",
                "train.steps=16", "train.log_every=1", "train.eval_every=16",
                "train.save_every=16", "train.eval_rows=64"])
            train_lib.train(data[seq], run, cfg)
        rates = [json.loads(line).get("tokens_per_s") for line in
                 (run / "metrics.jsonl").read_text().splitlines()]
        found[batch, seq] = batch * seq / statistics.median([r for r in rates[3:] if r])
        print(f"pilot: batch {batch} x {seq}: {found[batch, seq]:.3f} s per update")
    return found


def train_seconds(run: Path) -> float:
    """Training seconds the run spent: its log lines' training time (tokens / tokens-per-s)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    total, last = 0.0, 0
    for line in lines:
        if line.get("tokens_per_s"):
            total += (line["tokens"] - last) / line["tokens_per_s"]
        last = line["tokens"]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="training budget per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "recipes")
    args = ap.parse_args()
    compile_cache.enable()
    data = {128: args.out / "data128", 512: args.out / "data512"}
    if not (data[128] / "manifest.json").is_file():
        prepare(data[128], quiet=True, **DATA)
    if not (data[512] / "manifest.json").is_file():
        prepare(data[512], quiet=True, corpus="stdlib", seq_len=512,
                tokenizer=data[128] / "tokenizer.json")
    per_step = seconds_per_step(args.out, data)
    rows = []
    for recipe in args.recipes:
        mean_step = sum(share * per_step[b, s] for share, b, s in shapes(recipe))
        steps = int(args.minutes * 60 / mean_step)
        for seed in args.seeds:
            run = args.out / f"{recipe}-seed{seed}"
            t0 = time.perf_counter()
            if not (run / "eval.json").is_file():
                train_lib.train(data[128], run, recipe_config(recipe, steps, seed, data[512]))
                evaluate_run(run)
            ev = json.loads((run / "eval.json").read_text())
            scored = ev.get("fixed_rate") or ev
            ft = finetune_lib.finetune_run(run, protocol=finetune_lib.Protocol(
                learning_rates=(3e-4,), seeds=3, epochs=3, control=False), progress=False,
                say=lambda *a: None)
            metric = ft["task"]["metric"]
            test = ft["encoders"]["trained"]["selected"]["test"][metric]
            rows.append({"recipe": recipe, "seed": seed, "steps": steps,
                         "train_seconds": round(train_seconds(run), 1),
                         "loss_15": scored["trained"]["loss"],
                         "accuracy_15": scored["trained"]["accuracy"],
                         "finetune_mean": test["mean"], "finetune_std": test["std"],
                         "wall_seconds": round(time.perf_counter() - t0, 1)})
            r = rows[-1]
            print(f"({recipe}) seed {seed}: {steps} updates, {r['train_seconds']:.0f} s of "
                  f"training; 15 % held-out loss {r['loss_15']:.4f}, accuracy "
                  f"{100 * r['accuracy_15']:.2f} %; fine-tuned {metric} "
                  f"{100 * r['finetune_mean']:.1f} % ± {100 * r['finetune_std']:.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recipes.json").write_text(json.dumps(rows, indent=2))
    print("\nrecipe | updates | training s | 15 % loss | 15 % accuracy | fine-tuned")
    for recipe in args.recipes:
        mine = [r for r in rows if r["recipe"] == recipe]

        def avg(key, rs=mine):
            return statistics.mean(r[key] for r in rs)

        print(f"({recipe}) | {mine[0]['steps']} | {avg('train_seconds'):.0f} | "
              f"{avg('loss_15'):.4f} | {100 * avg('accuracy_15'):.2f} % | "
              f"{100 * avg('finetune_mean'):.1f} % (seeds {[r['seed'] for r in mine]})")


if __name__ == "__main__":
    main()
