"""The Hugging Face side of ``compare_hf.py`` (its best honest configuration), and the HF pieces
``quality.py`` trains its HF sides with.

``HFSide``: ``BertForMaskedLM`` (``ModernBertForMaskedLM`` for a modern preset, SDPA, the
sliding window as a mask) with its default attention implementation (SDPA), no dropout (clozax
has none), ``DataCollatorForLanguageModeling`` (the preset's mask rate) on pre-tokenized ids
that carry ``special_tokens_mask`` as ``run_mlm.py`` prepares them, ``torch.optim.AdamW`` (fused
where torch supports it, weight decay off for biases and norms as the HF Trainer does),
``clip_grad_norm_``; ``compare_hf.py`` sets ``torch.set_num_threads(os.cpu_count())``. bf16:
forward and loss under ``torch.autocast(device, dtype=torch.bfloat16)``, as the Trainer's
``bf16=True`` does.

Shared pieces: ``hf_dims`` (a clozax preset's shape), ``hf_model``, ``hf_tokenizer``,
``hf_adamw`` (the two weight-decay groups), ``special_table`` and ``mlm_examples`` (the
collator's input rows). torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from shapes import B1, B2, CLIP, EPS, LR, SPECIALS, WD, Rows


def torch_sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def hf_adamw(model, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
             fused: bool = False):
    """``torch.optim.AdamW`` over ``model``'s parameters in the HF Trainer's two groups:
    ``weight_decay`` on the weights, none on biases and norms (BERT's ``LayerNorm``, ModernBERT's
    ``*norm``). ``fused``: torch's fused kernel, or its default implementation where torch has
    none for the device (``"AdamW(fused=True)" if opt.defaults.get("fused")`` tells which)."""
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if ("bias" in name or "norm" in name.lower()) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def special_table(specials: dict, vocab: int) -> np.ndarray:
    """(vocab,) bool: which ids are special (the collator's ``special_tokens_mask``)."""
    special = np.zeros(vocab, bool)
    special[list(set(specials.values()))] = True
    return special


def mlm_examples(rows: Rows, special: np.ndarray, indices) -> list[dict]:
    """The collator's inputs for ``rows`` at ``indices``, as ``run_mlm.py`` prepares them."""
    out = []
    for i in indices:
        ids = rows.tokens[i]
        out.append({
            "input_ids": ids.tolist(),
            "attention_mask": (rows.segments[i] > 0).astype(np.int64).tolist(),
            "special_tokens_mask": special[ids].astype(np.int64).tolist(),
        })
    return out


class HFSide:
    """transformers BertForMaskedLM + DataCollatorForLanguageModeling + torch AdamW."""

    def __init__(self, shape: dict, dtype_name: str, rows: Rows, device: str, data: Path | None,
                 compiled: bool = False):
        import torch
        import transformers
        from transformers import DataCollatorForLanguageModeling

        self.torch, self.rows, self.batch, self.device = torch, rows, shape["batch"], device
        torch.manual_seed(0)
        model, rate = hf_model(shape, rows.specials["pad"])
        self.model = model.to(device)
        self.model.train()
        self.attn_impl = getattr(self.model.config, "_attn_implementation", "?")
        self.compiled = compiled
        self.opt = hf_adamw(self.model, LR, (B1, B2), EPS, WD, fused=True)
        self.opt_kind = "AdamW(fused=True)" if self.opt.defaults.get("fused") else "AdamW(default)"
        self.collator = DataCollatorForLanguageModeling(
            hf_tokenizer(rows, data), mlm=True, mlm_probability=rate, return_tensors="pt"
        )
        self.autocast = dtype_name == "bf16"
        self.forward = torch.compile(self.model) if compiled else self.model
        self.special_table = special_table(rows.specials, rows.vocab)
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        self.data_seconds = 0.0
        self.loss = None

    def _examples(self, index: int) -> list[dict]:
        r = np.sort(self.rows.batch_rows(index, self.batch))
        return mlm_examples(self.rows, self.special_table, r)

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
        torch_sync(self.device)
        return float(self.loss.detach())


def hf_dims(preset: str) -> dict:
    from clozax.core.model_config import PRESETS, ModelConfig

    p = {**{f: getattr(ModelConfig, f) for f in ("mlp", "global_every", "local_window")},
         **PRESETS[preset]}
    return {k: p[k] for k in ("hidden", "layers", "heads", "intermediate", "mlp",
                              "global_every", "local_window")}


def hf_model(shape: dict, pad: int):
    """(model, mask rate): BertForMaskedLM, or ModernBertForMaskedLM for a modern preset."""
    from transformers import BertConfig, BertForMaskedLM, ModernBertConfig, ModernBertForMaskedLM

    from clozax.train.config import PRESET_MASKING

    h = hf_dims(shape["preset"])
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


def hf_tokenizer(rows: Rows, data: Path | None):
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
