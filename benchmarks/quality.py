"""Quality at equal wall-clock: clozax against Hugging Face's own training of the same
architecture, on the same prepared rows, scored on the same frozen held-out masks.

    python benchmarks/quality.py --minutes 4
    python benchmarks/quality.py --minutes 1 --sides modern-hf modern-doc   # a quick look

Sides (the built-in corpus prepared once at 512-token rows, vocabulary 8,192, batch 8; every
side gets ``--minutes`` of wall-clock for its whole training, model building included):

- ``modern-doc``: ``clozax train --preset modern-small --minutes M`` (per-document attention,
  its default), N(0, 0.02) initialisation;
- ``modern-doc-mbinit``: the same with ``model.init=modernbert``;
- ``modern-row``: ``model.attention_within_segments=false`` (attention across the packed row,
  as transformers computes it) with ``model.init=modernbert`` (as transformers initialises it);
- ``modern-hf``: ``ModernBertForMaskedLM`` (same shape: 6 x 256, 4 heads, GeGLU 384, global
  every third layer, 128-token window), ``DataCollatorForLanguageModeling`` at 30 %,
  ``torch.optim.AdamW`` with the same learning rate, betas, epsilon, weight decay (not on
  norms) and clipping, transformers' linear warm-up/decay schedule over the steps a 5-step
  pilot says fit in the budget, SDPA attention, all cores;
- ``classic``: ``clozax train --preset small --minutes M`` (15 %);
- ``classic-hf``: ``BertForMaskedLM`` of the same shape with the same pieces at 15 %.

clozax's ``--minutes`` covers its whole command (compilation, the end-of-run evaluation and
checkpoint included); the HF loop's budget covers model building and its training steps.
Scores: each family's frozen mask set at its training rate (modern 30 %, classic 15 %;
``--eval-rows`` held-out rows, keyed by ``--eval-seed``), built once by clozax's masker and
given to both sides of the family: clozax's runs through ``clozax.train.heldout``, the HF
models through their own forward on the same corrupted inputs (``attention_mask`` = real
tokens), the logits read at the same slots. Writes ``benchmarks/out/quality/quality.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from clozax.core.masker import make_masker  # noqa: E402
from clozax.core.vocab import Vocabulary  # noqa: E402
from clozax.data import open_dataset, prepare  # noqa: E402
from clozax.train import compile_cache, heldout, run_dir  # noqa: E402
from clozax.train import config as config_lib  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from downstream import clozax_command  # noqa: E402

SEQ, BATCH = 512, 8
SIDES = {  # name: (family, preset, clozax overrides or None for the HF side)
    "modern-doc": ("modern", "modern-small", []),
    "modern-doc-mbinit": ("modern", "modern-small", ["model.init=\"modernbert\""]),
    "modern-row": ("modern", "modern-small", ["model.attention_within_segments=false",
                                              "model.init=\"modernbert\""]),
    "modern-hf": ("modern", "modern-small", None),
    "classic": ("classic", "small", []),
    "classic-hf": ("classic", "small", None),
}


def train_side(name: str, data: Path, out: Path, minutes: float) -> dict:
    """Train one side in a process of its own (each budget counts from its process's start,
    imports included), once: a side with ``done.json`` is reused."""
    _, preset, overrides = SIDES[name]
    run = out / name
    if not (run / "done.json").is_file():
        if overrides is None:
            cmd = [sys.executable, __file__, "--hf-train", name, "--minutes", str(minutes),
                   "--out", str(out)]
        else:
            sets = [f"train.batch_size={BATCH}", "train.log_every=10", "train.eval_rows=64",
                    *overrides]
            cmd = [*clozax_command(), "train", "--data", str(data),
                   "--out", str(run), "--preset", preset, "--minutes", str(minutes),
                   *(arg for s in sets for arg in ("--set", s))]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        if overrides is not None:
            last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
            (run / "done.json").write_text(json.dumps(
                {"steps": int(last["step"]),
                 "wall_seconds": round(time.perf_counter() - t0, 1)}))
    return json.loads((run / "done.json").read_text())


def hf_train(name: str, dataset, minutes: float, out: Path, seed: int = 0) -> None:
    """Train transformers' model with transformers' pieces for ``minutes`` of wall-clock from
    this process's start; save it (safetensors) and ``done.json`` in ``out / name``."""
    from clozax.train.budget import process_started

    t0 = process_started()
    import hf_side
    import torch
    from shapes import Rows
    from transformers import DataCollatorForLanguageModeling, get_linear_schedule_with_warmup

    _, preset, _ = SIDES[name]
    torch.manual_seed(seed)
    cfg = config_lib.resolve(preset=preset)
    shape = {"preset": preset, "vocab": dataset.vocab_size, "seq": SEQ, "batch": BATCH}
    model, rate = hf_side.hf_model(shape, dataset.specials["pad"])
    model.train()
    o = cfg.optim

    def optimizer():  # the default (unfused) AdamW, decay off for biases and norms
        return hf_side.hf_adamw(model, o.learning_rate, (o.b1, o.b2), o.eps, o.weight_decay)

    split = dataset.train
    rows = Rows(np.asarray(split.tokens, np.int32), np.asarray(split.segments, np.int32),
                np.asarray(split.word_starts, bool), dict(dataset.specials), dataset.vocab_size,
                "train split")
    tokenizer = hf_side.hf_tokenizer(rows, dataset.path)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=rate,
                                               return_tensors="pt")
    special = hf_side.special_table(dataset.specials, dataset.vocab_size)
    order = np.random.default_rng(seed).permutation(split.rows)

    def batch(i):
        take = order[np.arange(i * BATCH, (i + 1) * BATCH) % split.rows]
        return collator(hf_side.mlm_examples(rows, special, take))

    def step(i):
        loss = model(**batch(i)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    # A pilot: time 5 steps at a zero learning rate, then start over from the same weights.
    opt = optimizer()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 0.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    t_pilot = time.perf_counter()
    for i in range(5):
        step(i)
    per_step = (time.perf_counter() - t_pilot) / 5
    model.load_state_dict(state)
    opt = optimizer()
    budget = minutes * 60 - (time.perf_counter() - t0)
    steps = max(1, int(budget / per_step))
    sched = get_linear_schedule_with_warmup(opt, min(o.warmup_steps, steps // 2), steps)
    i, last = 0, None
    while time.perf_counter() - t0 < minutes * 60:
        last = step(i)
        i += 1
    info = {"steps": i, "planned_steps": steps, "wall_seconds":
            round(time.perf_counter() - t0, 1), "last_loss": last}
    model.save_pretrained(out / name)
    (out / name / "done.json").write_text(json.dumps(info))


def score_hf(path: Path, split, masks: heldout.EvalMasks, batch: int = 16) -> dict:
    """Loss and accuracy of a transformers model on a clozax frozen mask set."""
    import torch
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(path)
    model.eval()
    nll = correct = count = 0.0
    with torch.no_grad():
        for start in range(0, masks.rows.size, batch):
            idx = np.arange(start, min(start + batch, masks.rows.size))
            inputs, segments, positions, targets, valid, _ = heldout.mask_arrays(
                split, masks, idx, with_kinds=True)
            logits = model(input_ids=torch.from_numpy(inputs).long(),
                           attention_mask=torch.from_numpy(segments > 0).long()).logits
            at = torch.take_along_dim(logits, torch.from_numpy(positions).long()[..., None],
                                      dim=1).double()  # (batch, count, vocab)
            logp = torch.log_softmax(at, dim=-1)
            t = torch.from_numpy(targets).long()[..., None]
            v = torch.from_numpy(valid)
            nll += float(-(logp.gather(-1, t)[..., 0])[v].sum())
            correct += float((at.argmax(-1) == t[..., 0])[v].sum())
            count += float(v.sum())
    return {"loss": nll / count, "accuracy": correct / count, "count": int(count)}


def score_clozax(run: Path, split, masks: heldout.EvalMasks) -> dict:
    loaded = run_dir.load_run(run)
    m = heldout.evaluate_masks(loaded.params, loaded.config.model, split, masks).metrics()
    return {"loss": m["loss"], "accuracy": m["accuracy"], "count": m["count"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget per side")
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--eval-rows", type=int, default=256)
    ap.add_argument("--eval-seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "quality")
    ap.add_argument("--hf-train", choices=[n for n, s in SIDES.items() if s[2] is None],
                    help=argparse.SUPPRESS)  # one HF side, in the process main() starts
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    data = args.out / "data512"
    if args.hf_train:
        hf_train(args.hf_train, open_dataset(data), args.minutes, args.out)
        return
    compile_cache.enable()
    if not (data / "manifest.json").is_file():
        prepare(data, quiet=True, corpus="stdlib", vocab_size=8192, seq_len=SEQ)
    dataset = open_dataset(data)
    masks = {}
    for family, preset in (("modern", "modern-small"), ("classic", "small")):
        cfg = config_lib.resolve(preset=preset)
        masker = make_masker(cfg.masking, Vocabulary(dataset.vocab_size, dataset.specials), SEQ)
        masks[family] = heldout.build_eval_masks(dataset.heldout, masker, args.eval_seed,
                                                 args.eval_rows)
    results = {}
    for name in args.sides:
        family = SIDES[name][0]
        info = train_side(name, data, args.out, args.minutes)
        score = score_hf if SIDES[name][2] is None else score_clozax
        scores = score(args.out / name, dataset.heldout, masks[family])
        results[name] = {**info, **scores, "family": family}
        print(f"{name:18s} {info['steps']:5d} steps in {info['wall_seconds']:6.1f} s; held-out "
              f"({family} masks, {scores['count']} slots) loss {scores['loss']:.4f}, accuracy "
              f"{100 * scores['accuracy']:.2f} %", flush=True)
    (args.out / "quality.json").write_text(json.dumps(
        {"minutes": args.minutes, "eval_rows": args.eval_rows, "results": results}, indent=2))
    print("\nside | steps | wall s | held-out loss | accuracy")
    for name, r in results.items():
        print(f"{name} | {r['steps']} | {r['wall_seconds']:.0f} | {r['loss']:.4f} | "
              f"{100 * r['accuracy']:.2f} %")
    if not math.isfinite(sum(r["loss"] for r in results.values())):
        raise SystemExit("a side diverged (non-finite held-out loss)")


if __name__ == "__main__":
    main()
