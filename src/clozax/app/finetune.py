"""``clozax finetune``'s command line (registered by ``clozax.app.cli``): parses, calls
``clozax.judge.finetune.protocol``. Kept apart because its task and protocol options alone
would take ``app/cli.py`` far past 400 lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from clozax.train import compile_cache

Opt = typer.Option


def _numbers(text: str | None, option: str, example: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{option} {text!r} is not a comma-separated list of numbers; pass "
                         f"e.g. {option} {example}") from None


def finetune(
    run: Annotated[Path, typer.Argument(help="Run directory (clozax train or import-hf).")],
    task: Annotated[Path | None, Opt(help="Training file: JSONL, CSV, TSV, parquet or CoNLL "
                                          "(default: the run's dataset labels).")] = None,
    validation: Annotated[Path | None, Opt(help="Validation file (default: 10 % of the "
                                                "training file, split by group).")] = None,
    test: Annotated[Path | None, Opt(help="Test file (default: 20 % of the training file, "
                                          "split by group).")] = None,
    kind: Annotated[str, Opt(help="classification, pair, regression or tokens.")]
    = "classification",
    text_field: Annotated[str, Opt(help="Field of the text.")] = "text",
    pair_field: Annotated[str, Opt(help="Field of the second text (pair tasks; regression "
                                        "reads it when given).")] = "text_pair",
    label_field: Annotated[str, Opt(help="Field of the label.")] = "label",
    group_field: Annotated[str | None, Opt(help="Field grouping examples for the split "
                                                "(default: the text).")] = None,
    tokens_field: Annotated[str, Opt(help="Field of the words (tokens).")] = "tokens",
    tags_field: Annotated[str, Opt(help="Field of the BIO tags (tokens).")] = "tags",
    glue_task: Annotated[str | None, Opt(help="A GLUE task by name: cola, sst2, mrpc, qqp, "
                                              "stsb, mnli, qnli, rte.")] = None,
    glue_dir: Annotated[Path | None, Opt(help="The local GLUE folder (or the task's).")] = None,
    name: Annotated[str | None, Opt(help="Task name: RUN/finetune/NAME (default: the file's "
                                         "stem, the GLUE task, or 'labels').")] = None,
    metric: Annotated[str | None, Opt(help="Validation metric that picks the learning rate "
                                           "(default by kind).")] = None,
    lr: Annotated[str | None, Opt(help="Learning-rate grid, comma-separated (default by "
                                       "encoder width: 2e-5,5e-5,1e-4 from 768 up, else "
                                       "1e-4,3e-4,1e-3).")] = None,
    seeds: Annotated[int, Opt(help="Seeds per learning rate.")] = 3,
    epochs: Annotated[int, Opt(help="Epochs per job.")] = 3,
    batch_size: Annotated[int, Opt(help="Examples per step.")] = 32,
    dropout: Annotated[float, Opt(help="Head dropout.")] = 0.1,
    warmup: Annotated[float, Opt(help="Warm-up fraction of each job's steps.")] = 0.06,
    pooling: Annotated[str, Opt(help="cls, or mean (ModernBERT-style encoders).")] = "cls",
    layer_decay: Annotated[str, Opt(help="Layer-wise learning-rate decay: layer i of L trains "
                                         "at lr x DECAY^(L-i), the embeddings at DECAY^(L+1), "
                                         "the head at lr (1: none); comma-separated, a grid "
                                         "chosen on validation with the rate.")] = "1",
    reinit_top: Annotated[int, Opt(help="Start the trained encoder's top N blocks from its "
                                        "random init (0: none): for blocks pretraining made "
                                        "specialists in masked-token prediction.")] = 0,
    control: Annotated[bool, Opt(help="Also fine-tune the random-init encoder.")] = True,
    bf16: Annotated[bool, Opt(help="Compute in bfloat16 (parameters stay float32).")] = False,
    max_train: Annotated[int | None, Opt(help="Train on a keyed choice of this many "
                                              "examples.")] = None,
    max_len: Annotated[int | None, Opt(help="Tokens per example, special tokens included: "
                                            "longer texts are cut (default: the length the "
                                            "encoder was trained on).")] = None,
    split_seed: Annotated[int, Opt(help="Seed of the carved splits.")] = 0,
    keep_pretraining_overlap: Annotated[bool, Opt(
        help="Score validation/test examples the encoder read in pretraining (default: "
             "dropped and counted).")] = False,
    step: Annotated[int | None, Opt(help="Fine-tune this checkpoint step (default: the "
                                         "newest) into RUN/finetune/NAME-stepSTEP.")] = None,
    predict: Annotated[Path | None, Opt(help="Instead of fine-tuning: print predictions of "
                                             "RUN/finetune/NAME/model for this file (JSONL).")]
    = None,
):
    """Fine-tune an encoder on a labelled task: a learning-rate grid x seeds, picked on
    validation, test mean ± std and worst seed, against the random-init encoder and TF-IDF."""
    compile_cache.enable()
    from clozax.judge.finetune import protocol as ft
    from clozax.judge.finetune.tasks import Fields

    fields = Fields(text=text_field, pair=pair_field, label=label_field, group=group_field,
                    tokens=tokens_field, tags=tags_field)
    spec = ft.TaskSpec(train=task, validation=validation, test=test, kind=kind, fields=fields,
                       glue=glue_task, glue_dir=glue_dir, name=name, metric=metric,
                       split_seed=split_seed, keep_pretraining_overlap=keep_pretraining_overlap,
                       max_len=max_len)
    if predict is not None:
        from clozax.judge.finetune.predict import predict_file

        model_dir = run if (run / "finetuned.json").is_file() else \
            ft.task_dir(run, spec.task_name(), step) / "model"
        for record in predict_file(model_dir, predict, fields):
            print(json.dumps(record))
        return
    protocol = ft.Protocol(learning_rates=_numbers(lr, "--lr", "1e-4,3e-4"),
                           layer_decays=_numbers(layer_decay, "--layer-decay", "1,0.8"),
                           seeds=seeds, epochs=epochs, batch_size=batch_size, dropout=dropout,
                           warmup_fraction=warmup, pooling=pooling, control=control,
                           compute_dtype="bfloat16" if bf16 else None,
                           max_train_examples=max_train, reinit_top=reinit_top)
    from rich.console import Console

    result = ft.finetune_run(run, spec, protocol, step=step)
    console = Console()
    console.print(ft.summary_table(result))
    console.print(f"wrote {ft.task_dir(run, result['task']['name'], step) / ft.RESULT_FILE}")
