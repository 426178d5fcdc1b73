"""Rank statistics that do not rank rounding: tied_ranks, top_indices and every metric built on them."""
import numpy as np
import pytest
import torch
from scipy.stats import rankdata, spearmanr

import iglens_stats as igs
import iglens_core as ig
import iglens_data as igd
from conftest import tiny_model


def _separated(rng, shape):
    """Random rows (values in 0..1.1) whose sorted neighbours are >= 0.01 apart, far above the tolerance."""
    rows = np.cumsum(rng.uniform(0.01, 0.1, size=shape), -1)
    return rng.permuted(rows, axis=-1)


def _noisy(values, rng, relative=1e-9):
    return values * (1 + relative * rng.standard_normal(values.shape))


def test_tied_ranks_equal_scipy_when_separated_and_tie_within_tolerance():
    rng = np.random.default_rng(0)
    x = _separated(rng, (6, 11))
    assert (igs.tied_ranks(x) == rankdata(x, axis=-1)).all()
    # values closer than the tolerance share their average rank, as scipy does for exact ties
    flat = np.array([[1e-9, 3e-7, 2e-6, 0.4, 0.9, 5e-8]])   # a curve flat near 0, then rising
    want = rankdata(np.where(flat < 1e-5, 0.0, flat), axis=-1)
    assert (igs.tied_ranks(flat) == want).all()
    assert np.isnan(igs.tied_ranks(np.array([[0.1, np.nan, 0.2]]))).all()
    tol = ig.tie_tolerance(flat)
    assert tol.shape == (1, 1) and tol[0, 0] == pytest.approx(ig.RANK_ATOL + ig.RANK_RTOL * np.ptp(flat))


def test_noise_and_shift_change_no_rank_top_k_onset_or_half():
    rng = np.random.default_rng(1)
    for _ in range(20):
        # realistic rows: a flat stretch of float noise near 0, then distinct steps
        flat = rng.uniform(1e-9, 1e-6, size=(4, 8))
        rising = np.cumsum(rng.uniform(0.01, 0.1, size=(4, 8)), -1)
        x = np.concatenate([flat, rising], -1)
        noisy, shifted = _noisy(x, rng), x + rng.uniform(-1, 1)
        assert (igs.tied_ranks(noisy) == igs.tied_ranks(x)).all()
        assert (igs.tied_ranks(shifted) == igs.tied_ranks(x)).all()
        assert (igs.top_indices(noisy, 5) == igs.top_indices(x, 5)).all()
        assert (igs.tied_ranks(x)[:, :8] == 4.5).all()   # the flat stretch is one tie
        effects = rng.normal(size=x.shape)
        assert (igs.spearman_rows(noisy, effects) == igs.spearman_rows(x, effects)).all()
        assert (igs.top1_agreement(noisy, effects) == igs.top1_agreement(x, effects)).all()
        np.testing.assert_array_equal(igs.onset_beats_median(noisy, effects), igs.onset_beats_median(x, effects))
        restoration = x / x[:, -1:]
        assert (igs.restoration_half(_noisy(restoration, rng)) == igs.restoration_half(restoration)).all()
        a = ig.Attribution(torch.from_numpy(np.diff(x, prepend=0.0, axis=-1)), list(range(1, 17)),
                           [f"L{j}" for j in range(1, 17)], torch.zeros(4), torch.from_numpy(x[:, -1]),
                           torch.zeros(4, 17), 0.0, torch.zeros(4), torch.zeros(4), "prediction_aware", 1, "zero")
        b = ig.Attribution(**{**a.__dict__, "values": torch.from_numpy(_noisy(a.values.numpy(), rng))})
        assert (a.onset() == b.onset()).all()


def test_spearman_rows_is_scipy_spearman_on_separated_rows():
    rng = np.random.default_rng(2)
    x, y = _separated(rng, (5, 9)), _separated(rng, (5, 9))
    got = igs.spearman_rows(x, y)
    assert got == pytest.approx([spearmanr(a, b).statistic for a, b in zip(x, y)], abs=1e-12)


def test_top_indices_is_argsort_when_separated_and_earliest_on_ties():
    rng = np.random.default_rng(3)
    x = _separated(rng, (3, 30))
    assert (igs.top_indices(x, 4) == np.argsort(-x, -1)[:, :4]).all()
    assert igs.top_indices(np.array([0.2, 0.7, 0.7 + 1e-7, 0.1]), 1).tolist() == [1]
    with pytest.raises(ValueError, match="k must be"):
        igs.top_indices(x, 31)


def _cumulative_vs_level(model, trace):
    """(T, n+1) IG-Lens prediction-aware cumulative curve [0, cumsum] and the logit-lens level."""
    a = ig.ig_lens(model, trace)
    curve = torch.cat([torch.zeros(len(a.values), 1, dtype=torch.float64), a.values.double().cumsum(-1)], -1)
    return curve.numpy(), a.lens.double().numpy()


def _assert_same_spearman(curve, level, rng):
    assert (igs.tied_ranks(curve) == igs.tied_ranks(level)).all()
    for _ in range(3):
        effects = rng.normal(size=curve.shape)
        np.testing.assert_array_equal(igs.spearman_rows(curve, effects), igs.spearman_rows(level, effects))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_cumulative_and_level_give_the_same_spearman_tiny(arch):
    rng = np.random.default_rng(4)
    for seed in range(3):
        model = tiny_model(arch, seed=seed)
        ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(seed))
        _assert_same_spearman(*_cumulative_vs_level(model, ig.collect(model, ids, 3)), rng)


def test_cumulative_and_level_give_the_same_spearman_packaged(packaged):
    model, tokenizer = packaged
    rng = np.random.default_rng(5)
    pairs = [("What is the capital of Vietnam?", "The capital of Vietnam is Hanoi."),
             ("Name a primary colour.", "Red is a primary colour."),
             ("Who wrote Hamlet?", "Hamlet was written by William Shakespeare."),
             ("What is 2 + 2?", "2 + 2 = 4.")]
    generator = torch.Generator().manual_seed(5)
    for prompt, answer in pairs:
        ids, prompt_len = igd.encode(tokenizer, prompt, answer)
        # then random tokens: targets of probability 1e-17..1e-6 whose level curves are flat
        # within rounding, where exact ranks of the two curves differ (10 of 29 tokens measured)
        ids = torch.cat([ids, torch.randint(0, len(tokenizer), (1, 8), generator=generator)], 1)
        _assert_same_spearman(*_cumulative_vs_level(model, ig.collect(model, ids, prompt_len)), rng)


def test_top_positive_skips_parts_tied_with_zero():
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = np.zeros(40)
        live = rng.choice(40, size=rng.integers(1, 8), replace=False)
        x[live] = rng.uniform(0.05, 1.0, size=len(live))
        noisy = x + rng.normal(0, 1e-9, size=40)          # zeros become +-1e-9: rounding, not signal
        for k in (1, 5, 10):
            top = igs.top_positive(noisy, k)
            expected = np.argsort(-x, kind="stable")[:min(k, len(live))]
            assert sorted(top.tolist()) == sorted(expected.tolist())
            assert (noisy[top] > 1e-5).all()
    with pytest.raises(ValueError, match="k must be"):
        igs.top_positive(np.zeros((2, 3)), 7)
    with pytest.raises(ValueError, match="without NaN"):
        igs.top_positive(np.array([1.0, np.nan]), 1)


def test_no_chain_ties_real_differences():
    """A dense run of distinct values (steps below the tolerance, total far above it) is not one tie:
    every group spans at most the tolerance, so the ranks follow the values but for steps below it."""
    rng = np.random.default_rng(7)
    values = np.sort(rng.standard_cauchy(20_000))  # heavy tails: dense in the middle
    ranks = igs.tied_ranks(values)
    tol = float(ig.tie_tolerance(values)[0])
    # values further apart than the tolerance never share a rank and keep their order
    order = np.argsort(values)
    far = np.diff(values[order]) > tol
    assert (np.diff(ranks[order])[far] > 0).all()
    # any two values in one group differ by at most the tolerance
    for rank in np.unique(ranks)[:2000]:
        members = values[ranks == rank]
        assert np.ptp(members) <= tol
    # a top-k set: a part above the tolerance is picked before parts a whole chain below it
    step = 0.6 * float(ig.tie_tolerance(np.array([0.0, 1.0]))[0])
    chain = 1.0 - step * np.arange(100)  # steps of 0.6 tol: single linkage ties all 100
    shares = np.concatenate([np.zeros(5), chain[::-1]])  # the largest last: single linkage picked 5, 6, 7
    picked = igs.top_parts(shares, 3)
    assert picked[0] in (103, 104) and (shares[picked] >= 1.0 - 4 * step).all()


def test_tie_groups_against_a_plain_loop():
    rng = np.random.default_rng(3)
    for _ in range(50):
        values = np.sort(rng.normal(size=rng.integers(1, 60)).round(rng.integers(1, 3)))[::-1]
        tol = float(rng.uniform(0, 0.5))
        groups, anchor, expected = igs.tie_groups(values, tol), None, []
        for v in values:
            if anchor is None or v < anchor - tol:
                anchor = v
                expected.append(len(set(expected)))
            else:
                expected.append(expected[-1])
        assert list(groups) == expected
        limited = igs.tie_groups(values, tol, limit=3)
        cut = min(len(values), np.searchsorted(np.asarray(expected), expected[min(2, len(values) - 1)], side="right"))
        assert list(limited[:cut]) == expected[:cut]


def test_rank_agreement_reads_blocks_and_metrics_off_a_case_written_by_hand():
    """Scores peak at block 3 (index 2), effects at block 5; the named block 3's effect (0.9) beats the
    median of the blocks scored lower (0.1, 0.2, 0.3, ... ); with ``named`` the named block moves."""
    score = np.array([0.1, 0.2, 0.9, 0.3, 0.4])
    effect = np.array([0.1, 0.2, 0.9, 0.3, 1.5])
    out = igs.rank_agreement(score, effect)
    assert out["named_block"] == 3 and out["most_harmful"] == 5
    assert out["beats_median"] == 1.0  # 0.9 > median(0.1, 0.2, 0.3, 0.4)
    assert out["top1"] == 0.0
    assert out["spearman"] == pytest.approx(0.9)  # ranks 1 2 5 3 4 vs 1 2 4 3 5
    named = igs.rank_agreement(score, effect, named=0)  # block 1: nothing scores lower
    assert named["named_block"] == 1 and np.isnan(named["beats_median"])
