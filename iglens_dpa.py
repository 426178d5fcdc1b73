"""Dual Path Attribution's ablation benchmark (notebook 10), and every method's scores on it.

A peer's benchmark (DPA, arXiv 2603.19742, lab-paper-code/dual_path_attribution,
experiments/ablation/ablation_pipe.py): every attention edge (block, head, query, key) and every
MLP neuron (block, position, neuron) of one item, ranked together by a method's score; zero the top
fraction x ("disrupt") or all but it ("recover") and read the target's probability at the last
position. One machinery serves the ablation and the gradient methods: multiplicative gates on the
post-softmax attention weights and on the down projection's input (1 = as the model computes it,
0 = zeroed; d p / d gate = activation x gradient; gates in between scale a component).

Imports :mod:`iglens_core`, :mod:`iglens_baselines`, :mod:`iglens_graph` and :mod:`iglens_dpa_method` and holds, in reading
order: the protocol (``dpa_context``, ``dpa_order``, ``dpa_ablation``, ``dpa_areas``, ``dpa_kept``),
integrated gradients over the component gates (``mask_ig``, ``mask_ig_gaps``) and the methods'
scores for the same items (``dpa_scores``: IG-Lens, its graph, mask IG, AtP on the logit and on p,
the activations, random, exhaustive, and DPA itself from :mod:`iglens_dpa_method`, which also
holds the gated run of the model that the protocol and the gradient methods use).
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from iglens_core import (DEFAULT_MEMORY_BUDGET, Readout, check_quantity, collect_components, components,
                         get_adapter, head_counts, logits_at_end, plain_number, projection_weight,
                         sublayer_module, sublayer_projection)
from iglens_core import as_model  # a TransformerLens or nnsight model: the Hugging Face model inside
from iglens_baselines import frozen_parameters
from iglens_graph import attribution_graph, non_finite_error
from iglens_dpa_method import dpa_attribution, dpa_item, gated_run


# A peer's benchmark (DPA, arXiv 2603.19742, lab-paper-code/dual_path_attribution,
# experiments/ablation/ablation_pipe.py): every attention edge (block, head, query, key) and every
# MLP neuron (block, position, neuron) of one item, ranked together by a method's score; zero the
# top fraction x ("disrupt") or all but it ("recover") and read the target's probability at the
# last position. One machinery serves the ablation and the gradient baselines: multiplicative
# gates on the post-softmax attention weights and on the down projection's input (1 = as the
# model computes it, 0 = zeroed; d p / d gate = activation x gradient).

DPA_MODES = ("disrupt", "recover")
DPA_FRACTIONS = tuple(math.exp(-17.0 + 1.8 * i) for i in range(10))  # exp(-17), exp(-15.2), ..., exp(-0.8)
# the curves' fixed end points in the original's plot_ablation_results.ipynb (x, y)
DPA_ANCHORS = {"disrupt": ((1e-10, 100.0),), "recover": ((1e-6, 0.0), (1.0, 100.0))}
DPA_METHODS = ("ig_lens", "ig_lens_gauss", "ig_lens_graph", "mask_ig", "atp", "atp_prob", "atp_prob_last",
               "attn_act", "mlp_act", "random", "exhaustive", "dpa", "dpa_logprob")
# earlier names, still accepted: "grad_x_act" was DPA's AtP (now "atp"), "atp_last" AtP on p at the last
# position (now "atp_prob_last"); "activation" ranks attn_act's and |down projection input| together
DPA_ALIASES = {"grad_x_act": "atp", "atp_last": "atp_prob_last"}
MASK_QUANTITIES = ("prob", "logprob", "logit")


def dpa_layout(model) -> tuple[int, int, int]:
    """``(n, H, d_ff)``: blocks, attention heads (query heads under GQA) and MLP neurons."""
    model = as_model(model)
    adapter = get_adapter(model)
    d_ff = projection_weight(sublayer_projection(adapter.blocks[0], "mlp")[0])[0].shape[1]
    return adapter.n_layers, head_counts(model)[0], int(d_ff)


def _check_budget(memory_budget) -> None:
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, np.integer)) or memory_budget < 1:
        raise ValueError(f"memory_budget must be a positive integer number of bytes, got {memory_budget!r}")


def _as_scores(value, name: str) -> np.ndarray:
    """``value`` as a float64 array; a ValueError naming ``name`` for text or objects, and for NaN or inf."""
    try:
        value = np.asarray(torch.as_tensor(value, dtype=torch.float64).cpu())
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be numbers (a tensor or array), got {type(value).__name__} {str(value)[:60]!r}") from None
    if not np.isfinite(value).all():
        raise ValueError(f"{name} must be finite, got {int((~np.isfinite(value)).sum())} NaN or infinite entries")
    return value


def _dpa_flat_scores(scores: dict, n: int, H: int, S: int, d_ff: int,
                     context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(flat, ranked)``: (n H S S + n S d_ff,) float64 scores, the edges then the neurons, C order,
    and which of them the ablation ranks: an edge whose query and key both lie in ``context`` (S,)
    and a neuron at a position in it, of a kind the dict holds (a key absent or None leaves that kind
    out, as the original's None scores: never ranked, never zeroed, not counted in N)."""
    if not isinstance(scores, dict) or not set(scores) <= {"edges", "neurons"}:
        raise ValueError(f"scores must be a dict with keys 'edges' and/or 'neurons', got "
                         f"{sorted(scores) if isinstance(scores, dict) else type(scores).__name__}")
    parts, ranked = [], []
    for key, shape in (("edges", (n, H, S, S)), ("neurons", (n, S, d_ff))):
        value = scores.get(key)
        inside = context[:, None] & context[None, :] if key == "edges" else context[:, None]  # (S, S) / (S, 1)
        if value is not None:
            value = _as_scores(value, f"scores[{key!r}]")
            if value.shape != shape:
                raise ValueError(f"scores[{key!r}] must have shape {shape}, got {value.shape}")
        parts.append(np.zeros(math.prod(shape)) if value is None else value.ravel())
        ranked.append(np.broadcast_to(inside & (value is not None), shape).ravel())
    if all(scores.get(key) is None for key in ("edges", "neurons")):
        raise ValueError("scores must hold 'edges' and/or 'neurons' (not None): there is nothing to rank")
    return np.concatenate(parts), np.concatenate(ranked)


def _check_context(context, S: int) -> np.ndarray:
    """(S,) bool: ``context`` checked (None: every position)."""
    if context is None:
        return np.ones(S, bool)
    array = np.asarray(context.cpu() if isinstance(context, torch.Tensor) else context)
    if array.shape != (S,) or array.dtype != bool or not array.any():
        raise ValueError(f"context must be None or ({S},) booleans (True = ranked and ablated), at least one "
                         f"True, got {array.dtype} of shape {array.shape}{'' if array.any() else ', none True'}")
    return array


def dpa_context(tokenizer, input_ids) -> np.ndarray:
    """(S,) bool: the positions DPA's original ranks and ablates, False at the special tokens the
    tokenizer adds around a text itself (a beginning-of-sequence token).

    How the original decides (experiments/attribution/utils.py ``collate_known``, attribution_pipe.py
    ``DataHandler.collate_fn``): the prompt is ``tokenizer.decode(tokenizer.encode(text,
    add_special_tokens=True))``, tokenised again without special tokens, and its "context" is the
    tokens whose character offsets fall in ``text``: every token but those the tokenizer added. So
    position 0 is left out only when the tokenizer adds a BOS (Gemma's ``<bos>``, Llama 3's
    ``<|begin_of_text|>``; SmolLM2 and Qwen add none, and then every position is context); a token
    it appends (none of these) likewise. The ablation (:func:`dpa_ablation` ``context=``) gives the
    components outside the context the lowest score: never zeroed in disrupt, always kept in
    recover, not counted in N. Here the added tokens are found by encoding a probe word with and
    without special tokens (plus the BOS that :func:`iglens_data.prompt_token_ids` restores when a
    tokenizer says ``add_bos_token`` but leaves it out), and marked where ``input_ids`` starts (ends)
    with them; a chat template's own tokens count as context (the original's component benchmark
    feeds plain prompts). Not replicated: the original's end rule (the first token whose end offset
    reaches ``len(text) - 1``) also drops a final one-character token from the context.

    Args:
        tokenizer: a Hugging Face tokenizer (callable with ``add_special_tokens``).
        input_ids: (1, S) or (S,) the item's prompt.
    """
    ids = torch.as_tensor(input_ids)
    ids = (ids[0] if ids.dim() == 2 and ids.shape[0] == 1 else ids).tolist()
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"input_ids must be (1, S) or (S,) integer token ids with S >= 1, got shape "
                         f"{tuple(torch.as_tensor(input_ids).shape)}")
    probe = "The"
    with_special = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    starts = [i for i in range(len(with_special) - len(plain) + 1) if with_special[i:i + len(plain)] == plain]
    if not plain or not starts:
        raise ValueError(f"cannot find the tokens of {probe!r} ({plain}) among those the tokenizer gives with its "
                         f"special tokens ({with_special}): which tokens it adds is unknown")
    prefix, suffix = with_special[:starts[0]], with_special[starts[0] + len(plain):]
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and prefix[:1] != [bos]:
        prefix = [bos] + prefix
    context = np.ones(len(ids), bool)
    if prefix and ids[:len(prefix)] == prefix:
        context[:len(prefix)] = False
    if suffix and len(ids) > len(prefix) + len(suffix) and ids[-len(suffix):] == suffix:
        context[-len(suffix):] = False
    if not context.any():
        raise ValueError(f"input_ids {ids} hold only the tokens the tokenizer adds itself: no context to rank")
    return context


def dpa_order(scores, *, ties: str = "random", seed: int = 0) -> np.ndarray:
    """(N,) component indices by signed score, descending, as the original sorts them; equal scores in a
    seeded random order.

    Only scores that are exactly equal tie (the original sorts its bfloat16 scores as they are; nothing
    else ties). An earlier rule tied scores closer than 1e-6 of the largest |score| by single linkage
    along the sorted values; densely packed scores then chained into one group that held most
    components (82% of AtP's, 98.7% of IG-Lens's on one SmolLM2 item), which was shuffled, so the
    order and the areas depended on where the chain broke: on the float path, that is, on the
    machine (AtP's recover area on notebook 10's CI items: 39.7 on one CPU, 53.8 on another). Scores
    that differ only by rounding can still swap with each other; that moves a cut-off by a component
    or two, not a group.

    Among exactly equal scores (most methods leave many components at exactly 0), ``ties="random"``
    orders the components by a fixed permutation drawn from ``seed`` (numpy's PCG64: the same on
    every machine), so a method that leaves most components unscored keeps a random set of them, as
    the random baseline would; ``ties="index"`` keeps the lower flat index first (edges before
    neurons, then block, head, query, key / block, position, neuron), which hands those slots to all
    the edges and the early blocks' neurons. The original breaks ties by an unstable bfloat16 argsort
    (no defined order).

    Args:
        scores: (N,) flat scores, e.g. edges then neurons.
        ties: ``"random"`` or ``"index"``.
        seed: the permutation's seed (integer >= 0), for ``ties="random"``.
    """
    if ties not in ("random", "index"):
        raise ValueError(f"ties must be 'random' or 'index', got {ties!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    x = _as_scores(scores, "scores").ravel()
    if ties == "index":
        return np.argsort(-x, kind="stable")  # by score descending, then by index
    # by score descending, then by the seeded permutation's key (np.lexsort((key, -x)), 2.5x faster):
    # visit the components in the order of their keys and sort that stably
    key = np.random.default_rng(seed).permutation(x.size)
    by_key = np.empty_like(key)
    by_key[key] = np.arange(x.size)
    return by_key[np.argsort(-x[by_key], kind="stable")]


def _zeroed_probs(model, ids: torch.Tensor, target: int, zero: np.ndarray, layout, batch_size: Optional[int],
                  memory_budget: int) -> torch.Tensor:
    """(R,) float64 target probabilities at the last position, one row per row of ``zero`` (R, N)
    bool (True = that component zeroed), rows batched per forward pass."""
    n, H, d_ff = layout
    S = ids.shape[1]
    width = next(model.parameters()).element_size()
    per_row = width * (4 * H * S * S + S * (4 * d_ff + 16 * model.config.hidden_size)) + zero.shape[1]
    batch = batch_size or max(1, min(len(zero), memory_budget // per_row))
    edges_at = n * H * S * S
    out = []
    for start in range(0, len(zero), batch):
        rows = torch.from_numpy(~zero[start:start + batch])  # (B, N) True = kept
        edges = rows[:, :edges_at].view(-1, n, H, S, S)
        neurons = rows[:, edges_at:].view(-1, n, S, d_ff)
        edge_gates = [None if bool(edges[:, layer].all()) else edges[:, layer].to(ids.device) for layer in range(n)]
        neuron_gates = [None if bool(neurons[:, layer].all()) else neurons[:, layer].to(ids.device) for layer in range(n)]
        with gated_run(model, edge_gates, neuron_gates):
            logits = logits_at_end(model, 1, input_ids=ids.expand(len(rows), -1))[:, -1]
        out.append(torch.softmax(logits.double(), -1)[:, target].cpu())
    return torch.cat(out)


@torch.no_grad()
def dpa_ablation(model, input_ids, target: int, scores: dict, *, mode: str = "disrupt",
                 fractions: Optional[Sequence[float]] = None, ties: str = "random", seed: int = 0,
                 context=None, batch_size: Optional[int] = None,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET) -> np.ndarray:
    """Dual Path Attribution's component ablation for one item: relative drops in percent.

    Components: every attention edge (block, head, query position, key position), ablated by
    setting that post-softmax weight to 0 with no renormalisation, and every MLP neuron (block,
    position, neuron), ablated by setting its activation (the input of the down projection: the
    gated unit's ``act_fn(gate) * up``, which is 0 exactly when the original's ``act_fn`` output
    is) to 0. All ``N = n H C^2 + n C d_ff`` of them at the C context positions (edges above the
    diagonal included, as in the original's count) are ranked together by the signed score,
    descending, tied scores in a seeded random order (:func:`dpa_order`).
    For each fraction x, ``k = ceil(N x)``: ``"disrupt"`` zeroes the top k, ``"recover"`` all but
    the top k. Outside the context (``context``, from :func:`dpa_context`: the BOS a tokenizer adds)
    nothing is ranked, zeroed or counted, as in the original: an edge with its query or its key
    there and a neuron there keep their values in both modes. A kind of component the scores leave
    out (``None``) is likewise never zeroed (the original's attn_act ranks the edges alone). The result is ``(p_base - p_x) / p_base * 100`` with p the target's probability at
    the last position (the model's own logits, soft-capping included).

    The unablated row and every fraction's row go through the model together (equal rows once), batched per
    forward pass (``batch_size`` rows, default: as many as ``memory_budget`` allows; 11 rows of a
    short prompt fit in one pass of the packaged models).

    Departures from the original (ablation_pipe.py, nnsight, bfloat16, batches of padded items):
    p is read from the model's final logits after Gemma's final soft-capping (the original reads
    ``lm_head``'s output, before it); scores are float64, exactly equal ones ordered by a seeded
    permutation, not bfloat16 in an unstable argsort; the model runs in its own dtype (float32
    here) with eager attention (required: the weights exist only there; switched back afterwards);
    under GQA an edge is a query head's weight (the original's layout, H = num_attention_heads),
    its value the shared key/value head's; sliding windows and attention soft-capping act before
    the softmax, so they are kept as the model computes them; one unpadded item per call.

    Args:
        model: a causal LM whose attention calls its modeling module's ``eager_attention_forward``
            (Llama, Gemma 2/3, Qwen, Mistral, ...).
        input_ids: (1, S) or (S,) the prompt; the target is predicted after its last token.
        target: the target token id.
        scores: ``{"edges": (n, H, S, S), "neurons": (n, S, d_ff)}`` (torch or numpy); a missing
            key or None leaves that kind out of the ranking (at least one kind must be given).
        mode: ``"disrupt"`` or ``"recover"``.
        fractions: values in [0, 1]; default :data:`DPA_FRACTIONS` (exp(-17), exp(-15.2), ...,
            exp(-0.8), 10 points).
        ties, seed: the order of tied scores (:func:`dpa_order`); ``"random"`` with the same seed
            for every method of an item, so methods that leave the same components unscored keep
            the same ones (the permutation runs over the ranked components).
        context: (S,) bool, True where components are ranked and ablated (:func:`dpa_context`);
            None: every position.
        batch_size: rows per forward pass (>= 1), or None.

    Returns:
        (F,) float64 relative drops in percent, one per fraction (0: p unchanged; 100: p -> 0;
        negative: p rose).
    """
    model = as_model(model)
    if mode not in DPA_MODES:
        raise ValueError(f"mode must be one of {DPA_MODES}, got {mode!r}")
    fractions = _as_scores(DPA_FRACTIONS if fractions is None else fractions, "fractions")
    if fractions.ndim != 1 or not fractions.size or not ((fractions >= 0) & (fractions <= 1)).all():
        raise ValueError(f"fractions must be a non-empty 1-D sequence of values in [0, 1], got {fractions}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    _check_budget(memory_budget)
    ids, target = dpa_item(model, input_ids, target)
    layout = dpa_layout(model)
    flat, ranked = _dpa_flat_scores(scores, layout[0], layout[1], ids.shape[1], layout[2],
                                    _check_context(context, ids.shape[1]))
    inside = np.flatnonzero(ranked)  # (N,) the ranked components; the rest keep their values
    rank = np.full(flat.size, flat.size, dtype=np.int64)
    rank[inside[dpa_order(flat[inside], ties=ties, seed=seed)]] = np.arange(inside.size)
    counts = np.ceil(inside.size * fractions)  # (F,) components in the top x
    top = rank[None, :] < counts[:, None]  # (F, N_all)
    zero = np.concatenate([np.zeros((1, flat.size), bool), top if mode == "disrupt" else ~top & ranked])
    # equal rows run once (on the packaged models' items the three smallest fractions all give k = 1)
    _, first, inverse = np.unique(np.packbits(zero, axis=1), axis=0, return_index=True, return_inverse=True)
    distinct = np.sort(first)  # the distinct rows in their order
    probs = _zeroed_probs(model, ids, target, zero[distinct], layout, batch_size, memory_budget)
    probs = probs[np.searchsorted(distinct, first)[inverse.ravel()]]
    return ((probs[0] - probs[1:]) / probs[0] * 100).numpy()


def dpa_areas(disrupt, recover, fractions: Optional[Sequence[float]] = None, *, anchors: bool = True,
              scale: str = "linear", cap: bool = False) -> dict:
    """DPA's curve areas: ``y(x) = 100 - mean over items`` of the drops, trapezoid on linear x.

    ``disturb_aoc`` (lower is better: removing the top components destroys the prediction),
    ``recover_aoc`` (higher is better: the top components alone keep it) and
    ``total = recover_aoc - disturb_aoc``. With ``anchors`` the curves get the original's fixed
    end points (plot_ablation_results.ipynb, :data:`DPA_ANCHORS`): (1e-10, 100) for disrupt,
    (1e-6, 0) and (1, 100) for recover, so the numbers are comparable with the paper's tables.

    On linear x the areas are set by the two largest fractions (exp(-2.6), exp(-0.8)) and the
    anchors; ``scale="log"`` (not the original's) gives every fraction the same weight: the
    trapezoid over ``ln x`` divided by its range, the curve's mean height in percent (0..100 when
    p only falls), without anchors.

    The original's areas are unbounded above: an item whose kept top x raises p nine-fold has a
    drop of -800 there, and adds y = 900 to the mean, as much as nine items that keep p intact.
    ``cap=True`` (not the original's) counts every negative drop as 0 (p at most its value with
    every component on), so each item adds at most 100 at each fraction.

    Args:
        disrupt, recover: (items, F) or (F,) drops in percent from :func:`dpa_ablation` (NaN
            entries are left out of the mean).
        fractions: the F fractions; default :data:`DPA_FRACTIONS`.
        scale: ``"linear"`` (the original) or ``"log"``.
        cap: clip each item's drops at 0 before the mean.

    Returns:
        ``{"disturb_aoc", "recover_aoc", "total"}`` floats.
    """
    if scale not in ("linear", "log"):
        raise ValueError(f"scale must be 'linear' or 'log', got {scale!r}")
    if not isinstance(cap, (bool, np.bool_)):
        raise ValueError(f"cap must be True or False, got {cap!r}")
    x = _as_scores(DPA_FRACTIONS if fractions is None else fractions, "fractions")
    if x.ndim != 1 or not x.size or not ((x > 0) & (x <= 1)).all() or np.unique(x).size != x.size:
        raise ValueError(f"fractions must be a 1-D sequence of distinct values in (0, 1], got {x}")
    if scale == "log" and x.size < 2:
        raise ValueError(f"scale='log' needs at least two fractions, got {x}")
    out = {}
    for name, mode, drops in (("disturb_aoc", "disrupt", disrupt), ("recover_aoc", "recover", recover)):
        try:  # NaN drops are allowed (nanmean below); text is not
            drops = np.atleast_2d(np.asarray(drops, dtype=np.float64))
        except (TypeError, ValueError):
            raise ValueError(f"{mode} drops must be numbers (items, fractions), got {str(drops)[:60]!r}") from None
        if drops.ndim != 2 or drops.shape[1] != x.size:
            raise ValueError(f"{mode} drops must have shape (items, {x.size}), got {drops.shape}")
        if cap:
            drops = np.maximum(drops, 0.0)  # NaN stays NaN
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            points = list(zip(x, 100.0 - np.nanmean(drops, 0)))
        if scale == "linear":
            xs, ys = np.array(sorted(points + list(DPA_ANCHORS[mode] if anchors else ()))).T
            out[name] = float(np.trapezoid(ys, xs))
        else:
            xs, ys = np.array(sorted(points)).T
            out[name] = float(np.trapezoid(ys, np.log(xs)) / np.log(xs[-1] / xs[0]))
    out["total"] = out["recover_aoc"] - out["disturb_aoc"]
    return out


# -- integrated gradients over the component gates (the EAP-IG family) ------------------------

MASK_RULES = ("adaptive", "cubic")
MASK_PANEL_POINTS = 2  # Gauss-Legendre points per panel of the adaptive rule
MASK_SPLIT_SHARE = 0.5  # each round bisects the panels that hold this share of the estimated gap
MASK_RTOL = 1e-4  # a panel whose estimated gap is below this share of f's variation is not split


class MaskIG(NamedTuple):
    """Integrated gradients over the component gates of one item (:func:`mask_ig`).

    Attributes:
        scores: ``{"edges": (n, H, S, S), "neurons": (n, S, d_ff)}`` float64, each gate's integral
            (0 for the components outside the context, whose gates stay at 1).
        f_on, f_off: f with every gate at 1 (the model as it is) and every varied gate at 0.
        gap: ``sum(scores) - (f_on - f_off)``, the completeness gap of the quadrature.
        steps: quadrature points (gradient passes); quantity: f.
        rule: ``"adaptive"`` or ``"cubic"``.
        panels: (K+1,) float64 panel edges in u (t = u^3), 0 to 1; ``[0, 1]`` for the cubic rule.
        nodes, weights: (steps,) float64, the points t in (0, 1) and their weights (Jacobian
            included): ``score_i = sum_j weights[j] * d f / d g_i (nodes[j])``.
        scan_rows: forward-only rows (one gated forward pass each, no backward) the adaptive rule
            spent placing its panels; 0 for the cubic rule.
    """
    scores: dict
    f_on: float
    f_off: float
    gap: float
    steps: int
    quantity: str
    rule: str = "cubic"
    panels: Optional[np.ndarray] = None
    nodes: Optional[np.ndarray] = None
    weights: Optional[np.ndarray] = None
    scan_rows: int = 0


def gate_path_nodes(panels, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The composite rule on the panels: ``(nodes t (steps,), weights (steps,))`` float64.

    Panel k, ``[panels[k], panels[k+1]]`` in u, gets ``steps // K`` Gauss-Legendre points in u (the
    first ``steps % K`` panels one more), mapped to ``t = u^3`` with the Jacobian ``3 u^2`` in the
    weight, so that ``int_0^1 g(t) dt ~ sum_j weights[j] g(nodes[j])``. One panel ``[0, 1]`` is the
    cubic rule (``t = u^3`` on ``steps`` points).
    """
    panels = np.asarray(panels, dtype=np.float64)
    K = len(panels) - 1
    if panels.ndim != 1 or K < 1 or panels[0] != 0 or panels[-1] != 1 or not (np.diff(panels) > 0).all():
        raise ValueError(f"panels must be increasing edges in u from 0 to 1, got {panels!r}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < K:
        raise ValueError(f"steps must be an integer >= the {K} panels (one point each at least), got {steps!r}")
    nodes, weights = [], []
    for k, count in enumerate(steps // K + (np.arange(K) < steps % K)):
        x, w = np.polynomial.legendre.leggauss(int(count))  # on [-1, 1]
        low, width = panels[k], panels[k + 1] - panels[k]
        u = low + width * (x + 1) / 2
        nodes.append(u ** 3)
        weights.append(3 * u ** 2 * w * width / 2)
    return np.concatenate(nodes), np.concatenate(weights)


def gate_path_panels(values, steps: int, f_off: float, f_on: float, *, points: int = MASK_PANEL_POINTS,
                     floor: float = 0.0) -> tuple[np.ndarray, int]:
    """The adaptive rule's panels, placed from forward passes only: ``(panels (K+1,) in u, rows)``.

    At most K = ``steps // points`` panels (at least 1). Each panel's completeness gap under its own
    ``points``-point Gauss-Legendre rule is estimated without gradients: ``d f / d t`` at each node by
    a central difference of f (exact where f is quadratic in t; its step the image in t of
    ``width / (8 points)`` in u, inside the panel), the rule's sum of those, less
    ``f(end) - f(start)``. Starting from ``[0, 1]``, each round bisects (in u) the panels
    with the largest estimated |gap| that together hold ``MASK_SPLIT_SHARE`` of it, all of them in
    one batch of rows, until K panels or until every estimate is below twice ``floor`` (then
    :func:`gate_path_nodes` gives each panel more points: a higher order where f is smooth; one
    panel is the cubic rule). The estimates are compared in powers of two of ``floor``, ties to the
    earlier panel, so that rounding alone rarely moves a panel.

    Args:
        values: a function from (B,) float64 t in [0, 1] to (B,) float64 f along the gate path.
        steps: the gradient points the rule will have (:func:`gate_path_nodes`).
        f_off, f_on: f at t = 0 and t = 1.
        points: Gauss-Legendre points per panel (1..64).
        floor: >= 0, the rounding of f as a central difference sees it: estimates below twice it
            count as 0, the others are compared in powers of two of it (0: as they are).

    Returns:
        ``(panels, rows)``: the edges in u (0 to 1) and the number of f values computed.
    """
    if isinstance(points, bool) or not isinstance(points, (int, np.integer)) or not 1 <= points <= 64:
        raise ValueError(f"points must be an integer in 1..64 (Gauss-Legendre points per panel), got {points!r}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    for name, value in (("f_off", f_off), ("f_on", f_on), ("floor", floor)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
                or not math.isfinite(value) or (name == "floor" and value < 0):
            raise ValueError(f"{name} must be a finite number{' >= 0' * (name == 'floor')}, got {value!r}")
    x, w = np.polynomial.legendre.leggauss(int(points))
    x, w = (x + 1) / 2, w / 2  # on [0, 1]

    def estimates(pieces):  # [(a, b, f(a), f(b))] in u -> estimated gaps, from one batch of 2 q rows each
        a, b, fa, fb = (np.array(column, dtype=np.float64)[:, None] for column in zip(*pieces))  # (P, 1)
        u = a + (b - a) * x  # (P, q) nodes in u
        t = u ** 3
        step = np.minimum(3 * u ** 2 * (b - a) / (8 * points), np.minimum(t - a ** 3, b ** 3 - t) / 2)  # in t
        f = np.asarray(values(np.concatenate([(t - step).ravel(), (t + step).ravel()])), np.float64)
        if f.shape != (2 * t.size,) or not np.isfinite(f).all():
            raise ValueError(f"values must map ({2 * t.size},) points t to as many finite numbers, got shape {f.shape}")
        slopes = (f[t.size:] - f[:t.size]).reshape(t.shape) / (2 * step)  # (P, q) d f / d t
        return list((slopes * 3 * u ** 2 * w * (b - a)).sum(1) - (fb - fa)[:, 0])

    K = max(1, int(steps) // int(points))
    panels, ends = [0.0, 1.0], [float(f_off), float(f_on)]
    gaps = estimates([(0.0, 1.0, ends[0], ends[1])]) if K > 1 else [0.0]
    rows = 2 * int(points) * (K > 1)
    while len(panels) - 1 < K:
        size = np.abs(gaps)
        base = max(floor, MASK_RTOL * float(np.abs(np.diff(ends)).sum()))
        if base > 0:  # in powers of two of the base, 0 below twice it: rounding rarely reorders panels
            size = np.exp2(np.floor(np.log2(np.maximum(size, base) / base))) - 1.0
        if size.max() == 0:  # every panel exact to f's rounding: its points go to more points per panel
            break
        order = np.argsort(-size, kind="stable")
        held = np.cumsum(size[order])
        chosen = order[:int(np.searchsorted(held, MASK_SPLIT_SHARE * held[-1])) + 1]
        chosen = np.sort(chosen[:K - (len(panels) - 1)])
        middles = [(panels[k] + panels[k + 1]) / 2 for k in chosen]
        f_mid = np.asarray(values(np.array(middles) ** 3), np.float64)
        pieces = []
        for k, middle, f in zip(chosen, middles, f_mid):
            pieces += [(panels[k], middle, ends[k], f), (middle, panels[k + 1], f, ends[k + 1])]
        new = estimates(pieces)
        rows += len(middles) + 2 * int(points) * len(pieces)
        for i, k in reversed(list(enumerate(chosen))):  # from the right: the indices to the left hold
            panels.insert(k + 1, middles[i])
            ends.insert(k + 1, float(f_mid[i]))
            gaps[k:k + 1] = new[2 * i:2 * i + 2]
    return np.array(panels), rows


def _target_values(logits: torch.Tensor, target: int, quantity: str) -> torch.Tensor:
    """(B,) float64 f at the last position from (B, V) logits: p, log p or the logit (after any soft-cap)."""
    logits = logits.double()
    if quantity == "logit":
        return logits[:, target]
    return (torch.softmax if quantity == "prob" else torch.log_softmax)(logits, -1)[:, target]


def _gate_levels(level: torch.Tensor, vary_edges: torch.Tensor, vary_neurons: torch.Tensor, n: int, H: int,
                 d_ff: int, grad: bool) -> tuple[list, list]:
    """Per block, the edge gates (B, H, S, S) and neuron gates (B, S, d_ff): ``level`` (B,) where varied, 1
    elsewhere; leaves of their own that require grad with ``grad``, else one shared view."""
    B, S = len(level), vary_edges.shape[0]
    edges = torch.where(vary_edges, level[:, None, None, None], 1.0).expand(B, H, S, S)
    neurons = torch.where(vary_neurons, level[:, None, None], 1.0).expand(B, S, d_ff)
    if not grad:
        return [edges] * n, [neurons] * n
    return ([edges.clone().requires_grad_(True) for _ in range(n)],
            [neurons.clone().requires_grad_(True) for _ in range(n)])


def _mask_ig(model, ids: torch.Tensor, target: int, steps: int, quantity: str, context: np.ndarray,
             batch_size: Optional[int], memory_budget: int, rule: str = "adaptive") -> MaskIG:
    n, H, d_ff = dpa_layout(model)
    S, param = ids.shape[1], next(model.parameters())
    inside = torch.from_numpy(context).to(ids.device)
    vary_edges, vary_neurons = inside[:, None] & inside[None, :], inside[:, None]  # (S, S), (S, 1)
    vocab = model.get_input_embeddings().num_embeddings
    per_block = param.element_size() * (6 * H * S * S + S * (6 * d_ff + 16 * model.config.hidden_size))
    per_row = n * per_block + 32 * vocab  # kept for the backward: every block's weights, activations, states
    off = ([(~vary_edges).to(param.dtype)[None, None]] * n, [(~vary_neurons).to(param.dtype)[None]] * n)
    f_ends = []
    for gates in (([None] * n, [None] * n), off):  # eager attention in both, as along the path
        with torch.no_grad(), gated_run(model, *gates):
            f_ends.append(float(_target_values(logits_at_end(model, 1, input_ids=ids)[:, -1], target, quantity)[0]))
    f_on, f_off = f_ends
    panels, scan_rows = np.array([0.0, 1.0]), 0
    if rule == "adaptive":
        scan_batch = batch_size or max(1, memory_budget // (per_block + 32 * vocab))

        def path_values(t: np.ndarray) -> np.ndarray:  # (B,) f along the path, forward passes only
            out = []
            for start in range(0, len(t), scan_batch):
                level = torch.as_tensor(t[start:start + scan_batch], device=ids.device, dtype=param.dtype)
                gates = _gate_levels(level, vary_edges, vary_neurons, n, H, d_ff, False)
                with torch.no_grad(), gated_run(model, *gates):
                    logits = logits_at_end(model, 1, input_ids=ids.expand(len(level), -1))[:, -1]
                    out += _target_values(logits, target, quantity).tolist()
            return np.array(out)
        floor = 256 * torch.finfo(param.dtype).eps * max(1.0, abs(f_on), abs(f_off))  # f's rounding, differenced
        panels, scan_rows = gate_path_panels(path_values, steps, f_off, f_on, floor=floor)
    nodes, weights = gate_path_nodes(panels, steps)
    t, weight = torch.from_numpy(nodes), torch.from_numpy(weights)
    batch = batch_size or max(1, min(steps, memory_budget // per_row))
    scores = _empty_scores(n, H, S, d_ff)
    for start in range(0, steps, batch):
        level = t[start:start + batch].to(device=ids.device, dtype=param.dtype)  # (B,)
        edges, neurons = _gate_levels(level, vary_edges, vary_neurons, n, H, d_ff, True)
        with torch.enable_grad(), frozen_parameters(model), gated_run(model, edges, neurons):
            logits = logits_at_end(model, 1, input_ids=ids.expand(len(level), -1))[:, -1]
            grads = torch.autograd.grad(_target_values(logits, target, quantity).sum(), edges + neurons)  # rows independent
        rows = weight[start:start + batch]
        scores["edges"] += torch.einsum("b,lbhqk->lhqk", rows, torch.stack(grads[:n]).double().cpu())
        scores["neurons"] += torch.einsum("b,lbsi->lsi", rows, torch.stack(grads[n:]).double().cpu())
    scores["edges"] *= vary_edges.cpu()
    scores["neurons"] *= vary_neurons.cpu()
    total = float(scores["edges"].sum() + scores["neurons"].sum())
    return MaskIG(scores, f_on, f_off, total - (f_on - f_off), steps, quantity, rule, panels, nodes, weights, scan_rows)


def _check_mask_args(steps, quantity, batch_size, memory_budget, rule="adaptive") -> int:
    steps = plain_number(steps)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= 10 ** 4:
        raise ValueError(f"steps must be an integer in 1..10000 (quadrature points on the gate path), got {steps!r}")
    if quantity not in MASK_QUANTITIES:
        raise ValueError(f"quantity must be one of {MASK_QUANTITIES}, got {quantity!r}")
    if not isinstance(rule, str) or rule not in MASK_RULES:
        raise ValueError(f"rule must be one of {MASK_RULES} (the gate path's quadrature), got {rule!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    _check_budget(memory_budget)
    return int(steps)


@torch.no_grad()
def mask_ig(model, input_ids, target: int, *, steps: int = 32, rule: str = "adaptive", quantity: str = "prob",
            context=None, batch_size: Optional[int] = None, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> MaskIG:
    """Total effect of every edge and neuron by integrated gradients over the component gates.

    The EAP-IG family (MIB's circuit track) on :func:`dpa_ablation`'s components: every edge gate
    and every neuron gate (:func:`iglens_dpa_method.gated_run`: a post-softmax attention weight, a down projection's
    input, each times its gate) is scaled together by t from 0 (all zeroed) to 1 (the model as it
    is), and each gate's gradient of f is integrated along that path, times (1 - 0):
    ``score_i = int_0^1 d f / d g_i (t) dt``. By the gradient theorem the scores add up to
    ``f(all on) - f(all off)``; the quadrature's shortfall is returned as ``gap``. Cost: ``steps``
    forward and backward passes (rows batched per pass), and for the adaptive rule the forward-only
    rows that place its panels.

    Rules (both in u with ``t = u^3``, Jacobian ``3 u^2`` included: points crowded near t = 0, where
    the norms rescale whatever is left):

    - ``"adaptive"`` (default): a composite Gauss-Legendre rule, 2 points on each of ``steps // 2``
      panels placed by bisection where f along the path bends (:func:`gate_path_panels`: each
      panel's completeness gap estimated from forward passes only, by central differences of f).
      Costs about ``4 steps`` forward-only rows (no backward) in about ``log2(steps) + a few``
      batches besides the gradient passes. On SmolLM2, whose f along the path has narrow bumps, it
      converges where the cubic rule does not (README, "A peer's benchmark").
    - ``"cubic"``: one panel, ``steps`` Gauss-Legendre points in u: exact to high order where f is
      smooth in u (Gemma 3), misses bumps narrower than its spacing.

    Args:
        model, input_ids, target: as :func:`dpa_ablation`.
        steps: gradient points (1..10000).
        rule: :data:`MASK_RULES`.
        quantity: f: ``"prob"`` (p(target) at the last position), ``"logprob"`` or ``"logit"``.
        context: (S,) bool (:func:`dpa_context`); the gates outside it stay at 1 and score 0, so
            the path ends where the benchmark's recover does at x = 0. None: every position.
        batch_size: rows per pass (the gradient points, and the adaptive rule's forward-only rows),
            or None (as many as ``memory_budget`` allows).

    Returns:
        :class:`MaskIG`.
    """
    model = as_model(model)
    steps = _check_mask_args(steps, quantity, batch_size, memory_budget, rule)
    ids, target = dpa_item(model, input_ids, target)
    return _mask_ig(model, ids, target, steps, quantity, _check_context(context, ids.shape[1]), batch_size,
                    memory_budget, rule)


def mask_ig_gaps(model, input_ids, target: int, steps: Sequence[int] = (8, 16, 32, 64), **kwargs) -> dict:
    """``{m: gap}``: :func:`mask_ig`'s completeness gap ``sum(scores) - (f_on - f_off)`` for each
    number of points m (keyword arguments as :func:`mask_ig`, ``rule`` among them)."""
    model = as_model(model)
    if isinstance(steps, (int, np.integer)) or not len(steps):
        raise ValueError(f"steps must be a non-empty sequence of point counts, got {steps!r}")
    return {int(m): mask_ig(model, input_ids, target, steps=m, **kwargs).gap for m in steps}


# -- the methods' scores for the same items ----------------------------------------------------

def _empty_scores(n: int, H: int, S: int, d_ff: int) -> dict:
    return {"edges": torch.zeros(n, H, S, S, dtype=torch.float64),
            "neurons": torch.zeros(n, S, d_ff, dtype=torch.float64)}


def _gate_gradients(model, ids: torch.Tensor, target: int, quantity: str) -> tuple[dict, dict]:
    """Activation x gradient of every edge and neuron, from one forward and one backward pass.

    With unit gates ``g`` on the attention weights and activations (:func:`iglens_dpa_method.gated_run`),
    ``d f / d g = a * d f / d a`` for each component's activation a: exactly the zero-baseline
    attribution patching estimate of removing it (with the sign flipped: positive = it helps f).

    Args:
        quantity: ``"prob"`` (f = p(target) at the last position) or ``"logit"`` (its logit, after
            any soft-cap).

    Returns:
        ``(scores, activations)``: scores as :func:`dpa_ablation` takes them, float64, and the
        ungated attention weights (n, H, S, S) and activations (n, S, d_ff) as ``"edges"`` /
        ``"neurons"``.
    """
    n, H, d_ff = dpa_layout(model)
    S, param = ids.shape[1], next(model.parameters())
    edges = [torch.ones(1, H, S, S, dtype=param.dtype, device=ids.device, requires_grad=True) for _ in range(n)]
    neurons = [torch.ones(1, S, d_ff, dtype=param.dtype, device=ids.device, requires_grad=True) for _ in range(n)]
    record: dict = {}
    with torch.enable_grad(), frozen_parameters(model), gated_run(model, edges, neurons, record):
        logits = logits_at_end(model, 1, input_ids=ids)[:, -1]
        grads = torch.autograd.grad(_target_values(logits, target, quantity)[0], edges + neurons)
    scores = {"edges": torch.cat(grads[:n]).double().cpu(), "neurons": torch.cat(grads[n:]).double().cpu()}
    activations = {"edges": torch.cat(record["weights"]).detach().double().cpu(),
                   "neurons": torch.cat(record["acts"]).detach().double().cpu()}
    return scores, activations


def _act_fn_outputs(model, ids: torch.Tensor) -> torch.Tensor:
    """(n, S, d_ff) float64: each MLP's activation-function output (``mlp.act_fn``, GPT-2's
    ``mlp.act``), the original's mlp_act: for a gated MLP ``act(gate)``, before the product with up."""
    adapter = get_adapter(model)
    outputs, current, hooks, seen = [None] * adapter.n_layers, [0], [], set()
    try:
        for layer, block in enumerate(adapter.blocks):
            mlp = sublayer_module(block, "mlp")
            act = getattr(mlp, "act_fn", None) or getattr(mlp, "act", None)
            if not isinstance(act, nn.Module):
                raise ValueError(f"{type(mlp).__name__} has no activation module (act_fn or act): mlp_act cannot read it")
            hooks.append(mlp.register_forward_pre_hook(lambda mod, args, layer=layer: current.__setitem__(0, layer)))
            if id(act) not in seen:  # a module shared by the blocks is hooked once
                seen.add(id(act))
                hooks.append(act.register_forward_hook(lambda mod, args, out: outputs.__setitem__(current[0], out)))
        model(ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(outputs).double().cpu()


def _exhaustive_scores(model, ids: torch.Tensor, target: int, subset: int, seed: int, context: np.ndarray,
                       batch_size: Optional[int], memory_budget: int) -> dict:
    """``p_base - p`` with one component zeroed, for ``subset`` components drawn (seeded) from the
    edges at or below the diagonal and the neurons, in the context; every other component scores 0."""
    n, H, d_ff = layout = dpa_layout(model)
    S = ids.shape[1]
    scores = _empty_scores(n, H, S, d_ff)
    causal = torch.from_numpy(np.tril(context[:, None] & context[None, :])).expand(n, H, S, S).flatten()
    neurons = np.broadcast_to(context[:, None], (n, S, d_ff)).ravel()
    pool = np.concatenate([np.flatnonzero(causal.numpy()), causal.numel() + np.flatnonzero(neurons)])
    chosen = np.sort(np.random.default_rng(seed).choice(pool, size=min(subset, pool.size), replace=False))
    zero = np.zeros((len(chosen) + 1, causal.numel() + n * S * d_ff), bool)
    zero[np.arange(1, len(chosen) + 1), chosen] = True  # row 0: nothing zeroed
    probs = _zeroed_probs(model, ids, target, zero, layout, batch_size, memory_budget)
    flat = torch.cat([scores["edges"].flatten(), scores["neurons"].flatten()])
    flat[torch.from_numpy(chosen)] = probs[0] - probs[1:]
    return {"edges": flat[:causal.numel()].view(n, H, S, S), "neurons": flat[causal.numel():].view(n, S, d_ff)}


def _ig_lens_scores(model, ids: torch.Tensor, target: int, estimator: str, steps: int, quantity: str,
                    readout: Optional[Readout]) -> dict:
    """IG-Lens at the predicting position: (block, head, source) shares as the edges of the last
    query row, neuron shares at the last position; every other component scores 0."""
    n, H, d_ff = dpa_layout(model)
    S = ids.shape[1]
    full = torch.cat([ids.cpu(), torch.tensor([[target]])], 1)  # the target teacher-forced after the prompt
    trace = collect_components(model, full, S, sources=True)
    parts = components(model, trace, resolution="all", steps=steps, estimator=estimator, readout=readout,
                       quantity=quantity)
    scores = _empty_scores(n, H, S, d_ff)
    scores["edges"][:, :, S - 1, :] = parts.sources[0, :, :, :S].double()
    scores["neurons"][:, S - 1, :] = parts.neurons[0, :, :-1].double()  # the bias is not a component
    return scores


def _finite_scores(scorer):
    """:func:`dpa_scores` checked: a ValueError naming the method and the model's non-finite parameters
    (or an overflow) where a score is NaN or inf, instead of scores that rank NaN."""
    signature = inspect.signature(scorer)

    @functools.wraps(scorer)
    def checked(*args, **kwargs):
        scores = scorer(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        model, method = given["model"], given["method"]
        bad = {kind: int((~torch.isfinite(value)).sum()) for kind, value in scores.items() if value is not None}
        if any(bad.values()):
            counts = ", ".join(f"{count} of the {kind}" for kind, count in bad.items() if count)
            raise non_finite_error(model, f"in the {method!r} scores ({counts})")
        return scores
    return checked


@_finite_scores
@torch.no_grad()
def dpa_scores(model, input_ids, target: int, method: str, *, seed: int = 0, steps: int = 16,
               mask_steps: int = 32, mask_rule: str = "adaptive", quantity: str = "prob", subset: int = 128,
               context=None, readout: Optional[Readout] = None, batch_size: Optional[int] = None,
               memory_budget: int = DEFAULT_MEMORY_BUDGET) -> dict:
    """A method's score of every attention edge and MLP neuron of one item, for :func:`dpa_ablation`.

    Methods (:data:`DPA_METHODS`), higher = more important for the target:

    - ``"ig_lens"`` / ``"ig_lens_gauss"``: IG-Lens components (prediction-aware / Gauss-Legendre,
      ``steps`` points per segment, ``quantity`` its readout) at the predicting position only:
      each (block, head, source position) share is the score of the edge (block, head, last query,
      source), each neuron's share that of the neuron at the last position; the other positions'
      components score 0 (IG-Lens does not attribute them). The edge scores of a head add up to its
      share. One forward pass plus the readout's closed-form gradients; no backward.
    - ``"ig_lens_graph"``: the node shares of IG-Lens's attribution graph
      (:func:`iglens_graph.attribution_graph`, prediction-aware, ``steps``, ``quantity``: p or
      log p) at every position: its edges (block, head, query, key) and neurons (block, position,
      neuron), the credit that flows through each with the patterns and norms fixed.
    - ``"mask_ig"``: :func:`mask_ig`, integrated gradients of ``quantity`` over the component gates
      (``mask_steps`` points, ``mask_rule`` its quadrature, gates outside ``context`` held at 1).
    - ``"atp"``: DPA's AtP (component_attribution_modules.py ``AtPComponentAttribution``), the
      activation (a post-softmax weight, a down projection's input) times the gradient of the
      target's **logit** at the last position, ``a * d logit / d a``, every position (one forward,
      one backward); after Gemma's final soft-cap, a positive factor per item that leaves the order
      as the original's pre-cap logit gives it. Earlier name: ``"grad_x_act"``.
    - ``"atp_prob"``: AtP on the probability, ``a * d p(target) / d a`` (this repository's earlier
      ``"atp"``). ``"atp_prob_last"`` (earlier ``"atp_last"``): the same restricted to the last
      query row and the last position, a control for IG-Lens's restriction.
    - ``"attn_act"`` / ``"mlp_act"``: the original's activation baselines, ranked as separate
      methods: the post-softmax attention weights alone (``"neurons"`` None, left out of the
      ranking), or the MLPs' activation-function outputs alone, signed (``act_fn``'s output:
      ``act(gate)`` of a gated MLP; ``"edges"`` None). ``"activation"`` (not in DPA_METHODS): the
      attention weights and ``|down projection input|`` in one ranking.
    - ``"random"``: standard normal draws (``seed``).
    - ``"dpa"``: Dual Path Attribution as the original runs it (:func:`dpa_attribution`, its default
      weights), on the target logit, every edge and neuron at every position. ``"dpa_logprob"``: the same
      from the log-probability's start vector (``dpa_attribution(..., quantity="logprob")``), like for like
      with the graph in log p.
    - ``"exhaustive"``: the drop ``p_base - p`` when one component alone is zeroed, for ``subset``
      components drawn (``seed``) from the edges at or below the diagonal and the neurons in the
      ``context``; the rest score 0. A reference ceiling on that subset only; ``subset + 1`` rows.

    Args:
        context: (S,) bool (:func:`dpa_context`), used by ``"mask_ig"`` and ``"exhaustive"``; the
            other methods score every component and :func:`dpa_ablation` leaves out those outside it.

    Returns:
        ``{"edges": (n, H, S, S), "neurons": (n, S, d_ff)}`` float64 on the CPU (None for a kind the
        method does not rank); for the edges, ``[block, head, query, key]``.
    """
    model = as_model(model)
    method = DPA_ALIASES.get(method, method) if isinstance(method, str) else method
    if method not in DPA_METHODS + ("activation",):
        raise ValueError(f"method must be one of {DPA_METHODS} (or 'activation', "
                         f"{', '.join(repr(a) for a in DPA_ALIASES)}), got {method!r}")
    seed, steps, subset = (plain_number(value) for value in (seed, steps, subset))
    for name, value, low in (("seed", seed, 0), ("steps", steps, 1), ("subset", subset, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    check_quantity(quantity)
    mask_steps = _check_mask_args(mask_steps, quantity, batch_size, memory_budget, mask_rule)
    ids, target = dpa_item(model, input_ids, target)
    n, H, d_ff = dpa_layout(model)
    S = ids.shape[1]
    context = _check_context(context, S)
    if method in ("ig_lens", "ig_lens_gauss"):
        return _ig_lens_scores(model, ids, target, "prediction_aware" if method == "ig_lens" else "gauss_legendre",
                               steps, quantity, readout)
    if method == "ig_lens_graph":
        graph = attribution_graph(model, torch.cat([ids.cpu(), torch.tensor([[target]])], 1), S, steps=steps,
                                  quantity=quantity, readout=readout, edges=True)
        return {"edges": graph.edges[:, :, :S, :S].double().cpu(), "neurons": graph.neurons[:, :S].double().cpu()}
    if method == "mask_ig":
        return _mask_ig(model, ids, target, mask_steps, quantity, context, batch_size, memory_budget, mask_rule).scores
    if method in ("dpa", "dpa_logprob"):
        out = dpa_attribution(model, ids, target, quantity="logit" if method == "dpa" else "logprob")
        return {key: out[key] for key in ("edges", "neurons")}
    if method == "random":
        rng = np.random.default_rng(seed)
        return {"edges": torch.from_numpy(rng.standard_normal((n, H, S, S))),
                "neurons": torch.from_numpy(rng.standard_normal((n, S, d_ff)))}
    if method == "exhaustive":
        return _exhaustive_scores(model, ids, target, subset, seed, context, batch_size, memory_budget)
    if method == "mlp_act":
        return {"edges": None, "neurons": _act_fn_outputs(model, ids)}
    if method in ("attn_act", "activation"):
        record: dict = {}
        with gated_run(model, record=record):
            model(ids, use_cache=False)
        return {"edges": torch.cat(record["weights"]).double().cpu(),
                "neurons": torch.cat(record["acts"]).double().abs().cpu() if method == "activation" else None}
    scores = _gate_gradients(model, ids, target, "logit" if method == "atp" else "prob")[0]
    if method == "atp_prob_last":
        scores["edges"][:, :, :S - 1] = 0
        scores["neurons"][:, :S - 1] = 0
    return scores


DPA_MAX_CONTEXT = 400  # the original's filter: at most this many context tokens (attribution_pipe.py)


def dpa_kept(model, tokenizer, input_ids, target: int, *, min_prob: float = 0.1,
             max_context: int = DPA_MAX_CONTEXT) -> tuple[bool, float]:
    """The original's item filter (experiments/attribution/attribution_pipe.py): ``(kept, p)``, kept when
    the model's arg-max at the last position is the target, ``p(target) > min_prob``, the target's
    token string (``tokenizer.convert_ids_to_tokens``, e.g. ``"ĠParis"``) is longer than one character
    and the context (:func:`dpa_context`: the prompt less the tokens the tokenizer adds) holds at most
    ``max_context`` tokens. With ``tokenizer=None`` the last two rules are not applied."""
    model = as_model(model)
    min_prob, max_context = plain_number(min_prob), plain_number(max_context)
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob < 1.0:
        raise ValueError(f"min_prob must be a probability in [0, 1), got {min_prob!r}")
    if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or max_context < 1:
        raise ValueError(f"max_context must be an integer >= 1 (tokens), got {max_context!r}")
    ids, target = dpa_item(model, input_ids, target)
    with torch.no_grad():
        probs = torch.softmax(logits_at_end(model, 1, input_ids=ids)[0, -1].double(), -1)
    p = float(probs[target])
    if tokenizer is None:
        return bool(int(probs.argmax()) == target and p > min_prob), p
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    text = convert([target])[0] if convert is not None else tokenizer.decode([target])
    short = int(dpa_context(tokenizer, ids.cpu()).sum()) <= max_context
    return bool(int(probs.argmax()) == target and p > min_prob and len(text) > 1 and short), p
