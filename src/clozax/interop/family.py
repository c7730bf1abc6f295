"""The BERT-style tensor layout that clozax's two exportable families share, parametrised by
each family's names (``clozax.interop.bert``, ``clozax.interop.roberta_prelayernorm``).

A family maps clozax's parameter leaves to Hugging Face tensors and back, writes and checks
``config.json``. Two things are not a renaming:

- token types: clozax has none. Export writes ``token_type_embeddings`` as zeros (2 rows, so any
  token_type_ids give the same output); import adds row 0 into every position row, which is
  exact for token_type_ids = 0 (HF's default).
- position rows: a family may offset clozax position ``p`` to HF row ``p + position_offset``
  (RoBERTa's position ids start after the pad id); rows before the offset are written as zeros.

Kernels are stored ``(in, out)`` in clozax and ``(out, in)`` in HF ``nn.Linear``, so both
directions transpose them. The tied decoder weight is not written: HF ties it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from clozax.interop.hf_files import config_int

Path_ = tuple[str, ...]  # a leaf's keys in the clozax parameter tree


@dataclass(frozen=True)
class Family:
    """One transformers model family with BERT's tensor layout."""

    layer_norm: str  # the clozax ``model.layer_norm`` it represents
    model_type: str
    mlm: str  # the *ForMaskedLM class
    encoder: str  # the bare encoder class
    prefix: str  # the encoder's attribute in the MLM class, e.g. "bert."
    head: str  # the MLM head's prefix
    head_transform: str
    head_norm: str
    attention_norm: str  # per-block LayerNorm names under ``encoder.layer.{i}.``
    mlp_norm: str
    final_norm: str | None  # the encoder's LayerNorm after the last block (pre-LN only)
    specials: dict  # special name -> this family's token string
    positions_after_pad: bool  # HF position rows start at pad_id + 1 (RoBERTa)

    def represents(self, model_config) -> bool:
        """Whether a run with ``model_config`` exports as this family exactly: BERT's layout
        with this family's LayerNorm placement and none of the modern options."""
        c = model_config
        return (c.layer_norm == self.layer_norm and c.positions == "learned" and c.mlp == "gelu"
                and c.bias and c.embedding_norm and c.final_norm and c.first_attention_norm
                and not c.has_local_layers)

    def position_offset(self, pad_id: int) -> int:
        """HF position row of clozax position 0."""
        return pad_id + 1 if self.positions_after_pad else 0

    # ------------------------------------------------------------------------- name tables

    def layer_table(self) -> list[tuple[Path_, str]]:
        """(clozax path under ``layers``, HF name under ``encoder.layer.{i}.``) for one block."""
        dense = [(("attention", "query"), "attention.self.query"),
                 (("attention", "key"), "attention.self.key"),
                 (("attention", "value"), "attention.self.value"),
                 (("attention", "output"), "attention.output.dense"),
                 (("intermediate",), "intermediate.dense"),
                 (("output",), "output.dense")]
        norms = [(("attention_norm",), self.attention_norm), (("mlp_norm",), self.mlp_norm)]
        table = [((*ours, "kernel"), f"{hf}.weight") for ours, hf in dense]
        table += [((*ours, "bias"), f"{hf}.bias") for ours, hf in dense]
        table += [((*ours, "scale"), f"{hf}.weight") for ours, hf in norms]
        table += [((*ours, "bias"), f"{hf}.bias") for ours, hf in norms]
        return table

    def top_table(self, with_head: bool) -> list[tuple[Path_, str]]:
        """(clozax path, HF name relative to the encoder prefix, or ``/``absolute for the head)."""
        table = [(("embeddings", "word"), "embeddings.word_embeddings.weight"),
                 (("embeddings", "layer_norm", "scale"), "embeddings.LayerNorm.weight"),
                 (("embeddings", "layer_norm", "bias"), "embeddings.LayerNorm.bias")]
        if self.final_norm is not None:
            table += [(("final_norm", "scale"), f"{self.final_norm}.weight"),
                      (("final_norm", "bias"), f"{self.final_norm}.bias")]
        if with_head:
            h = self.head
            table += [(("head", "transform", "kernel"), f"/{h}{self.head_transform}.weight"),
                      (("head", "transform", "bias"), f"/{h}{self.head_transform}.bias"),
                      (("head", "layer_norm", "scale"), f"/{h}{self.head_norm}.weight"),
                      (("head", "layer_norm", "bias"), f"/{h}{self.head_norm}.bias"),
                      (("head", "bias"), f"/{h}bias")]
        return table

    # ------------------------------------------------------------------------- export

    def to_hf_tensors(self, params, model_config, pad_id: int, with_head: bool = True) -> dict:
        """HF tensors (numpy float32, ``(out, in)`` linears) for clozax ``params``.

        Names carry the ``*ForMaskedLM`` prefix when ``with_head``, none for a bare encoder
        (as ``save_pretrained`` writes them).
        """
        c = model_config
        prefix = self.prefix if with_head else ""
        out = {}

        def name(hf):
            return hf[1:] if hf.startswith("/") else prefix + hf

        for path, hf in self.top_table(with_head):
            value = np.asarray(_get(params, path), np.float32)
            out[name(hf)] = np.ascontiguousarray(value.T if path[-1] == "kernel" else value)
        for path, hf in self.layer_table():
            stacked = np.asarray(_get(params["layers"], path), np.float32)  # (layers, ...)
            for i in range(c.layers):
                value = stacked[i].T if path[-1] == "kernel" else stacked[i]  # (in,out)->(out,in)
                out[f"{prefix}encoder.layer.{i}.{hf}"] = np.ascontiguousarray(value)
        offset = self.position_offset(pad_id)
        position = np.zeros((c.max_positions + offset, c.hidden), np.float32)
        position[offset:] = np.asarray(params["embeddings"]["position"], np.float32)
        out[f"{prefix}embeddings.position_embeddings.weight"] = position
        out[f"{prefix}embeddings.token_type_embeddings.weight"] = np.zeros((2, c.hidden),
                                                                           np.float32)
        return out

    def hf_config(self, model_config, specials: dict, with_head: bool = True) -> dict:
        """``config.json`` for the export of a run with ``model_config``."""
        c = model_config
        pad = int(specials["pad"])
        return {
            **shape_config(self, c, with_head),
            "max_position_embeddings": c.max_positions + self.position_offset(pad),
            "hidden_act": "gelu",  # exact erf, as clozax computes it
            # model.dropout and model.attention_dropout (fine-tuning's and the contrastive
            # stage's; clozax pretrains without any).
            "hidden_dropout_prob": c.dropout,
            "attention_probs_dropout_prob": c.attention_dropout,
            "layer_norm_eps": c.layer_norm_eps,
            "initializer_range": c.init_std,
            "type_vocab_size": 2,  # both rows zero: token types change nothing
            "position_embedding_type": "absolute",
            "pad_token_id": pad,
            "bos_token_id": int(specials["cls"]),
            "eos_token_id": int(specials["sep"]),
            "tie_word_embeddings": True,
            "is_decoder": False,
            "dtype": "float32",
        }

    # ------------------------------------------------------------------------- import

    def check_hf_config(self, cfg: dict, hf_dir: Path) -> None:
        """Refuse settings of this family that clozax cannot represent exactly."""
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"{hf_dir} uses hidden_act={act!r}; clozax computes only exact-erf "
                             "'gelu', so outputs would differ")
        pet = cfg.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise ValueError(f"{hf_dir} uses position_embedding_type={pet!r}; clozax has only "
                             "learned absolute positions")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError(f"{hf_dir} is configured as a decoder; clozax imports encoders only")

    def _strip_prefix(self, tensors: dict) -> dict:
        """Encoder tensors without the ``bert.``-style prefix (a saved ``BertModel`` has none);
        names outside the encoder get a leading ``/``."""
        prefix = self.prefix
        if any(k.startswith(prefix) for k in tensors):
            return {k[len(prefix):] if k.startswith(prefix) else "/" + k: v
                    for k, v in tensors.items()}
        encoder = ("embeddings.", "encoder.", "LayerNorm.", "pooler.")
        return {k if k.startswith(encoder) else "/" + k: v for k, v in tensors.items()}

    def from_hf_tensors(self, tensors: dict, cfg: dict, pad_id: int):
        """(clozax params as numpy, ModelConfig fields, has_mlm_head) from HF tensors + config."""
        named = self._strip_prefix(tensors)
        has_head = f"/{self.head}bias" in named
        layers = config_int(cfg, "num_hidden_layers")

        def take(name, shape=None):
            if name not in named:
                raise ValueError(f"the checkpoint lacks tensor {name.lstrip('/')!r}; it is not "
                                 f"a complete {self.mlm}/{self.encoder}")
            value = np.asarray(named[name], np.float32)
            if shape is not None and value.shape != shape:
                raise ValueError(f"tensor {name.lstrip('/')!r} has shape {value.shape}, "
                                 f"config.json implies {shape}; the checkpoint and config "
                                 "disagree")
            return value

        vocab, hidden = config_int(cfg, "vocab_size"), config_int(cfg, "hidden_size")
        word = take("embeddings.word_embeddings.weight")
        if word.shape != (vocab, hidden):
            raise ValueError(f"word embeddings have shape {word.shape} but config.json says "
                             f"vocab_size={vocab}, hidden_size={hidden}; fix config.json")
        params: dict = {}
        for path, hf in self.top_table(has_head):
            value = take(hf)
            _put(params, path, value.T if path[-1] == "kernel" else value)  # (out,in)->(in,out)
        for path, hf in self.layer_table():
            per_layer = [take(f"encoder.layer.{i}.{hf}") for i in range(layers)]
            if path[-1] == "kernel":
                per_layer = [w.T for w in per_layer]  # (out, in) -> (in, out)
            _put(params, ("layers", *path), np.stack(per_layer))  # (layers, ...)
        # Tied decoder: an untied one cannot be represented.
        decoder = named.get(f"/{self.head}decoder.weight")
        if has_head and decoder is not None and not np.array_equal(decoder, word):
            raise ValueError("the checkpoint's MLM decoder weight is not tied to the word "
                             "embeddings; clozax ties them, so it cannot import this model")
        if has_head and cfg.get("tie_word_embeddings", True) is False and decoder is None:
            raise ValueError("config.json has tie_word_embeddings=false but no decoder weight; "
                             "the checkpoint is incomplete")
        offset = self.position_offset(pad_id)
        position = take("embeddings.position_embeddings.weight")
        if position.shape[0] <= offset:
            raise ValueError(f"the position table has {position.shape[0]} rows, not more than "
                             f"the pad offset {offset}; the checkpoint is not usable")
        type_row = take("embeddings.token_type_embeddings.weight")[0]
        _put(params, ("embeddings", "position"), position[offset:] + type_row)
        if not has_head:  # identity transform, zero bias: defined but meaningless MLM outputs
            _put(params, ("head", "transform", "kernel"), np.eye(hidden, dtype=np.float32))
            _put(params, ("head", "transform", "bias"), np.zeros(hidden, np.float32))
            _put(params, ("head", "layer_norm", "scale"), np.ones(hidden, np.float32))
            _put(params, ("head", "layer_norm", "bias"), np.zeros(hidden, np.float32))
            _put(params, ("head", "bias"), np.zeros(vocab, np.float32))
        fields = {
            "vocab_size": vocab, "hidden": hidden, "layers": layers,
            "heads": config_int(cfg, "num_attention_heads"),
            "intermediate": config_int(cfg, "intermediate_size"),
            "max_positions": int(position.shape[0] - offset), "layer_norm": self.layer_norm,
            "layer_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
            "init_std": float(cfg.get("initializer_range", 0.02)),
            "dropout": float(cfg.get("hidden_dropout_prob", 0.0)),  # what fine-tuning uses
        }
        return params, fields, has_head


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _put(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def shape_config(family, model_config, with_head: bool) -> dict:
    """The keys every family's ``config.json`` starts with: its classes and the model's
    shape (``family`` has ``mlm``, ``encoder`` and ``model_type``)."""
    c = model_config
    return {
        "architectures": [family.mlm if with_head else family.encoder],
        "model_type": family.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "intermediate_size": c.intermediate,
    }


def at_trained_length(params, model_config, length: int):
    """``(params, model_config)`` as exported for a run trained on rows of ``length`` tokens:
    learned positions keep only the trained rows of their table (``max_position_embeddings``
    = ``length``: the rows past it are initial noise no export should advertise); RoPE has no
    table, so its model is unchanged (the tokenizer's ``model_max_length`` says the length)."""
    if model_config.positions != "learned" or length >= model_config.max_positions:
        return params, model_config
    embeddings = {**params["embeddings"], "position": params["embeddings"]["position"][:length]}
    return {**params, "embeddings": embeddings}, replace(model_config, max_positions=length)
