"""Dual Path Attribution itself (DPA, arXiv 2603.19742, lab-paper-code/dual_path_attribution), and the
gated run of the model that DPA's benchmark (:mod:`iglens_dpa`) and DPA's sweep both read.

Imports :mod:`iglens_core` and :mod:`iglens_graph` (whose frozen blocks DPA's sweep reuses) and holds,
in reading order: ``gated_run`` (the model with its post-softmax attention weights and its down
projections' inputs gated or recorded, eager attention), ``dpa_item`` (one item's checks), and
``dpa_attribution`` with its weights (``DPA_WEIGHTS``): DPA's scores of every attention edge and
MLP neuron at every position.
"""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
from torch import nn

from iglens_core import (check_sequence, eager_attention, first_output, get_adapter, head_counts, plain_number,
                         projection_weight, sublayer_module, sublayer_projection)
from iglens_graph import LinearBlock, block_parts, freeze_norm, non_finite_error, rebuild_tolerance, record_pass


@contextmanager
def gated_run(model, edges=None, neurons=None, record: Optional[dict] = None):
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
            if not bool(torch.isfinite(out).all()):
                raise non_finite_error(model, f"at block {layer + 1}'s attention output")
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




def dpa_item(model, input_ids, target) -> tuple[torch.Tensor, int]:
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
                 recorded: torch.Tensor, where: str, tol: float):
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
            self.norm = freeze_norm(norm, rows, out, where, tol)
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
    queries and keys and the score scale (at ``eager_attention_forward``, :func:`gated_run`) and the
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
        with gated_run(model, record=record):
            store = record_pass(model, adapter, parts, ids)
    finally:
        for hook in hooks:
            hook.remove()
    extra["qk"] = record["qk"]
    return store, extra


DPA_QUANTITIES = ("logit", "logprob")  # the start vector: the target's logit (the original's) or its log-probability


@torch.no_grad()

def dpa_attribution(model, input_ids, target: int, *, weights: Optional[dict] = None,
                    neurons_at: str = "mid", quantity: str = "logit") -> dict:
    """Dual Path Attribution (DPA, arXiv 2603.19742) of one item: every attention edge and MLP neuron
    at every position, in the unit of the target logit (at the last position).

    Followed: lab-paper-code/dual_path_attribution, ``tracer/tracer.py`` (``BaseTracer._init_gradients``,
    ``ComponentTracer.batch_trace``) and ``tracer/backend.py`` (``Llama2Backend.get_mlp_update``,
    ``get_attn_update``, ``get_component_contributions``; ``Qwen3Backend`` for query/key norms), as
    ``DPAComponentAttribution`` in ``experiments/attribution/component_attribution_modules.py`` runs them.

    Top: the target's unembedding row through the final norm at its recorded scale, at the last
    position (the target logit's gradient w.r.t. ``h_n`` with the norm's denominator fixed); with
    ``quantity="logprob"`` the row of ``log p(target)`` instead, ``W_U^T g`` with ``g = d log p(target) / d u``
    at the recorded head output ``u`` (``(e_target - p)``, times the soft-cap's and the logit scale's
    derivatives), so that DPA splits the same first-order quantity a log-probability readout reads (a
    start this repository adds; the original starts from the logit only). Then block
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
        and outputs) and, last, of the head's (final norm's beta, head bias), "logit": the target logit (with
        ``quantity="logprob"``: ``<g, u>``, the start vector's value, not log p)}``,
        float64 on the CPU; ``embeddings`` is ``carried[0]``, DPA's input attribution.
    """
    weights = _dpa_weights(weights)
    if neurons_at not in DPA_NEURONS_AT:
        raise ValueError(f"neurons_at must be one of {DPA_NEURONS_AT}, got {neurons_at!r}")
    if quantity not in DPA_QUANTITIES:
        raise ValueError(f"quantity must be one of {DPA_QUANTITIES}, got {quantity!r}")
    ids, target = dpa_item(model, input_ids, target)
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
    tol = rebuild_tolerance(model)  # above float32's for a bfloat16 or float16 model (its rounded states)
    final = freeze_norm(adapter.norm, h_n[-1:], extra["final"], "the final norm", tol)
    head_weight, head_bias = projection_weight(adapter.head)
    bias = head_bias.double().cpu() if head_bias is not None else None
    if quantity == "logit":  # one row of the head: (d,)
        row = adapter.logit_scale * head_weight[target].double().cpu()
        bias_credit = adapter.logit_scale * float(bias[target]) if bias is not None else 0.0
    else:  # start (V,) = d log p(target) / d head output, at the recorded pass
        W = head_weight.double().cpu()
        u = final.forward(h_n[-1:])[0] @ W.T + (bias if bias is not None else 0.0)
        z = adapter.logit_scale * u
        z = torch.tanh(z / adapter.softcap) * adapter.softcap if adapter.softcap else z
        start = -torch.softmax(z, -1)
        start[target] += 1.0
        if adapter.softcap:  # d/dx [c tanh(x / c)] = 1 - tanh(x / c)^2
            start = start * (1 - (z / adapter.softcap) ** 2)
        start = adapter.logit_scale * start
        row, bias_credit = start @ W, float(start @ bias) if bias is not None else 0.0
    cot = torch.zeros_like(h_n)  # (S, d) the cotangent on h_L, L = n first
    cot[-1] = final.back(row[None])[0]
    constants = torch.zeros(n + 1, dtype=torch.float64)
    constants[n] = (float(row @ final.beta) if final.beta is not None else 0.0) + bias_credit
    S = h_n.shape[0]
    edges = torch.zeros(n, H, S, S, dtype=torch.float64)
    neurons, carried = [None] * n, torch.zeros(n + 1, S, dtype=torch.float64)
    carried[n] = (cot * h_n).sum(-1)
    for layer in reversed(range(n)):
        part, where = parts[layer], f"{name} block {layer + 1}"
        block = LinearBlock(part, store, layer, H, H_kv, path=False, tol=tol)
        query, key, scaling, softcap = extra["qk"][layer]
        if softcap is not None:
            raise ValueError(f"{where}: attention soft-capping is not supported by DPA")
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5  # eager's default
        z, attention = block.norm1.forward(store["h", layer]), part["attention"]
        sides = [_RotarySide(getattr(attention, proj), getattr(attention, norm, None), heads, z,
                             extra.get(("rotary", layer)), recorded[0].double().cpu(), f"{where} {proj}", tol)
                 for proj, norm, heads, recorded in (("q_proj", "q_norm", H, query), ("k_proj", "k_norm", H_kv, key))]
        rebuild = max(block.rebuild, *(side.rebuild for side in sides))
        if not rebuild <= tol:  # NaN too
            raise ValueError(f"{where}: the frozen block does not rebuild the recorded pass (relative gap "
                             f"{rebuild:.1e}, tolerance {tol:.0e}); this architecture computes its blocks otherwise "
                             "than DPA assumes")
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
