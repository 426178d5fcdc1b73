"""The causal interventions IG-Lens is tested against: what changes when a state is removed or restored.

Imports :mod:`iglens_core` and holds, in reading order:

1. ablation of a block, its attention or its MLP (``ablation_effects``, notebooks 05 and 06) and of
   sets of attention heads or MLP neurons (``component_ablation``, notebook 07): total effects
   through every later block, the paper's proposed falsification test
2. activation patching: restore the clean residual at the predicting position, every layer in one
   batch (``activation_patching`` -> ``Patching``, notebook 05)
3. causal tracing: restore one clean state (residual, attention or MLP output) at every position and
   layer of a corrupted run, ROME's grid (``causal_trace`` -> ``CausalTrace``, notebook 09), and its
   first-order estimate, attribution patching per state (``atp_states``)

The statistics that compare these effects with attribution scores are in :mod:`iglens_stats`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from iglens_core import (Adapter, Readout, Trace, check_foil, check_quantity, check_same_model, check_sequence, eager_attention, first_output, get_adapter,
                         hidden_arg, logits_at_end, plain_number, precision, replace_first, sublayer_module)
from iglens_core import as_model  # a TransformerLens or nnsight model: the Hugging Face model inside
from iglens_baselines import component_layout
from iglens_stats import restoration_half


ABLATION_MODES = ("zero", "mean")
ABLATION_PARTS = (None, "attn", "mlp")


def _check_ablation(mode: str, batch_size: int) -> None:
    if mode not in ABLATION_MODES:
        raise ValueError(f"mode must be one of {ABLATION_MODES}, got {mode!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")


class _Stop(Exception):
    """Raised by a hook to end a forward pass once what it needs is recorded."""


def _ablation_hook(rows: torch.Tensor, mode: str, whole_block: bool):
    """Forward hook replacing the update of ``rows`` of the batch (one ablated layer per row)."""
    def hook(module, args, kwargs, output):
        out = first_output(output)
        start = hidden_arg(args, kwargs) if whole_block else torch.zeros_like(out)
        update = out[rows] - start[rows]  # (r, L, d) the block's (or sub-module's) update
        replaced = torch.zeros_like(update) if mode == "zero" else update.mean(1, keepdim=True).expand_as(update)
        out = out.clone()
        out[rows] = start[rows] + replaced
        return replace_first(output, out)
    return hook


def _recorded_run(model, adapter: Adapter, input_ids: torch.Tensor, *, sublayer: Optional[str] = None,
                  embed_hook: Optional[Callable] = None):
    """One forward pass of ``input_ids`` (B, S), stopped at the final norm (no head), recording:

    - ``calls``: the ``(args, kwargs)`` each block was called with (masks, rotary embeddings);
    - ``hidden``: (n+1, B, S, d) the residual stream at every node and position (node 0 the input
      of block 1, node L the output of block L, node n the input of the final norm);
    - ``outputs``: (n, B, S, d) the output of each block's ``sublayer`` module (``"attn"`` /
      ``"mlp"``, before any post-norm), or None.

    ``embed_hook``: a forward hook put on the input embedding module for this run (e.g. noise)."""
    n = adapter.n_layers
    calls: list = [None] * n
    outputs: list = [None] * n
    final: list = []

    def record(layer):
        def hook(module, args, kwargs):
            calls[layer] = (tuple(args), dict(kwargs))
        return hook

    def keep(layer):
        def hook(module, args, output):
            outputs[layer] = first_output(output).detach()
        return hook

    def stop(module, args, kwargs):
        final.append(hidden_arg(args, kwargs).detach())
        raise _Stop

    hooks = [block.register_forward_pre_hook(record(layer), with_kwargs=True)
             for layer, block in enumerate(adapter.blocks)]
    hooks.append(adapter.norm.register_forward_pre_hook(stop, with_kwargs=True))
    if sublayer is not None:
        hooks += [sublayer_module(block, sublayer).register_forward_hook(keep(layer))
                  for layer, block in enumerate(adapter.blocks)]
    if embed_hook is not None:
        hooks.append(model.get_input_embeddings().register_forward_hook(embed_hook))
    try:
        model(input_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    hidden = torch.stack([hidden_arg(*call).detach() for call in calls] + final)  # (n+1, B, S, d)
    return calls, hidden, torch.stack(outputs) if sublayer is not None else None


def _run_blocks(adapter: Adapter, calls, first: int, hidden: torch.Tensor, last: Optional[int] = None) -> torch.Tensor:
    """Blocks ``first+1 .. last`` (0-based ``first``; ``last`` default n) on ``hidden`` (B, L, d), with
    the clean call's other arguments (masks, rotary position embeddings: the same for every copy)."""
    for layer in range(first, adapter.n_layers if last is None else last):
        args, kwargs = calls[layer]
        if args:
            out = adapter.blocks[layer](hidden, *args[1:], **kwargs)
        else:
            out = adapter.blocks[layer](**{**kwargs, "hidden_states": hidden})
        hidden = first_output(out)
    return hidden


@torch.no_grad()
def ablation_effects(model, trace: Trace, *, mode: str = "zero", layers: Optional[Sequence[int]] = None,
                     part: Optional[str] = None, batch_size: int = 8) -> torch.Tensor:
    """Drop in each target's probability when one block's residual update is removed.

    For block ``L`` the forward pass is rerun over the whole sequence with that block's update
    replaced at *every* position (prompt and answer), and the effect on target ``t`` is
    ``p_final[t] - p_ablated[t]`` (probability; positive = the block helped), with ``p_final``
    the head-once readout of ``hidden[n]``, which is the model's own probability. This is a
    total causal effect: it includes everything the block's output does through the later
    blocks, which IG-Lens by design does not measure.

    Modes. ``"zero"``: the block becomes an identity (its output is its input), i.e. the update
    ``h_L - h_(L-1)`` is set to 0. ``"mean"``: the update at every position is replaced by its
    mean over the sequence's positions (all of them, the first included), so the block still
    adds its typical vector but nothing position-specific.

    Parts. ``part="attn"`` or ``"mlp"`` removes only that sub-update: the output of the block's
    attention (``self_attn`` / ``attn`` / ``attention``) or MLP module is set to 0 (``"zero"``)
    or to its mean over positions (``"mean"``). For Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX that
    output is exactly the residual update; for Gemma it passes through the block's post-norm
    afterwards (zero stays zero; the mean is taken before that norm).

    Cost. One clean forward records each block's call; then ``batch_size`` copies of the
    sequence, copy ``i`` ablating its own layer, run together from the input of the lowest
    ablated block of the batch (blocks below it are unaffected, so they are not rerun). Each
    run gives all ``T`` targets at once.

    Args:
        model: the causal LM that produced ``trace``.
        trace: from :func:`collect`.
        mode: one of :data:`ABLATION_MODES`.
        layers: blocks to ablate, in ``1..n``; default all.
        part: one of :data:`ABLATION_PARTS`.
        batch_size: sequence copies (ablated layers) per run, >= 1.

    Returns:
        (T, len(layers)) float32 (float64 for a float64 model) probability drops.
    """
    model = as_model(model)
    check_same_model(model, trace)
    _check_ablation(mode, batch_size)
    if part not in ABLATION_PARTS:
        raise ValueError(f"part must be one of {ABLATION_PARTS}, got {part!r}")
    adapter = get_adapter(model)
    n = adapter.n_layers
    if layers is None:
        layers = list(range(1, n + 1))
    layers = [int(layer) for layer in layers]
    bad = [layer for layer in layers if not 1 <= layer <= n]
    if bad or not layers:
        raise ValueError(f"layers must be a non-empty list of blocks in 1..{n}, got {layers}")
    readout = Readout(model)
    device = next(model.parameters()).device
    calls = _recorded_run(model, adapter, trace.input_ids.to(device))[0]
    positions, targets = trace.positions.to(device), trace.targets.to(device)
    order = sorted(range(len(layers)), key=lambda i: layers[i])  # neighbours share a start block
    p_ablated = torch.empty(len(layers), len(targets), dtype=readout.dtype if readout.dtype == torch.float64
                            else torch.float32)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        first = min(layers[i] for i in chunk) - 1  # 0-based block the run starts at
        hooks = [sublayer_module(adapter.blocks[layers[i] - 1], part).register_forward_hook(
            _ablation_hook(torch.tensor([row], device=device), mode, part is None), with_kwargs=True)
            for row, i in enumerate(chunk)]
        try:
            hidden = hidden_arg(*calls[first]).expand(len(chunk), -1, -1)  # (B, L, d)
            hidden = _run_blocks(adapter, calls, first, hidden)
        finally:
            for hook in hooks:
                hook.remove()
        p_ablated[chunk] = readout(hidden[:, positions], targets[None]).cpu().to(p_ablated.dtype)  # (B, T)
    p_final = readout(trace.hidden[-1], trace.targets).to(p_ablated.dtype)  # (T,)
    return p_final[:, None] - p_ablated.T


@torch.no_grad()
def component_ablation(model, trace: Trace, sets: Sequence[Sequence[tuple[int, int]]], *,
                       resolution: str = "head", mode: str = "zero", batch_size: int = 8) -> torch.Tensor:
    """Drop in each target's probability when a set of heads (or neurons) is removed together.

    A forward pre-hook on the output projection (or down projection) of each affected block
    replaces the input columns of the removed parts at every position: by 0 (``"zero"``) or by
    their mean over the sequence's positions (``"mean"``), and the whole model is rerun; the
    effect is ``model_probs - p_ablated`` (positive: the parts helped). A total causal effect,
    as :func:`ablation_effects`.

    Args:
        trace: from :func:`iglens_core.collect` (any trace of the model).
        sets: one list of ``(block, index)`` pairs per ablation, ``block`` in ``1..n``, ``index``
            the head in ``0..H-1`` or the neuron in ``0..d_ff-1``; an empty list ablates nothing.
        resolution: ``"head"`` or ``"neuron"``.
        mode: one of :data:`ABLATION_MODES`.
        batch_size: ablations (sequence copies) per forward pass, >= 1.

    Returns:
        (T, len(sets)) probability drops, float32 (float64 for a float64 model).
    """
    model = as_model(model)
    check_same_model(model, trace)
    _check_ablation(mode, batch_size)
    adapter = get_adapter(model)
    n = adapter.n_layers
    _, projections, parts, width = component_layout(model, resolution)
    sets = [[(int(block), int(index)) for block, index in chosen] for chosen in sets]
    bad = [pair for chosen in sets for pair in chosen if not (1 <= pair[0] <= n and 0 <= pair[1] < parts)]
    if bad:
        raise ValueError(f"sets must hold (block, index) pairs with block in 1..{n} and index in "
                         f"0..{parts - 1}, got {bad[:5]}")
    device = next(model.parameters()).device
    ids, positions, targets = (trace.input_ids.to(device), trace.positions.to(device),
                               trace.targets.to(device))
    out = torch.empty(len(sets), len(targets), dtype=precision(next(model.parameters()).dtype))
    tail = ids.shape[-1] - int(positions.min())   # the vocabulary product only where a target is read
    columns = positions - (ids.shape[-1] - tail)
    for start in range(0, len(sets), batch_size):
        chunk = sets[start:start + batch_size]
        keep = torch.ones(n, len(chunk), parts * width)  # (n, B, P) 1 = kept input column
        for row, chosen in enumerate(chunk):
            for block, index in chosen:
                keep[block - 1, row, index * width:(index + 1) * width] = 0

        def hook(module, args, layer):
            x = args[0]
            kept = keep[layer].to(x)[:, None, :]  # (B, 1, P)
            fill = x.mean(1, keepdim=True) * (1 - kept) if mode == "mean" else 0.0
            return (x * kept + fill,) + tuple(args[1:])

        hooks = [projections[layer].register_forward_pre_hook(lambda mod, args, layer=layer: hook(mod, args, layer))
                 for layer in range(n) if (keep[layer] == 0).any()]
        try:
            logits = logits_at_end(model, tail, input_ids=ids.expand(len(chunk), -1))[:, columns]  # (B, T, V)
        finally:
            for handle in hooks:
                handle.remove()
        logp = torch.log_softmax(logits.to(out.dtype), -1)
        out[start:start + len(chunk)] = logp.gather(-1, targets[None, :, None].expand(len(chunk), -1, 1))[..., 0].exp().cpu()
    return trace.model_probs.to(out.dtype)[:, None] - out.T


@dataclass
class Patching:
    """Restoration curve of one target (:func:`activation_patching`).

    Attributes:
        probs: (n+1,) the clean target's probability when the corrupted run's ``h_L`` at the
            predicting position is replaced by the clean run's, for ``L = 0..n`` (``L = 0``: the
            embedding, the input of block 1; ``L = n``: the input of the final norm).
        p_clean: the clean run's probability of the target (head-once readout of clean ``h_n``).
        p_corrupted: the corrupted run's probability of the same (clean) target.
    """
    probs: torch.Tensor
    p_clean: float
    p_corrupted: float

    @property
    def restoration(self) -> torch.Tensor:
        """(n+1,) float64 ``r(L) = (p_L - p') / (p_clean - p')``: 0 = nothing restored, 1 = all;
        NaN where the corruption does not change the probability (``p_clean == p'``)."""
        return _restoration(self.probs, self.p_clean, self.p_corrupted)

    def half_layer(self, level: float = 0.5) -> int:
        """First node ``L`` in ``0..n`` with ``r(L) >= level`` (``n`` always qualifies: ``r(n) = 1``);
        -1 when the restoration is undefined (NaN)."""
        return restoration_half(self.restoration[None], level)[0]


def _restoration(probs: torch.Tensor, p_clean: float, p_corrupted: float) -> torch.Tensor:
    """float64 ``(probs - p') / (p_clean - p')``; NaN everywhere when ``p_clean == p'``."""
    gap = p_clean - p_corrupted
    if gap == 0.0:
        return torch.full(probs.shape, math.nan, dtype=torch.float64)
    return (probs.double() - p_corrupted) / gap


def _check_ids(model, ids, name: str, sequence: bool = True) -> torch.Tensor:
    """``ids`` as (1, L) long token ids of the model's vocabulary, L >= 1; else ValueError. A ``sequence``
    must also fit the model's context (:func:`iglens_core.check_sequence`)."""
    ids = torch.as_tensor(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be (1, L) integer token ids with L >= 1, got "
                         f"shape {tuple(ids.shape)} dtype {ids.dtype}")
    vocab = model.get_input_embeddings().num_embeddings
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{name} must be token ids in 0..{vocab - 1}, got {int(ids.min())}..{int(ids.max())}")
    return (check_sequence(model, ids, None) if sequence else ids).long()


def _splice_last(row: int, value: torch.Tensor):
    """Forward pre-hook: the input of a block (or the final norm) with ``hidden[row, -1] = value``."""
    def hook(module, args, kwargs):
        hidden = hidden_arg(args, kwargs).clone()
        hidden[row, -1] = value.to(hidden)
        return ((hidden,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
    return hook


@torch.no_grad()
def activation_patching(model, trace: Trace, corrupted_ids: torch.Tensor, *, target: int = 0,
                        min_gap: float = 0.01) -> Patching:
    """Activation patching at the predicting position: from which layer on does it carry the answer?

    ``corrupted_ids`` is a corrupted version of the clean sequence up to its predicting position
    (e.g. another subject of the same relation, same template), *ending at* the position that
    predicts ``trace.targets[target]``: the clean and corrupted sequences are aligned at their
    last position (their lengths may differ). For each node ``L = 0..n`` the corrupted run's
    ``h_L`` at that last position is replaced by the clean ``trace.hidden[L, target]`` and the
    later blocks run; every other position keeps its corrupted values (a causal model never
    lets the last position change them), and the clean target's probability is read with the
    head-once readout. Node ``n`` is the clean ``h_n`` itself, so ``r(n) = 1``.

    Cost: the corrupted prefix (every position but the last) runs once and its keys and values
    are kept (the model's KV cache, shared by all copies); then one decoding step of ``n + 1``
    copies of the last token, copy ``L < n`` spliced at the input of block ``L + 1`` and copy
    ``n`` left corrupted (it gives ``p'``): about two forward passes in all, against ``n + 1``
    spliced full forward passes. Copy ``L``'s blocks ``1..L`` see the corrupted token, as in
    the corrupted run, so they are not an approximation.

    Args:
        model: the causal LM that produced ``trace`` (any architecture with a KV cache).
        trace: from :func:`collect` on the clean sequence.
        corrupted_ids: (1, L') or (L',) long, the corrupted sequence through its predicting position.
        target: index into ``trace.targets`` (``0..T-1``) of the target to restore.
        min_gap: probability in [0, 1]; the corruption must move the target's probability by at
            least this, ``|p_clean - p'| >= min_gap``. ``r(L)`` divides the probabilities'
            rounding (float32: ~1e-7 typical, up to ~7e-6) by that gap, so a corruption that
            barely changes the prediction (e.g. the clean prefix itself: a gap of 2e-7) gives a
            restoration curve of pure rounding and a meaningless half layer; at 0.01 the
            rounding of ``r`` stays below ~1e-5 typical (notebook 05 asks 0.05). 0 accepts any
            gap (for checks of ``probs`` alone).

    Returns:
        :class:`Patching` with ``probs`` (n+1,) float32 (float64 for a float64 model).

    Raises:
        ValueError: bad arguments, or a gap below ``min_gap`` (choose another corruption).
    """
    model = as_model(model)
    check_same_model(model, trace)
    targets, target, min_gap = trace.targets, plain_number(target), plain_number(min_gap)
    if isinstance(min_gap, bool) or not isinstance(min_gap, (int, float)) or not 0.0 <= min_gap <= 1.0:
        raise ValueError(f"min_gap must be a probability in [0, 1], got {min_gap!r}")
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < len(targets):
        raise ValueError(f"target must be an index in 0..{len(targets) - 1}, got {target!r}")
    ids = _check_ids(model, corrupted_ids, "corrupted_ids")
    adapter = get_adapter(model)
    n = adapter.n_layers
    if trace.n_layers != n:
        raise ValueError(f"trace has {trace.n_layers} blocks, the model {n}: not this model's trace")
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = None
    if ids.shape[1] > 1:  # keys and values of the corrupted prefix, one copy per restored node
        cache = model(ids[:, :-1], use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(n + 1)
    clean = trace.hidden[:, target]  # (n+1, d)
    final: list = []

    def grab(module, args, kwargs):  # h_n of every copy; the final norm and the head are not needed
        final.append(hidden_arg(args, kwargs)[:, -1].detach())
        raise _Stop

    hooks = [block.register_forward_pre_hook(_splice_last(layer, clean[layer]), with_kwargs=True)
             for layer, block in enumerate(adapter.blocks)]
    hooks.append(adapter.norm.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        model(ids[:, -1:].expand(n + 1, 1), past_key_values=cache, use_cache=cache is not None)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    last = final[0]  # (n+1, d): rows 0..n-1 restored at node L, row n corrupted
    last = torch.cat([last[:n], clean[n][None].to(last), last[n:]])  # (n+2, d)
    probs = Readout(model)(last, targets[target]).cpu()
    gap = float(probs[n]) - float(probs[n + 1])
    if abs(gap) < min_gap:
        raise ValueError(f"the corrupted run changes the target's probability by only "
                         f"p_clean - p' = {gap:.3g} ({float(probs[n]):.6g} - {float(probs[n + 1]):.6g}), "
                         f"less than min_gap={min_gap}: its restoration curve would be rounding. "
                         "Choose a corruption that changes the prediction (or lower min_gap)")
    return Patching(probs=probs[:n + 1], p_clean=float(probs[n]), p_corrupted=float(probs[n + 1]))


TRACE_KINDS = ("hidden", "attn", "mlp")
# Below this gap between p_clean and p' a restoration is rounding noise: a float32 readout is off
# by up to ~1e-5 in probability (iglens_core._target_prob), which is 1% of a 1e-3 gap.
MIN_GAP = 1e-3
NOISE_SAMPLES = 10  # ROME's number of noise draws


@dataclass
class CausalTrace:
    """Restoration grid of one fact (:func:`causal_trace`).

    Attributes:
        probs: (S, N) the target's probability at the last position when the clean state at
            position ``s`` and column ``j`` is restored in the corrupted run (mean over the noise
            draws for a noise corruption). float32 (float64 for a float64 model).
        p_clean: the clean run's probability of the target.
        p_corrupted: ``p'``, the corrupted run's probability of the target (mean over draws).
        kind: ``"hidden"``, ``"attn"`` or ``"mlp"``.
        window: blocks restored together (``"attn"`` / ``"mlp"``; 1 for ``"hidden"``).
        layers: (N,) what column ``j`` restores: for ``"hidden"`` the node ``0..n`` (0 the
            embedding output, L the output of block L), for ``"attn"`` / ``"mlp"`` the centre
            block ``1..n`` of the window.
    """
    probs: torch.Tensor
    p_clean: float
    p_corrupted: float
    kind: str
    window: int
    layers: torch.Tensor

    @property
    def restoration(self) -> torch.Tensor:
        """(S, N) float64 ``r(s, L) = (p_{s,L} - p') / (p_clean - p')``: 0 nothing restored, 1 all."""
        return _restoration(self.probs, self.p_clean, self.p_corrupted)


def rome_window(block: int, window: int, n_layers: int) -> range:
    """Blocks (1-based) restored together around ``block``, as ROME centres its window:
    ``block - window // 2 .. block + ceil(window / 2) - 1``, clipped to ``1..n``; e.g. window 10
    around block 12 restores blocks 7..16, window 1 block 12 alone."""
    return range(max(1, block - window // 2), min(n_layers, block + (window + 1) // 2 - 1) + 1)


@torch.no_grad()
def embedding_std(model, token_ids=None) -> float:
    """Standard deviation of the input embedding module's outputs, over every element.

    Args:
        token_ids: the tokens to measure (ROME: the subjects' tokens of its fact set); default
            the whole vocabulary (in chunks). The module's own output is used, so a scaled
            embedding (Gemma's ``sqrt(d)``) is measured as the blocks see it.
    """
    model = as_model(model)
    embed = model.get_input_embeddings()
    vocab = embed.num_embeddings
    ids = torch.arange(vocab) if token_ids is None else _check_ids(model, token_ids, "token_ids", sequence=False)[0]
    device = next(model.parameters()).device
    total = squares = 0.0
    for start in range(0, len(ids), 4096):
        values = embed(ids[start:start + 4096].to(device)).double()  # (chunk, d)
        total, squares = total + values.sum().item(), squares + values.square().sum().item()
    count = len(ids) * embed.embedding_dim
    return math.sqrt(max(squares - total * total / count, 0.0) / max(count - 1, 1))


def _check_positive_int(name: str, value) -> int:
    value = plain_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _subject_positions(subject, length: int) -> range:
    """``subject`` (a slice or a ``(start, stop)`` pair) as a non-empty range in ``0..length-1``."""
    if isinstance(subject, tuple) and len(subject) == 2:
        subject = slice(*(plain_number(x) for x in subject))
    if not isinstance(subject, slice) or subject.step not in (None, 1):
        raise ValueError(f"subject must be a slice (or (start, stop) pair) of positions with step 1, got {subject!r}")
    positions = range(length)[subject]
    if not positions:
        raise ValueError(f"subject {subject} selects no position of the {length}-token sequence (0..{length - 1})")
    return positions


def _noise_hook(draws: torch.Tensor, positions: range):
    """Forward hook on the embedding module: ``draws`` (k, len(positions), d) added to batch row i."""
    def hook(module, args, output):
        output = output.clone()
        output[:, positions.start:positions.stop] += draws.to(output)
        return output
    return hook


def _restore_hook(positions: torch.Tensor, values: torch.Tensor):
    """Forward hook: output row i at position ``positions[i]`` set to ``values[i]`` (B, d)."""
    def hook(module, args, output):
        out = first_output(output).clone()
        out[torch.arange(len(positions)), positions] = values.to(out)
        return replace_first(output, out)
    return hook


def _branch(values: torch.Tensor):
    """Forward pre-hook: the block's input (B, L, d) with ``len(values)`` rows appended, copies of
    row 0 whose first position is set to ``values`` (k, d)."""
    def hook(module, args, kwargs):
        hidden = hidden_arg(args, kwargs)
        grown = hidden[:1].repeat(len(values), 1, 1)
        grown[:, 0] = values.to(grown)
        hidden = torch.cat([hidden, grown])
        return ((hidden,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
    return hook


def _restored_probs(model, adapter: Adapter, readout: Readout, ids: torch.Tensor, clean: torch.Tensor,
                    cells: torch.Tensor, target: int, batch_size: int) -> torch.Tensor:
    """The target's probability at the last position of ``ids`` (1, S) with the clean state
    ``clean[L, s]`` ((n+1, S, d)) put back at node ``L < n``, position ``s``, one value per row
    ``(s, L)`` of ``cells`` (sorted by s, then L).

    Every copy that restores position s runs positions s.. only: the earlier positions are the
    run's own in every copy, so their keys and values are computed once (the model's KV cache,
    extended position by position). And a copy that restores node L is the run itself below
    block L + 1: one row carries the run, and each restored copy branches off it at its block
    (the cache of block b holds as many rows as there are copies by then). So a restored state
    costs only its own blocks over its own positions, ``(n - L)(S - s)`` token-blocks."""
    probs = torch.empty(len(cells), dtype=clean.dtype)
    prefix, cached = None, 0  # the run's keys and values of positions 0..cached-1 (one row)
    for s in cells[:, 0].unique().tolist():
        if s > cached:
            prefix = model(ids[:, cached:s], past_key_values=prefix, use_cache=True, logits_to_keep=1).past_key_values
            cached = s
        group = (cells[:, 0] == s).nonzero()[:, 0]
        for index in group.split(batch_size):
            nodes = cells[index, 1]
            cache = copy.deepcopy(prefix)
            if cache is not None:
                for block, layer in enumerate(cache.layers):  # rows at block b: the run and the copies restored by then
                    layer.batch_repeat_interleave(1 + int((nodes <= block).sum()))
            final: list = []

            def grab(module, args, kwargs):  # h_n at the last position; the head is read once below
                final.append(hidden_arg(args, kwargs)[1:, -1].clone())
                raise _Stop

            hooks = [adapter.blocks[node].register_forward_pre_hook(_branch(clean[node, s][None]), with_kwargs=True)
                     for node in nodes.tolist()]
            hooks.append(adapter.norm.register_forward_pre_hook(grab, with_kwargs=True))
            try:
                model(ids[:, s:], past_key_values=cache, use_cache=cache is not None)
            except _Stop:
                pass
            finally:
                for hook in hooks:
                    hook.remove()
            probs[index] = readout(final[0], torch.tensor(target)).cpu()  # rows in the order of their nodes
    return probs


@torch.no_grad()
def causal_trace(model, clean_ids, corrupted_ids, target: int, *, kind: str = "hidden", window: int = 1,
                 noise: Optional[float] = None, subject=None, seeds: Optional[Sequence[int]] = None,
                 min_gap: float = MIN_GAP, batch_size: int = 64) -> CausalTrace:
    """Causal tracing (Meng et al. 2022, ROME): where, by position and layer, does restoring one
    clean state bring the answer back?

    The clean sequence predicts ``target`` at its last position with probability ``p_clean``; the
    corrupted run gives ``p'``. For every position ``s`` and node ``L = 0..n`` the corrupted run is
    repeated with the clean ``h_L`` (node 0 the embedding output, node L the output of block L)
    put back at position ``s`` alone, every later block run, and the target read at the last
    position: ``r(s, L) = (p_{s,L} - p') / (p_clean - p')``. Node ``n`` matters only at the last
    position (``r(S-1, n) = 1``; elsewhere the probability stays ``p'``).

    Corruption, one of:

    - ``corrupted_ids``: the same template with another subject (subject swap), of the clean
      length, so that every position aligns;
    - ``corrupted_ids=None`` with ``subject`` (positions) and ``noise``: ROME's recipe, Gaussian
      noise of standard deviation ``noise`` (default ``3 * embedding_std(model)``, over the whole
      vocabulary; ROME measured it over its subjects' tokens: ``3 * embedding_std(model, ids)``) added to the
      embedding module's output at the subject positions. Draw ``i`` is
      ``noise * torch.randn((len(subject), d), generator=torch.Generator().manual_seed(seeds[i]))``
      (float32, on the CPU, so it is the same on every device); every probability is the mean
      over the draws (default ``seeds``: ``0..9``, ROME's ten samples).

    Kinds. ``"hidden"`` restores the residual stream ``h_L`` (``window`` must be 1). ``"attn"``
    / ``"mlp"`` restore only that sublayer module's output at position ``s`` (before any Gemma
    post-norm), in the ``window`` blocks centred on block ``L`` as ROME does
    (:func:`rome_window`); the blocks' other parts run on the corrupted stream. Columns are then
    the centre blocks ``1..n``.

    Cost. One clean and one corrupted forward pass record every state. A position whose clean
    state equals the corrupted one bit for bit (before the subject; at node 0 everywhere but the
    subject) is not rerun: putting it back changes nothing, so its run is the corrupted run and
    its probability ``p'`` (per draw). For a subject swap (``"hidden"``), the copies that restore
    position ``s`` run positions ``s..S-1`` only, on the corrupted prefix's keys and values (the
    model's KV cache), and a copy that restores node L branches off the corrupted run at block
    L + 1 (the blocks below see only corrupted states): each cell costs its own blocks over its
    own positions, about a third of rerunning every position from block L + 1 on SmolLM2's chat
    prompts (measured 3.0-3.4x faster at 1 thread). Otherwise, per column, the restored copies
    run together from the first restored block on. ``batch_size`` copies run at a time; the
    final norm and head read only the last position.

    Args:
        model: a causal LM (Llama, Gemma, GPT-2, GPT-NeoX, Qwen2 and the other adapters' blocks).
        clean_ids: (1, S) or (S,) token ids; the target is predicted at the last position.
        corrupted_ids: the same shape, or None for a noise corruption.
        target: token id in ``0..V-1``, the clean answer.
        kind: one of :data:`TRACE_KINDS`.
        window: blocks per restoration, >= 1 (``"attn"`` / ``"mlp"`` only).
        noise: standard deviation of the noise (embedding units), > 0; noise corruption only.
        subject: slice or ``(start, stop)`` of the subject's positions; noise corruption only.
        seeds: one seed per noise draw; noise corruption only.
        min_gap: smallest ``|p_clean - p'|`` accepted (:data:`MIN_GAP`): below it the restoration
            would divide rounding noise.
        batch_size: restored copies per forward pass, >= 1.

    Returns:
        :class:`CausalTrace` with ``probs`` (S, n+1) for ``"hidden"``, (S, n) otherwise.

    Raises:
        ValueError: bad ids, lengths, target, kind, window, noise, subject or seeds, or a
            corruption that moves the target's probability by less than ``min_gap``.
    """
    model = as_model(model)
    if kind not in TRACE_KINDS:
        raise ValueError(f"kind must be one of {TRACE_KINDS}, got {kind!r}")
    target, min_gap, noise = plain_number(target), plain_number(min_gap), plain_number(noise)
    window = _check_positive_int("window", window)
    if kind == "hidden" and window != 1:
        raise ValueError(f"window applies to kind 'attn' / 'mlp' (ROME); kind 'hidden' restores one node: window must be 1, got {window}")
    batch_size = _check_positive_int("batch_size", batch_size)
    if isinstance(min_gap, bool) or not isinstance(min_gap, (int, float)) or not 0.0 <= min_gap < 1.0:
        raise ValueError(f"min_gap must be a probability in [0, 1), got {min_gap!r}")
    clean = _check_ids(model, clean_ids, "clean_ids")
    length = clean.shape[1]
    adapter = get_adapter(model)
    n = adapter.n_layers
    readout = Readout(model)
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < readout.vocab_size:
        raise ValueError(f"target must be a token id in 0..{readout.vocab_size - 1}, got {target!r}")
    device = next(model.parameters()).device
    if corrupted_ids is not None:
        if noise is not None or subject is not None or seeds is not None:
            raise ValueError("noise=, subject= and seeds= set a noise corruption: pass corrupted_ids=None with them, "
                             f"or leave them unset with corrupted_ids (got noise={noise!r}, subject={subject!r}, seeds={seeds!r})")
        corrupted = _check_ids(model, corrupted_ids, "corrupted_ids")
        if corrupted.shape != clean.shape:
            raise ValueError(f"clean_ids and corrupted_ids must have the same length, got "
                             f"{clean.shape[1]} and {corrupted.shape[1]}")
        embed_hook = None
    else:
        if subject is None:
            raise ValueError("corrupted_ids=None corrupts the subject with noise: pass subject= (its positions)")
        positions = _subject_positions(subject, length)
        seeds = list(range(NOISE_SAMPLES)) if seeds is None else seeds
        values = [plain_number(x) for x in seeds] if np.iterable(seeds) and not isinstance(seeds, str) else []
        if not values or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not -2**63 <= x < 2**64
                             for x in values):
            raise ValueError(f"seeds must be a non-empty sequence of integers in -2**63..2**64-1 (torch's seeds), got {seeds!r}")
        seeds = values
        noise = 3.0 * embedding_std(model) if noise is None else noise
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0.0 < noise < math.inf:
            raise ValueError(f"noise must be a finite standard deviation > 0, got {noise!r}")
        width = model.get_input_embeddings().embedding_dim
        draws = torch.stack([noise * torch.randn((len(positions), width), generator=torch.Generator().manual_seed(int(x)))
                             for x in seeds])  # (k, len(subject), d)
        corrupted = clean.expand(len(seeds), -1)
        embed_hook = _noise_hook(draws, positions)
    part = None if kind == "hidden" else kind
    calls, clean_hidden, clean_parts = _recorded_run(model, adapter, clean.to(device), sublayer=part)
    _, hidden, parts = _recorded_run(model, adapter, corrupted.to(device), sublayer=part, embed_hook=embed_hook)
    copies = hidden.shape[1]  # hidden (n+1, k, S, d), parts (n, k, S, d): k draws (1 for a swap)
    p_draws = readout(hidden[n, :, -1], torch.tensor(target)).cpu()  # (k,) each draw's p'
    p_clean = float(readout(clean_hidden[n, 0, -1], torch.tensor(target)))
    p_corrupted = float(p_draws.double().mean())
    if abs(p_clean - p_corrupted) < min_gap:
        raise ValueError(f"the corruption moves the target's probability by {p_clean - p_corrupted:+.2e} "
                         f"(p_clean {p_clean:.6f}, p' {p_corrupted:.6f}), less than min_gap={min_gap}: "
                         "the restoration would be rounding noise")
    layers = torch.arange(n + 1) if kind == "hidden" else torch.arange(1, n + 1)
    probs = p_draws[None, :, None].repeat(length, 1, len(layers))  # (S, k, N): an unchanged run gives p'
    shared = kind == "hidden" and embed_hook is None  # a swap: restored copies share the corrupted prefix's keys and values
    if shared:
        cells = (clean_hidden[:, 0] != hidden[:, 0]).any(-1).T.nonzero()  # (s, node) pairs to rerun, position-major
        if len(cells) and cells[-1].tolist() == [length - 1, n]:
            probs[-1, 0, n] = p_clean  # h_n restored at the last position is the clean run; elsewhere it changes nothing
        cells = cells[cells[:, 1] < n]
        probs[cells[:, 0], 0, cells[:, 1]] = _restored_probs(model, adapter, readout, corrupted.to(device), clean_hidden[:, 0],
                                                             cells, target, batch_size)
    for column, layer in enumerate([] if shared else layers.tolist()):
        blocks = [] if kind == "hidden" else list(rome_window(layer, window, n))
        first = layer if kind == "hidden" else blocks[0] - 1  # node the run starts from
        clean_states, states = ((clean_hidden[layer:layer + 1], hidden[layer:layer + 1]) if kind == "hidden"
                                else (clean_parts[first:blocks[-1]], parts[first:blocks[-1]]))
        changed = (clean_states != states).flatten(0, 1).any(-1).any(0).nonzero()[:, 0]  # positions to rerun
        rows = torch.arange(len(changed) * copies, device=device)
        row_positions, row_copies = changed.to(device)[rows // copies], rows % copies  # position-major
        for start in range(0, len(rows), batch_size):
            at, draw = row_positions[start:start + batch_size], row_copies[start:start + batch_size]
            state = hidden[first, draw]  # (B, S, d) corrupted
            if kind == "hidden":
                state = state.clone()
                state[torch.arange(len(at)), at] = clean_hidden[layer, 0, at]
            hooks = [sublayer_module(adapter.blocks[block - 1], kind).register_forward_hook(
                _restore_hook(at, clean_parts[block - 1, 0, at])) for block in blocks]
            try:
                state = _run_blocks(adapter, calls, first, state)
            finally:
                for hook in hooks:
                    hook.remove()
            probs[at.cpu(), draw.cpu(), column] = readout(state[:, -1], torch.tensor(target)).cpu()
    probs = probs.double().mean(1).to(probs.dtype)  # (S, N)
    return CausalTrace(probs=probs, p_clean=p_clean, p_corrupted=p_corrupted, kind=kind, window=window,
                       layers=layers)


def atp_states(model, clean_ids, corrupted_ids, target: int, *, quantity: str = "prob", foil=None,
               min_gap: float = MIN_GAP) -> torch.Tensor:
    """Attribution patching per residual state: the first-order estimate of :func:`causal_trace`'s grid.

    ``r_AtP(s, L) = <dp/dh_L(s) at the corrupted run, h_L(s)_clean - h_L(s)_corrupted> / (p_clean - p')``:
    restoring ``h_L(s)`` in the corrupted run, linearised at the corrupted run (Nanda 2023; Syed et al.
    2023), in the trace's units. One clean and one corrupted forward pass and one backward pass.

    Args:
        clean_ids, corrupted_ids: (1, S) or (S,) token ids of the same length (a subject swap).
        target: the clean answer's token id; min_gap: as :func:`causal_trace`, in the readout's units.
        quantity, foil: the readout f, as :class:`iglens_core.Readout` (``"prob"``: p(y), or p(y) - p(foil);
            ``"logprob"``: log p(y), or the logit difference z_y - z_foil); the map is then
            ``<df/dh_L(s), clean - corrupted> / (f(clean) - f(corrupted))``, the same readout as the
            counterfactual graph it is compared with.

    Returns:
        (S, n+1) float64, the layout of :attr:`CausalTrace.restoration`.
    """
    model = as_model(model)
    clean, corrupted = _check_ids(model, clean_ids, "clean_ids"), _check_ids(model, corrupted_ids, "corrupted_ids")
    if corrupted.shape != clean.shape:
        raise ValueError(f"clean_ids and corrupted_ids must have the same length, got {clean.shape[1]} and {corrupted.shape[1]}")
    adapter, readout = get_adapter(model), Readout(model)
    target = plain_number(target)
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < readout.vocab_size:
        raise ValueError(f"target must be a token id in 0..{readout.vocab_size - 1}, got {target!r}")
    check_quantity(quantity)
    foil = check_foil(foil, torch.tensor([target]), readout.vocab_size)
    foil = None if foil is None else int(foil[0])
    device = next(model.parameters()).device
    with torch.no_grad():
        calls, clean_hidden, _ = _recorded_run(model, adapter, clean.to(device))
        _, hidden, _ = _recorded_run(model, adapter, corrupted.to(device))
    with torch.enable_grad():
        states = [hidden[0].clone().requires_grad_(True)]
        for layer in range(adapter.n_layers):
            state = _run_blocks(adapter, calls, layer, states[-1], last=layer + 1)
            states.append(state if state.requires_grad else state.requires_grad_(True))
        for state in states:
            state.retain_grad()
        f_corrupted = _readout_value(readout.logits(states[-1][:, -1]).double()[0], target, foil, quantity)
        f_corrupted.backward()  # Readout's own call is no-grad
    f_clean = float(readout(clean_hidden[-1, :, -1], torch.tensor(target), foil, quantity=quantity))
    gap = f_clean - float(f_corrupted.detach())
    if abs(gap) < min_gap:
        raise ValueError(f"the corruption moves the readout ({quantity}) by {gap:+.2e}, less than min_gap={min_gap}")
    grads = torch.stack([state.grad[0] for state in states])  # (n+1, S, d)
    change = (clean_hidden - hidden)[:, 0]  # (n+1, S, d)
    return (grads.double() * change.double()).sum(-1).T / gap


def _readout_value(logits: torch.Tensor, target: int, foil: Optional[int], quantity: str) -> torch.Tensor:
    """f of (V,) logits, differentiable: p(y) [- p(foil)] or log p(y) [z_y - z_foil]."""
    if quantity == "logprob":
        return logits.log_softmax(-1)[target] if foil is None else logits[target] - logits[foil]
    probs = logits.softmax(-1)
    return probs[target] if foil is None else probs[target] - probs[foil]


# -- swapping attention patterns between two runs: does the corruption act through where heads look, or
# through what they read?
_PATTERNS: list = []  # while pattern_swap runs: the patterns (per layer, (1, H, S, S)) to use instead


def _fixed_pattern_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention that reads the values through the pattern in ``_PATTERNS`` (its queries and keys unused)."""
    pattern = _PATTERNS[-1][module.layer_idx].to(value.dtype)  # (1, H, S, S)
    values = value.repeat_interleave(pattern.shape[1] // value.shape[1], 1)
    return (pattern @ values).transpose(1, 2).contiguous(), pattern


def _register_fixed_pattern() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register("iglens_fixed_pattern", _fixed_pattern_attention)


_register_fixed_pattern()


@torch.no_grad()
def pattern_swap(model, clean_ids, corrupted_ids, target: int) -> dict:
    """p(target) at the last position with every attention pattern taken from the other run.

    Four probabilities: ``clean`` and ``corrupted`` (the two runs), ``corrupted_clean_patterns`` (the corrupted
    input, every head of every block attending with the clean run's pattern) and ``clean_corrupted_patterns``
    (the clean input with the corrupted run's patterns). If the corruption acted through queries and keys
    (where heads look), the first swap would restore p; if it acts through what the heads read (values, MLPs),
    p stays near the corrupted run's and the second swap leaves p near the clean run's.

    Args:
        clean_ids, corrupted_ids: (1, S) or (S,) token ids of the same length; target: the clean answer's id.

    Returns:
        dict of the four probabilities (floats).
    """
    model = as_model(model)
    clean, corrupted = _check_ids(model, clean_ids, "clean_ids"), _check_ids(model, corrupted_ids, "corrupted_ids")
    if corrupted.shape != clean.shape:
        raise ValueError(f"clean_ids and corrupted_ids must have the same length, got {clean.shape[1]} and {corrupted.shape[1]}")
    vocab = Readout(model).vocab_size
    target = plain_number(target)
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < vocab:
        raise ValueError(f"target must be a token id in 0..{vocab - 1}, got {target!r}")
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation (set_attn_implementation)")
    device = next(model.parameters()).device
    out, patterns = {}, {}
    with eager_attention(model):
        for name, ids in (("clean", clean), ("corrupted", corrupted)):
            run = model(ids.to(device), use_cache=False, output_attentions=True)
            out[name] = float(torch.softmax(run.logits[0, -1].double(), -1)[target])
            patterns[name] = run.attentions
    before = model.config._attn_implementation
    model.set_attn_implementation("iglens_fixed_pattern")
    try:
        for name, ids, other in (("corrupted_clean_patterns", corrupted, "clean"), ("clean_corrupted_patterns", clean, "corrupted")):
            _PATTERNS.append(patterns[other])
            try:
                logits = model(ids.to(device), use_cache=False).logits
            finally:
                _PATTERNS.pop()
            out[name] = float(torch.softmax(logits[0, -1].double(), -1)[target])
    finally:
        model.set_attn_implementation(before)
    return out
