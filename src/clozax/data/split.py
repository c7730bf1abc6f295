"""Document-level train / held-out split by a keyed hash of the group name.

A group's side depends only on ``(seed, group)``, never on corpus order or size, so adding
documents never moves an existing group. Exact duplicates are dropped before splitting
(``corpus.clean`` keeps the first occurrence), so no normalised text can sit on both sides.
"""

from __future__ import annotations

import hashlib

TRAIN = "train"
HELDOUT = "heldout"
SPLITS = (TRAIN, HELDOUT)


def group_key(group: str, seed: int) -> int:
    """A uniform 64-bit integer from a blake2b hash of the group name keyed with the seed."""
    key = seed.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(group.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little")


def assign_split(key: int, heldout_fraction: float) -> str:
    """``"heldout"`` when the group's key, scaled to [0, 1), falls under the fraction."""
    return HELDOUT if key / 2**64 < heldout_fraction else TRAIN
