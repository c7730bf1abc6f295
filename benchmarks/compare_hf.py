"""Side by side, in one process: clozax's train step against Hugging Face ``BertForMaskedLM``.

Both sides train the same shapes on the same rows (vocab 8192, hidden 256, 4 layers, 4 heads,
intermediate 1024, seq 128, batch 32, 15 % masking, AdamW with the same hyper-parameters,
global-norm clipping 1.0, no dropout on either side: clozax has none, so HF gets
``hidden_dropout_prob = attention_probs_dropout_prob = 0``). After warm-up (compilation
excluded), timed blocks of ``--steps-per-block`` steps alternate between the two sides, so load
from other processes on a shared machine hits both; the ratio reported is the median over the
block pairs of clozax tokens/s / HF tokens/s.

    .venv/bin/python benchmarks/compare_hf.py                   # fp32 and bf16, ~3 min on 2 cores
    .venv/bin/python benchmarks/compare_hf.py --dtype fp32 --blocks 6 --steps-per-block 5
    .venv/bin/python benchmarks/compare_hf.py --synthetic --json
    .venv/bin/python benchmarks/compare_hf.py --shape base --dtype bf16   # BERT-base, for GPUs
    .venv/bin/python benchmarks/compare_hf.py --shape modern-small --synthetic --dtype fp32
    .venv/bin/python benchmarks/compare_hf.py --shape modern-base --synthetic --dtype bf16

The ``modern-*`` shapes put clozax's modern presets (RoPE, GeGLU, no biases, global attention
every third layer and a 128-token window on the others, 30 % masking, rows of 1024) against
``ModernBertForMaskedLM`` (SDPA, the same sliding window as a mask) with a 30 % collator.

clozax side: ``clozax.train.make_train_step`` + ``make_optimizer`` (the real step: on-device
corruption, sparse head at the static selected slots, clipping, AdamW), ``jax.jit`` with
``donate_argnums=0``; the batch is read from the memory-mapped split and ``device_put`` inside
the timed loop. bf16: ``model.compute_dtype=bfloat16`` (fp32 parameters and statistics).

HF side (its best honest configuration): ``BertForMaskedLM`` with its default attention
implementation (SDPA), ``DataCollatorForLanguageModeling`` (mlm_probability 0.15) on
pre-tokenized ids that carry ``special_tokens_mask`` as ``run_mlm.py`` prepares them,
``torch.optim.AdamW`` (fused where torch supports it, weight decay off for biases and LayerNorm
as the HF Trainer does), ``clip_grad_norm_(1.0)``, ``torch.set_num_threads(os.cpu_count())``.
bf16: forward and loss under ``torch.autocast(device, dtype=torch.bfloat16)``, as the Trainer's
``bf16=True`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clozax.core.flops import executed_flops_per_step, layer_keys, useful_flops_per_step

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "data" / "stdlib"
SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}

SHAPES = {  # model preset, vocabulary, sequence length, batch
    "small": {"preset": "small", "vocab": 8192, "seq": 128, "batch": 32},
    "base": {"preset": "base", "vocab": 8192, "seq": 128, "batch": 32},
    "modern-small": {"preset": "modern-small", "vocab": 8192, "seq": 1024, "batch": 4},
    "modern-base": {"preset": "modern-base", "vocab": 8192, "seq": 1024, "batch": 32},
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
LR, B1, B2, EPS, WD, CLIP = 1e-3, 0.9, 0.98, 1e-6, 0.01, 1.0  # clozax's OptimConfig defaults


class MatmulPeak:
    """FLOP/s of a large square ``jnp.dot`` in one dtype; ``sample()`` times ``reps`` of them.

    Sampled once per block pair, next to the timed steps, so the peak fraction compares rates
    measured under the same load from other processes. The product accumulates and returns
    float32 (``preferred_element_type``), the form in which XLA:CPU runs bf16 on its fast path
    (AMX via YNNPACK, ~1.4 TFLOP/s on 2 cores; a bf16-result dot takes a ~0.24 TFLOP/s path)
    and in which clozax's kernels call it; for float32 it is the plain product.
    """

    def __init__(self, dtype_name: str, n: int = 2048, reps: int = 4):
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(DTYPES[dtype_name])
        self.jax, self.n, self.reps = jax, n, reps
        self.a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        self.b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        self.dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        self.dot(self.a, self.b).block_until_ready()

    def sample(self) -> float:
        t0 = time.perf_counter()
        out = [self.dot(self.a, self.b) for _ in range(self.reps)]
        self.jax.block_until_ready(out)
        return 2 * self.n**3 * self.reps / (time.perf_counter() - t0)


def torch_matmul_peak(dtype_name: str, device: str, n: int = 2048, reps: int = 8) -> float:
    """The same measurement with ``torch.mm`` (context: what the HF side's kernels reach)."""
    import torch

    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    best = math.inf
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * n**3 / best


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- data


@dataclass
class Rows:
    """Pre-tokenized rows shared by both sides: (rows, seq) token ids and segment ids."""

    tokens: np.ndarray  # (rows, seq) int32
    segments: np.ndarray  # (rows, seq) int32, 0 = padding
    word_starts: np.ndarray  # (rows, seq) bool
    specials: dict
    vocab: int
    source: str

    def batch_rows(self, index: int, batch: int) -> np.ndarray:
        rng = np.random.default_rng([0, index])
        return rng.choice(len(self.tokens), batch, replace=False)


def load_rows(data: Path | None, synthetic: bool, vocab: int, seq: int, n: int = 1024) -> Rows:
    if synthetic or data is None:
        rng = np.random.default_rng(0)
        tokens = rng.integers(len(SPECIALS), vocab, size=(n, seq), dtype=np.int32)
        tokens[:, 0], tokens[:, -1] = SPECIALS["cls"], SPECIALS["sep"]
        segments = np.ones((n, seq), np.int32)
        return Rows(tokens, segments, np.ones((n, seq), bool), dict(SPECIALS), vocab,
                    f"synthetic uniform ids, {n} rows")
    from clozax.data import open_dataset

    ds = open_dataset(data)
    if ds.seq_len != seq or ds.vocab_size != vocab:
        raise SystemExit(
            f"error: dataset {data} has seq_len {ds.seq_len} and vocab {ds.vocab_size}; this "
            f"shape needs {seq} and {vocab}: pass --synthetic"
        )
    split = ds.train
    return Rows(np.asarray(split.tokens, np.int32), np.asarray(split.segments, np.int32),
                np.asarray(split.word_starts, bool), dict(ds.specials), vocab,
                f"{data} train split, {split.rows} rows")


# ----------------------------------------------------------------------------- clozax side


class ClozaxSide:
    """The real clozax train step, jitted with donated state."""

    def __init__(self, shape: dict, dtype_name: str, rows: Rows, overrides: tuple = ()):
        import jax
        import jax.numpy as jnp

        from clozax.core import model as M
        from clozax.core import optim as optim_lib
        from clozax.core import pipeline
        from clozax.core.vocab import Vocabulary
        from clozax.train import config as C
        from clozax.train import step as step_lib

        self.jax, self.rows, self.batch = jax, rows, shape["batch"]
        self.cfg = C.resolve(preset=shape["preset"], overrides=[
            f"model.vocab_size={shape['vocab']}",
            f"model.compute_dtype=\"{DTYPES[dtype_name]}\"",
            f"train.batch_size={shape['batch']}",
            f"optim.learning_rate={LR}", f"optim.b1={B1}", f"optim.b2={B2}",
            f"optim.eps={EPS}", f"optim.weight_decay={WD}", f"optim.clip_norm={CLIP}",
            *overrides,
        ])
        vocab = Vocabulary(shape["vocab"], rows.specials)
        seq = shape["seq"]
        keys = pipeline.Keys.from_seed(0)
        params = M.init(self.cfg.model, keys.init)
        optimizer, schedule = optim_lib.make_optimizer(self.cfg.optim, 10_000, params)
        self.state = pipeline.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
        self.mask_key = keys.mask
        self.step_fn = jax.jit(
            step_lib.make_train_step(self.cfg, vocab, seq, optimizer, schedule), donate_argnums=0
        )
        masker = pipeline.make_masker(self.cfg.masking, vocab, seq)
        loss_fn = step_lib.make_loss(self.cfg.model)

        def forward(params, batch, key):
            masked, sel = masker(key, batch)
            targets = jnp.take_along_axis(batch["tokens"], sel.positions, axis=-1)
            return loss_fn(params, masked.inputs, batch["segments"], sel.positions, targets,
                           sel.valid)[0]

        self.forward_fn = jax.jit(forward)
        from clozax.core.masking import selection_count

        self.count = selection_count(self.cfg.masking.rate, seq)
        self.data_seconds = 0.0
        self.metrics = None

    def host_batch(self, index: int):
        t0 = time.perf_counter()
        r = np.sort(self.rows.batch_rows(index, self.batch))
        batch = {"tokens": self.rows.tokens[r], "segments": self.rows.segments[r],
                 "word_starts": self.rows.word_starts[r]}
        batch = self.jax.device_put(batch)
        self.data_seconds += time.perf_counter() - t0
        return batch

    def step(self, index: int) -> None:
        self.state, self.metrics = self.step_fn(self.state, self.host_batch(index), self.mask_key)

    def sync(self) -> float:
        return float(self.jax.block_until_ready(self.metrics)["loss"])

    def forward_only(self, index: int) -> None:
        self.metrics = {"loss": self.forward_fn(self.state.params, self.host_batch(index),
                                                self.mask_key)}


# ----------------------------------------------------------------------------- HF side


class HFSide:
    """transformers BertForMaskedLM + DataCollatorForLanguageModeling + torch AdamW."""

    def __init__(self, shape: dict, dtype_name: str, rows: Rows, device: str, data: Path | None,
                 compiled: bool = False):
        import torch
        import transformers
        from transformers import DataCollatorForLanguageModeling

        self.torch, self.rows, self.batch, self.device = torch, rows, shape["batch"], device
        torch.manual_seed(0)
        model, rate = _hf_model(shape, rows.specials["pad"])
        self.model = model.to(device)
        self.model.train()
        self.attn_impl = getattr(self.model.config, "_attn_implementation", "?")
        self.compiled = compiled
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if ("bias" in name or "LayerNorm" in name or "norm" in name)
             else decay).append(p)
        groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
        try:
            self.opt = torch.optim.AdamW(groups, lr=LR, betas=(B1, B2), eps=EPS, fused=True)
            self.opt_kind = "AdamW(fused=True)"
        except (RuntimeError, TypeError, ValueError):
            self.opt = torch.optim.AdamW(groups, lr=LR, betas=(B1, B2), eps=EPS)
            self.opt_kind = "AdamW(default)"
        self.collator = DataCollatorForLanguageModeling(
            _hf_tokenizer(rows, data), mlm=True, mlm_probability=rate, return_tensors="pt"
        )
        self.autocast = dtype_name == "bf16"
        self.forward = torch.compile(self.model) if compiled else self.model
        special = np.zeros(rows.vocab, bool)
        special[list(set(rows.specials.values()))] = True
        self.special_table = special
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        self.data_seconds = 0.0
        self.loss = None

    def _examples(self, index: int) -> list[dict]:
        r = np.sort(self.rows.batch_rows(index, self.batch))
        out = []
        for i in r:
            ids = self.rows.tokens[i]
            out.append({
                "input_ids": ids.tolist(),
                "attention_mask": (self.rows.segments[i] > 0).astype(np.int64).tolist(),
                "special_tokens_mask": self.special_table[ids].astype(np.int64).tolist(),
            })
        return out

    def collate(self, index: int) -> dict:
        t0 = time.perf_counter()
        batch = self.collator(self._examples(index))
        batch = {k: v.to(self.device) for k, v in batch.items()}
        self.data_seconds += time.perf_counter() - t0
        return batch

    def _loss(self, batch):
        torch = self.torch
        if self.autocast:
            with torch.autocast(self.device, dtype=torch.bfloat16):
                return self.forward(**batch).loss
        return self.forward(**batch).loss

    def step(self, index: int) -> None:
        batch = self.collate(index)
        loss = self._loss(batch)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss

    def forward_only(self, index: int) -> None:
        with self.torch.no_grad():
            self.loss = self._loss(self.collate(index))

    def sync(self) -> float:
        _sync(self.device)
        return float(self.loss.detach())


def _hf_dims(preset: str) -> dict:
    from clozax.core.model_config import PRESETS, ModelConfig

    p = {**{f: getattr(ModelConfig, f) for f in ("mlp", "global_every", "local_window")},
         **PRESETS[preset]}
    return {k: p[k] for k in ("hidden", "layers", "heads", "intermediate", "mlp",
                              "global_every", "local_window")}


def _hf_model(shape: dict, pad: int):
    """(model, mask rate): BertForMaskedLM, or ModernBertForMaskedLM for a modern preset."""
    from transformers import BertConfig, BertForMaskedLM, ModernBertConfig, ModernBertForMaskedLM

    from clozax.train.config import PRESET_MASKING

    h = _hf_dims(shape["preset"])
    rate = PRESET_MASKING.get(shape["preset"], {}).get("rate", 0.15)
    if h["mlp"] != "geglu":
        return BertForMaskedLM(BertConfig(
            vocab_size=shape["vocab"], hidden_size=h["hidden"], num_hidden_layers=h["layers"],
            num_attention_heads=h["heads"], intermediate_size=h["intermediate"],
            max_position_embeddings=512, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, hidden_act="gelu", pad_token_id=pad)), rate
    return ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=shape["vocab"], hidden_size=h["hidden"], num_hidden_layers=h["layers"],
        num_attention_heads=h["heads"], intermediate_size=h["intermediate"],
        max_position_embeddings=max(shape["seq"], 512), global_attn_every_n_layers=
        h["global_every"], local_attention=h["local_window"], pad_token_id=pad,
        bos_token_id=SPECIALS["cls"], cls_token_id=SPECIALS["cls"], eos_token_id=SPECIALS["sep"],
        sep_token_id=SPECIALS["sep"])), rate


def _hf_tokenizer(rows: Rows, data: Path | None):
    """The dataset's own tokenizer (or a word-level one over ``vocab`` ids when synthetic)."""
    from transformers import PreTrainedTokenizerFast

    names = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
    kwargs = {f"{k}_token": v for k, v in names.items()}
    path = None if data is None else Path(data) / "tokenizer.json"
    if path is not None and path.is_file() and "synthetic" not in rows.source:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path), **kwargs)
    else:
        from tokenizers import Tokenizer, models

        vocab = {names[k]: i for k, i in SPECIALS.items()}
        vocab.update({f"w{i}": i for i in range(len(SPECIALS), rows.vocab)})
        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), **kwargs
        )
    if len(tok) != rows.vocab or tok.mask_token_id != rows.specials["mask"]:
        raise SystemExit(f"error: tokenizer has {len(tok)} ids, mask id {tok.mask_token_id}; "
                         f"expected {rows.vocab} and {rows.specials['mask']}")
    return tok


# ----------------------------------------------------------------------------- timing


def time_block(side, start: int, steps: int, fn: str = "step") -> float:
    """Seconds for ``steps`` calls of ``side.<fn>`` on batches ``start..``, synced at the end."""
    run = getattr(side, fn)
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        run(i)
    side.sync()
    return time.perf_counter() - t0


def compare(dtype_name: str, args, rows: Rows, device: str) -> dict:
    shape = SHAPES[args.shape]
    tokens_per_step = shape["batch"] * shape["seq"]
    t0 = time.perf_counter()
    cz = ClozaxSide(shape, dtype_name, rows, tuple(args.set))
    cz.step(0)
    first_loss_cz = cz.sync()
    compile_s = time.perf_counter() - t0
    candidates = {"off": [False], "on": [True], "best": [False, True]}[args.hf_compile]
    hf_rates = {}
    for compiled in candidates:  # HF at its best configuration: eager or torch.compile
        side = HFSide(shape, dtype_name, rows, device, args.data, compiled=compiled)
        t0 = time.perf_counter()
        for i in range(args.warmup):
            side.step(i)
            side.sync()
        first = time.perf_counter() - t0
        rate = tokens_per_step * args.steps_per_block / time_block(side, 0, args.steps_per_block)
        hf_rates["torch.compile" if compiled else "eager"] = {"tokens_per_s": rate,
                                                               "warmup_s": first}
        if len(candidates) == 1 or rate >= max(r["tokens_per_s"] for r in hf_rates.values()):
            hf = side
    first_loss_hf = hf.sync()
    for i in range(1, args.warmup):  # warm-up, untimed
        cz.step(i)
        cz.sync()
    cz.data_seconds = hf.data_seconds = 0.0
    cz_tps, hf_tps, ratios, peaks = [], [], [], []
    peak = MatmulPeak(dtype_name, n=8192 if device == "cuda" else 2048)
    index = args.warmup
    for b in range(args.blocks):
        # Alternate who goes first so neither side always follows the other.
        order = [("cz", cz), ("hf", hf)] if b % 2 == 0 else [("hf", hf), ("cz", cz)]
        got = {}
        for name, side in order:
            got[name] = tokens_per_step * args.steps_per_block / time_block(
                side, index, args.steps_per_block)
        index += args.steps_per_block
        cz_tps.append(got["cz"])
        hf_tps.append(got["hf"])
        ratios.append(got["cz"] / got["hf"])
        peaks.append(peak.sample())
    timed_steps = args.blocks * args.steps_per_block
    data = {"clozax": cz.data_seconds / timed_steps, "hf": hf.data_seconds / timed_steps}

    # Breakdown (compile excluded): forward-only vs the full step, a few steps each.
    reps = max(2, args.steps_per_block // 2)
    breakdown = {}
    for name, side in (("clozax", cz), ("hf", hf)):
        side.forward_only(index)
        side.sync()
        fwd = time_block(side, index, reps, "forward_only") / reps
        full = time_block(side, index, reps, "step") / reps
        breakdown[name] = {"forward_s": fwd, "step_s": full, "backward_and_update_s": full - fwd,
                           "data_s": data[name]}

    h = _hf_dims(shape["preset"])
    glu = h["mlp"] == "geglu"
    keys = layer_keys(shape["seq"], h["layers"], h["global_every"], h["local_window"])
    useful = useful_flops_per_step(h["hidden"], h["layers"], h["intermediate"], shape["vocab"],
                                   shape["seq"], shape["batch"], cz.count, glu, keys)
    # HF's SDPA scores every key on every layer (its sliding window is a mask): all seq keys.
    dense = executed_flops_per_step(h["hidden"], h["layers"], h["intermediate"], shape["vocab"],
                                    shape["seq"], shape["batch"], glu)
    cz_med, hf_med = statistics.median(cz_tps), statistics.median(hf_tps)
    steps_per_s_cz, steps_per_s_hf = cz_med / tokens_per_step, hf_med / tokens_per_step
    peak_med = statistics.median(peaks)
    # Peak fraction per block (rate and peak sampled side by side), then the median.
    fractions = [useful * t / tokens_per_step / p for t, p in zip(cz_tps, peaks, strict=True)]
    return {
        "dtype": dtype_name,
        "clozax_tokens_per_s": cz_med,
        "hf_tokens_per_s": hf_med,
        "ratio": statistics.median(ratios),
        "clozax_blocks": cz_tps,
        "hf_blocks": hf_tps,
        "block_ratios": ratios,
        "matmul_peak_flops": peak_med,
        "matmul_peak_blocks": peaks,
        "torch_matmul_peak_flops": torch_matmul_peak(dtype_name, device),
        "useful_flops_per_step": useful,
        "clozax_useful_flops": useful * steps_per_s_cz,
        "clozax_peak_fraction": statistics.median(fractions),
        "hf_useful_flops": useful * steps_per_s_hf,
        "hf_executed_flops": dense * steps_per_s_hf,
        "hf_executed_peak_fraction": dense * steps_per_s_hf / peak_med,
        "breakdown": breakdown,
        "clozax_compile_and_first_step_s": compile_s,
        "first_loss": {"clozax": first_loss_cz, "hf": first_loss_hf},
        "selected_per_sequence": cz.count,
        "mfu": None if not args.peak_tflops else {
            "peak_tflops": args.peak_tflops,
            "clozax": useful * steps_per_s_cz / (args.peak_tflops * 1e12),
            "hf_useful": useful * steps_per_s_hf / (args.peak_tflops * 1e12),
            "hf_executed": dense * steps_per_s_hf / (args.peak_tflops * 1e12),
        },
        "clozax_overrides": list(args.set),
        "batch": shape["batch"],
        "hf_optimizer": hf.opt_kind,
        "hf_attention": hf.attn_impl,
        "hf_model": type(hf.model).__name__,
        "hf_compiled": hf.compiled,
        "hf_candidates": hf_rates,
        "seq": shape["seq"],
    }


def _fmt_rate(x: float) -> str:
    return f"{x / 1e12:.3f} TFLOP/s" if x >= 1e11 else f"{x / 1e9:.1f} GFLOP/s"


def print_result(r: dict) -> None:
    b = r["breakdown"]
    print(f"\n== {r['dtype']}, seq {r['seq']}, batch {r['batch']} ==")
    print(f"  clozax  {r['clozax_tokens_per_s']:10,.0f} tokens/s   blocks "
          + " ".join(f"{x:,.0f}" for x in r["clozax_blocks"]))
    print(f"  HF      {r['hf_tokens_per_s']:10,.0f} tokens/s   blocks "
          + " ".join(f"{x:,.0f}" for x in r["hf_blocks"]))
    print(f"  ratio clozax/HF  {r['ratio']:.2f}x  (median of block pairs: "
          + " ".join(f"{x:.2f}" for x in r["block_ratios"]) + ")")
    print(f"  matmul peak ({r['dtype']}, 2048^3 jnp.dot -> f32, median of blocks)  "
          f"{_fmt_rate(r['matmul_peak_flops'])}"
          f"   (torch.mm: {_fmt_rate(r['torch_matmul_peak_flops'])})")
    print(f"  clozax useful FLOP rate  {_fmt_rate(r['clozax_useful_flops'])}"
          f"  = {100 * r['clozax_peak_fraction']:.0f} % of peak (median per block)"
          f"  ({r['useful_flops_per_step'] / 1e9:.1f} GFLOP/step)")
    print(f"  HF useful FLOP rate      {_fmt_rate(r['hf_useful_flops'])};"
          f" executed (dense head) {_fmt_rate(r['hf_executed_flops'])}"
          f" = {100 * r['hf_executed_peak_fraction']:.0f} % of peak")
    for side in ("clozax", "hf"):
        s = b[side]
        print(f"  {side:6s} step {1e3 * s['step_s']:7.1f} ms = forward {1e3 * s['forward_s']:6.1f}"
              f" + backward/update {1e3 * s['backward_and_update_s']:6.1f}"
              f"; batch prep (in step) {1e3 * s['data_s']:5.1f} ms")
    if r.get("mfu"):
        m = r["mfu"]
        print(f"  MFU vs {m['peak_tflops']:g} TFLOP/s: clozax {100 * m['clozax']:.1f} % (useful); "
              f"HF {100 * m['hf_useful']:.1f} % useful, {100 * m['hf_executed']:.1f} % executed")
    if len(r["hf_candidates"]) > 1:
        print("  HF candidates (one block after warm-up): " + ", ".join(
            f"{k} {v['tokens_per_s']:,.0f} tokens/s (warm-up {v['warmup_s']:.0f} s)"
            for k, v in r["hf_candidates"].items())
            + f"; compared against {'torch.compile' if r['hf_compiled'] else 'eager'}")
    print(f"  clozax compile + first step {r['clozax_compile_and_first_step_s']:.1f} s;"
          f" first losses clozax {r['first_loss']['clozax']:.3f}, HF {r['first_loss']['hf']:.3f}"
          f"; {r['selected_per_sequence']} selected slots/sequence")


# Host allocator settings. Each is fixed at process start (glibc reads them then), so one process
# runs one setting for both sides; ``--allocators`` with several runs one process per setting and
# compares each side at its own best, so neither side is handicapped by the other's setting.
ALLOCATORS = {
    # clozax.hostmem, as `clozax train` applies it: one arena, no mmap, no trim. Measured:
    # clozax fp32 +13 %, HF fp32 +16 %, HF bf16 -26 % (its threads contend for the one arena).
    "clozax": {},
    "default": {"CLOZAX_HOST_MALLOC": "default"},  # glibc as it comes
    # No mmap and no trim, glibc's usual per-thread arenas: HF bf16's fastest setting measured.
    "no-mmap": {"CLOZAX_HOST_MALLOC": "default", "MALLOC_MMAP_MAX_": "0",
                "MALLOC_TRIM_THRESHOLD_": str(2**62)},
}


def run_allocators(argv: list[str], names: list[str]) -> int:
    """One subprocess per allocator setting; then each side at its best, per dtype."""
    runs = {}
    for name in names:
        what = ALLOCATORS[name] or "clozax.hostmem, as clozax train"
        print(f"-- allocator {name!r} ({what}) ...", file=sys.stderr, flush=True)
        env = {**os.environ, **ALLOCATORS[name]}
        for key in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"):
            if key not in ALLOCATORS[name]:
                env.pop(key, None)
        out = subprocess.run([sys.executable, __file__, *argv, "--allocators", name, "--json"],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            sys.stderr.write(out.stdout + out.stderr)
            return out.returncode
        runs[name] = json.loads(out.stdout)
    summary = []
    for i, r0 in enumerate(next(iter(runs.values()))["results"]):
        by = {name: run["results"][i] for name, run in runs.items()}
        best_cz = max(by, key=lambda n: by[n]["clozax_tokens_per_s"])
        best_hf = max(by, key=lambda n: by[n]["hf_tokens_per_s"])
        summary.append({
            "dtype": r0["dtype"],
            "per_allocator": {n: {"clozax_tokens_per_s": r["clozax_tokens_per_s"],
                                  "hf_tokens_per_s": r["hf_tokens_per_s"],
                                  "same_process_ratio": r["ratio"]} for n, r in by.items()},
            "clozax_best": {"allocator": best_cz,
                            "tokens_per_s": by[best_cz]["clozax_tokens_per_s"]},
            "hf_best": {"allocator": best_hf, "tokens_per_s": by[best_hf]["hf_tokens_per_s"]},
            "ratio_best_vs_best": (by[best_cz]["clozax_tokens_per_s"]
                                   / by[best_hf]["hf_tokens_per_s"]),
        })
    if "--json" in argv:
        print(json.dumps({"runs": runs, "summary": summary}, indent=2))
        return 0
    for name, run in runs.items():
        print(f"\n######## allocator {name}")
        for r in run["results"]:
            print_result(r)
    print("\n== each side at its best allocator ==")
    for s in summary:
        cells = "; ".join(f"{n}: clozax {v['clozax_tokens_per_s']:,.0f} / HF "
                          f"{v['hf_tokens_per_s']:,.0f}" for n, v in s["per_allocator"].items())
        print(f"  {s['dtype']}: {cells}")
        print(f"  {s['dtype']}: clozax {s['clozax_best']['tokens_per_s']:,.0f} tokens/s "
              f"({s['clozax_best']['allocator']}) vs HF {s['hf_best']['tokens_per_s']:,.0f} "
              f"({s['hf_best']['allocator']}): ratio {s['ratio_best_vs_best']:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--steps-per-block", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--synthetic", action="store_true", help="uniform random ids, no data")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: shape's)")
    parser.add_argument("--seq", type=int, help="tokens per row (default: shape's; other lengths "
                        "need --synthetic or a dataset prepared at that length)")
    parser.add_argument("--hf-compile", choices=["off", "on", "best"], default="off",
                        help="HF side under torch.compile: off, on, or best (time both after "
                        "warm-up, compare against the faster)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help='clozax config override, e.g. --set model.attention=\'"cudnn"\'')
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense peak for the dtype (e.g. 989 for H100/H200 "
                        "bf16): also print MFU against it")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--allocators", default="clozax",
                        help="comma-separated host allocator settings, one process each: "
                        f"{', '.join(ALLOCATORS)}, or 'all'; with several, each side is "
                        "compared at its best (default: clozax, this process)")
    args = parser.parse_args(argv)
    names = list(ALLOCATORS) if args.allocators == "all" else args.allocators.split(",")
    if unknown := [n for n in names if n not in ALLOCATORS]:
        parser.error(f"unknown allocator {unknown}; choose from {', '.join(ALLOCATORS)} or all")
    if len(names) > 1:  # each child gets "--allocators NAME" last, which argparse keeps
        return run_allocators(list(sys.argv[1:] if argv is None else argv), names)
    if args.batch is not None:
        if args.batch < 1:
            parser.error("--batch must be >= 1")
        SHAPES[args.shape] = {**SHAPES[args.shape], "batch": args.batch}
    if args.seq is not None:
        from clozax.core.model_config import PRESETS

        top = PRESETS[SHAPES[args.shape]["preset"]]["max_positions"]
        if not 8 <= args.seq <= top:
            parser.error(f"--seq must lie in [8, {top}] (the preset's max_positions)")
        SHAPES[args.shape] = {**SHAPES[args.shape], "seq": args.seq}
    if min(args.steps_per_block, args.blocks, args.warmup) < 1:
        parser.error("--steps-per-block, --blocks and --warmup must be >= 1")

    from clozax.train import hostmem

    kept = hostmem.keep_freed_memory()  # before JAX is imported (a no-op unless "clozax")

    import jax
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPES[args.shape]
    synthetic = args.synthetic or not (args.data / "manifest.json").is_file()
    rows = load_rows(None if synthetic else args.data, synthetic, shape["vocab"], shape["seq"])
    env = {
        "shape": {**shape, **_hf_dims(shape["preset"])},
        "data": rows.source,
        "jax": jax.__version__, "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "host_malloc": names[0] + (" (clozax.hostmem applied)" if kept else ""),
        "torch_threads": torch.get_num_threads(), "torch_device": device,
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": sys.version.split()[0],
        "steps_per_block": args.steps_per_block, "blocks": args.blocks, "warmup": args.warmup,
    }
    if not args.json:
        print(f"shape {env['shape']}; data: {rows.source}")
        print(f"jax {env['jax']} ({env['jax_backend']}, XLA_FLAGS={env['xla_flags']!r}, host "
              f"allocator {env['host_malloc']}, both sides); "
              f"torch {torch.__version__} on {device}, {env['torch_threads']} threads")
        print(f"{args.blocks} alternating blocks x {args.steps_per_block} steps after "
              f"{args.warmup} warm-up steps per side", flush=True)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    results = []
    for d in dtypes:
        r = compare(d, args, rows, device)
        results.append(r)
        if not args.json:
            if d == dtypes[0]:
                print(f"HF: {r['hf_model']}, attention {r['hf_attention']}, {r['hf_optimizer']},"
                      f" DataCollatorForLanguageModeling, transformers "
                      f"{__import__('transformers').__version__}")
            print_result(r)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"env": env, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
