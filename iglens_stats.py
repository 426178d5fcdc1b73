"""Statistics for comparing scores with effects, the same on every machine.

Imports :mod:`iglens_core` (for its tie tolerance) and holds, in reading order:

1. ranks and top-k with ties: values within ``ig.tie_tolerance`` of each other tie, so no rank
   orders rounding (``tied_ranks``, ``top_indices``, ``top_positive``)
2. onset metrics: Spearman per row, top-1 agreement, the falsification test ``onset_beats_median``,
   non-monotone lens curves (notebooks 05, 06)
3. restoration curves: the layer where a patching or tracing restoration first reaches a level
   (``restoration_half``, ``restoration_last``), and the route scores of a (block, head, source) map
   and of a (node, position) state map against a trace grid (``source_route_scores``,
   ``state_map_scores``, notebook 09)
4. bootstrap intervals and the verdict tables the README quotes (``bootstrap_ci``, ``format_ci``,
   ``bootstrap_table``, ``onset_verdict``, ``verdict_table``; notebooks 05, 07, 09, 10), and of the areas
   of curves that are ratios of means over items (``curve_areas``, ``bootstrap_areas``,
   ``interval_text``; MIB's faithfulness, notebook 12)
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from iglens_core import tie_tolerance


def restoration_half(restoration, level: float = 0.5) -> np.ndarray:
    """(N,) first node ``L`` with ``r(L) >= level`` for each row of an (N, n+1) restoration array;
    ``n`` where no node reaches it (only by rounding: ``r(n) = 1``); -1 for an all-NaN row.

    ``r(L)`` within :func:`iglens_core.tie_tolerance` of ``level`` counts as reaching it, so
    rounding (``r``'s is the probabilities' divided by the gap ``p_clean - p'``) never moves
    the half layer across machines."""
    r = np.asarray(torch.as_tensor(restoration, dtype=torch.float64))
    if r.ndim != 2:
        raise ValueError(f"restoration must have shape (N, n+1), got {r.shape}")
    if not 0.0 < level <= 1.0:
        raise ValueError(f"level must be in (0, 1], got {level}")
    reached = r >= level - tie_tolerance(np.nan_to_num(r))  # within the rank tolerance: reached
    reached[:, -1] = True
    out = reached.argmax(-1)
    out[np.isnan(r).all(-1)] = -1
    return out


def _check_pair(scores, effects) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(torch.as_tensor(scores, dtype=torch.float64))
    effects = np.asarray(torch.as_tensor(effects, dtype=torch.float64))
    if scores.ndim != 2 or scores.shape != effects.shape:
        raise ValueError(f"scores and effects must both have shape (T, n), got {scores.shape} "
                         f"and {effects.shape}")
    return scores, effects


def tie_groups(descending, tolerance: float, limit: Optional[int] = None) -> np.ndarray:
    """Group ids of values sorted largest first: a group opens at its largest member and holds every
    later value within ``tolerance`` below it; the next value opens the next group.

    Unlike single linkage (neighbours closer than the tolerance join, so a dense run of distinct
    values chains into one group however wide), a group spans at most ``tolerance``: real
    differences are never tied away. Values that differ only by rounding (much less than the
    tolerance) fall in one group unless a group's edge lies within that rounding of one of them.

    Args:
        descending: (n,) float64 values, sorted largest first.
        tolerance: the width of a group, >= 0.
        limit: stop once this many values are grouped; the rest share the next group id.
    """
    ascending = -np.asarray(descending, dtype=np.float64)
    group = np.empty(len(ascending), dtype=np.int64)
    start = index = 0
    while start < len(ascending):
        stop = int(np.searchsorted(ascending, ascending[start] + tolerance, side="right"))
        group[start:stop] = index
        index, start = index + 1, stop
        if limit is not None and stop >= limit:
            group[stop:] = index
            break
    return group


def tied_ranks(values) -> np.ndarray:
    """(..., n) float64 ranks ``1..n`` along the last axis, values within tolerance tied.

    Sorted largest first, values are grouped by :func:`tie_groups` with :func:`tie_tolerance`
    (a group holds the values within the tolerance below its largest member, so no chain of small
    steps ties real differences); a group shares its members' average rank, as
    ``scipy.stats.rankdata`` does for exact ties (rank n the largest). A perturbation much smaller
    than the tolerance (the float path) changes no rank unless a value lies within it of a group's
    edge. NaN rows give NaN ranks.

    Args:
        values: (..., n) scores, e.g. (T, n) per-layer values of T tokens.
    """
    x = np.asarray(torch.as_tensor(values, dtype=torch.float64))
    tolerance = tie_tolerance(x)
    rows, tols = x.reshape(-1, x.shape[-1]), tolerance.reshape(-1)
    ranks = np.full(rows.shape, np.nan)
    for i, (row, tol) in enumerate(zip(rows, tols)):
        if np.isnan(row).any():
            continue
        order = np.argsort(-row, kind="stable")  # largest first
        group = tie_groups(row[order], tol)
        position = np.arange(len(row), 0.0, -1.0)  # the largest has rank n
        average = np.bincount(group, weights=position) / np.bincount(group)
        ranks[i, order] = average[group]
    return ranks.reshape(x.shape)


def top_indices(values, k: int = 1) -> np.ndarray:
    """(..., k) indices of the ``k`` largest values along the last axis, ties within tolerance
    broken by the lower index (the earlier layer); ``k = 1`` is the tolerant arg-max.

    Args:
        values: (..., n) scores; flatten a grid (e.g. (n, H) heads) to rank across it.
        k: 1..n.
    """
    ranks = tied_ranks(values)
    n = ranks.shape[-1]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in 1..{n}, got {k!r}")
    return np.argsort(-ranks, axis=-1, kind="stable")[..., :k]


def top_positive(values, k: int) -> np.ndarray:
    """Flat indices of up to ``k`` largest values of a score of any shape that lie above 0 by more
    than the tie tolerance, ordered as :func:`top_indices` orders them (largest first, ties: lower
    flat index, e.g. the earlier block).

    Parts whose score is tied with 0 (e.g. heads of early blocks whose share of Δp is 1e-9, a source
    position after the predicting one) are never picked: ranking them would order rounding, and the
    earliest-index tie break would fill a top-k set with block 1. Fewer than ``k`` come back where
    fewer are positive. For the largest magnitudes pass ``abs(values)``; for the most negative,
    ``-values``.

    Args:
        values: (...) scores (shares, |DLA|, (n, H, S) sources, ...), flattened in C order; use
            ``np.unravel_index(indices, values.shape)`` for the position of each.
        k: 1..values.size.
    """
    x = np.asarray(torch.as_tensor(values, dtype=torch.float64)).reshape(-1)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= len(x):
        raise ValueError(f"k must be an integer in 1..{len(x)}, got {k!r}")
    if np.isnan(x).any():
        raise ValueError(f"values must be without NaN, got {int(np.isnan(x).sum())} NaN of {len(x)}")
    return top_parts(np.maximum(x, 0.0), k)  # negatives join the parts tied with 0


def top_parts(shares, k: int) -> np.ndarray:
    """Flat indices of the ``k`` parts of largest ``|share|``, in order, never one tied with 0.

    The project's tie rule, as :func:`top_positive` of ``|shares|`` applies it: sorted largest
    first, values are grouped by :func:`tie_groups` with :func:`iglens_core.tie_tolerance` (a group
    spans at most the tolerance, so no chain of small steps ties real differences), a group's
    members go by the lower flat index, and a part whose ``|share|`` is within the tolerance of 0 is
    never picked (so fewer than ``k`` come back when fewer stand out from 0).

    Args:
        shares: (...,) one token's parts, e.g. (n, H, S) sources; flattened in C order.
        k: how many at most (>= 1).

    Returns:
        (<= k,) int64 flat indices into ``shares``.
    """
    size = np.abs(np.asarray(torch.as_tensor(shares, dtype=torch.float64)).reshape(-1))
    tolerance = tie_tolerance(size)[0]
    if k < len(size) and np.isfinite(size).all():  # only values within the tolerance below the k-th can be picked
        kth = np.partition(size, len(size) - k)[len(size) - k]
        candidates = np.flatnonzero(size >= kth - tolerance)  # ascending flat indices (a graph: 2 million nodes)
    else:
        candidates = np.arange(len(size))
    kept = size[candidates]
    order = np.argsort(-kept, kind="stable")  # largest first; stable: ties by the lower flat index
    group = tie_groups(kept[order], tolerance, limit=k)
    top = candidates[order[np.lexsort((order, group))][:k]]  # by group, then by index within a group
    return top[size[top] > tolerance]


def spearman_rows(scores, effects) -> np.ndarray:
    """(T,) Spearman rank correlation, per token, between a per-layer score and ablation effects.

    Ranks are :func:`tied_ranks`: values within the rank tolerance are ties, so the
    statistic does not order rounding (the level ``f(h_L)`` and the cumulative
    ``f(h_L) - f(h_0)`` give the same number), and ties take their average rank.

    Args:
        scores, effects: (T, n), e.g. IG-Lens values and :func:`ablation_effects`.

    Returns:
        (T,) float64 in [-1, 1]; NaN for a token whose scores or effects are all tied.
    """
    scores, effects = _check_pair(scores, effects)
    a, b = tied_ranks(scores), tied_ranks(effects)
    out = np.full(len(scores), np.nan)
    for t, (x, y) in enumerate(zip(a, b)):
        if np.ptp(x) > 0 and np.ptp(y) > 0:
            x, y = x - x.mean(), y - y.mean()
            out[t] = float(x @ y / np.sqrt((x @ x) * (y @ y)))
    return out


def top1_agreement(scores, effects) -> np.ndarray:
    """(T,) 1.0 where the top-scored layer is among the layers whose ablation hurts most, else 0.0.

    The top-scored layer is :func:`top_indices` (ties within the rank tolerance go to
    the earlier layer); "hurts most" is the top group of :func:`tied_ranks` of the
    effects (every layer tied with the largest effect)."""
    scores, effects = _check_pair(scores, effects)
    named = top_indices(scores)                      # (T, 1)
    ranks = tied_ranks(effects)
    return (np.take_along_axis(ranks, named, -1)[:, 0] == ranks.max(-1)).astype(float)


def onset_beats_median(scores, effects, named: Optional[Sequence[int]] = None) -> np.ndarray:
    """(T,) the falsification test: does ablating the named layer hurt more than is typical below it?

    For each token the method names a layer (its top-scored layer, or ``named``); the test
    passes (1.0) when that layer's ablation effect exceeds the median effect of the layers the
    method scores lower, and fails (0.0) otherwise; NaN where no layer scores lower. "Lower" and
    "exceeds" are taken with the rank tolerance (:func:`tied_ranks`,
    :func:`iglens_core.tie_tolerance`): a layer tied with the named one is not lower, and an
    effect within tolerance of the median does not exceed it.

    Args:
        scores, effects: (T, n).
        named: (T,) indices (0-based, into the n layers) of the named layer; default the
            tolerant arg-max :func:`top_indices`.
    """
    scores, effects = _check_pair(scores, effects)
    named = top_indices(scores)[:, 0] if named is None else np.asarray(named, dtype=int)
    if named.shape != (len(scores),) or named.min(initial=0) < 0 or named.max(initial=0) >= scores.shape[1]:
        raise ValueError(f"named must hold {len(scores)} layer indices in 0..{scores.shape[1] - 1}")
    ranks, tolerance = tied_ranks(scores), tie_tolerance(effects)[:, 0]
    out = np.full(len(scores), np.nan)
    for t, j in enumerate(named):
        lower = ranks[t] < ranks[t, j]
        if lower.any():
            out[t] = float(effects[t, j] > np.median(effects[t, lower]) + tolerance[t])
    return out


def rank_agreement(score, effect, named: Optional[int] = None) -> dict:
    """One item's layer scores (n,) against its ablation effects (n,), as notebook 05 tabulates them:
    ``named_block`` (the block the method names, 1-based: ``named`` or its tolerant arg-max),
    ``most_harmful`` (the tolerant arg-max of the effects, 1-based), ``beats_median``
    (:func:`onset_beats_median`), ``spearman`` (:func:`spearman_rows`), ``top1`` (:func:`top1_agreement`)."""
    s, e = np.asarray(score)[None], np.asarray(effect)[None]
    return dict(named_block=(named if named is not None else int(top_indices(score)[0])) + 1,
                most_harmful=int(top_indices(effect)[0]) + 1,
                beats_median=onset_beats_median(s, e, None if named is None else [named])[0],
                spearman=spearman_rows(s, e)[0], top1=top1_agreement(s, e)[0])



def non_monotone(lens, drop: float = 0.05) -> np.ndarray:
    """(T,) True where the logit-lens trajectory falls by more than ``drop`` below its running maximum.

    Args:
        lens: (T, n+1) target probability at the path nodes (``Attribution.lens``).
        drop: probability; a trajectory that never falls more than this is called monotone.
    """
    lens = np.asarray(torch.as_tensor(lens, dtype=torch.float64))
    if lens.ndim != 2:
        raise ValueError(f"lens must have shape (T, n+1), got {lens.shape}")
    if not 0.0 <= drop < 1.0:
        raise ValueError(f"drop must be a probability in [0, 1), got {drop}")
    return (np.maximum.accumulate(lens, -1) - lens).max(-1) > drop


def bootstrap_ci(values, *, statistic: Callable = np.nanmean, n_boot: int = 2000,
                 level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Percentile bootstrap of a statistic over items (resampled with replacement, seeded).

    Args:
        values: (N,) one number per item (NaN entries are ignored by the default ``np.nanmean``).
        statistic: maps an (N,) sample (or (n_boot, N) with ``axis=-1``) to a number.

    Returns:
        ``(estimate, low, high)``; all NaN for an empty input.
    """
    values = np.asarray(values, dtype=float)
    if values.ndim != 1:
        raise ValueError(f"values must be one-dimensional, got shape {values.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be an integer >= 1, got {n_boot!r}")
    if np.isnan(values).all():
        return (math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    samples = values[rng.integers(0, len(values), size=(n_boot, len(values)))]
    with warnings.catch_warnings():  # a resample of only NaNs gives NaN, quietly
        warnings.simplefilter("ignore", RuntimeWarning)
        boot = statistic(samples, axis=-1)
    low, high = np.nanquantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(statistic(values)), float(low), float(high)


def format_ci(values, *, n_boot: int = 2000, seed: int = 0, digits: int = 2, signed: bool = False) -> str:
    """``"mean [low, high]"``: :func:`bootstrap_ci` of ``values`` as text (``signed``: ``+0.12``)."""
    spec = f"{'+' if signed else ''}.{digits}f"
    est, low, high = bootstrap_ci(np.asarray(values, dtype=float), n_boot=n_boot, seed=seed)
    return f"{est:{spec}} [{low:{spec}}, {high:{spec}}]"


def bootstrap_table(frame, by: Sequence[str], metrics: Sequence[str], *, order: Optional[dict] = None,
                    n_boot: int = 2000, seed: int = 0, digits: int = 2):
    """One row per group of ``frame``: the group's keys, ``items`` (its rows) and, per metric, the
    mean over its rows with a percentile-bootstrap 95% interval (:func:`format_ci`).

    Args:
        frame: one row per item (and method, mode, ...).
        by: the grouping columns.
        metrics: the columns to summarise (NaN entries are left out of a mean).
        order: for some ``by`` columns, the order of their values (e.g. the methods); the other
            columns keep the order in which their values first appear.

    Returns:
        A DataFrame, groups in that order.
    """
    import pandas as pd
    by, order = list(by), dict(order or {})

    def rank(column):
        levels = order.get(column.name)
        levels = pd.unique(column) if levels is None else levels
        return column.map({value: i for i, value in enumerate(levels)})

    frame = frame.sort_values(by, key=rank, kind="stable")
    rows = []
    for key, group in frame.groupby(by, sort=False):
        row = dict(zip(by, key if isinstance(key, tuple) else (key,)), items=len(group))
        for metric in metrics:
            row[metric] = format_ci(group[metric].to_numpy(), n_boot=n_boot, seed=seed, digits=digits)
        rows.append(row)
    return pd.DataFrame(rows)


def onset_verdict(per_item, mode: str, *, method: str, control: str, random_method: str, n_blocks: int,
                  n_boot: int = 2000, seed: int = 0) -> str:
    """Notebook 05's verdict in words for one ablation mode: the onset test's rate for ``method``
    against a random ranking and against ``control`` (paired over the same items), and how strongly
    its per-block ranking agrees with the ablation effects.

    Args:
        per_item: one row per (item, method, mode) with ``beats_median``, ``spearman`` and ``top1``.
    """
    def rows(name):
        return per_item[(per_item.method == name) & (per_item["mode"] == mode)]

    ours, ctrl = rows(method), rows(control)
    rate = bootstrap_ci(ours.beats_median.to_numpy(), n_boot=n_boot, seed=seed)
    rand = bootstrap_ci(rows(random_method).beats_median.to_numpy(), n_boot=n_boot, seed=seed)
    diff = bootstrap_ci(ours.beats_median.to_numpy() - ctrl.beats_median.to_numpy(), n_boot=n_boot, seed=seed)
    rho = bootstrap_ci(ours.spearman.to_numpy(), n_boot=n_boot, seed=seed)
    paired = (f"({ctrl.beats_median.mean():.0%}; paired difference "
              f"{diff[0]:+.2f} [{diff[1]:+.2f}, {diff[2]:+.2f}])")
    text = (f"{mode} ablation: the IG-Lens onset beats the median lower-scored block for {rate[0]:.0%} of "
            f"{len(ours)} items [{rate[1]:.0%}, {rate[2]:.0%}]; "
            + ("well above a random ranking" if rate[1] > rand[2] else "not clearly above a random ranking")
            + f" ({rand[0]:.0%}), ")
    if diff[1] > 0:
        text += f"and above the always-the-last-block control {paired}"
    elif diff[2] < 0:
        text += f"but below the always-the-last-block control {paired}"
    else:
        text += (f"but not distinguishable from the always-the-last-block control {paired}: late blocks "
                 "matter more than the median earlier one whichever method names them")
    strength = "weakly" if abs(rho[0]) < 0.3 else "moderately" if abs(rho[0]) < 0.6 else "strongly"
    return (text + f". Over all {n_blocks} blocks the two rankings agree {strength} (Spearman {rho[0]:.2f} "
            f"[{rho[1]:.2f}, {rho[2]:.2f}]), and the top-scored block is the most harmful one to remove for "
            f"{ours.top1.mean():.0%} of items.")


def verdict_table(per_item, per_patch, methods: Sequence[str], modes: Sequence[str], *, n_boot: int = 2000,
                  seed: int = 0):
    """Notebook 05's two-reference verdict: per method, the ablation rows (beats median, Spearman per
    mode) and the patching rows (distance, within 2, Spearman over nodes and blocks), each as
    "mean [95% bootstrap interval]" (:func:`format_ci`). Returns a frame with one row per method."""
    import pandas as pd
    rows = []
    for method in methods:
        row = dict(method=method)
        for mode in modes:
            sel = per_item[(per_item.method == method) & (per_item["mode"] == mode)]
            row[f"{mode}: beats median"] = format_ci(sel.beats_median, n_boot=n_boot, seed=seed)
            row[f"{mode}: Spearman"] = format_ci(sel.spearman, n_boot=n_boot, seed=seed)
        sel = per_patch[per_patch.method == method]
        for column, metric in (("patch: |named-half|", "distance"), ("patch: within 2", "within2"),
                               ("patch: Spearman nodes", "spearman_curve"), ("patch: Spearman blocks", "spearman_steps")):
            row[column] = format_ci(sel[metric], n_boot=n_boot, seed=seed)
        rows.append(row)
    return pd.DataFrame(rows)


def restoration_last(restoration, level: float = 0.5) -> np.ndarray:
    """(N,) last node ``L`` with ``r(L) >= level`` in each row of an (N, nodes) restoration array,
    -1 where none does; ``r`` within :func:`iglens_core.tie_tolerance` of ``level`` counts, as in
    :func:`restoration_half`. At the last subject token the restoration is high at early nodes and
    falls once attention has moved what it holds: this is the node where it falls below ``level``."""
    r = np.asarray(torch.as_tensor(restoration, dtype=torch.float64))
    if r.ndim != 2:
        raise ValueError(f"restoration must have shape (N, nodes), got {r.shape}")
    if not 0.0 < level <= 1.0:
        raise ValueError(f"level must be in (0, 1], got {level}")
    reached = r >= level - tie_tolerance(np.nan_to_num(r))
    last = r.shape[1] - 1 - reached[:, ::-1].argmax(-1)
    return np.where(reached.any(-1), last, -1)


SOURCE_METRICS = ("top_from_subject", "top_from_any_subject", "top_from_last", "names_subject_block", "distance",
                  "within2", "spearman_positions", "spearman_grid")


def _subject_set(subject: int, subject_positions, S: int) -> set:
    positions = {subject} if subject_positions is None else {int(position) for position in subject_positions}
    if not positions or any(not 0 <= s < S - 1 for s in positions) or subject not in positions:
        raise ValueError(f"subject_positions must be positions in 0..{S - 2} that include subject={subject}, "
                         f"got {sorted(positions)}")
    return positions


def source_route_scores(parts, restoration, subject: int, *, level: float = 0.5,
                        subject_positions: Optional[Sequence[int]] = None) -> dict:
    """One item: a (block, head, source) map of the focus token against its causal trace grid.

    - the top route: the (block, head, source) part with the largest value (:func:`top_positive`;
      ties to the earlier block, parts tied with zero never); ``top_from_subject`` /
      ``top_from_last``: 1.0 when its source is the last subject token / the predicting position;
      ``top_from_any_subject``: when it is any of ``subject_positions`` (every token of the subject's
      mentions; a multi-token name is often read at its first token);
    - ``subject_block`` (1..n): the block of the top part read from the last subject token, against
      ``trace_block``: 1 + the last node at which restoring that token alone recovers ``level`` of
      the probability (:func:`restoration_last`; block L + 1 reads node L, so a route from the subject
      at block B agrees when B is that block); ``distance`` = ``|subject_block - trace_block|`` and
      ``within2``; NaN where either is missing (``names_subject_block`` says whether the map names one);
    - ``spearman_positions``: Spearman with ties (:func:`spearman_rows`) over the S positions between
      the map's per-position total and the strongest restoration at that position (max over nodes
      0..n-1); ``spearman_grid``: over the n x S cells, block L against node L - 1.

    Args:
        parts: (n, H, S) the method's scores, S the positions up to the predicting one (the last).
        restoration: (S, n+1) :attr:`CausalTrace.restoration` of the same sequence.
        subject: position of the last subject token, 0..S-2.
        subject_positions: every subject token's position (default: ``subject`` alone).

    Returns:
        A dict of floats: ``top_block``, ``top_head``, ``top_source``, ``subject_block``,
        ``trace_block`` and the :data:`SOURCE_METRICS`.
    """
    if not isinstance(parts, (torch.Tensor, np.ndarray, list, tuple)):
        hint = ": pass one token's sources, e.g. parts.sources[t, ..., :S]" if hasattr(parts, "sources") else ""
        raise ValueError(f"parts must be an (n, H, S) tensor or array of scores, got {type(parts).__name__}{hint}")
    parts = np.asarray(torch.as_tensor(parts, dtype=torch.float64))
    r = np.asarray(torch.as_tensor(restoration, dtype=torch.float64))
    if parts.ndim != 3 or r.shape != (parts.shape[2], parts.shape[0] + 1):
        raise ValueError(f"parts must be (n, H, S) and restoration (S, n+1), got {parts.shape} and {r.shape}")
    n, _, S = parts.shape
    if isinstance(subject, bool) or not isinstance(subject, (int, np.integer)) or not 0 <= subject < S - 1:
        raise ValueError(f"subject must be a position in 0..{S - 2} (before the predicting one), got {subject!r}")
    anywhere = _subject_set(subject, subject_positions, S)
    nan = math.nan
    top = top_positive(parts, 1)
    block, head, source = (np.unravel_index(int(top[0]), parts.shape) if len(top) else (nan, nan, nan))
    from_subject = top_positive(parts[:, :, subject], 1)
    subject_block = float(from_subject[0] // parts.shape[1] + 1) if len(from_subject) else nan
    last = int(restoration_last(r[subject:subject + 1, :n], level)[0])
    trace_block = float(last + 1) if last >= 0 else nan
    distance = abs(subject_block - trace_block)
    per_position = np.stack([parts.sum((0, 1)), r[:, :n].max(1)])
    grid = np.stack([parts.sum(1).ravel(), r[:, :n].T.ravel()])
    return dict(top_block=float(block) + 1, top_head=float(head), top_source=float(source),
                top_from_subject=float(source == subject) if len(top) else nan,
                top_from_any_subject=float(source in anywhere) if len(top) else nan,
                top_from_last=float(source == S - 1) if len(top) else nan,
                names_subject_block=float(len(from_subject) > 0), subject_block=subject_block,
                trace_block=trace_block, distance=distance, within2=float(distance <= 2) if distance == distance else nan,
                spearman_positions=float(spearman_rows(per_position[:1], per_position[1:])[0]),
                spearman_grid=float(spearman_rows(grid[:1], grid[1:])[0]))


STATE_METRICS = ("top_from_subject", "top_from_any_subject", "subject_peak", "any_subject_peak", "distance", "within2",
                 "spearman_positions", "spearman_grid")


def state_map_scores(state_map, restoration, subject: int, *, level: float = 0.5,
                     subject_positions: Optional[Sequence[int]] = None) -> dict:
    """One item: a (node, position) map of the residual states against the causal trace grid, cell for
    cell (node ``L`` = the output of block ``L``, node 0 the embedding output, as the trace restores).

    Maps of this form: the attribution graph's ``carried`` (the share of Δp that ``h_L(s)`` carries
    into later blocks, divided by Δp), attribution patching per state (:func:`iglens_causal.atp_states`,
    the trace's first-order estimate), a random map. Over nodes ``0..n-1`` (node n holds the
    predicting position only) and positions ``0..S-2`` (before the predicting one):

    - ``top_from_subject`` / ``top_from_any_subject``: the largest cell (:func:`top_positive`) is at
      the last subject token / at any subject token; NaN where no cell stands out from 0;
    - ``subject_peak`` / ``any_subject_peak``: the largest value of the last subject token's column
      / of the subject tokens' summed column over the nodes (for ``carried``: its share of Δp);
    - ``map_block``: 1 + the last node at which the last subject token still holds ``level`` of its
      own peak (the map's units differ from the trace's, so each map is read against its own
      peak), against ``trace_block`` = 1 + the last node at which restoring it alone recovers
      ``level`` (:func:`restoration_last`); ``distance`` and ``within2`` (NaN where either is missing);
    - ``spearman_positions``: Spearman with ties over positions of the largest value per position
      against the largest restoration; ``spearman_grid``: over the n x (S - 1) cells.

    Args:
        state_map: (n+1, S) the map, S the positions up to the predicting one (the last).
        restoration: (S, n+1) :attr:`CausalTrace.restoration` of the same sequence.
        subject: position of the last subject token, 0..S-2; subject_positions: every subject
            token's position (default ``subject`` alone).
    """
    values = np.asarray(torch.as_tensor(state_map, dtype=torch.float64))
    r = np.asarray(torch.as_tensor(restoration, dtype=torch.float64))
    if values.ndim != 2 or r.shape != values.T.shape or values.shape[0] < 2 or values.shape[1] < 2:
        raise ValueError(f"state_map must be (n+1, S) and restoration (S, n+1), got {values.shape} and {r.shape}")
    if not np.isfinite(values).all():
        raise ValueError(f"state_map must be finite, got {int((~np.isfinite(values)).sum())} NaN or inf entries")
    nodes, S = values.shape
    n = nodes - 1
    if isinstance(subject, bool) or not isinstance(subject, (int, np.integer)) or not 0 <= subject < S - 1:
        raise ValueError(f"subject must be a position in 0..{S - 2} (before the predicting one), got {subject!r}")
    anywhere = sorted(_subject_set(subject, subject_positions, S))
    nan = math.nan
    grid = values[:n, :S - 1]  # (n, S-1)
    top = top_positive(grid, 1)
    source = int(np.unravel_index(int(top[0]), grid.shape)[1]) if len(top) else None
    column = values[:n, subject]
    peak = float(column.max())
    reached = column >= level * peak - tie_tolerance(column)[0] if peak > tie_tolerance(column)[0] else None
    map_block = float(n - reached[::-1].argmax()) if reached is not None else nan
    last = int(restoration_last(r[subject:subject + 1, :n], level)[0])
    trace_block = float(last + 1) if last >= 0 else nan
    distance = abs(map_block - trace_block)
    per_position = np.stack([grid.max(0), r[:S - 1, :n].max(1)])
    cells = np.stack([grid.ravel(), r[:S - 1, :n].T.ravel()])
    return dict(top_source=float(source) if source is not None else nan,
                top_from_subject=float(source == subject) if source is not None else nan,
                top_from_any_subject=float(source in anywhere) if source is not None else nan,
                subject_peak=peak, any_subject_peak=float(values[:n, anywhere].sum(1).max()),
                map_block=map_block, trace_block=trace_block, distance=distance,
                within2=float(distance <= 2) if distance == distance else nan,
                spearman_positions=float(spearman_rows(per_position[:1], per_position[1:])[0]),
                spearman_grid=float(spearman_rows(cells[:1], cells[1:])[0]))


PATCHING_METRICS = ("patching_spearman", "patching_half_distance", "patching_within2")


def patching_curve_scores(state_map, restoration, *, level: float = 0.5) -> dict:
    """One item: a (node, position) map's column at the predicting position against activation patching's
    restoration curve there, node for node (notebook 05's question, asked of a state map).

    Restoring ``h_L`` at the predicting position in the corrupted run is both activation patching's node
    ``L`` (:func:`iglens_causal.activation_patching`) and the trace's cell (last position, ``L``), so the
    curve is the trace grid's last row. Over nodes ``0..n-1`` (node ``n`` restores the final state, 1 by
    construction): ``patching_spearman``, Spearman with ties of the map's column against the curve;
    ``patching_half_distance``, |the first node where the map's column reaches ``level`` - the first
    node where the curve does| (:func:`restoration_half`; the map read in the trace's units, a share of
    the difference), and ``patching_within2`` (distance <= 2).

    Args:
        state_map: (n+1, S) the map, the predicting position last; restoration: (S, n+1) the trace grid.
    """
    values = np.asarray(torch.as_tensor(state_map, dtype=torch.float64))
    r = np.asarray(torch.as_tensor(restoration, dtype=torch.float64))
    if values.ndim != 2 or r.shape != values.T.shape or values.shape[0] < 3:
        raise ValueError(f"state_map must be (n+1, S) with n >= 2 and restoration (S, n+1), got {values.shape} and {r.shape}")
    column, curve = values[:, -1], r[-1]  # (n+1,) each
    n = len(column) - 1
    distance = float(abs(int(restoration_half(column[None], level)[0]) - int(restoration_half(curve[None], level)[0])))
    return dict(patching_spearman=float(spearman_rows(column[None, :n], curve[None, :n])[0]),
                patching_half_distance=distance, patching_within2=float(distance <= 2))


def curve_areas(x, f) -> tuple[np.ndarray, np.ndarray]:
    """``(area under f, area under |1 - f|)`` by trapezoids on ``x`` (K,), along the last axis of ``f``
    (..., K) (MIB's CPR and CMD integrals)."""
    x, f = np.asarray(x, dtype=float), np.asarray(f, dtype=float)
    if x.ndim != 1 or f.shape[-1:] != x.shape:
        raise ValueError(f"f must end in x's length: x {x.shape}, f {f.shape}")
    width = np.diff(x)
    return (((f[..., 1:] + f[..., :-1]) / 2 * width).sum(-1),
            ((np.abs(1 - f[..., 1:]) + np.abs(1 - f[..., :-1])) / 2 * width).sum(-1))


def bootstrap_areas(curves, m_full, m_empty, x, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """The areas of curves whose points are ratios of means over the same N items, with resamples.

    Point k of a curve is f_k = (mean m_k - mean m_empty) / (mean m_full - mean m_empty) (MIB's
    faithfulness: means over the items, then the ratio), areas by :func:`curve_areas` on ``x``.

    Args:
        curves: ``{key: (K, N)}`` per item, the metric at each of the K points ``x``.
        m_full, m_empty: (N,) per item, the metric of the full model and of the empty circuit.

    Returns:
        ``{key: (1 + n_boot, 2)}``: row 0 (area under f, area under |1 - f|) on the N items, then on each
        of ``n_boot`` resamples of the items (with replacement, seeded), the same resamples for every key,
        so that a difference of two keys' rows is a paired bootstrap of the difference.
    """
    m_full, m_empty = np.asarray(m_full, dtype=float), np.asarray(m_empty, dtype=float)
    if m_full.ndim != 1 or m_full.shape != m_empty.shape or not len(m_full):
        raise ValueError(f"m_full and m_empty must be (N,) with N >= 1, got {m_full.shape} and {m_empty.shape}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be an integer >= 1, got {n_boot!r}")
    n = len(m_full)
    rows = np.vstack([np.arange(n), np.random.default_rng(seed).integers(0, n, size=(n_boot, n))])
    empty = m_empty[rows].mean(-1)
    span = m_full[rows].mean(-1) - empty  # (1 + n_boot,)
    out = {}
    for key, values in curves.items():
        values = np.asarray(values, dtype=float)
        if values.shape != (len(x), n):
            raise ValueError(f"curve {key!r} must be ({len(x)}, {n}) (points, items), got {values.shape}")
        f = (values[:, rows].mean(-1) - empty) / span  # (K, 1 + n_boot)
        out[key] = np.stack(curve_areas(x, f.T), -1)
    return out


def interval_text(samples, *, digits: int = 2, signed: bool = False, level: float = 0.95) -> str:
    """``"estimate [low, high]"`` of a column of :func:`bootstrap_areas` (row 0 the estimate, the rest
    resamples: their percentile interval at ``level``)."""
    samples = np.asarray(samples, dtype=float)
    if samples.ndim != 1 or len(samples) < 2:
        raise ValueError(f"samples must be (1 + n_boot,) with n_boot >= 1, got shape {samples.shape}")
    low, high = np.quantile(samples[1:], [(1 - level) / 2, (1 + level) / 2])
    spec = f"{'+' if signed else ''}.{digits}f"
    return f"{samples[0]:{spec}} [{low:{spec}}, {high:{spec}}]"
