"""The encoder's configuration: shape and numerics, validated on construction, and the
named presets (a dict). Shared by the model, the run config and every exporter."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, fields

import jax.numpy as jnp

from clozax.core import attention as attention_lib
from clozax.core.layers import MLPS

LAYER_NORMS = ("pre", "post")
POSITIONS = ("learned", "rope")
INITS = ("normal", "modernbert")
REMAT_POLICIES = ("none", "block", "dots")
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Encoder shape and numerics. Hashable, so it can be a static argument of ``jax.jit``."""

    vocab_size: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 1024
    max_positions: int = 512
    layer_norm: str = "pre"  # "pre" (RobertaPreLayerNorm layout) or "post" (original BERT)
    attention_within_segments: bool = False  # keep attention inside each packed document
    compute_dtype: str = "float32"  # or "bfloat16"; parameters are always float32
    # Speed-only: how attention is computed (``clozax.core.attention``: "auto" picks a path per
    # device, row length and mask; "einsum", "xla", "cudnn", "flash" name one); the same maths.
    attention: str = "auto"
    # Speed-only: ``jax.lax.scan`` unroll over the blocks (None: every block unrolled, which
    # measured fastest on CPU, +13 %, and on an H200, +27 % over unroll=1, at the price of
    # compile time that the persistent compilation cache pays once).
    unroll: int | None = None
    # Speed-only: recompute in the backward instead of keeping activations: "none", "block"
    # (keep only each block's input) or "dots" (keep matmul outputs without batch dimensions).
    remat: str = "none"
    layer_norm_eps: float = 1e-12
    # ``apply(dropout_key=...)``: after the embeddings and each attention and MLP output, as
    # BERT's hidden_dropout_prob; an import keeps the checkpoint's. Pretraining passes no key.
    dropout: float = 0.0  # hidden dropout while fine-tuning (BERT's 0.1); pretraining has none
    # ``apply(dropout_key=...)``: on the attention probabilities, as BERT's
    # attention_probs_dropout_prob (sentence-transformers keeps MiniLM's 0.1). It runs the
    # ``einsum`` path whatever ``attention`` says (the fused kernels draw no dropout). An import
    # leaves it 0; the contrastive stage's ``--attention-dropout`` sets it.
    attention_dropout: float = 0.0
    init_std: float = 0.02
    # "normal": every kernel and embedding N(0, init_std). "modernbert": ModernBERT's rule (HF
    # ModernBertPreTrainedModel._init_weights): normals truncated at +-init_cutoff std, std
    # init_std for embeddings and input projections (QKV, the MLP's input), init_std / sqrt(2 x
    # layers) for output projections (attention and MLP outputs, the head's dense).
    init: str = "normal"
    init_cutoff: float = 2.0  # ModernBertConfig.initializer_cutoff_factor
    # Architecture options (ModernBERT's choices in the ``modern-*`` presets); the defaults are
    # BERT's, and keep the model what it was before these options existed.
    positions: str = "learned"  # "learned" absolute rows, or "rope" (``clozax.core.positions``)
    rope_theta_global: float = 160_000.0  # RoPE base on global-attention layers
    rope_theta_local: float = 10_000.0  # RoPE base on local (sliding-window) layers
    mlp: str = "gelu"  # "gelu" (dense, GELU, dense) or "geglu" (``clozax.core.layers.mlp``)
    bias: bool = True  # biases in every dense layer and LayerNorm (the decoder's always)
    embedding_norm: bool = True  # a LayerNorm after the embeddings
    final_norm: bool = True  # pre-LN only: a LayerNorm after the last block
    first_attention_norm: bool = True  # pre-LN only: false = layer 0 attends to its raw input
    global_every: int = 1  # layer i attends globally when i % global_every == 0, else locally
    local_window: int = 128  # local layers see keys within local_window // 2 of the query

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "layers", "heads", "intermediate", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"model.{name}={value!r} is not a positive integer; give a whole number >= 1"
                )
        if self.hidden % self.heads:
            raise ValueError(
                f"model.heads={self.heads} does not divide model.hidden={self.hidden}; "
                "choose heads that divide hidden"
            )
        if self.layer_norm not in LAYER_NORMS:
            raise ValueError(
                f"model.layer_norm={self.layer_norm!r} is not one of {LAYER_NORMS}; use 'pre' "
                "(RoBERTa-PreLayerNorm, stable at high learning rates) or 'post' (original BERT)"
            )
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"model.compute_dtype={self.compute_dtype!r} is not one of {COMPUTE_DTYPES}; "
                "use 'float32' or 'bfloat16' (parameters stay float32 either way)"
            )
        if self.attention not in attention_lib.IMPLS:
            raise ValueError(
                f"model.attention={self.attention!r} is not one of {attention_lib.IMPLS}; use "
                "'auto' (the fastest correct path for the device, row length and mask), or "
                "name one"
            )
        if self.attention == "cudnn" and self.attention_within_segments:
            raise ValueError(
                "model.attention='cudnn' takes per-row lengths and cannot keep attention inside "
                "packed documents; set model.attention_within_segments=false or use 'xla'"
            )
        if self.attention == "cudnn" and self.compute_dtype != "bfloat16":
            raise ValueError(
                "model.attention='cudnn' runs cuDNN's fused kernel, which needs "
                "model.compute_dtype='bfloat16'; set it, or use model.attention='xla'"
            )
        if self.unroll is not None and (isinstance(self.unroll, bool)
                                        or not isinstance(self.unroll, numbers.Integral)
                                        or self.unroll < 1):
            raise ValueError(f"model.unroll={self.unroll!r} is not a positive integer; give the "
                             "blocks per scan step, or leave it unset to unroll every block")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r} is not one of {REMAT_POLICIES}")
        if not isinstance(self.attention_within_segments, bool):
            raise ValueError(
                f"model.attention_within_segments={self.attention_within_segments!r} is not a "
                "bool; use true or false"
            )
        self._check_architecture()
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not 0 <= value < 1:
                raise ValueError(f"model.{name}={value!r} is not in [0, 1); use e.g. 0.1")
        if self.init not in INITS:
            raise ValueError(f"model.init={self.init!r} is not one of {INITS}")
        for name in ("layer_norm_eps", "init_std", "init_cutoff", "rope_theta_global",
                     "rope_theta_local"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"model.{name}={value!r} is not a finite positive number; "
                    f"use e.g. {getattr(ModelConfig, name)}"
                )

    def _check_architecture(self):
        for name, choices in (("positions", POSITIONS), ("mlp", MLPS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"model.{name}={getattr(self, name)!r} is not one of {choices}")
        for name in ("bias", "embedding_norm", "final_norm", "first_attention_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} is not a bool; use true "
                                 "or false")
            if self.layer_norm == "post" and name in ("final_norm", "first_attention_norm") \
                    and not getattr(self, name):
                raise ValueError(f"model.{name}=false applies only to pre-LN blocks; set "
                                 "model.layer_norm='pre' or leave it true")
        for name in ("global_every", "local_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"model.{name}={value!r} is not a positive integer; give a "
                                 "whole number >= 1")
        if self.local_window % 2:
            raise ValueError(f"model.local_window={self.local_window} is odd; give an even "
                             "window (keys within local_window // 2 on each side, as in HF)")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"model.positions='rope' needs an even head dim, not "
                             f"{self.head_dim}; choose heads so that hidden / heads is even")

    @property
    def has_local_layers(self) -> bool:
        """Whether some layer attends through the sliding window."""
        return self.global_every > 1 and self.layers > 1

    def is_global(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) attends to every position (ModernBERT's rule)."""
        return layer % self.global_every == 0

    @property
    def drops(self) -> bool:
        """Whether ``apply(dropout_key=...)`` drops anything (hidden or attention dropout)."""
        return self.dropout > 0 or self.attention_dropout > 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def dtype(self):
        """The compute dtype as a jnp dtype."""
        return jnp.dtype(self.compute_dtype)


# BERT-style presets set only the shape fields; numerics and options keep their defaults.
PRESETS: dict[str, dict] = {
    "tiny": {"hidden": 32, "layers": 2, "heads": 2, "intermediate": 64, "max_positions": 128},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024, "max_positions": 512},
    "base": {"hidden": 768, "layers": 12, "heads": 12, "intermediate": 3072, "max_positions": 512},
}
# ModernBERT's architecture (Warner et al. 2024; HF ``ModernBertConfig`` defaults): RoPE with
# theta 160k on global and 10k on local layers, GeGLU, no biases but the decoder's, pre-LN with
# an embedding norm, a final norm and no attention norm in layer 0, global attention every third
# layer and a 128-token (+-64) window on the others, documents attending only to themselves.
MODERN = {"positions": "rope", "mlp": "geglu", "bias": False, "layer_norm": "pre",
          "embedding_norm": True, "final_norm": True, "first_attention_norm": False,
          "global_every": 3, "local_window": 128, "layer_norm_eps": 1e-5,
          "attention_within_segments": True}
PRESETS.update({
    "modern-tiny": {**MODERN, "hidden": 32, "layers": 3, "heads": 2, "intermediate": 48,
                    "max_positions": 128, "local_window": 16},
    "modern-small": {**MODERN, "hidden": 256, "layers": 6, "heads": 4, "intermediate": 384,
                     "max_positions": 1024},
    # ModernBERT-base's shape: 22 layers x 768, 12 heads, GeGLU intermediate 1152, 8192 rows.
    "modern-base": {**MODERN, "hidden": 768, "layers": 22, "heads": 12, "intermediate": 1152,
                    "max_positions": 8192},
})


def preset(name: str, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of preset ``name`` with ``overrides`` applied (e.g. ``vocab_size``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    valid = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown model config key(s) {unknown}; valid keys are {valid}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def runnable_here(config: ModelConfig) -> ModelConfig:
    """``config`` with the speed-only settings this machine cannot run replaced by ones it can:
    ``attention="cudnn"`` or ``"flash"`` (NVIDIA GPUs only) becomes ``"auto"``, the same
    maths."""
    if not attention_lib.runs_here(config.attention):
        return dataclasses.replace(config, attention="auto")
    return config
