"""The encoder's configuration: shape and numerics, validated on construction, and the
named presets (a dict). Shared by the model, the run config and every exporter."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, fields

import jax.numpy as jnp

from clozax.core import attention as attention_lib

LAYER_NORMS = ("pre", "post")
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
    # Speed-only: how attention is computed (see ``_attention``); every choice is the same math.
    attention: str = "auto"
    # Speed-only: ``jax.lax.scan`` unroll over the blocks (None: every block unrolled, which
    # measured fastest on CPU, +13 %, and on an H200, +27 % over unroll=1, at the price of
    # compile time that the persistent compilation cache pays once).
    unroll: int | None = None
    # Speed-only: recompute in the backward instead of keeping activations: "none", "block"
    # (keep only each block's input) or "dots" (keep matmul outputs without batch dimensions).
    remat: str = "none"
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02

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
                "'auto' (einsum on CPU, XLA's dot_product_attention elsewhere), or name one"
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
        for name in ("layer_norm_eps", "init_std"):
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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def dtype(self):
        """The compute dtype as a jnp dtype."""
        return jnp.dtype(self.compute_dtype)


# Only the shape fields; numerics and options keep their defaults unless overridden.
PRESETS: dict[str, dict] = {
    "tiny": {"hidden": 32, "layers": 2, "heads": 2, "intermediate": 64, "max_positions": 128},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024, "max_positions": 512},
    "base": {"hidden": 768, "layers": 12, "heads": 12, "intermediate": 3072, "max_positions": 512},
}


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
    ``attention="cudnn"`` (NVIDIA GPUs only) becomes ``"auto"``, the same maths."""
    if config.attention == "cudnn" and not attention_lib.cudnn_available():
        return dataclasses.replace(config, attention="auto")
    return config
