"""``ModernBertForMaskedLM`` (and the bare ``ModernBertModel``): clozax runs with the modern
architecture (``positions="rope"``, ``mlp="geglu"``, pre-LN with an embedding norm, a final
norm and no attention norm in layer 0; biases on or off; any ``global_every`` and even
``local_window``), as the ``modern-*`` presets set it.

Each clozax leaf and its tensor (``i`` indexes the leading ``layers`` axis; kernels are
transposed, ``(in, out)`` here and ``(out, in)`` in HF; every ``bias`` only with
``model.bias``):

======================================  =================  ====================================
clozax leaf                             shape              HF tensor (``model.`` prefix)
======================================  =================  ====================================
embeddings.word                         (vocab, hidden)    embeddings.tok_embeddings.weight
                                                           (also the tied decoder weight)
embeddings.layer_norm.{scale,bias}      (hidden,)          embeddings.norm.{weight,bias}
layers.attention.{query,key,value}.*    (layers, h, h)     layers.i.attn.Wqkv.* (q, k, v rows)
layers.attention.output.*               (layers, h, h)     layers.i.attn.Wo.*
layers.attention_norm.{scale,bias}      (layers, hidden)   layers.i.attn_norm.* (not layer 0)
layers.intermediate.*                   (layers, h, 2I)    layers.i.mlp.Wi.* (input, then gate)
layers.output.*                         (layers, I, h)     layers.i.mlp.Wo.*
layers.mlp_norm.{scale,bias}            (layers, hidden)   layers.i.mlp_norm.*
final_norm.{scale,bias}                 (hidden,)          final_norm.*
head.transform.*                        (h, h)             head.dense.* (no prefix)
head.layer_norm.{scale,bias}            (hidden,)          head.norm.* (no prefix)
head.bias                               (vocab,)           decoder.bias (no prefix)
======================================  =================  ====================================

Layer 0 has no attention norm in HF; its clozax row is unused (zero gradient, so training
leaves it at its init) and is not exported; import sets it to ones (and zeros).

Positions: HF computes RoPE positions 0..seq-1 along every row and has no per-document
attention. clozax restarts positions at each packed document and keeps attention inside it
(``model.attention_within_segments``), so the two agree on rows holding one document each,
right-padded, which is how the export is used (and what parity is tested on).
The window: HF's ``local_attention`` is clozax's ``local_window`` (keys within half of it on
each side); HF's ``layer_types`` follow ``global_every`` (``full_attention`` when
``i % global_every == 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clozax.interop.family import shape_config
from clozax.interop.hf_files import config_int

HF_LAYER = "layers.{i}."
SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def _represents(c) -> bool:
    return (c.positions == "rope" and c.mlp == "geglu" and c.layer_norm == "pre"
            and c.embedding_norm and c.final_norm and not c.first_attention_norm)


@dataclass(frozen=True)
class ModernBertFamily:
    """The ModernBERT layout: fused QKV, GeGLU ``Wi``, RoPE, no position or type tables."""

    model_type: str = "modernbert"
    mlm: str = "ModernBertForMaskedLM"
    encoder: str = "ModernBertModel"
    prefix: str = "model."
    positions_after_pad: bool = False

    @property
    def specials(self) -> dict:
        return dict(SPECIALS)

    def represents(self, model_config) -> bool:
        """Whether a run with ``model_config`` exports as ModernBERT exactly."""
        return _represents(model_config)

    # ------------------------------------------------------------------------- export

    def to_hf_tensors(self, params, model_config, pad_id: int, with_head: bool = True) -> dict:
        """HF tensors (numpy float32, ``(out, in)`` linears) for clozax ``params``."""
        c = model_config
        prefix = self.prefix if with_head else ""
        out = {}

        def put(name, value):
            out[name] = np.ascontiguousarray(np.asarray(value, np.float32))

        def put_norm(name, p, index=None):
            for ours, theirs in (("scale", "weight"), ("bias", "bias")):
                if ours in p:
                    put(f"{name}.{theirs}", p[ours] if index is None else p[ours][index])

        def put_dense(name, p, index=None):
            put(f"{name}.weight", np.asarray(p["kernel"] if index is None
                                             else p["kernel"][index]).T)
            if "bias" in p:
                put(f"{name}.bias", p["bias"] if index is None else p["bias"][index])

        emb, lay = params["embeddings"], params["layers"]
        put(f"{prefix}embeddings.tok_embeddings.weight", emb["word"])
        put_norm(f"{prefix}embeddings.norm", emb["layer_norm"])
        att = {n: {k: np.asarray(v) for k, v in lay["attention"][n].items()}
               for n in ("query", "key", "value", "output")}
        for i in range(c.layers):
            name = prefix + HF_LAYER.format(i=i)
            qkv = {"kernel": np.concatenate([att[n]["kernel"][i] for n in ("query", "key",
                                                                           "value")], axis=1)}
            if c.bias:
                qkv["bias"] = np.concatenate([att[n]["bias"][i] for n in ("query", "key",
                                                                          "value")])
            put_dense(f"{name}attn.Wqkv", qkv)  # (3 * hidden, hidden)
            put_dense(f"{name}attn.Wo", att["output"], i)
            if i > 0:
                put_norm(f"{name}attn_norm", lay["attention_norm"], i)
            put_norm(f"{name}mlp_norm", lay["mlp_norm"], i)
            put_dense(f"{name}mlp.Wi", lay["intermediate"], i)  # (2 * inter, hidden)
            put_dense(f"{name}mlp.Wo", lay["output"], i)
        put_norm(f"{prefix}final_norm", params["final_norm"])
        if with_head:
            put_dense("head.dense", params["head"]["transform"])
            put_norm("head.norm", params["head"]["layer_norm"])
            put("decoder.bias", params["head"]["bias"])
        return out

    def hf_config(self, model_config, specials: dict, with_head: bool = True) -> dict:
        """``config.json`` for the export of a run with ``model_config``."""
        c = model_config
        layer_types = ["full_attention" if c.is_global(i) else "sliding_attention"
                       for i in range(c.layers)]
        return {
            **shape_config(self, c, with_head),
            "max_position_embeddings": c.max_positions,
            "hidden_activation": "gelu",  # exact erf, as clozax computes it
            "classifier_activation": "gelu",
            "norm_eps": c.layer_norm_eps,
            "initializer_range": c.init_std,
            "initializer_cutoff_factor": c.init_cutoff,
            "attention_bias": c.bias, "mlp_bias": c.bias, "norm_bias": c.bias,
            "classifier_bias": c.bias, "decoder_bias": True,
            "layer_types": layer_types,
            "global_attn_every_n_layers": c.global_every,  # what older transformers read
            "local_attention": c.local_window,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta_global},
                "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta_local},
            },
            "global_rope_theta": c.rope_theta_global,  # older transformers' names
            "local_rope_theta": c.rope_theta_local,
            # model.dropout (fine-tuning's; clozax pretrains without any) after the embeddings
            # and the MLP, model.attention_dropout on the attention probabilities.
            "attention_dropout": c.attention_dropout, "embedding_dropout": c.dropout,
            "mlp_dropout": c.dropout,
            "pad_token_id": int(specials["pad"]),
            "bos_token_id": int(specials["cls"]), "cls_token_id": int(specials["cls"]),
            "eos_token_id": int(specials["sep"]), "sep_token_id": int(specials["sep"]),
            "tie_word_embeddings": True,
            "dtype": "float32",
        }

    # ------------------------------------------------------------------------- import

    def check_hf_config(self, cfg: dict, hf_dir: Path) -> None:
        """Refuse settings of ModernBERT that clozax cannot represent exactly."""
        for key in ("hidden_activation", "classifier_activation"):
            act = cfg.get(key, "gelu")
            if act != "gelu":
                raise ValueError(f"{hf_dir} uses {key}={act!r}; clozax computes only exact-erf "
                                 "'gelu', so outputs would differ")
        biases = {k: bool(cfg.get(k, False)) for k in ("attention_bias", "mlp_bias",
                                                       "norm_bias", "classifier_bias")}
        if len(set(biases.values())) > 1:
            raise ValueError(f"{hf_dir} mixes bias settings {biases}; clozax has one "
                             "model.bias for every layer, so it imports only all on or all off")
        if cfg.get("tie_word_embeddings", True) is False:
            raise ValueError(f"{hf_dir} has tie_word_embeddings=false; clozax ties the decoder "
                             "to the word embeddings")
        for kind, params in (cfg.get("rope_parameters") or {}).items():
            if params and params.get("rope_type", "default") != "default":
                raise ValueError(f"{hf_dir} uses rope_type={params.get('rope_type')!r} on "
                                 f"{kind}; clozax has only the default RoPE")
        self._global_every(cfg, hf_dir)

    @staticmethod
    def _global_every(cfg: dict, hf_dir: Path) -> int:
        layers = config_int(cfg, "num_hidden_layers")
        every = int(cfg.get("global_attn_every_n_layers", 3))
        types = cfg.get("layer_types")
        if types is None:
            return every
        for k in range(1, layers + 1):
            if types == ["sliding_attention" if i % k else "full_attention"
                         for i in range(layers)]:
                return k
        raise ValueError(f"{hf_dir} has layer_types {types}, not global every k layers from "
                         "layer 0; clozax cannot represent that pattern")

    def from_hf_tensors(self, tensors: dict, cfg: dict, pad_id: int):
        """(clozax params as numpy, ModelConfig fields, has_mlm_head) from HF tensors + config."""
        has_head = "decoder.bias" in tensors or "head.dense.weight" in tensors
        prefix = self.prefix if any(k.startswith(self.prefix) for k in tensors) else ""
        layers, hidden = config_int(cfg, "num_hidden_layers"), config_int(cfg, "hidden_size")
        vocab, inter = config_int(cfg, "vocab_size"), config_int(cfg, "intermediate_size")
        bias = bool(cfg.get("attention_bias", False))

        def take(name, shape):
            if name not in tensors:
                raise ValueError(f"the checkpoint lacks tensor {name!r}; it is not a complete "
                                 f"{self.mlm}/{self.encoder}")
            value = np.asarray(tensors[name], np.float32)
            if value.shape != shape:
                raise ValueError(f"tensor {name!r} has shape {value.shape}, config.json implies "
                                 f"{shape}; the checkpoint and config disagree")
            return value

        def norm(name):
            p = {"scale": take(f"{name}.weight", (hidden,))}
            if bias:
                p["bias"] = take(f"{name}.bias", (hidden,))
            return p

        def dense(name, fan_in, fan_out, use_bias=bias):
            p = {"kernel": take(f"{name}.weight", (fan_out, fan_in)).T}  # -> (in, out)
            if use_bias:
                p["bias"] = take(f"{name}.bias", (fan_out,))
            return p

        def stack(per_layer):  # list of equal trees -> one tree of (layers, ...) arrays
            first = per_layer[0]
            if isinstance(first, dict):
                return {k: stack([p[k] for p in per_layer]) for k in first}
            return np.stack(per_layer)

        word = take(f"{prefix}embeddings.tok_embeddings.weight", (vocab, hidden))
        blocks = []
        for i in range(layers):
            name = prefix + HF_LAYER.format(i=i)
            qkv = dense(f"{name}attn.Wqkv", hidden, 3 * hidden)
            ones = {"scale": np.ones(hidden, np.float32)}
            if bias:
                ones["bias"] = np.zeros(hidden, np.float32)
            blocks.append({
                "attention": {
                    **{n: {k: v[..., j * hidden:(j + 1) * hidden] for k, v in qkv.items()}
                       for j, n in enumerate(("query", "key", "value"))},
                    "output": dense(f"{name}attn.Wo", hidden, hidden),
                },
                "attention_norm": norm(f"{name}attn_norm") if i > 0 else ones,
                "intermediate": dense(f"{name}mlp.Wi", hidden, 2 * inter),
                "output": dense(f"{name}mlp.Wo", inter, hidden),
                "mlp_norm": norm(f"{name}mlp_norm"),
            })
        params = {
            "embeddings": {"word": word, "layer_norm": norm(f"{prefix}embeddings.norm")},
            "layers": stack(blocks),
            "final_norm": norm(f"{prefix}final_norm"),
        }
        if has_head:
            decoder = tensors.get("decoder.weight")
            if decoder is not None and not np.array_equal(np.asarray(decoder, np.float32), word):
                raise ValueError("the checkpoint's MLM decoder weight is not tied to the word "
                                 "embeddings; clozax ties them, so it cannot import this model")
            head_bias = (take("decoder.bias", (vocab,)) if cfg.get("decoder_bias", True)
                         else np.zeros(vocab, np.float32))
            params["head"] = {"transform": dense("head.dense", hidden, hidden),
                              "layer_norm": norm("head.norm"), "bias": head_bias}
        else:  # identity transform, zero bias: defined but meaningless MLM outputs
            transform = {"kernel": np.eye(hidden, dtype=np.float32)}
            if bias:
                transform["bias"] = np.zeros(hidden, np.float32)
            unit = {"scale": np.ones(hidden, np.float32)}
            if bias:
                unit["bias"] = np.zeros(hidden, np.float32)
            params["head"] = {"transform": transform, "layer_norm": unit,
                              "bias": np.zeros(vocab, np.float32)}
        rope = cfg.get("rope_parameters") or {}
        fields = {
            "vocab_size": vocab, "hidden": hidden, "layers": layers,
            "heads": config_int(cfg, "num_attention_heads"), "intermediate": inter,
            "max_positions": config_int(cfg, "max_position_embeddings"),
            "layer_norm": "pre", "positions": "rope", "mlp": "geglu", "bias": bias,
            "embedding_norm": True, "final_norm": True, "first_attention_norm": False,
            "global_every": self._global_every(cfg, Path("config.json")),
            "local_window": int(cfg.get("local_attention", 128)),
            "rope_theta_global": float((rope.get("full_attention") or {}).get(
                "rope_theta", cfg.get("global_rope_theta", 160_000.0))),
            "rope_theta_local": float((rope.get("sliding_attention") or {}).get(
                "rope_theta", cfg.get("local_rope_theta", 10_000.0))),
            "layer_norm_eps": float(cfg.get("norm_eps", 1e-5)),
            "init_std": float(cfg.get("initializer_range", 0.02)),
            "init_cutoff": float(cfg.get("initializer_cutoff_factor", 2.0)),
            "dropout": float(cfg.get("mlp_dropout", 0.0)),  # what fine-tuning uses
            # HF has no per-document attention; a packed row keeps its documents apart here.
            "attention_within_segments": True,
        }
        return params, fields, has_head


MODERNBERT = ModernBertFamily()
