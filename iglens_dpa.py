"""Dual Path Attribution's ablation benchmark (notebook 10), and every method's scores on it.

A peer's benchmark (DPA, arXiv 2603.19742, lab-paper-code/dual_path_attribution,
experiments/ablation/ablation_pipe.py): every attention edge (block, head, query, key) and every MLP
neuron (block, position, neuron) of one item, ranked together by a method's score; zero the top
fraction x ("disrupt") or all but it ("recover") and read the target's probability at the last
position. One machinery serves the ablation and the gradient baselines: multiplicative gates on the
post-softmax attention weights and on the down projection's input (1 = as the model computes it,
0 = zeroed; d p / d gate = activation x gradient).

Imports :mod:`iglens_core`, :mod:`iglens_baselines` and :mod:`iglens_graph` and holds, in reading
order: the protocol (``dpa_order``, ``dpa_ablation``, ``dpa_areas``, ``dpa_kept``), the methods'
scores for the same items (``dpa_scores``: IG-Lens, AtP, gradient x activation, activation, random,
exhaustive, DPA) and DPA itself (``dpa_attribution``: its sweep, on :mod:`iglens_graph`'s frozen blocks).
"""

from __future__ import annotations

import math
import sys
import warnings
from contextlib import contextmanager
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from iglens_core import (DEFAULT_MEMORY_BUDGET, Readout, check_quantity, check_sequence, collect_components,
                         components, eager_attention, first_output, get_adapter, head_counts, logits_at_end,
                         plain_number, projection_weight, sublayer_module, sublayer_projection)
from iglens_baselines import frozen_parameters
from iglens_graph import REBUILD_TOLERANCE, LinearBlock, block_parts, freeze_norm, record_pass


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
DPA_METHODS = ("ig_lens", "ig_lens_gauss", "atp", "atp_last", "grad_x_act", "activation", "random",
               "exhaustive", "dpa")


def dpa_layout(model) -> tuple[int, int, int]:
    """``(n, H, d_ff)``: blocks, attention heads (query heads under GQA) and MLP neurons."""
    adapter = get_adapter(model)
    d_ff = projection_weight(sublayer_projection(adapter.blocks[0], "mlp")[0])[0].shape[1]
    return adapter.n_layers, head_counts(model)[0], int(d_ff)


@contextmanager
def _gates(model, edges=None, neurons=None, record: Optional[dict] = None):
    """Run the model with gated attention weights and MLP activations (eager attention).

    For the duration, block L's post-softmax attention weights ``A`` (B, H, S, S) become
    ``A * edges[L]`` (no renormalisation; the heads' outputs are recomputed as ``(A * gate) @ v``,
    values of the shared key/value head under GQA), and its down projection's input ``act``
    (B, S, d_ff) (the gated unit ``act_fn(gate) * up``, GPT-2's ``act_fn`` output) becomes
    ``act * neurons[L]``; a None entry (or list) leaves that block as it is.

    Route: the core's :func:`iglens_core.eager_attention` switches the model to its eager
    attention, and the modeling module's ``eager_attention_forward`` (what transformers 5.x
    attention modules call for ``"eager"``; looked up at call time) is wrapped for the duration.
    The wrapper checks that the weights rebuild the eager output (``A @ v``) and that every gated
    block was reached; else a ValueError names the architecture.

    Args:
        edges, neurons: per block, a gate broadcastable to (B, H, S, S) / (B, S, d_ff), or None.
        record: if a dict, gets ``"weights"`` and ``"acts"``: per block the ungated tensors; and
            ``"qk"``: per block ``(query (B, H, S, hd), key (B, H_kv, S, hd), scaling, softcap)`` as
            the attention passes them to ``eager_attention_forward`` (after any rotary embedding).
    """
    adapter = get_adapter(model)
    n = adapter.n_layers
    edges, neurons = edges or [None] * n, neurons or [None] * n
    attentions = [sublayer_module(block, "attn") for block in adapter.blocks]
    index = {id(module): layer for layer, module in enumerate(attentions)}
    reached = set()
    if record is not None:
        record.update(weights=[None] * n, acts=[None] * n, qk=[None] * n)

    def gate_neurons(layer):
        def hook(module, args):
            if record is not None:
                record["acts"][layer] = args[0]
            if neurons[layer] is None:
                return None
            return (args[0] * neurons[layer].to(args[0]),) + tuple(args[1:])
        return hook

    def wrap(original):
        def eager(module, query, key, value, attention_mask, *args, **kwargs):
            out, weights = original(module, query, key, value, attention_mask, *args, **kwargs)
            layer = index.get(id(module))
            if layer is None:
                return out, weights
            reached.add(layer)
            if record is not None:
                record["weights"][layer] = weights
                scaling = kwargs.get("scaling", args[0] if args else None)
                record["qk"][layer] = (query, key, scaling, kwargs.get("softcap"))
            if edges[layer] is None:
                return out, weights
            values = value[:, torch.arange(weights.shape[1], device=value.device)
                           // (weights.shape[1] // value.shape[1])]  # (B, H, S, hd) repeat_kv
            with torch.no_grad():
                rebuilt = torch.matmul(weights, values).transpose(1, 2)
                same = torch.allclose(rebuilt, out, rtol=1e-3, atol=1e-4 * float(out.abs().max()) + 1e-6)
            if not same:
                raise ValueError(f"{type(module).__name__}: the eager attention output is not A @ v; "
                                 "its weights cannot be gated here (an unsupported architecture?)")
            weights = weights * edges[layer].to(weights)
            return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights
        return eager

    patched, hooks = [], []
    try:
        if any(gate is not None for gate in edges) or record is not None:
            for name in {type(module).__module__ for module in attentions}:
                modeling = sys.modules[name]
                original = getattr(modeling, "eager_attention_forward", None)
                if original is None:
                    raise ValueError(f"{name} has no eager_attention_forward: attention weights cannot be "
                                     "gated for this architecture")
                setattr(modeling, "eager_attention_forward", wrap(original))
                patched.append((modeling, original))
        for layer, block in enumerate(adapter.blocks):
            if neurons[layer] is not None or record is not None:
                hooks.append(sublayer_projection(block, "mlp")[0].register_forward_pre_hook(gate_neurons(layer)))
        with eager_attention(model):
            yield
        missing = [layer + 1 for layer in range(n) if (edges[layer] is not None or record is not None)
                   and layer not in reached]
        if missing:
            raise ValueError(f"the attention of blocks {missing[:5]} never called eager_attention_forward: "
                             "attention weights cannot be gated for this architecture")
    finally:
        for modeling, original in patched:
            setattr(modeling, "eager_attention_forward", original)
        for hook in hooks:
            hook.remove()


def _dpa_item(model, input_ids, target) -> tuple[torch.Tensor, int]:
    """Validate one item: ``(input_ids (1, S) long on the model's device, target)``; the model in eval
    mode, the ids within its vocabulary and context (:func:`iglens_core.check_sequence`)."""
    ids, target = torch.as_tensor(input_ids), plain_number(target)
    ids = ids[None] if ids.dim() == 1 else ids
    vocab = model.get_input_embeddings().num_embeddings
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be (1, S) integer token ids with S >= 1, got shape "
                         f"{tuple(ids.shape)} and dtype {ids.dtype}")
    if not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
        raise ValueError(f"token ids must lie in 0..{vocab - 1} (the model's vocabulary), got "
                         f"{ids[(ids < 0) | (ids >= vocab)].unique()[:5].tolist()}")
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < vocab:
        raise ValueError(f"target must be a token id in 0..{vocab - 1}, got {target!r}")
    return check_sequence(model, ids, None).long().to(next(model.parameters()).device), int(target)


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


def _dpa_flat_scores(scores: dict, n: int, H: int, S: int, d_ff: int) -> np.ndarray:
    """(n H S S + n S d_ff,) float64: the edge scores then the neuron scores, C order; a missing
    entry (key absent or None) scores 0."""
    if not isinstance(scores, dict) or not set(scores) <= {"edges", "neurons"}:
        raise ValueError(f"scores must be a dict with keys 'edges' and/or 'neurons', got "
                         f"{sorted(scores) if isinstance(scores, dict) else type(scores).__name__}")
    parts = []
    for key, shape in (("edges", (n, H, S, S)), ("neurons", (n, S, d_ff))):
        value = scores.get(key)
        value = np.zeros(shape) if value is None else _as_scores(value, f"scores[{key!r}]")
        if value.shape != shape:
            raise ValueError(f"scores[{key!r}] must have shape {shape}, got {value.shape}")
        parts.append(value.ravel())
    return np.concatenate(parts)


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
        with _gates(model, edge_gates, neuron_gates):
            logits = logits_at_end(model, 1, input_ids=ids.expand(len(rows), -1))[:, -1]
        out.append(torch.softmax(logits.double(), -1)[:, target].cpu())
    return torch.cat(out)


@torch.no_grad()
def dpa_ablation(model, input_ids, target: int, scores: dict, *, mode: str = "disrupt",
                 fractions: Optional[Sequence[float]] = None, ties: str = "random", seed: int = 0,
                 batch_size: Optional[int] = None, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> np.ndarray:
    """Dual Path Attribution's component ablation for one item: relative drops in percent.

    Components: every attention edge (block, head, query position, key position), ablated by
    setting that post-softmax weight to 0 with no renormalisation, and every MLP neuron (block,
    position, neuron), ablated by setting its activation (the input of the down projection: the
    gated unit's ``act_fn(gate) * up``, which is 0 exactly when the original's ``act_fn`` output
    is) to 0. All ``N = n H S^2 + n S d_ff`` of them (edges above the diagonal included, as in the
    original's count) are ranked together by the signed score, descending, tied scores in a seeded
    random order (:func:`dpa_order`).
    For each fraction x, ``k = ceil(N x)``: ``"disrupt"`` zeroes the top k, ``"recover"`` all but
    the top k. The result is ``(p_base - p_x) / p_base * 100`` with p the target's probability at
    the last position (the model's own logits, soft-capping included).

    The unablated row and every fraction's row go through the model together, batched per
    forward pass (``batch_size`` rows, default: as many as ``memory_budget`` allows; 11 rows of a
    short prompt fit in one pass of the packaged models).

    Departures from the original (ablation_pipe.py, nnsight, bfloat16, batches of padded items):
    p is read from the model's final logits after Gemma's final soft-capping (the original reads
    ``lm_head``'s output, before it); scores are float64, equal within a tolerance and then ordered
    by a seeded permutation, not by an unstable bfloat16 argsort; the model runs in its own dtype (float32
    here) with eager attention (required: the weights exist only there; switched back afterwards);
    under GQA an edge is a query head's weight (the original's layout, H = num_attention_heads),
    its value the shared key/value head's; sliding windows and attention soft-capping act before
    the softmax, so they are kept as the model computes them; one unpadded item per call, so the
    whole sequence is the "context" in recover.

    Args:
        model: a causal LM whose attention calls its modeling module's ``eager_attention_forward``
            (Llama, Gemma 2/3, Qwen, Mistral, ...).
        input_ids: (1, S) or (S,) the prompt; the target is predicted after its last token.
        target: the target token id.
        scores: ``{"edges": (n, H, S, S), "neurons": (n, S, d_ff)}`` (torch or numpy); a missing
            key or None scores every such component 0.
        mode: ``"disrupt"`` or ``"recover"``.
        fractions: values in [0, 1]; default :data:`DPA_FRACTIONS` (exp(-17), exp(-15.2), ...,
            exp(-0.8), 10 points).
        ties, seed: the order of tied scores (:func:`dpa_order`); ``"random"`` with the same seed
            for every method of an item, so methods that leave the same components unscored keep
            the same ones.
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
    ids, target = _dpa_item(model, input_ids, target)
    layout = dpa_layout(model)
    flat = _dpa_flat_scores(scores, layout[0], layout[1], ids.shape[1], layout[2])
    rank = np.empty(flat.size, dtype=np.int64)
    rank[dpa_order(flat, ties=ties, seed=seed)] = np.arange(flat.size)
    counts = np.ceil(flat.size * fractions)  # (F,) components in the top x
    top = rank[None, :] < counts[:, None]  # (F, N)
    zero = np.concatenate([np.zeros((1, flat.size), bool), top if mode == "disrupt" else ~top])
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


# -- the methods' scores for the same items ----------------------------------------------------

def _empty_scores(n: int, H: int, S: int, d_ff: int) -> dict:
    return {"edges": torch.zeros(n, H, S, S, dtype=torch.float64),
            "neurons": torch.zeros(n, S, d_ff, dtype=torch.float64)}


def _gate_gradients(model, ids: torch.Tensor, target: int, quantity: str) -> tuple[dict, dict]:
    """Activation x gradient of every edge and neuron, from one forward and one backward pass.

    With unit gates ``g`` on the attention weights and activations (:func:`_gates`),
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
    with torch.enable_grad(), frozen_parameters(model), _gates(model, edges, neurons, record):
        logits = logits_at_end(model, 1, input_ids=ids)[0, -1]
        value = torch.softmax(logits.double(), -1)[target] if quantity == "prob" else logits[target]
        grads = torch.autograd.grad(value, edges + neurons)
    scores = {"edges": torch.cat(grads[:n]).double().cpu(), "neurons": torch.cat(grads[n:]).double().cpu()}
    activations = {"edges": torch.cat(record["weights"]).detach().double().cpu(),
                   "neurons": torch.cat(record["acts"]).detach().double().cpu()}
    return scores, activations


def _exhaustive_scores(model, ids: torch.Tensor, target: int, subset: int, seed: int, batch_size: Optional[int],
                       memory_budget: int) -> dict:
    """``p_base - p`` with one component zeroed, for ``subset`` components drawn (seeded) from the
    edges at or below the diagonal and the neurons; every other component scores 0."""
    n, H, d_ff = layout = dpa_layout(model)
    S = ids.shape[1]
    scores = _empty_scores(n, H, S, d_ff)
    causal = torch.ones(S, S, dtype=torch.bool).tril().expand(n, H, S, S).flatten()
    pool = np.concatenate([np.flatnonzero(causal.numpy()), causal.numel() + np.arange(n * S * d_ff)])
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
               quantity: str = "prob", subset: int = 128, readout: Optional[Readout] = None,
               batch_size: Optional[int] = None, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> dict:
    """A method's score of every attention edge and MLP neuron of one item, for :func:`dpa_ablation`.

    Methods (:data:`DPA_METHODS`), higher = more important for the target:

    - ``"ig_lens"`` / ``"ig_lens_gauss"``: IG-Lens components (prediction-aware / Gauss-Legendre,
      ``steps`` points per segment, ``quantity`` its readout) at the predicting position only:
      each (block, head, source position) share is the score of the edge (block, head, last query,
      source), each neuron's share that of the neuron at the last position; the other positions'
      components score 0 (IG-Lens does not attribute them). The edge scores of a head add up to its
      share. One forward pass plus the readout's closed-form gradients; no backward.
    - ``"atp"``: attribution patching with a zero baseline, ``a * d p(target) / d a`` for every
      attention weight and every activation at every position (one forward, one backward).
    - ``"atp_last"``: the same restricted to the last query row and the last position, a control
      for IG-Lens's restriction.
    - ``"grad_x_act"``: ``a * d logit(target) / d a`` (the original's AtP, on the logit).
    - ``"activation"``: the attention weight for an edge, ``|a|`` for a neuron (one ranking over
      two scales, as the original's attn_act and mlp_act pooled).
    - ``"random"``: standard normal draws (``seed``).
    - ``"dpa"``: Dual Path Attribution as the original runs it (:func:`dpa_attribution`, its default
      weights), on the target logit, every edge and neuron at every position.
    - ``"exhaustive"``: the drop ``p_base - p`` when one component alone is zeroed, for ``subset``
      components drawn (``seed``) from the edges at or below the diagonal and the neurons; the
      rest score 0. A reference ceiling on that subset only; ``subset + 1`` rows of forward passes.

    Returns:
        ``{"edges": (n, H, S, S), "neurons": (n, S, d_ff)}`` float64 on the CPU; for the edges,
        ``[block, head, query, key]``.
    """
    if method not in DPA_METHODS:
        raise ValueError(f"method must be one of {DPA_METHODS}, got {method!r}")
    seed, steps, subset = (plain_number(value) for value in (seed, steps, subset))
    for name, value, low in (("seed", seed, 0), ("steps", steps, 1), ("subset", subset, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    check_quantity(quantity)
    _check_budget(memory_budget)
    ids, target = _dpa_item(model, input_ids, target)
    n, H, d_ff = dpa_layout(model)
    S = ids.shape[1]
    if method in ("ig_lens", "ig_lens_gauss"):
        return _ig_lens_scores(model, ids, target, "prediction_aware" if method == "ig_lens" else "gauss_legendre",
                               steps, quantity, readout)
    if method == "dpa":
        return {key: value for key, value in dpa_attribution(model, ids, target).items() if key in ("edges", "neurons")}
    if method == "random":
        rng = np.random.default_rng(seed)
        return {"edges": torch.from_numpy(rng.standard_normal((n, H, S, S))),
                "neurons": torch.from_numpy(rng.standard_normal((n, S, d_ff)))}
    if method == "exhaustive":
        return _exhaustive_scores(model, ids, target, subset, seed, batch_size, memory_budget)
    if method == "activation":
        record: dict = {}
        with _gates(model, record=record):
            model(ids, use_cache=False)
        return {"edges": torch.cat(record["weights"]).double().cpu(),
                "neurons": torch.cat(record["acts"]).double().abs().cpu()}
    scores = _gate_gradients(model, ids, target, "logit" if method == "grad_x_act" else "prob")[0]
    if method == "atp_last":
        scores["edges"][:, :, :S - 1] = 0
        scores["neurons"][:, :S - 1] = 0
    return scores


def dpa_kept(model, tokenizer, input_ids, target: int, *, min_prob: float = 0.1) -> tuple[bool, float]:
    """The original's item filter: ``(kept, p)``, kept when the model's arg-max at the last position
    is the target, ``p(target) > min_prob`` and the target's text is longer than one character."""
    min_prob = plain_number(min_prob)
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob < 1.0:
        raise ValueError(f"min_prob must be a probability in [0, 1), got {min_prob!r}")
    ids, target = _dpa_item(model, input_ids, target)
    with torch.no_grad():
        probs = torch.softmax(logits_at_end(model, 1, input_ids=ids)[0, -1].double(), -1)
    p = float(probs[target])
    text = tokenizer.decode([target]) if tokenizer is not None else "xx"
    return bool(int(probs.argmax()) == target and p > min_prob and len(text) > 1), p


# -- Dual Path Attribution itself ----------------------------------------------------------------

DPA_WEIGHTS = {"q": 0.25, "k": 0.25, "v": 0.5, "gate": 0.5, "up": 0.5}  # the original's --dpa_weights default
DPA_NEURONS_AT = ("mid", "post")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


class _RotarySide:
    """The queries (or keys) of one block at fixed norm scales, a linear map ``z (S, d) -> (heads, S, hd)``
    (projection, query/key norm, rotary embedding), rebuilt in float64 and checked against the recorded
    ones; :meth:`back` is its transpose."""

    def __init__(self, proj: nn.Module, norm: Optional[nn.Module], heads: int, z: torch.Tensor, rotary,
                 recorded: torch.Tensor, where: str):
        weight, bias = projection_weight(proj)
        self.W = weight.double().cpu()  # (heads * hd, d)
        pre = z @ self.W.T + (bias.double().cpu() if bias is not None else 0.0)  # (S, heads * hd)
        S, hd = z.shape[0], recorded.shape[-1]
        self.norm, self.width = None, hd
        if isinstance(norm, nn.Module):  # Qwen3, Gemma 3: an RMSNorm per head (or over all heads)
            weight = getattr(norm, "weight", None)
            self.width = weight.shape[-1] if isinstance(weight, torch.Tensor) else hd
            rows = pre.reshape(-1, self.width)
            out = norm(rows.to(proj.weight.device, proj.weight.dtype)).double().cpu()  # the module's own
            self.norm = freeze_norm(norm, rows, out, where)
            pre = self.norm.forward(rows).reshape(S, -1)
        no_rotation = (torch.ones(S, hd, dtype=torch.float64), torch.zeros(S, hd, dtype=torch.float64))
        cos, sin = rotary if rotary is not None else no_rotation
        if cos.shape != (S, hd):
            raise ValueError(f"{where}: rotary tables of shape {tuple(cos.shape)}, expected {(S, hd)} (partial rotary "
                             "embeddings are not supported by DPA)")
        self.cos, self.sin = cos[:, None], sin[:, None]  # (S, 1, hd)
        x = pre.view(S, heads, hd)
        self.rotated = (x * self.cos + _rotate_half(x) * self.sin).transpose(0, 1)  # (heads, S, hd)
        self.rebuild = float((self.rotated - recorded).norm() / recorded.norm().clamp_min(1e-30))

    def back(self, cot: torch.Tensor) -> torch.Tensor:
        """(heads, S, hd) on the rotated vectors -> (S, d) on the normed block input ``z``."""
        cot = cot.transpose(0, 1)  # (S, heads, hd)
        cot = (cot * self.cos - _rotate_half(cot * self.sin)).reshape(cot.shape[0], -1)  # transpose of the rotation
        if self.norm is not None:
            cot = self.norm.back(cot.reshape(-1, self.width)).reshape(cot.shape[0], -1)
        return cot @ self.W


def _gate_gain(act, g: torch.Tensor) -> torch.Tensor:
    """``act(g) / g`` elementwise (``act'(0)`` where ``g == 0``): for SiLU ``sigmoid(g)``."""
    zero = torch.zeros(1, dtype=g.dtype, requires_grad=True)
    with torch.enable_grad():
        (slope,) = torch.autograd.grad(act(zero).sum(), zero)
    return torch.where(g != 0, act(g) / torch.where(g != 0, g, torch.ones_like(g)), slope)


def _dpa_weights(weights) -> dict:
    if weights is None:
        return dict(DPA_WEIGHTS)
    if not isinstance(weights, dict) or set(weights) != set(DPA_WEIGHTS):
        raise ValueError(f"weights must be a dict with the keys {sorted(DPA_WEIGHTS)}, got "
                         f"{sorted(weights) if isinstance(weights, dict) else type(weights).__name__}")
    for key, value in weights.items():
        value = plain_number(value)
        if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
                or not math.isfinite(value)):
            raise ValueError(f"weights[{key!r}] must be a finite number, got {value!r}")
    return {key: float(plain_number(value)) for key, value in weights.items()}


def _dpa_record(model, adapter, parts: list, ids: torch.Tensor) -> tuple[dict, dict]:
    """One eager pass: the graph's record (:func:`iglens_graph.record_pass`: block inputs and outputs,
    patterns, norm inputs and outputs, float64) and what DPA reads besides: per block the rotated
    queries and keys and the score scale (at ``eager_attention_forward``, :func:`_gates`) and the
    rotary tables (the attention's ``position_embeddings``); the final norm's output at the last position."""
    extra, record = {}, {}

    def rotary(layer):
        def hook(module, args, kwargs):
            tables = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            if isinstance(tables, (tuple, list)) and len(tables) == 2:
                extra["rotary", layer] = tuple(table.detach()[0].double().cpu() for table in tables)  # (S, hd) each
        return hook

    hooks = [part["attention"].register_forward_pre_hook(rotary(layer), with_kwargs=True)
             for layer, part in enumerate(parts)]
    hooks.append(adapter.norm.register_forward_hook(
        lambda module, args, out: extra.__setitem__("final", first_output(out).detach()[0, -1:].double().cpu())))
    try:
        with _gates(model, record=record):
            store = record_pass(model, adapter, parts, ids)
    finally:
        for hook in hooks:
            hook.remove()
    extra["qk"] = record["qk"]
    return store, extra


@torch.no_grad()
def dpa_attribution(model, input_ids, target: int, *, weights: Optional[dict] = None,
                    neurons_at: str = "mid") -> dict:
    """Dual Path Attribution (DPA, arXiv 2603.19742) of one item: every attention edge and MLP neuron
    at every position, in the unit of the target logit (at the last position).

    Followed: lab-paper-code/dual_path_attribution, ``tracer/tracer.py`` (``BaseTracer._init_gradients``,
    ``ComponentTracer.batch_trace``) and ``tracer/backend.py`` (``Llama2Backend.get_mlp_update``,
    ``get_attn_update``, ``get_component_contributions``; ``Qwen3Backend`` for query/key norms), as
    ``DPAComponentAttribution`` in ``experiments/attribution/component_attribution_modules.py`` runs them.

    Top: the target's unembedding row through the final norm at its recorded scale, at the last
    position (the target logit's gradient w.r.t. ``h_n`` with the norm's denominator fixed). Then block
    n down to 1, one cotangent ``c`` on every residual state (every position), sent back along weighted paths:

    - MLP (``h_(L+1)`` to ``mid_L``): neuron cotangents ``c_m = W_down^T c`` (through a Gemma post-norm
      at its fixed scale). The gated unit ``act(g) * u`` is linearised along two paths: up (content),
      ``act(g)`` fixed, ``c_m act(g)`` back through ``W_u``; gate (control), ``act(g) = g s(g)`` with the
      gain ``s(g) = act(g) / g`` fixed (SiLU: ``sigmoid(g)``, the original's ``gate_proj.sigmoid()``),
      ``c_m u s(g)`` back through ``W_g``; weighted ``weights["up"]``, ``weights["gate"]``; then through
      the pre-MLP norm at its fixed scale; plus the residual.
    - attention (``mid_L`` to ``h_L``): value path (content), the patterns fixed, back through the output
      projection (and a post-norm), ``A^T``, ``W_v`` and the input norm, weight ``weights["v"]``; query and
      key paths (control), the softmax's exact backward ``delta = A (<back_q, v_k> - <back_q, z_q>)`` to
      the rotated queries and keys (times the score scale), the transposed rotary map, the query/key norms
      (Qwen3, Gemma 3), ``W_q`` / ``W_k`` and the input norm, weights ``weights["q"]``, ``weights["k"]``,
      the values fixed; plus the residual. Every norm's denominator is fixed at the recorded pass, in every path.

    Scores: edge ``(L, h, q, k) = A_h(q, k) <W_o^h v_h(k), c_mid_L(q)>`` (its write into ``mid_L``, through
    a post-norm at fixed scale); neuron ``(L, s, i) = m_i(s) <W_down[:, i], c(s)>`` with ``c`` the cotangent
    on ``mid_L`` (``neurons_at="mid"``: the original reads both kinds against ``residual_targets["mid.L"]``,
    the MLP's own input) or on ``h_(L+1)``, the state the MLP writes into (``"post"``).

    Completeness: with ``v = 1``, ``q = k = 0`` and ``gate + up = 1`` every map is exact on its linear
    part (``w_gate g s(g) + w_up act(g) = act(g)``; ``A v`` at a fixed pattern): ``carried[L].sum() +
    constants[L:].sum() == logit`` for every L. The default weights keep the MLP exact but not the
    attention (its query/key terms are not its output), so the sums miss the logit.

    Where this differs from the original: every norm scale with the model's own epsilon (the original:
    ``rsqrt(mean(x^2) + 1e-7)`` for all); a float64 sweep from the recorded pass (the original: bfloat16);
    the gate gain ``act(g) / g`` (equal to ``sigmoid`` for SiLU) so that GeGLU works, and Gemma 3's
    ``(1 + w)`` gains, sandwich post-norms and query/key norms at fixed scale (the original has Llama 2/3.1,
    Qwen2.5, Qwen3 and Mistral backends, no Gemma); the exact transpose of the rotary map,
    ``G cos - rotate_half(G sin)`` (the original's ``G cos - rotate_half(G) sin`` is the same for tables
    whose halves match, as all of those); a soft-capped head's logit before the cap; sliding windows as
    the model computes them (the original refuses them); one unpadded item. Non-gated MLPs (GPT-2), fused
    query/key projections (Phi-3) and attention soft-capping (Gemma 2) raise a ValueError.

    Args:
        model: a causal LM with gated MLPs and rotary attention (Llama, Qwen2/3, Mistral, Gemma 3), eval mode.
        input_ids: (1, S) or (S,) the prompt; the target is predicted after its last token.
        target: the target token id.
        weights: the path weights ``{"q", "k", "v", "gate", "up"}``; default :data:`DPA_WEIGHTS`.
        neurons_at: ``"mid"`` (the original) or ``"post"``.

    Returns:
        ``{"edges": (n, H, S, S) [block, head, query, key], "neurons": (n, S, d_ff), "embeddings": (S,),
        "carried": (n+1, S) <c_L(s), h_L(s)>, "constants": (n+1,) credit of each block's biases (value path
        and outputs) and, last, of the head's (final norm's beta, head bias), "logit": the target logit}``,
        float64 on the CPU; ``embeddings`` is ``carried[0]``, DPA's input attribution.
    """
    weights = _dpa_weights(weights)
    if neurons_at not in DPA_NEURONS_AT:
        raise ValueError(f"neurons_at must be one of {DPA_NEURONS_AT}, got {neurons_at!r}")
    ids, target = _dpa_item(model, input_ids, target)
    adapter, (H, H_kv) = get_adapter(model), head_counts(model)
    n, name = adapter.n_layers, type(model).__name__
    parts = [block_parts(block, layer) for layer, block in enumerate(adapter.blocks)]
    for layer, part in enumerate(parts):
        attention = part["attention"]
        if part["kind"] != "gated" or not all(isinstance(getattr(attention, proj, None), nn.Module)
                                               for proj in ("q_proj", "k_proj")):
            raise ValueError(f"{name}: DPA propagates through gated MLPs (act(W_g z) * W_u z) and separate query "
                             f"and key projections; block {layer + 1} has a {part['kind']} MLP "
                             f"({type(part['mlp']).__name__}) and attention {type(attention).__name__}")
    store, extra = _dpa_record(model, adapter, parts, ids)
    h_n = store["h", n]  # (S, d)
    final = freeze_norm(adapter.norm, h_n[-1:], extra["final"], "the final norm")
    head_weight, head_bias = projection_weight(adapter.head)
    row = head_weight[target].double().cpu()  # (d,)
    cot = torch.zeros_like(h_n)  # (S, d) the cotangent on h_L, L = n first
    cot[-1] = adapter.logit_scale * final.back(row[None])[0]
    constants = torch.zeros(n + 1, dtype=torch.float64)
    constants[n] = adapter.logit_scale * (float(row @ final.beta) if final.beta is not None else 0.0)
    constants[n] += adapter.logit_scale * (float(head_bias[target]) if head_bias is not None else 0.0)
    S = h_n.shape[0]
    edges = torch.zeros(n, H, S, S, dtype=torch.float64)
    neurons, carried = [None] * n, torch.zeros(n + 1, S, dtype=torch.float64)
    carried[n] = (cot * h_n).sum(-1)
    for layer in reversed(range(n)):
        part, where = parts[layer], f"{name} block {layer + 1}"
        block = LinearBlock(part, store, layer, H, H_kv, path=False)
        query, key, scaling, softcap = extra["qk"][layer]
        if softcap is not None:
            raise ValueError(f"{where}: attention soft-capping is not supported by DPA")
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5  # eager's default
        z, attention = block.norm1.forward(store["h", layer]), part["attention"]
        sides = [_RotarySide(getattr(attention, proj), getattr(attention, norm, None), heads, z,
                             extra.get(("rotary", layer)), recorded[0].double().cpu(), f"{where} {proj}")
                 for proj, norm, heads, recorded in (("q_proj", "q_norm", H, query), ("k_proj", "k_norm", H_kv, key))]
        rebuild = max(block.rebuild, *(side.rebuild for side in sides))
        if rebuild > REBUILD_TOLERANCE:
            raise ValueError(f"{where}: the frozen block does not rebuild the recorded pass (relative gap "
                             f"{rebuild:.1e}); this architecture computes its blocks otherwise than DPA assumes")
        # MLP: up path (act(g) fixed) and gate path (gain act(g)/g fixed) in the graph's a, b slots
        block.a = weights["gate"] * _gate_gain(part["act"], block.g)  # (S, d_ff)
        block.b = weights["up"] * part["act"](block.g)
        c_m, const_down = block.mlp_from_output(cot)  # (S, d_ff)
        c_z, const_mlp = block.mlp_to_input(c_m)
        cot_mid = cot + c_z  # (S, d) on mid_L
        neurons[layer] = (c_m if neurons_at == "post" else block.mlp_from_output(cot_mid)[0]) * block.m
        # attention: value path (patterns fixed), then query and key paths (the softmax's backward)
        back, const_out = block.attn_from_output(cot_mid)  # (S, H, hd) on each head's output
        reads = torch.einsum("qhd,khd->hqk", back, block.v_heads)  # (H, S, S) <back_q, v_k>
        edges[layer] = block.A * reads
        c_v, const_in = block.attn_to_input(back)
        delta = edges[layer] - block.A * (back * block.zh).sum(-1).T[:, :, None]  # (H, S, S) on the scores
        queries, keys = sides[0].rotated, sides[1].rotated[block.group]  # (H, S, hd)
        c_q = scaling * torch.einsum("hqk,hkd->hqd", delta, keys)
        c_k = scaling * torch.einsum("hqk,hqd->hkd", delta, queries)  # summed over each key head's group:
        c_k = torch.zeros_like(sides[1].rotated).index_add_(0, block.group, c_k)
        c_qk = block.norm1.back(weights["q"] * sides[0].back(c_q) + weights["k"] * sides[1].back(c_k))
        cot = cot_mid + weights["v"] * c_v + c_qk
        constants[layer] = const_down + const_mlp + const_out + weights["v"] * const_in
        carried[layer] = (cot * store["h", layer]).sum(-1)
    return {"edges": edges, "neurons": torch.stack(neurons), "embeddings": carried[0].clone(), "carried": carried,
            "constants": constants, "logit": float(carried[n].sum() + constants[n])}
