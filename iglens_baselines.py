"""The attribution methods IG-Lens is compared with, each on the same targets as a Trace.

The method lives in :mod:`iglens_core`; this module imports it and holds, in reading order:

1. direct logit attribution: exact in logits (``direct_logit_attribution``) and read as probability
   (``dla_probability``); none of the per-layer numbers below sums to Δp in probability (notebook 04)
2. the tuned lens: affine translators per layer, trained here on any texts (``TunedLens``,
   ``train_tuned_lens``, notebook 04)
3. captum's layer Integrated Gradients and layer conductance, one baseline per layer (notebook 04)
4. per attention head / MLP neuron / (head, source) direct logit attribution (``component_dla``,
   notebooks 07 and 09) and the attention weight x value norm control (``attention_norm``, notebook 09)

The causal references (ablation, patching, tracing) are in :mod:`iglens_causal`, DPA's benchmark
in :mod:`iglens_dpa`. Shapes follow the core: ``T`` predicting positions, ``n`` blocks, ``d`` hidden
size, ``V`` vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from iglens_core import (CACHE_DIR, Adapter, Readout, Trace, check_layers, check_same_model, collect,
                         component_terms, first_output, get_adapter, head_counts, head_values, hidden_arg, logits_at_end,
                         precision, projection_weight, replace_first, sublayer_projection)


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


@contextmanager
def frozen_parameters(model):
    """Parameters excluded from autograd for the duration (captum needs gradients of states only)."""
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        yield
    finally:
        for param, flag in zip(model.parameters(), flags):
            param.requires_grad_(flag)


def _captum_column(explainer, hooks, inputs, baselines, steps: int, method: str, limit: bool):
    """One captum ``attribute`` call, its hooks removed afterwards.

    Returns:
        ``(values (B,), limits (B,))`` float64: the attribution summed over positions and hidden
        dimensions, and that minus captum's convergence delta (NaN without ``limit``: the delta costs
        two more forward passes per token).
    """
    try:
        with torch.enable_grad():
            attributions = explainer.attribute(
                inputs, baselines=baselines, target=list(range(len(inputs))), n_steps=steps,
                method=method, return_convergence_delta=limit)
    finally:
        for hook in hooks:
            hook.remove()
    if limit:
        attributions, delta = attributions
    values = attributions.detach().double().sum((1, 2)).cpu()
    return values, (values - delta.detach().double().cpu()) if limit else torch.full_like(values, float("nan"))


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

    tail = ids.shape[-1] - int(positions.min())    # the vocabulary product only where a target is read
    columns = positions - (ids.shape[-1] - tail)

    def probs(batch: int) -> torch.Tensor:
        logits = logits_at_end(model, tail, input_ids=ids.expand(batch, -1))[:, columns]  # (B, K, V)
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
    with frozen_parameters(model):
        for j, (start, end) in enumerate(zip(starts, layers)):
            probe, state = _Probe(), {}

            def forward(gate, probe=probe, state=state):
                state["gate"] = gate.reshape(-1, 1, 1)
                return probs(gate.shape[0])

            def keep_input(mod, args, kwargs, state=state):
                state["input"] = hidden_arg(args, kwargs)

            def gated_output(mod, args, output, probe=probe, state=state):
                hidden = first_output(output)
                mixed = state["input"] + state["gate"].to(hidden) * (hidden - state["input"])
                return replace_first(output, probe(mixed))

            hooks = [adapter.blocks[start].register_forward_pre_hook(keep_input, with_kwargs=True),
                     adapter.blocks[end - 1].register_forward_hook(gated_output)]
            values[:, j], limits[:, j] = _captum_column(
                LayerIntegratedGradients(forward, probe), hooks, torch.ones(B, 1, device=device),
                torch.zeros(B, 1, device=device), steps, method, return_limit)
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
        lambda mod, args, kwargs: embedded.__setitem__("h0", hidden_arg(args, kwargs).detach()),
        with_kwargs=True)
    try:
        with torch.no_grad():
            model(trace.input_ids.to(device), use_cache=False)
    finally:
        capture.remove()
    start = embedded["h0"].expand(B, -1, -1).clone()  # (B, S, d)
    values = torch.zeros(B, len(layers), dtype=torch.float64)
    limits = torch.zeros_like(values)
    with frozen_parameters(model):
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
                return replace_first(output, probe(first_output(output)))

            hooks = [adapter.blocks[0].register_forward_pre_hook(substitute, with_kwargs=True),
                     adapter.blocks[end - 1].register_forward_hook(probed)]
            values[:, j], limits[:, j] = _captum_column(
                LayerConductance(forward, probe), hooks, start, torch.zeros_like(start), steps, method, return_limit)
    return (values, limits) if return_limit else values


CAPTUM_METHODS = ("gausslegendre", "riemann_left", "riemann_right", "riemann_middle",
                  "riemann_trapezoid")


def _check_captum(steps, method):
    if method not in CAPTUM_METHODS:
        raise ValueError(f"method must be one of {CAPTUM_METHODS}, got {method!r}")
    low = 1 if method == "gausslegendre" else 2
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < low:
        raise ValueError(f"steps must be an integer >= {low} for {method}, got {steps!r}")


def component_layout(model, resolution: str) -> tuple[str, list, int, int]:
    """``(sublayer, projections, parts, width)`` for ``"head"`` or ``"neuron"``: per block the projection
    whose input holds the parts, the number of parts (H heads or d_ff neurons), one part's input columns."""
    if resolution not in ("head", "neuron"):
        raise ValueError(f"resolution must be 'head' or 'neuron', got {resolution!r}")
    sublayer = "attn" if resolution == "head" else "mlp"
    projections = [sublayer_projection(block, sublayer)[0] for block in get_adapter(model).blocks]
    inputs = projection_weight(projections[0])[0].shape[1]
    parts = head_counts(model)[0] if sublayer == "attn" else inputs
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
    if resolution not in ("head", "neuron", "source"):
        raise ValueError(f"resolution must be 'head', 'neuron' or 'source', got {resolution!r}")
    check_same_model(model, trace)
    adapter = get_adapter(model)
    sources = resolution == "source"
    sublayer = component_layout(model, "head" if sources else resolution)[0]
    scale, center, _ = _frozen_final_norm(adapter, trace.hidden[-1].double())
    read = scale * adapter.head.weight.detach().double().cpu()[trace.targets]  # (T, d)
    if center:  # <P x, r> = <x, P r>: P is the (symmetric) centring projection
        read = read - read.mean(-1, keepdim=True)
    terms, _, per_source = component_terms(model, trace, adapter.logit_scale * read, sublayer, sources=sources)
    return per_source if sources else terms


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
        weight = projection_weight(sublayer_projection(block, "attn")[0])[0].double().cpu()  # (d, H * hd)
        values = head_values(trace, layer)  # (S, H, hd)
        heads = values.shape[1]
        written = torch.einsum("dhk,shk->shd", weight.view(-1, heads, values.shape[-1]), values)  # (S, H, d)
        out.append(trace.patterns[layer].double() * written.norm(dim=-1).T[None])  # (T, H, S)
    return torch.stack(out, 1)
