"""The batch masker: ``make_masker`` builds, from a run's ``MaskingConfig``, the one jittable
function that selects and corrupts the positions of a batch (the cores are in
``core/masking.py``).

Training uses it in its step; evaluation, the audit and the probe use the same one, so that what
is judged is masked exactly as what was trained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import masking
from clozax.core.vocab import Vocabulary


def make_masker(masking_config, vocab: Vocabulary, seq_len: int):
    """``(key, batch, step=None) -> (MaskedBatch, Selection)``, jittable, static selected count.

    ``masking_config`` has ``rate``, ``unit`` ("token" or "word") and ``policy``, and maybe a
    ramp (``rate_end`` over ``ramp_steps``). Eligible positions: real tokens (segment > 0) that
    are not special ids. With a ramp, a training ``step`` (traced) selects the ramp's count out
    of the slots of its highest rate (one program for the whole ramp); without a step (the
    frozen held-out masks) the masker selects at ``heldout_rate``, the rate the ramp ends at.
    """
    ramp = masking_config.rate_end is not None
    count = masking.selection_count(masking_config.heldout_rate, seq_len)
    slots = masking.selection_count(max(masking_config.rate, masking_config.heldout_rate),
                                    seq_len)
    # Host arrays, made constants of each program that traces the masker: a device array
    # closed over would be copied back to the host to become one, which a GPU run's
    # no-host-transfer guard around the train step refuses.
    special_table = np.asarray(vocab.special_table())  # (vocab,) bool
    random_ids = np.asarray(masking.allowed_random_ids(vocab.size, vocab.special_ids))
    policy = masking_config.policy
    mask_id = int(vocab.specials["mask"])

    def masker(key, batch, step=None):
        tokens, segments = batch["tokens"], batch["segments"]
        eligible = ~jnp.asarray(special_table)[tokens] & (segments > 0)  # (batch, seq)
        select_key, corrupt_key = jax.random.split(key)
        n, active = count, None
        if ramp and step is not None:
            n = slots
            active = masking.ramp_count(masking_config.rate, masking_config.rate_end,
                                        masking_config.ramp_steps, step, seq_len)
        if masking_config.unit == "word":
            selection = masking.select_words(select_key, eligible, batch["word_starts"], n,
                                             active)
        else:
            selection = masking.select_fixed(select_key, eligible, n, active)
        selected = masking.selection_mask(selection, tokens.shape[1])
        masked = masking.corrupt(corrupt_key, tokens, selected, policy, mask_id,
                                 jnp.asarray(random_ids))
        return masked, selection

    return masker
