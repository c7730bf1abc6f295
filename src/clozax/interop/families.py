"""The registry of exportable model families (a tuple), and choosing one for a run or for a
``save_pretrained`` directory. A new family is a new module with its ``Family`` added here."""

from __future__ import annotations

from pathlib import Path

from clozax.interop.bert import BERT
from clozax.interop.family import Family
from clozax.interop.modernbert import MODERNBERT, ModernBertFamily
from clozax.interop.roberta_prelayernorm import ROBERTA_PRELAYERNORM

FAMILIES: tuple[Family | ModernBertFamily, ...] = (BERT, ROBERTA_PRELAYERNORM, MODERNBERT)


def for_model(model_config) -> Family | ModernBertFamily:
    """The family a run's architecture exports as; ``ValueError`` when none represents it."""
    for family in FAMILIES:
        if family.represents(model_config):
            return family
    raise ValueError("no transformers family represents this architecture exactly; export "
                     "needs BERT's options (learned positions, gelu MLP, biases, every norm, "
                     "global attention) or ModernBERT's (the modern-* presets' positions, mlp, "
                     "layer_norm and norms)")


def for_hf_config(cfg: dict, hf_dir: Path) -> tuple[Family | ModernBertFamily, str]:
    """(family, architecture name) of a ``config.json``, after refusing what clozax cannot
    represent."""
    supported = {name: f for f in FAMILIES for name in (f.mlm, f.encoder)}
    by_type = {f.model_type: f for f in FAMILIES}
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = archs[0] if archs else None
    if arch is not None and arch not in supported:
        raise ValueError(f"{hf_dir} holds a {arch}; clozax imports only "
                         f"{', '.join(sorted(supported))}")
    if model_type not in by_type:
        raise ValueError(f"{hf_dir} has model_type {model_type!r}; clozax imports only "
                         f"{', '.join(sorted(by_type))}")
    family = by_type[model_type]
    if arch is not None and supported[arch] is not family:
        raise ValueError(f"{hf_dir}: architecture {arch} does not match model_type "
                         f"{model_type!r}; fix config.json")
    family.check_hf_config(cfg, hf_dir)
    return family, arch or family.mlm


def special_strings(name: str) -> list[str]:
    """Every family's token string for special ``name`` (candidates when importing)."""
    return [f.specials[name] for f in FAMILIES]
