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

import math
import warnings
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from iglens_core import (DEFAULT_MEMORY_BUDGET, Readout, check_quantity, collect_components, components,
                         get_adapter, head_counts, logits_at_end, plain_number, projection_weight, quadrature,
                         sublayer_module, sublayer_projection)
from iglens_baselines import frozen_parameters
from iglens_graph import attribution_graph
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
               "attn_act", "mlp_act", "random", "exhaustive", "dpa")
# earlier names, still accepted: "grad_x_act" was DPA's AtP (now "atp"), "atp_last" AtP on p at the last
# position (now "atp_prob_last"); "activation" ranks attn_act's and |down projection input| together
DPA_ALIASES = {"grad_x_act": "atp", "atp_last": "atp_prob_last"}
MASK_QUANTITIES = ("prob", "logprob", "logit")


def dpa_layout(model) -> tuple[int, int, int]:
    """``(n, H, d_ff)``: blocks, attention heads (query heads under GQA) and MLP neurons."""
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
    key = np.arange(x.size) if ties == "index" else np.random.default_rng(seed).permutation(x.size)
    return np.lexsort((key, -x))  # by score descending, then by the tie key


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

    The unablated row and every fraction's row go through the model together, batched per
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
    probs = _zeroed_probs(model, ids, target, zero, layout, batch_size, memory_budget)
    return ((probs[0] - probs[1:]) / probs[0] * 100).numpy()


def dpa_areas(disrupt, recover, fractions: Optional[Sequence[float]] = None, *, anchors: bool = True,
              scale: str = "linear") -> dict:
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

    Args:
        disrupt, recover: (items, F) or (F,) drops in percent from :func:`dpa_ablation` (NaN
            entries are left out of the mean).
        fractions: the F fractions; default :data:`DPA_FRACTIONS`.
        scale: ``"linear"`` (the original) or ``"log"``.

    Returns:
        ``{"disturb_aoc", "recover_aoc", "total"}`` floats.
    """
    if scale not in ("linear", "log"):
        raise ValueError(f"scale must be 'linear' or 'log', got {scale!r}")
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

class MaskIG(NamedTuple):
    """Integrated gradients over the component gates of one item (:func:`mask_ig`).

    Attributes:
        scores: ``{"edges": (n, H, S, S), "neurons": (n, S, d_ff)}`` float64, each gate's integral
            (0 for the components outside the context, whose gates stay at 1).
        f_on, f_off: f with every gate at 1 (the model as it is) and every varied gate at 0.
        gap: ``sum(scores) - (f_on - f_off)``, the completeness gap of the quadrature.
        steps: quadrature points; quantity: f.
    """
    scores: dict
    f_on: float
    f_off: float
    gap: float
    steps: int
    quantity: str


def _target_values(logits: torch.Tensor, target: int, quantity: str) -> torch.Tensor:
    """(B,) float64 f at the last position from (B, V) logits: p, log p or the logit (after any soft-cap)."""
    logits = logits.double()
    if quantity == "logit":
        return logits[:, target]
    return (torch.softmax if quantity == "prob" else torch.log_softmax)(logits, -1)[:, target]


def _mask_ig(model, ids: torch.Tensor, target: int, steps: int, quantity: str, context: np.ndarray,
             batch_size: Optional[int], memory_budget: int) -> MaskIG:
    n, H, d_ff = dpa_layout(model)
    S, param = ids.shape[1], next(model.parameters())
    inside = torch.from_numpy(context).to(ids.device)
    vary_edges, vary_neurons = inside[:, None] & inside[None, :], inside[:, None]  # (S, S), (S, 1)
    u, w = quadrature("gauss_legendre", steps)  # (m,) nodes in (0, 1), weights summing to 1
    t, weight = u ** 3, 3 * u ** 2 * w  # t = u^3 crowds the points near 0, where the norms rescale
    vocab = model.get_input_embeddings().num_embeddings
    per_row = (param.element_size() * n * (6 * H * S * S + S * (6 * d_ff + 16 * model.config.hidden_size))
               + 32 * vocab)  # kept for the backward: every block's weights, activations, states
    batch = batch_size or max(1, min(steps, memory_budget // per_row))
    scores = _empty_scores(n, H, S, d_ff)
    for start in range(0, steps, batch):
        level = t[start:start + batch].to(device=ids.device, dtype=param.dtype)[:, None, None, None]  # (B,1,1,1)
        B = len(level)
        edges = [torch.where(vary_edges, level, 1.0).expand(B, H, S, S).clone().requires_grad_(True)
                 for _ in range(n)]
        neurons = [torch.where(vary_neurons, level[:, 0], 1.0).expand(B, S, d_ff).clone().requires_grad_(True)
                   for _ in range(n)]
        with torch.enable_grad(), frozen_parameters(model), gated_run(model, edges, neurons):
            values = _target_values(logits_at_end(model, 1, input_ids=ids.expand(B, -1))[:, -1], target, quantity)
            grads = torch.autograd.grad(values.sum(), edges + neurons)  # rows are independent
        rows = weight[start:start + batch]
        scores["edges"] += torch.einsum("b,lbhqk->lhqk", rows, torch.stack(grads[:n]).double().cpu())
        scores["neurons"] += torch.einsum("b,lbsi->lsi", rows, torch.stack(grads[n:]).double().cpu())
    scores["edges"] *= vary_edges.cpu()
    scores["neurons"] *= vary_neurons.cpu()
    off = ([(~vary_edges).to(param.dtype)[None, None]] * n, [(~vary_neurons).to(param.dtype)[None]] * n)
    f_ends = []
    for gates in (([None] * n, [None] * n), off):  # eager attention in both, as along the path
        with torch.no_grad(), gated_run(model, *gates):
            f_ends.append(float(_target_values(logits_at_end(model, 1, input_ids=ids)[:, -1], target, quantity)[0]))
    f_on, f_off = f_ends
    total = float(scores["edges"].sum() + scores["neurons"].sum())
    return MaskIG(scores, f_on, f_off, total - (f_on - f_off), steps, quantity)


def _check_mask_args(steps, quantity, batch_size, memory_budget) -> int:
    steps = plain_number(steps)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= 10 ** 4:
        raise ValueError(f"steps must be an integer in 1..10000 (quadrature points on the gate path), got {steps!r}")
    if quantity not in MASK_QUANTITIES:
        raise ValueError(f"quantity must be one of {MASK_QUANTITIES}, got {quantity!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    _check_budget(memory_budget)
    return int(steps)


@torch.no_grad()
def mask_ig(model, input_ids, target: int, *, steps: int = 32, quantity: str = "prob", context=None,
            batch_size: Optional[int] = None, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> MaskIG:
    """Total effect of every edge and neuron by integrated gradients over the component gates.

    The EAP-IG family (MIB's circuit track) on :func:`dpa_ablation`'s components: every edge gate
    and every neuron gate (:func:`iglens_dpa_method.gated_run`: a post-softmax attention weight, a down projection's
    input, each times its gate) is scaled together by t from 0 (all zeroed) to 1 (the model as it
    is), and each gate's gradient of f is integrated along that path, times (1 - 0):
    ``score_i = int_0^1 d f / d g_i (t) dt``. By the gradient theorem the scores add up to
    ``f(all on) - f(all off)``; the quadrature's shortfall is returned as ``gap``. The integrand is
    sharp near t = 0 (the norms rescale whatever is left), so the rule crowds its points there:
    ``t = u^3`` on ``steps`` Gauss-Legendre points in u, Jacobian ``3 u^2`` included. Cost:
    ``steps`` forward and backward passes (rows batched per pass).

    Args:
        model, input_ids, target: as :func:`dpa_ablation`.
        steps: Gauss-Legendre points in u (1..10000).
        quantity: f: ``"prob"`` (p(target) at the last position), ``"logprob"`` or ``"logit"``.
        context: (S,) bool (:func:`dpa_context`); the gates outside it stay at 1 and score 0, so
            the path ends where the benchmark's recover does at x = 0. None: every position.
        batch_size: quadrature points per pass, or None (as many as ``memory_budget`` allows).

    Returns:
        :class:`MaskIG`.
    """
    steps = _check_mask_args(steps, quantity, batch_size, memory_budget)
    ids, target = dpa_item(model, input_ids, target)
    return _mask_ig(model, ids, target, steps, quantity, _check_context(context, ids.shape[1]), batch_size,
                    memory_budget)


def mask_ig_gaps(model, input_ids, target: int, steps: Sequence[int] = (8, 16, 32, 64), **kwargs) -> dict:
    """``{m: gap}``: :func:`mask_ig`'s completeness gap ``sum(scores) - (f_on - f_off)`` for each
    number of points m (keyword arguments as :func:`mask_ig`)."""
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


@torch.no_grad()
def dpa_scores(model, input_ids, target: int, method: str, *, seed: int = 0, steps: int = 16,
               mask_steps: int = 32, quantity: str = "prob", subset: int = 128, context=None,
               readout: Optional[Readout] = None, batch_size: Optional[int] = None,
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
      (``mask_steps`` points, gates outside ``context`` held at 1).
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
      weights), on the target logit, every edge and neuron at every position.
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
    method = DPA_ALIASES.get(method, method) if isinstance(method, str) else method
    if method not in DPA_METHODS + ("activation",):
        raise ValueError(f"method must be one of {DPA_METHODS} (or 'activation', "
                         f"{', '.join(repr(a) for a in DPA_ALIASES)}), got {method!r}")
    seed, steps, subset = (plain_number(value) for value in (seed, steps, subset))
    for name, value, low in (("seed", seed, 0), ("steps", steps, 1), ("subset", subset, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    check_quantity(quantity)
    mask_steps = _check_mask_args(mask_steps, quantity, batch_size, memory_budget)
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
        return _mask_ig(model, ids, target, mask_steps, quantity, context, batch_size, memory_budget).scores
    if method == "dpa":
        return {key: value for key, value in dpa_attribution(model, ids, target).items() if key in ("edges", "neurons")}
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
