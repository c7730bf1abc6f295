"""A run as a ``sentence-transformers`` model: ``clozax export RUN DIR --sentence-transformers``
adds to the ``transformers`` files the modules ``SentenceTransformer(DIR)`` reads — the
transformer, its pooling (``1_Pooling/config.json`` with every mode spelled out as a boolean,
the form old and new releases and serving stacks read), and a normalisation when embeddings are
unit length — and ``config_sentence_transformers.json`` with the similarity function.

A contrastive stage's run (``clozax embed``) is exported with the pooling it trained with
(``run.json``'s ``stage``), never another: ``sentence_pooling`` chooses it and refuses a
``--pooling`` that contradicts it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clozax.core import files
from clozax.core import model as model_lib
from clozax.core.pooling import POOLINGS, pool
from clozax.train.run_dir import load_run

SENTENCE_TRANSFORMERS = "6.3.0"  # the release the files are written for and tested with
_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
          "weightedmean_tokens", "lasttoken")


def sentence_pooling(info: dict, asked: str | None, run_dir: Path) -> str:
    """The pooling an export of the run whose ``run.json`` is ``info`` writes: a contrastive
    stage's own (``asked`` must be it or None), else ``asked`` (default ``mean``)."""
    if asked is not None and asked not in POOLINGS:
        raise ValueError(f"unknown pooling {asked!r}; choose one of {', '.join(POOLINGS)}")
    trained = (info.get("stage") or {}).get("pooling")
    if trained is None:
        return asked or "mean"
    if asked is not None and asked != trained:
        raise ValueError(f"run {run_dir} is a contrastive stage trained with {trained} pooling, "
                         f"not {asked}; drop --pooling (its own is used) or pass --pooling "
                         f"{trained}")
    return trained


def write_sentence_files(out: Path, hidden: int, max_length: int, pooling: str,
                         normalize: bool) -> None:
    """The sentence-transformers files beside a ``transformers`` export in ``out``."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    files.write_json(out / "modules.json", modules)
    files.write_json(out / "sentence_bert_config.json",
                     {"max_seq_length": max_length, "do_lower_case": False})
    chosen = {"mean": "mean_tokens", "cls": "cls_token"}[pooling]
    (out / "1_Pooling").mkdir()
    files.write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden,
        **{f"pooling_mode_{mode}": mode == chosen for mode in _MODES},
        "include_prompt": True})
    files.write_json(out / "config_sentence_transformers.json", {
        "__version__": {"sentence_transformers": SENTENCE_TRANSFORMERS},
        "prompts": {}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"})


def embeddings(run_dir: Path, texts: list[str], pooling: str = "mean",
               normalize: bool = False) -> np.ndarray:
    """clozax's own sentence embeddings of ``texts`` [N, H], fp32, one right-padded batch."""
    from clozax.interop.parity import encode_batch

    run = load_run(run_dir)
    ids, mask = encode_batch(run.tokenizer_path, texts, run.specials["pad"])
    run.check_length(ids.shape[1], "the longest text")
    hidden = model_lib.apply(run.params, run.config.model, ids, mask, mask.astype(np.int32))
    return np.asarray(pool(hidden, mask, pooling, normalize))


def sentence_parity(run_dir: Path, st_dir: Path, texts: list[str], pooling: str = "mean",
                    normalize: bool = False) -> float:
    """Max |clozax - SentenceTransformer(st_dir).encode| over ``texts`` (fp32, CPU)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ValueError("the parity check needs sentence-transformers; pip install "
                         "'clozax[sentence]' or drop --verify") from None
    theirs = SentenceTransformer(str(st_dir), device="cpu").encode(
        texts, batch_size=len(texts), convert_to_numpy=True)
    return float(np.abs(embeddings(run_dir, texts, pooling, normalize) - theirs).max())
