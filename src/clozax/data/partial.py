"""The partial directory of a ``clozax prepare``: what a killed or failed run leaves, and what
a later run reuses of it.

It is ``.{out}.partial-r{KEY}`` beside ``--out``, ``KEY`` a hash of the *reading settings*
(``READ_SETTINGS``: the corpus argument, fields, layout, split seed and fraction, ``--strict``,
``--shard-bytes``, the tokenizer sample, the format and clozax versions), written out in its
``state/settings.json``. Each later phase records the key of what it depends on in
``state/PHASE.key``, and a rerun reuses exactly what still holds:

- a piece's spools: its files' names, sizes and modification times and its range
  (``pieces.piece_identity``, kept in ``spool/plan.json``), so a changed or touched file is
  read again, alone;
- the merge of every piece (``spool/done.json``) and so the tokenizer: the corpus's identity
  (every piece), plus the tokenizer's settings;
- the packed shards and the manifest: that, plus ``--seq-len``.

``state/`` is removed just before the finished partial is renamed into place, so the dataset
holds only its own files.

A partial of *other* reading settings is never deleted silently: ``prepare`` stops with one
line naming it and what differs, and ``--discard-partial`` deletes it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import clozax
from clozax.core import files
from clozax.data.pieces import piece_identity

# PrepareConfig fields that decide the documents read and their split (everything else is
# a later phase's or speed only).
READ_SETTINGS = ("corpus", "text_field", "group_field", "label_field", "text_unit",
                 "group_by", "heldout_fraction", "seed", "strict", "shard_bytes",
                 "tokenizer_sample")
STATE = "state"


def read_settings(config, format_version: int) -> dict:
    """The settings a partial's reading depends on (its ``settings.json``)."""
    settings = {name: getattr(config, name) for name in READ_SETTINGS}
    # A given tokenizer is not trained, so no sample is drawn for it.
    settings["tokenizer_sample"] = None if config.tokenizer else config.tokenizer_sample
    return {**settings, "format_version": format_version, "clozax": clozax.__version__}


def key_of(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def partial_path(out: Path, settings: dict) -> Path:
    return out.parent / f".{out.name}.partial-r{key_of(settings)}"


def others(out: Path, mine: Path) -> list[Path]:
    """Partial prepares of ``out`` other than ``mine`` (other reading settings, or written by
    an older clozax)."""
    return sorted(p for p in out.parent.glob(f".{out.name}.partial-r*")
                  if p != mine and p.is_dir())


def difference(other: Path, settings: dict) -> str:
    """What ``other``'s reading settings differ in, for the message that names it."""
    theirs = files.read_json(other / STATE / "settings.json")
    if not isinstance(theirs, dict):
        return "settings not recorded (an older clozax)"
    changed = [f"{k} {theirs.get(k)!r} (now {settings.get(k)!r})" for k in sorted(settings)
               if theirs.get(k) != settings.get(k)]
    return ", ".join(changed[:3]) or "the same settings"


def refuse_or_discard(out: Path, mine: Path, settings: dict, discard: bool, say) -> None:
    """Stop on another partial of ``out`` (naming it), or delete it with ``discard``."""
    found = others(out, mine)
    if found and not discard:
        raise ValueError(
            f"an unfinished prepare of {out} with other settings is kept in {found[0]} "
            f"({difference(found[0], settings)}); run it again with those settings to finish "
            "it, or pass --discard-partial to delete it")
    for other in found:
        shutil.rmtree(other)
        say(f"deleted the unfinished prepare {other} (--discard-partial)")


def begin(tmp: Path, settings: dict) -> None:
    (tmp / STATE).mkdir(parents=True, exist_ok=True)
    if files.read_json(tmp / STATE / "settings.json") != settings:
        files.write_json(tmp / STATE / "settings.json", settings, sort_keys=True)


def finish(tmp: Path) -> None:
    """Remove the partial's own records before it is renamed into place."""
    shutil.rmtree(tmp / STATE, ignore_errors=True)


def has_work(tmp: Path) -> bool:
    """Whether the partial holds anything finished (a piece read, or more)."""
    return any((tmp / "spool").glob("*.read.json")) or (tmp / "tokenizer.json").is_file()


def keep_read_pieces(spool: Path, the_plan: dict, say) -> None:
    """Delete the spools of pieces whose files changed since they were read (their identity
    differs from the new plan's), so only those pieces are read again."""
    old = files.read_json(spool / "plan.json")
    if old is None:
        return
    n_old = len(old["pieces"])
    changed = [i for i in range(n_old)
               if i >= len(the_plan["pieces"])
               or piece_identity(old, i) != piece_identity(the_plan, i)]
    for i in changed:
        for stale in spool.glob(f"{i:05d}.*"):
            stale.unlink()
    if changed:
        read = n_old - len(changed)
        say(f"the corpus changed since the unfinished prepare read it: reading "
            f"{len(changed)} of its {n_old} pieces again (keeping {read})")


def corpus_identity(the_plan: dict) -> str:
    """What the whole reading phase depends on beyond the settings: every piece."""
    return key_of([piece_identity(the_plan, i) for i in range(len(the_plan["pieces"]))])


def phase_done(tmp: Path, phase: str, key: str) -> bool:
    """Whether ``phase`` was done (or started, for one that finishes piece by piece) for
    ``key``."""
    return files.read_json(tmp / STATE / f"{phase}.key") == {"key": key}


def mark_phase(tmp: Path, phase: str, key: str) -> None:
    files.write_json(tmp / STATE / f"{phase}.key", {"key": key})
