"""IG-Lens comparisons and causal references: what IG-Lens is positioned and tested against.

The method lives in :mod:`iglens_core`; this module imports it and holds, in reading order:

1. comparisons: direct logit attribution (exact in logits, and read as probability), the tuned
   lens, captum's layer Integrated Gradients and layer conductance (notebook 04)
2. ablation: block / attention / MLP (``ablation_effects``, notebooks 05, 06), and per attention
   head / MLP neuron the logit-space DLA (``component_dla``) and the ablation of sets of heads or
   neurons (``component_ablation``, notebook 07): total effects through every later block
3. activation patching: restore the clean residual at the predicting position, every layer in one
   batch (``activation_patching`` -> ``Patching``, notebook 05)
4. causal tracing: restore one clean state (residual, attention or MLP output) at every position
   and layer of a corrupted run, ROME's grid (``causal_trace`` -> ``CausalTrace``)
5. onset metrics: Spearman per token, top-1 agreement, the falsification test, bootstrap intervals
6. experiment helpers of notebooks 05, 07 and 09: fact tables and per-relation draws, subject-swap
   corruptions, bootstrap summary tables
7. source maps against causal tracing (notebooks 08, 09): per-head DLA by source position, attention
   weight x value norm, route scores of a (block, head, source) map against a trace grid
8. Dual Path Attribution's ablation protocol (notebook 10): edges and neurons ranked together by a
   method's score, zeroed in fractions (``dpa_ablation``, ``dpa_scores``, ``dpa_areas``)

Shapes follow the core: ``T`` predicting positions, ``n`` blocks, ``d`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import math
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from iglens_core import (_ATTENTIONS, _MLPS, CACHE_DIR, DEFAULT_MEMORY_BUDGET, Adapter, Readout, Trace,
                         _eager_attention, _first_attr, _first_output, _head_counts, _head_values, _hidden_arg,
                         _logits_at_end, _projection, _projection_weight, _quiet_transformers, check_layers, collect,
                         check_same_model, collect_components, component_terms, components, get_adapter,
                         precision, tie_tolerance)
import iglens_data as igd

# ---------------------------------------------------------------------------
# 1. Comparisons: direct logit attribution, tuned lens, layer IG and conductance
# ---------------------------------------------------------------------------
# The methods IG-Lens is positioned against (notebook 04). Each returns per-layer numbers for
# the same targets as a Trace; none of them sums to Δp in probability space, which 04 measures.

def _frozen_final_norm(adapter: Adapter, final: torch.Tensor):
    """The final norm with its scale frozen at the final state ``h_n``: a linear map.

    Every supported final norm has the form ``norm(h) = gain * P(h) / sigma(h) + bias`` with
    ``P`` the centring projection (LayerNorm) or the identity (RMSNorm), ``gain`` its weight (or
    ``1 + weight`` for Gemma). Freezing ``sigma`` at ``sigma(h_n)`` leaves the linear map
    ``x -> scale * P(x)`` with ``scale = gain / sigma(h_n)``, which reproduces ``norm(h_n)`` exactly.

    Args:
        final: (T, d) ``h_n``, the input of the final norm.

    Returns:
        ``(scale (T, d), center, bias (d,) or None)``, float64.

    Raises:
        ValueError: when no candidate form reproduces the norm's own output at ``h_n``.
    """
    norm = adapter.norm
    final = final.double()
    weight = getattr(norm, "weight", None)
    if weight is None:
        raise ValueError(f"the final norm {type(norm).__name__} has no weight; DLA supports "
                         "LayerNorm and RMSNorm variants")
    weight = weight.detach().double().cpu()
    bias = getattr(norm, "bias", None)
    bias = bias.detach().double().cpu() if isinstance(bias, torch.Tensor) else None
    eps = getattr(norm, "variance_epsilon", None)
    eps = getattr(norm, "eps", 1e-6) if eps is None else eps
    center = isinstance(norm, nn.LayerNorm) or ("LayerNorm" in type(norm).__name__
                                                 and "RMS" not in type(norm).__name__)
    centred = final - final.mean(-1, keepdim=True) if center else final
    sigma = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps)  # (T, 1)
    param = next(norm.parameters())
    with torch.no_grad():
        actual = norm(final.to(param.device, param.dtype)).double().cpu()
    for gain in (weight, 1.0 + weight):  # Llama/GPT-2 style, Gemma style
        scale = gain / sigma  # (T, d)
        rebuilt = scale * centred + (bias if bias is not None else 0.0)
        if torch.allclose(rebuilt, actual, rtol=1e-3, atol=1e-4 * float(actual.abs().max()) + 1e-6):
            return scale, center, bias
    raise ValueError(f"cannot write the final norm {type(norm).__name__} as gain * P(h) / sigma(h)"
                     " + bias; DLA supports LayerNorm and RMSNorm variants (incl. Gemma's 1 + w)")


def direct_logit_attribution(model, trace: Trace, *, subtract_mean: bool = False,
                             return_rest: bool = False):
    """Direct logit attribution (DLA) of each block to the target logit, in logits.

    Block ``L``'s residual update ``h_L - h_(L-1)`` is read through the final norm *linearised
    at the final state* (its scale ``sigma(h_n)`` frozen, see :func:`_frozen_final_norm`) and
    the unembedding row of the target: ``DLA_L = s * <scale_t * P(h_L - h_(L-1)), W_U[y_t]>``,
    with ``s`` the model's logit scale (1.0 for most models). Since the frozen norm is linear,
    the ``n`` block terms plus the rest (the embedding output ``h_0`` read the same way, the
    norm's bias and the head's bias) add up exactly to the target logit the model computes,
    *before* any final logit soft-capping (Gemma 2/3): DLA is additive in logit space only.

    Args:
        model: the causal LM that produced ``trace``.
        trace: from :func:`collect`.
        subtract_mean: use ``W_U[y] - mean_v W_U[v]`` (and the head bias likewise), so that the
            terms add up to ``logit_y - mean_v logit_v`` instead of ``logit_y``.
        return_rest: also return the rest term.

    Returns:
        (T, n) float64 logits; with ``return_rest`` a pair ``(values (T, n), rest (T,))`` with
        ``values.sum(-1) + rest`` equal to the (pre-softcap) target logit.
    """
    check_same_model(model, trace)
    adapter = get_adapter(model)
    hidden = trace.hidden.double()  # (n+1, T, d)
    scale, center, bias = _frozen_final_norm(adapter, hidden[-1])
    head_weight = adapter.head.weight.detach().double().cpu()  # (V, d)
    unembed = head_weight[trace.targets]  # (T, d)
    head_bias = getattr(adapter.head, "bias", None)
    head_bias = head_bias.detach().double().cpu() if isinstance(head_bias, torch.Tensor) else None
    if subtract_mean:
        unembed = unembed - head_weight.mean(0)
    read = scale * unembed  # (T, d): the frozen norm's scale folded into the unembedding row

    def project(x):
        return x - x.mean(-1, keepdim=True) if center else x

    updates = project(hidden[1:] - hidden[:-1])  # (n, T, d)
    values = adapter.logit_scale * (updates * read).sum(-1).T  # (T, n)
    if not return_rest:
        return values
    rest = (project(hidden[0]) * read).sum(-1)  # (T,)
    if bias is not None:
        rest = rest + (bias * unembed).sum(-1)
    if head_bias is not None:
        picked = head_bias[trace.targets]
        rest = rest + (picked - head_bias.mean() if subtract_mean else picked)
    return values, adapter.logit_scale * rest


def dla_probability(model, trace: Trace, *, mode: str = "cumulative") -> torch.Tensor:
    """Two ways to read direct logit attribution as probability; neither sums to Δp.

    ``"cumulative"``: ``q_L = softmax(frozen-norm logits of h_L)[y]``, i.e. the softmax of the
    cumulative DLA (the rest term plus blocks ``1..L``) over the whole vocabulary, and the
    per-block value ``q_L - q_(L-1)``. At ``L = n`` this is the model's probability, so the
    terms telescope to ``p_final - q_0``, where ``q_0`` (the embedding read through the norm
    frozen at ``h_n``) is not ``f(h_0)``.

    ``"linearised"``: softmax (and soft-capping, where the model has it) linearised at the
    final logits: ``p_y * (dz'_y - sum_v p_v dz'_v)`` with ``dz'`` block L's direct logits
    through the soft-cap's derivative; the first-order probability effect of each block.

    Returns:
        (T, n) float64 probabilities.
    """
    check_same_model(model, trace)
    if mode not in ("cumulative", "linearised"):
        raise ValueError(f"mode must be 'cumulative' or 'linearised', got {mode!r}")
    adapter = get_adapter(model)
    hidden = trace.hidden.double()  # (n+1, T, d)
    scale, center, bias = _frozen_final_norm(adapter, hidden[-1])
    weight = adapter.head.weight.detach()
    head_bias = getattr(adapter.head, "bias", None)
    device, dtype = weight.device, precision(weight.dtype)
    targets = trace.targets.to(device)
    s, cap = adapter.logit_scale, adapter.softcap

    def frozen_logits(x):  # (T, d) -> (T, V) pre-softcap logits of the frozen-norm read-out
        x = x - x.mean(-1, keepdim=True) if center else x
        normed = scale * x + (bias if bias is not None else 0.0)
        logits = normed.to(device, dtype) @ weight.to(dtype).T
        if isinstance(head_bias, torch.Tensor):
            logits = logits + head_bias.to(dtype)
        return s * logits

    def capped(z):
        return torch.tanh(z / cap) * cap if cap else z

    if mode == "cumulative":
        levels = torch.stack([torch.softmax(capped(frozen_logits(h)), -1).gather(-1, targets[:, None])[:, 0]
                              for h in hidden])  # (n+1, T)
        return (levels[1:] - levels[:-1]).T.double().cpu()
    z = frozen_logits(hidden[-1])  # (T, V)
    probs = torch.softmax(capped(z), -1)
    slope = 1.0 - torch.tanh(z / cap) ** 2 if cap else torch.ones_like(z)  # d softcap / dz
    weighted = (probs * slope) @ weight.to(dtype)  # (T, d): sum_v p_v s'_v W_v
    p_y = probs.gather(-1, targets[:, None])  # (T, 1)
    slope_y = slope.gather(-1, targets[:, None])
    row = (slope_y * weight[targets].to(dtype) - weighted).double().cpu()  # (T, d)
    updates = hidden[1:] - hidden[:-1]
    updates = updates - updates.mean(-1, keepdim=True) if center else updates
    return (p_y.double().cpu() * s * (updates * scale * row).sum(-1).T).double()


class TunedLens(nn.Module):
    """Tuned lens: per-layer affine translators read out by the model's own norm and head.

    Layer ``L < n`` is read as ``f(h_L + A_L h_L + b_L)``; layer ``n`` is the model's output and
    has no translator. ``A_L`` and ``b_L`` start at zero, so an untrained lens is exactly the
    logit lens (the parametrisation of the ``tuned-lens`` package, Belrose et al. 2023).

    Args:
        model: the causal LM whose norm and head read the translated states.
    """

    def __init__(self, model):
        super().__init__()
        self._readout = Readout(model)  # not a submodule: the state dict holds translators only
        d, n = self._readout.hidden_size, get_adapter(model).n_layers
        self.translators = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        for translator in self.translators:
            nn.init.zeros_(translator.weight)
            nn.init.zeros_(translator.bias)
        self.to(self._readout.device, precision(self._readout.dtype))
        self.info: dict = {}

    @property
    def n_layers(self) -> int:
        return len(self.translators)

    def translate(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n+1, ..., d) residual states -> the translated states (layer n unchanged)."""
        if hidden.shape[0] != self.n_layers + 1:
            raise ValueError(f"hidden must hold the n+1 = {self.n_layers + 1} block boundaries "
                             f"first, got shape {tuple(hidden.shape)}")
        hidden = hidden.to(self._readout.device, self.translators[0].weight.dtype)
        moved = [h + translator(h) for h, translator in zip(hidden[:-1], self.translators)]
        return torch.stack(moved + [hidden[-1]])

    @torch.no_grad()
    def probs(self, trace: Trace) -> torch.Tensor:
        """(T, n+1) target probability read out of every block boundary through the lens."""
        return self._readout(self.translate(trace.hidden), trace.targets[None].to(self._readout.device)).T.cpu()

    @torch.no_grad()
    def kl(self, trace: Trace) -> torch.Tensor:
        """(n+1,) mean over positions of KL(model output || lens output) per layer, in nats."""
        translated = self.translate(trace.hidden)
        return _kl_to_final(self._readout, translated).mean(-1).cpu()


def _kl_to_final(readout: Readout, hidden: torch.Tensor) -> torch.Tensor:
    """(n+1, N) KL(softmax(logits(hidden[-1])) || softmax(logits(hidden[L]))) in nats."""
    final = torch.log_softmax(readout.logits(hidden[-1]), -1)  # (N, V)
    out = []
    for h in hidden:
        logq = torch.log_softmax(readout.logits(h), -1)
        out.append((final.exp() * (final - logq)).sum(-1))
    return torch.stack(out)


def _lens_positions(model, tokenizer, texts, max_positions: int) -> torch.Tensor:
    """(n+1, N, d) residual states at every distinct position of the texts (prefixes kept once)."""
    hidden, seen = [], set()
    total = 0
    for text in texts:
        ids = (tokenizer(text, add_special_tokens=True)["input_ids"] if isinstance(text, str)
               else list(text))
        if len(ids) < 2:
            continue
        keep = [p for p in range(len(ids) - 1) if tuple(ids[:p + 1]) not in seen]
        seen.update(tuple(ids[:p + 1]) for p in keep)
        if not keep:
            continue
        trace = collect(model, torch.tensor([ids]), 1)  # positions 0 .. len-2
        hidden.append(trace.hidden[:, keep])
        total += len(keep)
        if total >= max_positions:
            break
    if not hidden:
        raise ValueError("texts must hold at least one sequence of 2 or more tokens")
    return torch.cat(hidden, 1)[:, :max_positions]


def train_tuned_lens(model, tokenizer, texts: Sequence[Union[str, Sequence[int]]], *,
                     steps: int = 200, batch_size: int = 2, lr: float = 1e-3, seed: int = 0,
                     max_positions: int = 1024, name: Optional[str] = None,
                     cache: Union[bool, Path, str] = True) -> TunedLens:
    """Train a :class:`TunedLens` on the model's own output distribution over ``texts``.

    Objective (as in Belrose et al. 2023): mean over positions and layers ``L < n`` of
    ``KL(p_final || p_lens,L)`` in nats, where ``p_final`` is the model's output distribution at
    that position. The text only supplies contexts; the labels are the model's own outputs.
    Each step takes ``batch_size`` random positions and every layer, i.e.
    ``batch_size * n`` rows of ``(d -> V)`` logits; Adam. The trained translators are cached in
    ``$IGLENS_CACHE/tuned_lens/<name>-<key>.pt``, the key a hash of texts and settings, so a rerun
    with the same settings loads instead of training.

    Args:
        texts: strings (tokenised with special tokens) or token id sequences, e.g. chat-formatted
            conversations; every distinct position is used once, at most ``max_positions``.
        steps: optimiser steps (>= 1); ``steps * batch_size * n`` rows in all.
        batch_size: positions per step (>= 1).
        lr: Adam learning rate (> 0).
        name: model name used in the cache file; default the model's directory name.
        cache: True (the default cache folder), a folder, or False (never read or write).

    Returns:
        The trained lens, with ``lens.info`` recording settings, the loss per step (``"loss"``)
        and whether it was loaded from the cache (``"cached"``).
    """
    import hashlib
    import json
    from tqdm.auto import tqdm
    for label, value, low in (("steps", steps, 1), ("batch_size", batch_size, 1),
                              ("max_positions", max_positions, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if not texts:
        raise ValueError("texts must hold at least one text")
    name = name or Path(str(getattr(model.config, "_name_or_path", "") or "model")).name or "model"
    settings = dict(steps=int(steps), batch_size=int(batch_size), lr=float(lr), seed=int(seed),
                    max_positions=int(max_positions), name=name)
    digest = hashlib.sha256(json.dumps([settings, [t if isinstance(t, str) else list(map(int, t))
                                                   for t in texts]]).encode()).hexdigest()[:10]
    folder = None
    if cache:
        folder = Path(cache) if not isinstance(cache, bool) else CACHE_DIR / "tuned_lens"
    path = folder / f"{name}-{digest}.pt" if folder is not None else None
    lens = TunedLens(model)
    if path is not None and path.exists():
        saved = torch.load(path, map_location=lens._readout.device, weights_only=True)
        lens.translators.load_state_dict(saved["translators"])
        lens.info = dict(saved["info"], cached=True)
        return lens

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    hidden = _lens_positions(model, tokenizer, texts, max_positions)  # (n+1, N, d)
    n, N = hidden.shape[0] - 1, hidden.shape[1]
    readout = lens._readout
    optimiser = torch.optim.Adam(lens.parameters(), lr=lr)
    frozen = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    losses = []
    try:
        with torch.enable_grad():  # callers often run with grad disabled globally
            for _ in tqdm(range(steps), desc="tuned lens", leave=False):
                index = torch.randint(N, (batch_size,), generator=generator)
                batch = hidden[:, index].to(readout.device)  # (n+1, B, d)
                with torch.no_grad():
                    final = torch.log_softmax(readout.logits(batch[-1]), -1)  # (B, V)
                moved = lens.translate(batch)[:-1]  # (n, B, d)
                logq = torch.log_softmax(readout.logits(moved.reshape(-1, moved.shape[-1])), -1)
                logq = logq.reshape(n, batch_size, -1)
                loss = (final.exp() * (final - logq)).sum(-1).mean()
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                losses.append(loss.item())
    finally:
        for param, flag in zip(model.parameters(), frozen):
            param.requires_grad_(flag)
    lens.info = dict(settings, positions=N, loss=losses, cached=False)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"translators": lens.translators.state_dict(),
                    "info": dict(settings, positions=N, loss=losses)}, path)
    return lens


def _replace_first(output, tensor):
    """A block's output with its hidden state replaced (blocks return a tensor or a tuple)."""
    if isinstance(output, (tuple, list)):
        return (tensor,) + tuple(output[1:])
    return tensor


@contextmanager
def _frozen_parameters(model):
    """Parameters excluded from autograd for the duration (captum needs gradients of states only)."""
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        yield
    finally:
        for param, flag in zip(model.parameters(), flags):
            param.requires_grad_(flag)


def _captum_column(explainer, hooks, inputs, baselines, steps: int, method: str):
    """One captum ``attribute`` call, its hooks removed afterwards.

    Returns:
        ``(values (B,), limits (B,))`` float64: the attribution summed over positions and hidden
        dimensions, and that minus captum's convergence delta.
    """
    try:
        with torch.enable_grad():
            attributions, delta = explainer.attribute(
                inputs, baselines=baselines, target=list(range(len(inputs))), n_steps=steps,
                method=method, return_convergence_delta=True)
    finally:
        for hook in hooks:
            hook.remove()
    values = attributions.detach().double().sum((1, 2)).cpu()
    return values, values - delta.detach().double().cpu()


class _Probe(nn.Module):
    """Identity module placed on a residual state, so that captum can hook a plain tensor."""

    def forward(self, hidden):
        return hidden


def _captum_setup(model, trace: Trace, layers, tokens):
    adapter = get_adapter(model)
    layers = check_layers(layers, trace.n_layers)
    T = len(trace.targets)
    tokens = list(range(T)) if tokens is None else [int(t) for t in tokens]
    bad = [t for t in tokens if not 0 <= t < T]
    if not tokens or bad:
        raise ValueError(f"tokens must be indices in 0..{T - 1}, got {tokens}")
    device = next(model.parameters()).device
    return adapter, layers, tokens, device


def _target_probs_fn(model, trace: Trace, tokens, device):
    """forward(batch) -> (B, len(tokens)) target probabilities of the model's own forward pass."""
    positions = trace.positions[tokens].to(device)
    targets = trace.targets[tokens].to(device)
    ids = trace.input_ids.to(device)

    def probs(batch: int) -> torch.Tensor:
        logits = model(ids.expand(batch, -1), use_cache=False).logits[:, positions]  # (B, K, V)
        logp = torch.log_softmax(logits.to(precision(logits.dtype)), -1)
        return logp.gather(-1, targets[None, :, None].expand(batch, -1, 1))[..., 0].exp()
    return probs


def layer_integrated_gradients(model, trace: Trace, *, layers: Optional[Sequence[int]] = None,
                               steps: int = 8, method: str = "gausslegendre",
                               tokens: Optional[Sequence[int]] = None, return_limit: bool = False):
    """Layer Integrated Gradients (captum ``LayerIntegratedGradients``), each layer with its own baseline.

    Segment ``j`` (blocks ``L(j-1)+1 .. Lj``; every block by default) is attributed with captum's
    layer IG on the *output* of block ``Lj`` at every position, with the baseline activation equal
    to the segment's *input* ``h_L(j-1)`` at every position: captum interpolates that residual state
    from ``h_L(j-1)`` to ``h_Lj`` and integrates the gradient of the target probability through the
    rest of the forward pass (later blocks with their attention, final norm, head, softmax). The
    value is the attribution summed over positions and hidden dimensions; by completeness it is
    approximately the total effect of removing the segment's update at every position,
    ``p - p(blocks L(j-1)+1..Lj made the identity)``. Each segment has its own baseline, so the
    values do not telescope: their sum is not Δp.

    Implementation: the baseline activation comes from a gate ``g`` on the segment's output,
    ``h_L(j-1) + g (h_Lj - h_L(j-1))``; inputs ``g = 1``, baselines ``g = 0``; captum patches the
    state itself, so its interpolation is exactly the straight segment.

    Cost: ``K`` captum calls, each ``steps`` forward and backward passes of the model per token.

    Args:
        layers: segment end layers (as :func:`ig_lens`); default every block.
        steps: captum ``n_steps`` (>= 1; >= 2 for the Riemann methods).
        method: captum's ``"gausslegendre"``, ``"riemann_left"``, ``"riemann_right"``,
            ``"riemann_middle"`` or ``"riemann_trapezoid"``.
        tokens: indices into the trace's targets; default all.
        return_limit: also return what each value converges to as ``steps`` grows, captum's
            ``F(input) - F(baseline)`` (the attribution sum minus its convergence delta).

    Returns:
        (len(tokens), K) float64 probabilities; with ``return_limit`` a pair
        ``(values, limits)`` of that shape.
    """
    check_same_model(model, trace)
    from captum.attr import LayerIntegratedGradients
    _check_captum(steps, method)
    adapter, layers, tokens, device = _captum_setup(model, trace, layers, tokens)
    probs = _target_probs_fn(model, trace, tokens, device)
    B = len(tokens)
    values = torch.zeros(B, len(layers), dtype=torch.float64)
    limits = torch.zeros_like(values)
    starts = [0] + layers[:-1]
    with _frozen_parameters(model):
        for j, (start, end) in enumerate(zip(starts, layers)):
            probe, state = _Probe(), {}

            def forward(gate, probe=probe, state=state):
                state["gate"] = gate.reshape(-1, 1, 1)
                return probs(gate.shape[0])

            def keep_input(mod, args, kwargs, state=state):
                state["input"] = _hidden_arg(args, kwargs)

            def gated_output(mod, args, output, probe=probe, state=state):
                hidden = _first_output(output)
                mixed = state["input"] + state["gate"].to(hidden) * (hidden - state["input"])
                return _replace_first(output, probe(mixed))

            hooks = [adapter.blocks[start].register_forward_pre_hook(keep_input, with_kwargs=True),
                     adapter.blocks[end - 1].register_forward_hook(gated_output)]
            values[:, j], limits[:, j] = _captum_column(
                LayerIntegratedGradients(forward, probe), hooks, torch.ones(B, 1, device=device),
                torch.zeros(B, 1, device=device), steps, method)
    return (values, limits) if return_limit else values


def layer_conductance(model, trace: Trace, *, layers: Optional[Sequence[int]] = None,
                      steps: int = 8, method: str = "gausslegendre",
                      tokens: Optional[Sequence[int]] = None, return_limit: bool = False):
    """Layer conductance (captum ``LayerConductance``) of each block's output, captum's standard usage.

    The input is the embedding output ``h_0`` at every position (the input of block 1), the
    baseline captum's default zero; the path is ``alpha * h_0``, ``alpha`` from 0 to 1, through the
    whole model. The conductance of segment end layer ``Lj`` is captum's conductance of the residual
    state ``h_Lj`` (all positions), summed over positions and hidden dimensions: the part of
    ``p(h_0) - p(0)`` that flows through ``h_Lj``. Each layer's own baseline is its state on the
    zero input, and since the whole change flows through every residual state, every layer gets
    approximately the whole change, up to discretisation: the values sum to about ``K`` times it,
    not to Δp. (Under RMSNorm a zero input stays zero through every block, so ``p(0) = 1/V``.)

    Cost: ``K`` captum calls, each ``steps + 1`` forward and backward passes per token.

    Args:
        layers, steps, method, tokens, return_limit: as :func:`layer_integrated_gradients`.

    Returns:
        (len(tokens), K) float64 probabilities (and their limits, see there).
    """
    check_same_model(model, trace)
    from captum.attr import LayerConductance
    _check_captum(steps, method)
    adapter, layers, tokens, device = _captum_setup(model, trace, layers, tokens)
    probs = _target_probs_fn(model, trace, tokens, device)
    B = len(tokens)
    embedded = {}
    capture = adapter.blocks[0].register_forward_pre_hook(
        lambda mod, args, kwargs: embedded.__setitem__("h0", _hidden_arg(args, kwargs).detach()),
        with_kwargs=True)
    try:
        with torch.no_grad():
            model(trace.input_ids.to(device), use_cache=False)
    finally:
        capture.remove()
    start = embedded["h0"].expand(B, -1, -1).clone()  # (B, S, d)
    values = torch.zeros(B, len(layers), dtype=torch.float64)
    limits = torch.zeros_like(values)
    with _frozen_parameters(model):
        for j, end in enumerate(layers):
            probe, state = _Probe(), {}

            def forward(h0, state=state):
                state["h0"] = h0
                return probs(h0.shape[0])

            def substitute(mod, args, kwargs, state=state):
                if args:
                    return (state["h0"],) + tuple(args[1:]), kwargs
                return args, dict(kwargs, hidden_states=state["h0"])

            def probed(mod, args, output, probe=probe):
                return _replace_first(output, probe(_first_output(output)))

            hooks = [adapter.blocks[0].register_forward_pre_hook(substitute, with_kwargs=True),
                     adapter.blocks[end - 1].register_forward_hook(probed)]
            values[:, j], limits[:, j] = _captum_column(
                LayerConductance(forward, probe), hooks, start, torch.zeros_like(start), steps, method)
    return (values, limits) if return_limit else values


CAPTUM_METHODS = ("gausslegendre", "riemann_left", "riemann_right", "riemann_middle",
                  "riemann_trapezoid")


def _check_captum(steps, method):
    if method not in CAPTUM_METHODS:
        raise ValueError(f"method must be one of {CAPTUM_METHODS}, got {method!r}")
    low = 1 if method == "gausslegendre" else 2
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < low:
        raise ValueError(f"steps must be an integer >= {low} for {method}, got {steps!r}")


# ---------------------------------------------------------------------------
# 2. Ablation (total causal effect of a block, for the falsification test)
# ---------------------------------------------------------------------------

ABLATION_MODES = ("zero", "mean")
ABLATION_PARTS = (None, "attn", "mlp")


def _check_ablation(mode: str, batch_size: int) -> None:
    if mode not in ABLATION_MODES:
        raise ValueError(f"mode must be one of {ABLATION_MODES}, got {mode!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")


class _Stop(Exception):
    """Raised by a hook to end a forward pass once what it needs is recorded."""


def _sublayer_module(block: nn.Module, part: Optional[str]) -> nn.Module:
    if part is None:
        return block
    module = _first_attr(block, _ATTENTIONS if part == "attn" else _MLPS)
    if module is None:
        raise ValueError(f"cannot find the {part} module of block {type(block).__name__} "
                         f"(looked for {_ATTENTIONS if part == 'attn' else _MLPS})")
    return module


def _ablation_hook(rows: torch.Tensor, mode: str, whole_block: bool):
    """Forward hook replacing the update of ``rows`` of the batch (one ablated layer per row)."""
    def hook(module, args, kwargs, output):
        out = _first_output(output)
        start = _hidden_arg(args, kwargs) if whole_block else torch.zeros_like(out)
        update = out[rows] - start[rows]  # (r, L, d) the block's (or sub-module's) update
        replaced = torch.zeros_like(update) if mode == "zero" else update.mean(1, keepdim=True).expand_as(update)
        out = out.clone()
        out[rows] = start[rows] + replaced
        return _replace_first(output, out)
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
            outputs[layer] = _first_output(output).detach()
        return hook

    def stop(module, args, kwargs):
        final.append(_hidden_arg(args, kwargs).detach())
        raise _Stop

    hooks = [block.register_forward_pre_hook(record(layer), with_kwargs=True)
             for layer, block in enumerate(adapter.blocks)]
    hooks.append(adapter.norm.register_forward_pre_hook(stop, with_kwargs=True))
    if sublayer is not None:
        hooks += [_sublayer_module(block, sublayer).register_forward_hook(keep(layer))
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
    hidden = torch.stack([_hidden_arg(*call).detach() for call in calls] + final)  # (n+1, B, S, d)
    return calls, hidden, torch.stack(outputs) if sublayer is not None else None


def _run_blocks(adapter: Adapter, calls, first: int, hidden: torch.Tensor) -> torch.Tensor:
    """Blocks ``first+1 .. n`` (0-based ``first``) on ``hidden`` (B, L, d), with the clean call's
    other arguments (masks, rotary position embeddings: the same for every copy)."""
    for layer in range(first, adapter.n_layers):
        args, kwargs = calls[layer]
        if args:
            out = adapter.blocks[layer](hidden, *args[1:], **kwargs)
        else:
            out = adapter.blocks[layer](**{**kwargs, "hidden_states": hidden})
        hidden = _first_output(out)
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
        hooks = [_sublayer_module(adapter.blocks[layers[i] - 1], part).register_forward_hook(
            _ablation_hook(torch.tensor([row], device=device), mode, part is None), with_kwargs=True)
            for row, i in enumerate(chunk)]
        try:
            hidden = _hidden_arg(*calls[first]).expand(len(chunk), -1, -1)  # (B, L, d)
            hidden = _run_blocks(adapter, calls, first, hidden)
        finally:
            for hook in hooks:
                hook.remove()
        p_ablated[chunk] = readout(hidden[:, positions], targets[None]).cpu().to(p_ablated.dtype)  # (B, T)
    p_final = readout(trace.hidden[-1], trace.targets).to(p_ablated.dtype)  # (T,)
    return p_final[:, None] - p_ablated.T


# -- components: heads and neurons (notebook 07) ------------------------------------------------

def _component_layout(model, adapter: Adapter, resolution: str):
    """``(sublayer, projections, parts, width)``: per block the projection whose input holds the
    parts, the number of parts (H heads or d_ff neurons) and the input columns of one part."""
    if resolution not in ("head", "neuron"):
        raise ValueError(f"resolution must be 'head' or 'neuron', got {resolution!r}")
    sublayer = "attn" if resolution == "head" else "mlp"
    projections = [_projection(block, sublayer)[0] for block in adapter.blocks]
    inputs = _projection_weight(projections[0])[0].shape[1]
    config = getattr(model.config, "text_config", None) or model.config
    parts = _first_attr(config, ("num_attention_heads", "n_head")) if sublayer == "attn" else inputs
    return sublayer, projections, parts, inputs // parts


def component_dla(model, trace: Trace, *, resolution: str = "head") -> torch.Tensor:
    """Direct logit attribution of every head (or MLP neuron, or head and source position) of every
    block, in logits.

    Part k's output ``delta_k`` (a head through its slice of the output projection, or a neuron
    times its column of the down projection; through the post-norm's diagonal map on Gemma; the
    bias last) read through the final norm frozen at ``h_n`` onto the target's unembedding row,
    as :func:`direct_logit_attribution` reads a block: ``s <scale_t * P delta_k, W_U[y_t]>``.
    Summed over the parts of both sublayers of block L it is that function's value for block L.

    Args:
        trace: from :func:`iglens_core.collect_components` (``sources=True`` for ``"source"``).
        resolution: ``"head"``, ``"neuron"`` or ``"source"``: each head's part split over the
            source positions it reads, ``s <scale_t * P D W_O[:, h] A_h(t, s) v_h(s), W_U[y_t]>``
            (per-head DLA by source position); summed over s it is the head's DLA.

    Returns:
        (T, n, H + 1) or (T, n, d_ff + 1) float64 logits (pre soft-cap); ``"source"``: (T, n, H, S).
    """
    check_same_model(model, trace)
    adapter = get_adapter(model)
    sources = resolution == "source"
    sublayer = _component_layout(model, adapter, "head" if sources else resolution)[0]
    scale, center, _ = _frozen_final_norm(adapter, trace.hidden[-1].double())
    read = scale * adapter.head.weight.detach().double().cpu()[trace.targets]  # (T, d)
    if center:  # <P x, r> = <x, P r>: P is the (symmetric) centring projection
        read = read - read.mean(-1, keepdim=True)
    terms, _, per_source = component_terms(model, trace, adapter.logit_scale * read, sublayer, sources=sources)
    return per_source if sources else terms


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
    check_same_model(model, trace)
    _check_ablation(mode, batch_size)
    adapter = get_adapter(model)
    n = adapter.n_layers
    _, projections, parts, width = _component_layout(model, adapter, resolution)
    sets = [[(int(block), int(index)) for block, index in chosen] for chosen in sets]
    bad = [pair for chosen in sets for pair in chosen if not (1 <= pair[0] <= n and 0 <= pair[1] < parts)]
    if bad:
        raise ValueError(f"sets must hold (block, index) pairs with block in 1..{n} and index in "
                         f"0..{parts - 1}, got {bad[:5]}")
    device = next(model.parameters()).device
    ids, positions, targets = (trace.input_ids.to(device), trace.positions.to(device),
                               trace.targets.to(device))
    out = torch.empty(len(sets), len(targets), dtype=precision(next(model.parameters()).dtype))
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
            logits = model(ids.expand(len(chunk), -1), use_cache=False).logits[:, positions]  # (B, T, V)
        finally:
            for handle in hooks:
                handle.remove()
        logp = torch.log_softmax(logits.to(out.dtype), -1)
        out[start:start + len(chunk)] = logp.gather(-1, targets[None, :, None].expand(len(chunk), -1, 1))[..., 0].exp().cpu()
    return trace.model_probs.to(out.dtype)[:, None] - out.T


# ---------------------------------------------------------------------------
# 3. Activation patching (restore the clean residual at the predicting position)
# ---------------------------------------------------------------------------

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


def _check_ids(model, ids, name: str) -> torch.Tensor:
    """``ids`` as (1, L) long token ids of the model's vocabulary, L >= 1; else ValueError."""
    ids = torch.as_tensor(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be (1, L) integer token ids with L >= 1, got "
                         f"shape {tuple(ids.shape)} dtype {ids.dtype}")
    vocab = model.get_input_embeddings().num_embeddings
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{name} must be token ids in 0..{vocab - 1}, got {int(ids.min())}..{int(ids.max())}")
    return ids.long()


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


def _splice_last(row: int, value: torch.Tensor):
    """Forward pre-hook: the input of a block (or the final norm) with ``hidden[row, -1] = value``."""
    def hook(module, args, kwargs):
        hidden = _hidden_arg(args, kwargs).clone()
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
    check_same_model(model, trace)
    targets = trace.targets
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
        final.append(_hidden_arg(args, kwargs)[:, -1].detach())
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


# ---------------------------------------------------------------------------
# 4. Causal tracing (restore one clean state at every position and layer, ROME)
# ---------------------------------------------------------------------------

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
    embed = model.get_input_embeddings()
    vocab = embed.num_embeddings
    ids = torch.arange(vocab) if token_ids is None else _check_ids(model, token_ids, "token_ids")[0]
    device = next(model.parameters()).device
    total = squares = 0.0
    for start in range(0, len(ids), 4096):
        values = embed(ids[start:start + 4096].to(device)).double()  # (chunk, d)
        total, squares = total + values.sum().item(), squares + values.square().sum().item()
    count = len(ids) * embed.embedding_dim
    return math.sqrt(max(squares - total * total / count, 0.0) / max(count - 1, 1))


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _subject_positions(subject, length: int) -> range:
    """``subject`` (a slice or a ``(start, stop)`` pair) as a non-empty range in ``0..length-1``."""
    if isinstance(subject, tuple) and len(subject) == 2:
        subject = slice(*subject)
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
        out = _first_output(output).clone()
        out[torch.arange(len(positions)), positions] = values.to(out)
        return _replace_first(output, out)
    return hook


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

    Cost. One clean and one corrupted forward pass record every state; then, per column, the
    restored copies (one per position, times ``len(seeds)`` for noise) run together,
    ``batch_size`` at a time, from the first restored block on: the blocks below it see only
    corrupted states, which the corrupted run already computed, so they are not rerun. A
    position whose clean state equals the corrupted one bit for bit (before the subject; at node
    0 everywhere but the subject) is not rerun either: putting it back changes nothing, so its
    run is the corrupted run and its probability ``p'`` (per draw). The final norm and head
    read only the last position.

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
    if kind not in TRACE_KINDS:
        raise ValueError(f"kind must be one of {TRACE_KINDS}, got {kind!r}")
    window = _check_positive_int("window", window)
    if kind == "hidden" and window != 1:
        raise ValueError(f"window applies to kind 'attn' / 'mlp' (ROME); kind 'hidden' restores one node: window must be 1, got {window}")
    batch_size = _check_positive_int("batch_size", batch_size)
    if not isinstance(min_gap, (int, float)) or not 0.0 <= min_gap < 1.0:
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
        seeds = list(range(NOISE_SAMPLES)) if seeds is None else list(seeds)
        if not seeds or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in seeds):
            raise ValueError(f"seeds must be a non-empty sequence of integers, got {seeds!r}")
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
    for column, layer in enumerate(layers.tolist()):
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
            hooks = [_sublayer_module(adapter.blocks[block - 1], kind).register_forward_hook(
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


# ---------------------------------------------------------------------------
# 5. Onset metrics (does a per-layer score rank layers the way ablation does?)
# ---------------------------------------------------------------------------

def _check_pair(scores, effects) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(torch.as_tensor(scores, dtype=torch.float64))
    effects = np.asarray(torch.as_tensor(effects, dtype=torch.float64))
    if scores.ndim != 2 or scores.shape != effects.shape:
        raise ValueError(f"scores and effects must both have shape (T, n), got {scores.shape} "
                         f"and {effects.shape}")
    return scores, effects


def tied_ranks(values) -> np.ndarray:
    """(..., n) float64 ranks ``1..n`` along the last axis, values within tolerance tied.

    Sorted, neighbours closer than :func:`tie_tolerance` join one group (single linkage: two
    values that differ by less than the tolerance are always tied; a chain of such steps is one
    group); a group shares its members' average rank, as ``scipy.stats.rankdata`` does for
    exact ties. A perturbation much smaller than the tolerance (the float path) changes no rank
    unless a gap between sorted neighbours lies within it of the tolerance itself. NaN rows give
    NaN ranks.

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
        order = np.argsort(row, kind="stable")
        group = np.concatenate([[0], np.cumsum(np.diff(row[order]) > tol)])  # sorted order
        position = np.arange(1.0, len(row) + 1)
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
    return igd.top_parts(np.maximum(x, 0.0), k)  # negatives join the parts tied with 0


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


# ---------------------------------------------------------------------------
# 6. Experiment helpers: facts, subject swaps, bootstrap tables (notebooks 05 and 08)
# ---------------------------------------------------------------------------

FACT_COLUMNS = ("relation", "subject", "prompt", "object")


def load_facts(source, *, statement: bool = False):
    """A fact table (one fact per row: ``relation, subject, prompt, object``, and ``answer``).

    A table without an ``id`` column gets one: ``<relation>_<k>``, k = 1, 2, ... within the relation
    in file order (the notebooks name items by it).

    Args:
        source: a CSV path, or a DataFrame.
        statement: for a base model: each prompt becomes its ``answer`` cut before the last
            occurrence of its ``object`` ("The capital of France is" for "... is Paris."), which
            the model must complete, and the answer the rest (" Paris.", with its leading space).

    Raises:
        ValueError: a missing column, or (``statement``) an answer that does not contain its object.
    """
    import pandas as pd
    facts = source.copy() if isinstance(source, pd.DataFrame) else pd.read_csv(source)
    missing = sorted(set(FACT_COLUMNS + (("answer",) if statement else ())) - set(facts.columns))
    if missing:
        raise ValueError(f"{'the fact table' if isinstance(source, pd.DataFrame) else source} lacks the columns "
                         f"{missing} (found {list(facts.columns)})")
    if statement:
        cut = [str(a).rfind(str(o)) for a, o in zip(facts.answer, facts.object)]
        bad = [i for i, at in enumerate(cut) if at < 0]
        if bad:
            raise ValueError(f"statement=True cuts each answer before its object, but {len(bad)} answers do not contain "
                             f"it (rows {bad[:5]}, e.g. {facts.answer.iloc[bad[0]]!r} / {facts.object.iloc[bad[0]]!r})")
        prompts = [str(a)[:at].rstrip() for a, at in zip(facts.answer, cut)]
        facts = facts.assign(prompt=prompts, answer=[str(a)[len(p):] for a, p in zip(facts.answer, prompts)])
    if "id" not in facts.columns:
        facts.insert(0, "id", [f"{r}_{k + 1:03d}" for r, k in zip(facts.relation, facts.groupby("relation").cumcount())])
    return facts


def object_tokens(tokenizer, answer: str, obj: str, n_tokens: int) -> list[int]:
    """Indices of the answer tokens that spell ``obj`` (e.g. ' H', 'ano', 'i' for "Hanoi"), cut at
    ``n_tokens``: the tokens of the answer up to the object's last occurrence, minus those before it."""
    start = answer.rfind(obj)
    before = tokenizer(answer[:start].rstrip(), add_special_tokens=False)["input_ids"]
    upto = tokenizer(answer[:start + len(obj)], add_special_tokens=False)["input_ids"]
    return list(range(len(before), min(len(upto), n_tokens)))


def draw_facts(facts, n_per_relation: int, seed: int = 0):
    """Up to ``n_per_relation`` facts drawn from *each* relation (all of a smaller relation), seeded.

    The draws are pandas' ``facts.groupby("relation").sample(n, random_state=seed)`` wherever
    every relation has at least ``n`` facts (one ``RandomState`` consumed relation by relation,
    in sorted order); a relation with fewer facts gives all of them instead of cutting every
    relation to its size.

    Args:
        facts: a fact table (:func:`load_facts`).
        n_per_relation: facts per relation, >= 0; 0 keeps every fact.

    Returns:
        The drawn rows grouped by relation, with a fresh index ``0..N-1``.
    """
    if isinstance(n_per_relation, bool) or not isinstance(n_per_relation, (int, np.integer)) or n_per_relation < 0:
        raise ValueError(f"n_per_relation must be an integer >= 0 (0: every fact), got {n_per_relation!r}")
    if "relation" not in facts.columns:
        raise ValueError(f"facts must have a 'relation' column, got {list(facts.columns)}")
    import pandas as pd
    if not n_per_relation:
        return facts.reset_index(drop=True)
    state = np.random.RandomState(seed)
    parts = [group.sample(n=min(n_per_relation, len(group)), random_state=state)
             for _, group in facts.groupby("relation")]
    return (pd.concat(parts) if parts else facts.iloc[:0]).reset_index(drop=True)


def swap_subject(text: str, old: str, new: str) -> str:
    """``text`` with every ``old`` replaced by ``new`` (case-insensitive; where the matched text starts
    with a capital, so does the replacement)."""
    import re
    return re.sub(re.escape(old), lambda m: new[0].upper() + new[1:] if m.group(0)[0].isupper() else new,
                  text, flags=re.IGNORECASE)


def corrupt_subject(tokenizer, fact, pool, *, length: int, answer_prefix: str = "", chat: bool = True,
                    seed: int = 0) -> tuple[Optional[torch.Tensor], Optional[str], bool]:
    """A subject-swap corruption: the same prompt with another subject of the same relation.

    Candidates are the ``pool`` facts of ``fact``'s relation with another subject and another
    object (case-insensitive), in a seeded random order. Each gives the token ids of the prompt
    with the subject swapped (chat template as :func:`iglens_data.encode`) followed by
    ``answer_prefix`` with the subject swapped (the answer up to the predicting position). The
    first candidate whose ids have ``length`` tokens wins (every position then aligns with the
    clean sequence); without one, the first candidate.

    Args:
        fact: one fact (a DataFrame row, a row of ``itertuples()`` or a dict) with ``relation``,
            ``subject``, ``prompt`` and ``object``.
        pool: the facts to draw the other subject from (e.g. the whole file).
        length: the clean sequence's length through its predicting position.
        answer_prefix: text of the answer before the predicted token ("" for a prompt alone).
        seed: order of the candidates.

    Returns:
        ``(ids (1, L') long, other subject, L' == length)``, or ``(None, None, False)`` when the
        relation has no other subject with another object.
    """
    from iglens_data import _prompt_ids
    get = (lambda key: fact[key]) if isinstance(fact, dict) else (lambda key: getattr(fact, key))
    relation, subject, prompt, obj = (get(key) for key in FACT_COLUMNS)
    others = pool[(pool.relation == relation) & (pool.object.str.lower() != str(obj).lower())
                  & (pool.subject != subject)]
    first = None
    for other in others.sample(frac=1.0, random_state=seed).itertuples():
        text = swap_subject(answer_prefix, subject, other.subject)
        ids = _prompt_ids(tokenizer, swap_subject(prompt, subject, other.subject), chat)
        ids = torch.tensor([ids + (tokenizer(text, add_special_tokens=False)["input_ids"] if text else [])])
        if ids.shape[1] == length:
            return ids, other.subject, True
        first = first or (ids, other.subject, False)
    return first if first else (None, None, False)


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


def tiny_model(arch: str = "llama", seed: int = 0, *, n_layers: int = 6, hidden_size: int = 32,
               vocab_size: int = 64, init_scale: float = 0.3):
    """A tiny randomly initialised causal LM built from a config (no download), for controlled checks.

    Norm weights (and biases, where the norm has them) are randomised: with unit norm weights
    some bugs are invisible. ``init_scale`` is the weights' standard deviation; 0.3 makes the
    output distribution far from uniform, so probabilities move along the path.

    Args:
        arch: ``"llama"`` (RMSNorm, rotary) or ``"gpt2"`` (LayerNorm with bias, learned positions).
        seed: seed of the weights.

    Returns:
        The model, float32, in eval mode.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    _quiet_transformers()
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, initializer_range=init_scale,
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=n_layers, n_head=4,
                            n_positions=128, initializer_range=init_scale)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("ln_"):
                if name.endswith("weight"):
                    param.copy_(1.0 + 0.5 * torch.randn_like(param))
                else:
                    param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


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


# ---------------------------------------------------------------------------
# 7. Source maps against causal tracing (notebooks 08 and 09)
# ---------------------------------------------------------------------------

def word_spans(tokenizer, ids: Sequence[int], word: str) -> list[tuple[int, int]]:
    """Token spans ``(start, stop)`` of every occurrence of ``word`` in ``decode(ids)``, in order
    (case-insensitive, as :func:`iglens_data.token_span`); ``[]`` when it does not occur. The last
    subject token of a sequence is ``word_spans(...)[-1][1] - 1``."""
    from iglens_data import token_span
    ids = [int(i) for i in ids]
    spans, start = [], 0
    while start < len(ids):
        found = token_span(tokenizer, ids[start:], word)
        if found is None:
            break
        spans.append((start + found[0], start + found[1]))
        start += found[1]
    return spans


def attention_norm(model, trace: Trace) -> torch.Tensor:
    """The control "attention weight x value norm" (Kobayashi et al. 2020): for every head h of every
    block and source position s, ``A_h(t, s) * ||W_O[:, slice_h] v_h(s)||``, the length of what the
    head writes from s (value bias included, post-norm left out), unsigned and in residual units.

    Args:
        trace: from :func:`iglens_core.collect_components` with ``sources=True``.

    Returns:
        (T, n, H, S) float64, >= 0.
    """
    check_same_model(model, trace)
    if trace.patterns is None:
        raise ValueError("attention_norm needs a trace from collect_components(model, input_ids, prompt_len, "
                         "sources=True)")
    adapter = get_adapter(model)
    out = []
    for layer, block in enumerate(adapter.blocks):
        weight = _projection_weight(_projection(block, "attn")[0])[0].double().cpu()  # (d, H * hd)
        values = _head_values(trace, layer)  # (S, H, hd)
        heads = values.shape[1]
        written = torch.einsum("dhk,shk->shd", weight.view(-1, heads, values.shape[-1]), values)  # (S, H, d)
        out.append(trace.patterns[layer].double() * written.norm(dim=-1).T[None])  # (T, H, S)
    return torch.stack(out, 1)


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


SOURCE_METRICS = ("top_from_subject", "top_from_last", "names_subject_block", "distance", "within2",
                  "spearman_positions", "spearman_grid")


def source_route_scores(parts, restoration, subject: int, *, level: float = 0.5) -> dict:
    """One item: a (block, head, source) map of the focus token against its causal trace grid.

    - the top route: the (block, head, source) part with the largest value (:func:`top_positive`;
      ties to the earlier block, parts tied with zero never); ``top_from_subject`` /
      ``top_from_last``: 1.0 when its source is the last subject token / the predicting position;
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

    Returns:
        A dict of floats: ``top_block``, ``top_head``, ``top_source``, ``subject_block``,
        ``trace_block`` and the :data:`SOURCE_METRICS`.
    """
    parts = np.asarray(torch.as_tensor(parts, dtype=torch.float64))
    r = np.asarray(torch.as_tensor(restoration, dtype=torch.float64))
    if parts.ndim != 3 or r.shape != (parts.shape[2], parts.shape[0] + 1):
        raise ValueError(f"parts must be (n, H, S) and restoration (S, n+1), got {parts.shape} and {r.shape}")
    n, _, S = parts.shape
    if isinstance(subject, bool) or not isinstance(subject, (int, np.integer)) or not 0 <= subject < S - 1:
        raise ValueError(f"subject must be a position in 0..{S - 2} (before the predicting one), got {subject!r}")
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
                top_from_last=float(source == S - 1) if len(top) else nan,
                names_subject_block=float(len(from_subject) > 0), subject_block=subject_block,
                trace_block=trace_block, distance=distance, within2=float(distance <= 2) if distance == distance else nan,
                spearman_positions=float(spearman_rows(per_position[:1], per_position[1:])[0]),
                spearman_grid=float(spearman_rows(grid[:1], grid[1:])[0]))


# ---------------------------------------------------------------------------
# 8. Dual Path Attribution's ablation protocol (notebook 10)
# ---------------------------------------------------------------------------
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
DPA_RANK_RTOL = 1e-6  # scores closer than this times the item's largest |score| are tied
DPA_METHODS = ("ig_lens", "ig_lens_gauss", "atp", "atp_last", "grad_x_act", "activation", "random",
               "exhaustive")


def _dpa_layout(model) -> tuple[int, int, int]:
    """``(n, H, d_ff)``: blocks, attention heads (query heads under GQA) and MLP neurons."""
    adapter = get_adapter(model)
    d_ff = _projection_weight(_projection(adapter.blocks[0], "mlp")[0])[0].shape[1]
    return adapter.n_layers, _head_counts(model)[0], int(d_ff)


@contextmanager
def _gates(model, edges=None, neurons=None, record: Optional[dict] = None):
    """Run the model with gated attention weights and MLP activations (eager attention).

    For the duration, block L's post-softmax attention weights ``A`` (B, H, S, S) become
    ``A * edges[L]`` (no renormalisation; the heads' outputs are recomputed as ``(A * gate) @ v``,
    values of the shared key/value head under GQA), and its down projection's input ``act``
    (B, S, d_ff) (the gated unit ``act_fn(gate) * up``, GPT-2's ``act_fn`` output) becomes
    ``act * neurons[L]``; a None entry (or list) leaves that block as it is.

    Route: the core's :func:`iglens_core._eager_attention` switches the model to its eager
    attention, and the modeling module's ``eager_attention_forward`` (what transformers 5.x
    attention modules call for ``"eager"``; looked up at call time) is wrapped for the duration.
    The wrapper checks that the weights rebuild the eager output (``A @ v``) and that every gated
    block was reached; else a ValueError names the architecture.

    Args:
        edges, neurons: per block, a gate broadcastable to (B, H, S, S) / (B, S, d_ff), or None.
        record: if a dict, gets ``"weights"`` and ``"acts"``: per block the ungated tensors.
    """
    adapter = get_adapter(model)
    n = adapter.n_layers
    edges, neurons = edges or [None] * n, neurons or [None] * n
    attentions = [_first_attr(block, _ATTENTIONS) for block in adapter.blocks]
    index = {id(module): layer for layer, module in enumerate(attentions)}
    reached = set()
    if record is not None:
        record.update(weights=[None] * n, acts=[None] * n)

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
                hooks.append(_projection(block, "mlp")[0].register_forward_pre_hook(gate_neurons(layer)))
        with _eager_attention(model):
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
    """Validate one item: ``(input_ids (1, S) long on the model's device, target)``."""
    ids = torch.as_tensor(input_ids)
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
    return ids.long().to(next(model.parameters()).device), int(target)


def _dpa_flat_scores(scores: dict, n: int, H: int, S: int, d_ff: int) -> np.ndarray:
    """(n H S S + n S d_ff,) float64: the edge scores then the neuron scores, C order; a missing
    entry (key absent or None) scores 0."""
    if not isinstance(scores, dict) or not set(scores) <= {"edges", "neurons"}:
        raise ValueError(f"scores must be a dict with keys 'edges' and/or 'neurons', got "
                         f"{sorted(scores) if isinstance(scores, dict) else type(scores).__name__}")
    parts = []
    for key, shape in (("edges", (n, H, S, S)), ("neurons", (n, S, d_ff))):
        value = scores.get(key)
        value = np.zeros(shape) if value is None else np.asarray(torch.as_tensor(value, dtype=torch.float64).cpu())
        if value.shape != shape:
            raise ValueError(f"scores[{key!r}] must have shape {shape}, got {value.shape}")
        if not np.isfinite(value).all():
            raise ValueError(f"scores[{key!r}] must be finite, got {int((~np.isfinite(value)).sum())} "
                             "NaN or infinite entries")
        parts.append(value.ravel())
    return np.concatenate(parts)


def dpa_order(scores, *, ties: str = "random", seed: int = 0) -> np.ndarray:
    """(N,) component indices by signed score, descending; ties in a seeded random order.

    Scores closer than ``DPA_RANK_RTOL`` (1e-6) times the largest |score| are tied (single
    linkage along the sorted values, as :func:`tied_ranks`): the float32 rounding of a score is
    ~1e-7 of the terms it is summed from, so two scores that differ only by the float path (another
    machine or thread count) are one tie group. A score summed from terms much larger than itself
    (a gradient with cancellation) can round by more and still swap with a neighbour: between 1 and
    2 threads that moved notebook 10's full-run areas by up to 0.2. The tolerance is relative, not
    :func:`iglens_core.tie_tolerance`: the methods' scores live on scales from probability
    gradients (1e-8) to activation norms (1e2), where an absolute floor would tie all or none.

    Inside a tie group, ``ties="random"`` orders the components by a fixed permutation drawn from
    ``seed`` (numpy's PCG64: the same on every machine), so a method that leaves most components
    unscored (0) keeps a random set of them, as the random baseline would, whichever they are;
    ``ties="index"`` keeps the lower flat index first (edges before neurons, then block, head,
    query, key / block, position, neuron), which hands those slots to all the edges and the early
    blocks' neurons. The original breaks ties by an unstable bfloat16 argsort (no defined order).

    Args:
        scores: (N,) flat scores, e.g. edges then neurons.
        ties: ``"random"`` or ``"index"``.
        seed: the permutation's seed (integer >= 0), for ``ties="random"``.
    """
    if ties not in ("random", "index"):
        raise ValueError(f"ties must be 'random' or 'index', got {ties!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    x = np.asarray(scores, dtype=np.float64).ravel()
    order = np.argsort(-x, kind="stable")
    tolerance = DPA_RANK_RTOL * (np.abs(x).max() if x.size else 0.0)
    group = np.concatenate([[0], np.cumsum(-np.diff(x[order]) > tolerance)])
    key = order if ties == "index" else np.random.default_rng(seed).permutation(x.size)[order]
    return order[np.lexsort((key, group))]


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
            logits = _logits_at_end(model, 1, input_ids=ids.expand(len(rows), -1))[:, -1]
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
    fractions = np.asarray(DPA_FRACTIONS if fractions is None else fractions, dtype=np.float64)
    if fractions.ndim != 1 or not fractions.size or not ((fractions >= 0) & (fractions <= 1)).all():
        raise ValueError(f"fractions must be a non-empty 1-D sequence of values in [0, 1], got {fractions}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    ids, target = _dpa_item(model, input_ids, target)
    layout = _dpa_layout(model)
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
    x = np.asarray(DPA_FRACTIONS if fractions is None else fractions, dtype=np.float64)
    if scale == "log" and (x.size < 2 or (x <= 0).any()):
        raise ValueError(f"scale='log' needs at least two fractions, all > 0, got {x}")
    out = {}
    for name, mode, drops in (("disturb_aoc", "disrupt", disrupt), ("recover_aoc", "recover", recover)):
        drops = np.atleast_2d(np.asarray(drops, dtype=np.float64))
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
    n, H, d_ff = _dpa_layout(model)
    S, param = ids.shape[1], next(model.parameters())
    edges = [torch.ones(1, H, S, S, dtype=param.dtype, device=ids.device, requires_grad=True) for _ in range(n)]
    neurons = [torch.ones(1, S, d_ff, dtype=param.dtype, device=ids.device, requires_grad=True) for _ in range(n)]
    record: dict = {}
    with torch.enable_grad(), _frozen_parameters(model), _gates(model, edges, neurons, record):
        logits = _logits_at_end(model, 1, input_ids=ids)[0, -1]
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
    n, H, d_ff = layout = _dpa_layout(model)
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
    n, H, d_ff = _dpa_layout(model)
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
    - ``"exhaustive"``: the drop ``p_base - p`` when one component alone is zeroed, for ``subset``
      components drawn (``seed``) from the edges at or below the diagonal and the neurons; the
      rest score 0. A reference ceiling on that subset only; ``subset + 1`` rows of forward passes.

    Returns:
        ``{"edges": (n, H, S, S), "neurons": (n, S, d_ff)}`` float64 on the CPU; for the edges,
        ``[block, head, query, key]``.
    """
    if method not in DPA_METHODS:
        raise ValueError(f"method must be one of {DPA_METHODS}, got {method!r}")
    for name, value, low in (("seed", seed, 0), ("steps", steps, 1), ("subset", subset, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    ids, target = _dpa_item(model, input_ids, target)
    n, H, d_ff = _dpa_layout(model)
    S = ids.shape[1]
    if method in ("ig_lens", "ig_lens_gauss"):
        return _ig_lens_scores(model, ids, target, "prediction_aware" if method == "ig_lens" else "gauss_legendre",
                               steps, quantity, readout)
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
    ids, target = _dpa_item(model, input_ids, target)
    with torch.no_grad():
        probs = torch.softmax(_logits_at_end(model, 1, input_ids=ids)[0, -1].double(), -1)
    p = float(probs[target])
    text = tokenizer.decode([target]) if tokenizer is not None else "xx"
    return bool(int(probs.argmax()) == target and p > min_prob and len(text) > 1), p
