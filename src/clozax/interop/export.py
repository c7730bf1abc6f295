"""``clozax export``: a run's checkpoint as a directory ``transformers`` loads offline
(``AutoModelForMaskedLM`` + ``AutoTokenizer``), in the family its architecture maps to
(``clozax.interop.families``). Needs only numpy + safetensors."""

from __future__ import annotations

from pathlib import Path

from safetensors.numpy import save_file

from clozax.core import files
from clozax.core.files import staged_dir
from clozax.interop.families import for_model
from clozax.interop.family import at_trained_length
from clozax.interop.hf_files import check_fresh_output, special_tokens, write_tokenizer
from clozax.interop.sentence import sentence_pooling, write_sentence_files
from clozax.judge.finetune import saved as finetuned
from clozax.train.run_dir import load_run


def export_run(run_dir: Path, out_dir: Path, step: int | None = None,
               pooling: str | None = None, normalize: bool = False) -> Path:
    """Write ``run_dir``'s checkpoint (default: latest) as a ``transformers`` directory.

    Files: config.json, model.safetensors, tokenizer.json (the run's, byte for byte),
    tokenizer_config.json and special_tokens_map.json (``PreTrainedTokenizerFast``).
    ``model_max_length`` (and, for learned positions, ``max_position_embeddings``) is the
    length the run trained on (``LoadedRun.trained_length``), not the table's size.
    With ``pooling`` (``mean`` or ``cls``), also the files ``SentenceTransformer(out_dir)``
    reads (``interop/sentence.py``); a contrastive stage's run only with the pooling it
    trained with (``sentence_pooling``). Returns ``out_dir``.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if finetuned.is_finetuned(run_dir):
        from clozax.interop.export_finetuned import export_finetuned

        return export_finetuned(run_dir, out_dir)
    run = load_run(run_dir, step)
    if pooling is not None:
        pooling = sentence_pooling(run.info, pooling, run_dir)
    if not run.tokenizer_path.is_file():
        raise ValueError(f"run {run_dir} has no tokenizer.json; it is damaged, re-train or "
                         "re-import it")
    with_head = run.has_mlm_head
    specials = run.specials
    tokens = special_tokens(run.tokenizer_path, specials)
    length = run.trained_length
    params, model_config = at_trained_length(run.params, run.config.model, length)
    family = for_model(model_config)
    tensors = family.to_hf_tensors(params, model_config, specials["pad"], with_head)
    check_fresh_output(out_dir, "export")
    with staged_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "clozax_run": str(run_dir.absolute()),
                            "clozax_step": str(run.step)})
        files.write_json(tmp / "config.json", family.hf_config(model_config, specials, with_head),
                         sort_keys=True)
        write_tokenizer(tmp, run.tokenizer_path, tokens, length)
        if pooling is not None:
            write_sentence_files(tmp, model_config.hidden, length, pooling, normalize)
    return out_dir
