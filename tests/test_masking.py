"""Masking invariants (hypothesis properties) and boundary validation messages."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clozax.core import masking
from clozax.core.masking import CorruptionPolicy, Kind

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

VOCAB = 40
SPECIALS = (0, 1, 2, 3, 4)  # pad, unk, cls, sep, mask
MASK_ID = 4
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 4))
    seq = draw(st.sampled_from([8, 16]))  # few shapes keep compilation cheap
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, VOCAB, size=(batch, seq)).astype(np.int32)
    pad_from = rng.integers(1, seq + 1, size=batch)
    for b in range(batch):
        tokens[b, pad_from[b]:] = 0
    tokens[:, 0] = 2
    eligible = ~np.isin(tokens, SPECIALS)
    eligible[0, 1] = True  # at least one eligible position in the batch
    tokens[0, 1] = max(tokens[0, 1], 5)
    rate = draw(st.sampled_from([0.15, 0.3, 0.5, 1.0]))
    key_seed = draw(st.integers(0, 2**31 - 1))
    return tokens, eligible, rate, key_seed


def run(tokens, eligible, rate, key_seed, policy=masking.BERT_POLICY):
    return masking.mask_tokens(
        jax.random.key(key_seed),
        tokens,
        eligible=eligible,
        rate=rate,
        policy=policy,
        mask_id=MASK_ID,
        vocab_size=VOCAB,
        special_ids=SPECIALS,
    )


@PROPERTY
@given(batches())
def test_targets_are_never_modified(case):
    tokens, eligible, rate, key = case
    out = run(tokens, eligible, rate, key)
    assert (np.asarray(out.targets) == tokens).all()


@PROPERTY
@given(batches())
def test_inputs_equal_targets_wherever_not_selected(case):
    tokens, eligible, rate, key = case
    out = run(tokens, eligible, rate, key)
    unselected = ~np.asarray(out.selected)
    assert (np.asarray(out.inputs)[unselected] == tokens[unselected]).all()
    assert (np.asarray(out.kind)[unselected] == Kind.NONE).all()


@PROPERTY
@given(batches())
def test_nothing_ineligible_is_ever_selected(case):
    tokens, eligible, rate, key = case
    out = run(tokens, eligible, rate, key)
    assert not (np.asarray(out.selected) & ~eligible).any()


@PROPERTY
@given(batches())
def test_fixed_count_holds_per_sequence(case):
    tokens, eligible, rate, key = case
    out = run(tokens, eligible, rate, key)
    count = masking.selection_count(rate, tokens.shape[1])
    expected = np.minimum(count, eligible.sum(-1))
    assert (np.asarray(out.selected).sum(-1) == expected).all()


@PROPERTY
@given(batches())
def test_a_random_replacement_is_never_a_special_id(case):
    tokens, eligible, rate, key = case
    out = run(tokens, eligible, rate, key, policy=CorruptionPolicy(0.0, 1.0, 0.0))
    replaced = np.asarray(out.kind) == Kind.RANDOM
    assert (replaced == np.asarray(out.selected)).all()
    assert not np.isin(np.asarray(out.inputs)[replaced], SPECIALS).any()


@PROPERTY
@given(batches())
def test_same_key_gives_the_same_result(case):
    tokens, eligible, rate, key = case
    a, b = run(tokens, eligible, rate, key), run(tokens, eligible, rate, key)
    for x, y in zip(a, b, strict=True):
        assert (np.asarray(x) == np.asarray(y)).all()


def test_different_keys_give_different_selections():
    tokens = np.full((4, 64), 7, np.int32)
    eligible = np.ones_like(tokens, bool)
    selections = {
        np.asarray(run(tokens, eligible, 0.15, k).selected).tobytes() for k in range(5)
    }
    assert len(selections) == 5


def test_mask_policy_fractions_are_honoured_in_aggregate():
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, VOCAB, size=(64, 128)).astype(np.int32)
    out = run(tokens, np.ones_like(tokens, bool), 0.5, 3)
    kind = np.asarray(out.kind)[np.asarray(out.selected)]
    fractions = [(kind == k).mean() for k in (Kind.MASK, Kind.RANDOM, Kind.KEEP)]
    # 4096 draws: 5 standard errors of a 0.1 fraction is about 0.023.
    np.testing.assert_allclose(fractions, [0.8, 0.1, 0.1], atol=0.025)


def test_explicit_selection_is_used_as_given():
    tokens = np.full((2, 6), 9, np.int32)
    selected = np.zeros((2, 6), bool)
    selected[0, 2] = selected[1, 5] = True
    out = masking.mask_tokens(
        jax.random.key(0), tokens, selected=selected, mask_id=MASK_ID, vocab_size=VOCAB,
        policy=masking.LESSON_POLICY,
    )
    assert (np.asarray(out.selected) == selected).all()
    assert (np.asarray(out.inputs)[selected] == MASK_ID).all()


def test_whole_word_selection_never_splits_a_word():
    rng = np.random.default_rng(1)
    batch, seq = 8, 32
    word_starts = rng.random((batch, seq)) < 0.5
    word_starts[:, 0] = True
    eligible = np.ones((batch, seq), bool)
    eligible[:, 0] = False  # [CLS]
    word_starts[:, 1] = True
    count = 6
    sel = masking.select_words(jax.random.key(2), eligible, word_starts, count)
    mask = np.asarray(masking.selection_mask(sel, seq))
    word_id = np.cumsum(word_starts, -1)
    for b in range(batch):
        assert 0 < mask[b].sum() <= count
        for w in np.unique(word_id[b][mask[b]]):
            assert mask[b][word_id[b] == w].all(), "a word was partly selected"
        assert not (mask[b] & ~eligible[b]).any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"selected": np.zeros((2, 4), bool)}, "no selected position"),
        ({"selected": np.ones((2, 4), np.int32)}, "boolean mask"),
        ({"selected": np.ones((2, 5), bool)}, "shape"),
        ({"selected": np.ones((2, 4), bool), "mask_id": 40}, "mask id 40 is not a valid input"),
        ({"selected": np.ones((2, 4), bool), "mask_id": 9}, "appears as a clean target"),
        ({"eligible": np.ones((2, 4), bool), "rate": 0.0}, "rate 0.0 is outside"),
        ({"eligible": np.ones((2, 4), bool), "rate": 1.5}, "rate 1.5 is outside"),
        ({"eligible": np.zeros((2, 4), bool)}, "no eligible position"),
        ({"selected": np.ones((2, 4), bool), "num_classes": 5}, "not an output class"),
    ],
)
def test_bad_masking_inputs_raise_with_a_message_naming_the_fix(kwargs, message):
    args = {"mask_id": MASK_ID, "vocab_size": VOCAB, **kwargs}
    with pytest.raises(ValueError, match=message):
        masking.mask_tokens(jax.random.key(0), np.full((2, 4), 9, np.int32), **args)


def test_fractions_that_do_not_sum_to_one_are_rejected():
    with pytest.raises(ValueError, match="sum to 0.9, not 1"):
        CorruptionPolicy(0.8, 0.1, 0.0)
    with pytest.raises(ValueError, match="outside"):
        CorruptionPolicy(1.2, -0.2, 0.0)


def test_a_random_pool_with_a_special_id_is_rejected():
    with pytest.raises(ValueError, match="special id"):
        masking.mask_tokens(
            jax.random.key(0), np.full((1, 4), 9, np.int32), selected=np.ones((1, 4), bool),
            mask_id=MASK_ID, vocab_size=VOCAB, random_ids=np.array([5, 6, 0]),
            special_ids=SPECIALS,
        )


# --------------------------------------------------------------------------- a rate ramp


def _ramp_masker(unit="token", rate_end=0.15, ramp_steps=10):
    from clozax.core.masker import make_masker
    from clozax.core.vocab import Vocabulary
    from clozax.train.config import MaskingConfig

    specials = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": MASK_ID}
    config = MaskingConfig(rate=0.4, rate_end=rate_end, ramp_steps=ramp_steps, unit=unit)
    return jax.jit(make_masker(config, Vocabulary(VOCAB, specials), 40)), config


def _ramp_batch():
    tokens = np.random.default_rng(0).integers(5, VOCAB, size=(6, 40)).astype(np.int32)
    tokens[:, 0], tokens[:, -1] = 2, 3  # 38 eligible tokens per row, plenty at every rate
    return {"tokens": tokens, "segments": np.ones_like(tokens),
            "word_starts": np.random.default_rng(1).random(tokens.shape) < 0.6}


def test_the_realised_masking_rate_follows_the_ramp_step_by_step():
    masker, config = _ramp_masker()
    batch, key = _ramp_batch(), jax.random.key(3)
    for step in (0, 3, 5, 9, 10, 50):
        masked, selection = masker(key, batch, step)
        rate = 0.4 + (0.15 - 0.4) * min(step / 10, 1.0)
        want = max(1, round(rate * 40))
        assert (np.asarray(selection.valid).sum(axis=1) == want).all(), step
        assert selection.valid.shape[1] == 16  # the slots of the ramp's highest rate, static
        # corruption reaches exactly the selected positions, never the unused slots
        assert (np.asarray(masked.selected).sum(axis=1) == want).all()
        assert (np.asarray(masked.inputs)[~np.asarray(masked.selected)]
                == batch["tokens"][~np.asarray(masked.selected)]).all()


def test_a_lower_rate_of_the_ramp_selects_a_subset_of_a_higher_ones_positions():
    masker, _ = _ramp_masker()
    batch, key = _ramp_batch(), jax.random.key(5)
    high = np.asarray(masker(key, batch, 0)[0].selected)
    low = np.asarray(masker(key, batch, 10)[0].selected)
    assert low.sum() < high.sum() and not (low & ~high).any()


def test_whole_word_selection_keeps_under_the_ramps_count():
    masker, _ = _ramp_masker(unit="word")
    batch, key = _ramp_batch(), jax.random.key(7)
    for step, want in ((0, 16), (10, 6)):
        valid = np.asarray(masker(key, batch, step)[1].valid).sum(axis=1)
        assert (valid <= want).all() and (valid >= want - 3).all(), (step, valid)


def test_the_held_out_masks_of_a_ramp_use_its_end_rate():
    masker, config = _ramp_masker()
    _, selection = masker(jax.random.key(0), _ramp_batch())  # no step: the frozen set's masker
    assert config.heldout_rate == 0.15
    assert selection.valid.shape[1] == 6 and np.asarray(selection.valid).all()


@pytest.mark.parametrize(("kw", "message"), [
    ({"rate_end": 0.7, "ramp_steps": 5}, "masking.rate_end=0.7 is outside"),
    ({"rate_end": 0.15, "ramp_steps": 0}, "masking.ramp_steps=0 must be >= 1"),
    ({"ramp_steps": 5}, "without masking.rate_end"),
])
def test_a_bad_ramp_is_refused_naming_the_key(kw, message):
    from clozax.train.config import MaskingConfig

    with pytest.raises(ValueError, match=message):
        MaskingConfig(rate=0.3, **kw)
