"""The counterfactual graph (issue 43): how much of ``f(clean) - f(corrupted)`` each residual state, head,
(query, key) edge (through its value, its query and its key), neuron and token embedding holds.

The zero-baseline graph (:mod:`iglens_graph`) splits p against nothing. Causal tracing, activation patching
and circuit benchmarks ask "instead of what": a corrupted input ``x'`` of the same length (subject swapped,
names flipped). This module splits ``Delta f = f(x) - f(x')`` for the head-once readout ``f`` (p(y), log p(y),
or either against a foil) at the last position.

Construction. Every sublayer is a map of all positions' states: the attention sublayer
``mid = x + A(x)`` (input norm, queries, keys, values, softmax, output projection, Gemma's post-norm) and
the MLP sublayer ``out = mid + M(mid)``. Along the straight path between the corrupted run's input of the
sublayer and the clean run's, ``x(t) = x' + t (x - x')``, the gradient theorem gives
``A(x) - A(x') = int_0^1 J_A(x(t)) (x - x') dt``: the softmax, the norms and the activations stay inside the
integral, nothing is frozen, so queries and keys get their credit. Starting from the readout's gradient
averaged on the straight line between the two final states (``cot_n``, at the last position), each sublayer
pulls the cotangent back, ``cot_in = cot_out + int_0^1 J(x(t))^T cot_out dt`` (Gauss-Legendre nodes in
float64, one vector-Jacobian product per node, batched), top-down to the embeddings. The share carried by
state (node L, position s) is ``<cot_L(s), h_L(s) - h'_L(s)>``.

Identities (tests/test_counterfactual.py):

- complete at every cut: ``carried[L].sum()`` (and ``carried_mid[L].sum()``) equals ``delta`` up to the
  quadrature gaps of the sublayers above (``gaps``, ``gap_readout``), which are reported and refined: a
  sublayer whose gap exceeds ``tolerance * |delta|`` is integrated again with twice the nodes (up to
  ``max_steps``). No error node: the gaps are the whole difference.
- positions before the first differing token hold exactly 0 (their states are equal in both runs);
- within a sublayer, exactly at every node (chain rule): the heads' shares add up to
  ``<cot_(L-1) - cot_mid, x - x'>``, the neurons' to ``<cot_mid - cot_L, mid - mid'>``, and each head's
  (query, key) edges (value, query and key parts) to its share at that query.

Edge parts. Head h at query q reads ``z(q) = sum_k A(q, k) v(k)`` with ``A = softmax(cap(s))`` and
``s(q, k) = scale <Q(q), K(k)>``; along the path ``dz(q) = sum_k [dA(q, k) v(k) + A(q, k) dv(k)]`` and
``ds(q, k) = scale (<dQ(q), K(k)> + <Q(q), dK(k)>)``. Edge (q, k)'s value part is
``A(q, k) <g_z(q), dv(k)>``, its query part ``g_s(q, k) scale <dQ(q), K(k)>``, its key part
``g_s(q, k) scale <Q(q), dK(k)>`` (``g`` the gradient of the sublayer's objective, ``d`` the tangent along
the path, both at each node), integrated with the same weights. Tangents come from forward-mode AD,
gradients from one reverse pass: parts cost a second forward pass per node.

Precision. By default every block runs as a float64 copy of the model's block (made one block at a time, its
norms in float64 as :func:`iglens_core.float64_forward` makes them), from the model's own embedding outputs,
so the graph splits the model's function computed in float64 and every cut is complete to the quadrature
gaps (<= ``tolerance * |delta|``, 1e-7 by default). ``dtype=torch.float32`` runs the chain in float32 instead
(copies of the blocks in float32, the model's own readout): about half the time per node, and the gaps then
hold float32 rounding too, so the default tolerance is :data:`FLOAT32_TOLERANCE`. ``delta_model`` is the
model's own readout in its dtype, and ``rebuild`` the largest relative gap between the chain's states and
the model's.
"""
from __future__ import annotations

import copy
import functools
import inspect
import itertools
import math
import weakref
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from tqdm.auto import tqdm

from iglens_checks import non_finite_error
from iglens_core import (as_model, check_foil, check_model, check_quantity, check_same_model, check_sequence,
                         eager_attention, first_output, float64_forward, get_adapter, head_counts, hidden_arg,
                         plain_number, quadrature, sublayer_module, sublayer_norm, sublayer_projection, Readout)

ATTENTION = "iglens_counterfactual"  # the attention implementation the block copies run
PARTS = ("value", "query", "key")  # the last axis of CounterfactualGraph.edges
DEFAULT_STEPS = 16  # Gauss-Legendre nodes per sublayer to start with (float64)
FLOAT32_STEPS = 4  # the same for a float32 chain: its map within 1.1e-5 (relative L1) of float64 at m = 64, as at 16
DEFAULT_TOLERANCE = 1e-7  # largest |gap| of one sublayer, relative to |delta|, before it is refined (float64)
FLOAT32_TOLERANCE = 1e-5  # the same for a float32 chain, above its rounding (~1e-6 a sublayer, measured)
MAX_STEPS = 256
REBUILD_TOLERANCE = 1e-3  # relative gap between the float64 copies' states and the model's
COPY_BUDGET = 2 * 2**30  # bytes of block (and float64 head) copies kept between calls and within one
_CAPTURE: list = []  # the attention function appends what it read while a capture is open
_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module -> {dtype: (its tensors' versions, copy)}


class _Stop(Exception):
    pass


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Eager attention, written out so that its queries, keys, raw scores, pattern and head outputs can
    be read (and their gradients and tangents taken). Registered as :data:`ATTENTION`."""
    groups = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)  # (B, H, S, hd)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    raw = query @ keys.transpose(-1, -2) * scaling  # (B, H, S, S)
    scores = raw if not softcap else softcap * torch.tanh(raw / softcap)
    if attention_mask is not None:
        mask = attention_mask[..., :keys.shape[-2]]
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.to(scores.dtype)
    pattern = torch.softmax(scores, -1)
    heads = pattern @ values  # (B, H, S, hd)
    if _CAPTURE:
        _CAPTURE[-1].update(query=query, key=key, value=value, raw=raw, pattern=pattern, heads=heads, scaling=scaling)
    return heads.transpose(1, 2).contiguous(), pattern


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION, _attention)


_register()


def _as_dtype(value, dtype: torch.dtype):
    """Floating tensors (and tuples of them) in a recorded block call as ``dtype``; the rest as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_as_dtype(v, dtype) for v in value)
    return value


def _versions(*modules: nn.Module) -> tuple:
    return tuple((t.data_ptr(), t._version) for m in modules for t in itertools.chain(m.parameters(), m.buffers()))


def _block_copy(block: nn.Module, dtype: torch.dtype, cache: bool = False) -> nn.Module:
    """A copy of ``block`` in ``dtype`` (float64: norms in float64 too), attention by :func:`_attention`. With
    ``cache`` the copy is kept for the block's lifetime and reused while none of its tensors has been changed or
    replaced."""
    versions = _versions(block)
    kept = _COPIES.get(block, {}).get(dtype)
    if cache and kept is not None and kept[0] == versions:
        return kept[1]
    out = copy.deepcopy(block).to(dtype)
    if dtype == torch.float64:
        float64_forward(out)
    for module in out.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION
    if cache:
        _COPIES.setdefault(block, {})[dtype] = (versions, out)
    return out


def _record(model, adapter, input_ids: torch.Tensor, dtype: torch.dtype = torch.float64):
    """One eager pass of ``input_ids`` (1, S), stopped at the final norm: each block's call (in ``dtype``,
    without cache arguments), each block's input (S, d) (the first is the embedding output h_0) and the final
    norm's input h_n (S, d)."""
    n = adapter.n_layers
    calls, final = [None] * n, []

    def record(layer):
        def hook(module, args, kwargs):
            hidden = hidden_arg(args, kwargs).detach()
            kwargs = {k: _as_dtype(v, dtype) for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values",
                                                                               "past_key_value", "layer_past", "use_cache")}
            rest = tuple(_as_dtype(a, dtype) for a in args[1:]) if args else None  # None: the state went by keyword
            calls[layer] = (hidden, rest, kwargs)
        return hook

    def stop(module, args, kwargs):
        final.append(hidden_arg(args, kwargs).detach())
        raise _Stop

    hooks = [block.register_forward_pre_hook(record(layer), with_kwargs=True) for layer, block in enumerate(adapter.blocks)]
    hooks.append(adapter.norm.register_forward_pre_hook(stop, with_kwargs=True))
    try:
        with eager_attention(model), torch.no_grad():
            model(input_ids.to(next(model.parameters()).device), use_cache=False)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return [(args, kwargs) for _, args, kwargs in calls], [hidden[0] for hidden, _, _ in calls], final[0][0]


class _PrefixKeys:
    """Stands in for the KV cache of one attention sublayer: the first call (the positions before the first
    differing token, equal in both runs and constant along every path) keeps its keys and values; every later
    call (the later positions, any batch) reads them before its own."""

    def __init__(self):
        self.keys = self.values = None

    def update(self, key, value, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key.detach(), value.detach()
            return key, value
        b = key.shape[0]
        return (torch.cat([self.keys.expand(b, -1, -1, -1), key], -2),
                torch.cat([self.values.expand(b, -1, -1, -1), value], -2))


def _split_call(block: nn.Module, call, first: int):
    """The recorded ``call`` of ``block`` cut at position ``first`` into a call over the positions before it
    and one over the positions from it on (queries there, keys over every position), sharing a
    :class:`_PrefixKeys`; None where the call holds an argument this cannot cut."""
    rest, kwargs = call
    signature = inspect.signature(block.forward)
    if "past_key_values" not in signature.parameters:
        return None
    try:
        bound = signature.bind(None, *(rest or ()), **kwargs).arguments
    except TypeError:
        return None
    keys, before, after = _PrefixKeys(), {}, {}
    for name, value in list(bound.items())[1:]:  # the first is the state
        for key, v in (value.items() if name == "kwargs" else [(name, value)]):
            if key == "attention_mask" and isinstance(v, torch.Tensor) and v.ndim == 4:
                before[key], after[key] = v[..., :first, :first], v[..., first:, :]
            elif key in ("position_ids", "cache_position") and isinstance(v, torch.Tensor):
                before[key], after[key] = v[..., :first], v[..., first:]
            elif key == "position_embeddings" and isinstance(v, tuple):
                before[key], after[key] = tuple(t[:, :first] for t in v), tuple(t[:, first:] for t in v)
            elif key == "past_key_values":
                continue
            elif isinstance(v, torch.Tensor) or (isinstance(v, tuple) and any(isinstance(t, torch.Tensor) for t in v)):
                return None  # a tensor argument of unknown layout: the full call
            else:
                before[key] = after[key] = v
    before["past_key_values"] = after["past_key_values"] = keys
    return (None, before), (None, after)


def _run_block(block: nn.Module, x: torch.Tensor, call) -> torch.Tensor:
    rest, kwargs = call
    return first_output(block(hidden_states=x, **kwargs) if rest is None else block(x, *rest, **kwargs))


class _Sublayers:
    """One block's two sublayers as maps of all positions' states, on its copy."""

    def __init__(self, block: nn.Module, call):
        self.block, self.call = block, call
        attention = sublayer_module(block, "attn")
        self.attn_out = sublayer_projection(block, "attn")[1] or attention  # what the residual adds
        self.norm2, self.mlp = sublayer_norm(block, "mlp"), sublayer_module(block, "mlp")
        self.down, self.post2 = sublayer_projection(block, "mlp")

    def after(self, prefix: torch.Tensor):
        """The attention sublayer as a map of the positions from ``len(prefix)`` on, every earlier position's
        input fixed at ``prefix`` (first, d); None where this block's call cannot be cut (then use :meth:`attn`)."""
        calls = _split_call(self.block, self.call, len(prefix))
        if calls is None:
            return None
        with torch.no_grad():
            self.attn(prefix[None], calls[0])  # keeps the prefix's keys and values
        return lambda x: self.attn(x, calls[1])

    def attn(self, x: torch.Tensor, call=None) -> torch.Tensor:
        """(B, S, d) block inputs -> (B, S, d) attention increments (the block run up to them)."""
        kept = []

        def keep(module, args, output):
            kept.append(first_output(output))
            raise _Stop
        hook = self.attn_out.register_forward_hook(keep)
        try:
            _run_block(self.block, x, self.call if call is None else call)
        except _Stop:
            pass
        finally:
            hook.remove()
        return kept[0]

    def mlp_increment(self, mid: torch.Tensor) -> torch.Tensor:
        """(B, S, d) mid states -> (B, S, d) MLP increments."""
        y = self.mlp(self.norm2(mid))
        return self.post2(y) if self.post2 is not None else y

    def neurons(self, mid: torch.Tensor):
        """The MLP increment and the input of its down projection (B, S, d_ff): the neurons' outputs."""
        kept = []
        hook = self.down.register_forward_pre_hook(lambda module, args: kept.append(args[0]))
        try:
            y = self.mlp_increment(mid)
        finally:
            hook.remove()
        return y, kept[0]


@dataclass
class CounterfactualGraph:
    """The split of ``delta = f(clean) - f(corrupted)`` (in the unit of f; tensors float64) over the model.

    Attributes:
        target, foil: token ids (foil None); quantity: ``"prob"`` or ``"logprob"``.
        input_ids, corrupted_ids: (S,) the two sequences; the readout is at the last position.
        first: the first position where they differ (every state before it is equal in both runs).
        f_clean, f_corrupted, delta: the readout of the chain (float64 by default) and its difference.
        delta_model: the same difference read by the model itself, in its dtype.
        carried: (n+1, S) ``<cot_L(s), h_L(s) - h'_L(s)>``: node 0 the token embeddings, node L block L's output.
        carried_mid: (n, S) the same at each block's state between attention and MLP.
        heads: (n, H, S) head h of block L at query s; neurons: (n, S, d_ff); None without ``parts``.
        edges: (n, H, S, S, 3) (query, key) through the value, the query and the key (:data:`PARTS`);
            sums over keys and parts to ``heads``; None without ``edges``.
        gaps: (n, 2) each sublayer's quadrature gap ``<cot_in, dx_in> - <cot_out, dx_out>`` (attention, MLP);
            gap_readout: ``<cot_n, dh_n> - delta``. Their sum is ``carried[0].sum() - delta``.
        steps: (n, 2) Gauss-Legendre nodes each sublayer used; readout_steps: the readout's.
        rebuild: largest relative gap between the chain's states and the model's own.
        cotangents: (n+1, S, d) ``cot_L``; cotangents_mid: (n, S, d) on the states between attention and MLP
            (0 before ``first``: no share needs them there, every state there being equal in both runs);
            states, states_mid: (2, n+1, S, d) and (2, n, S, d) the clean [0] and corrupted [1] states of the chain.
    """
    target: int
    foil: Optional[int]
    quantity: str
    input_ids: torch.Tensor
    corrupted_ids: torch.Tensor
    first: int
    f_clean: float
    f_corrupted: float
    delta: float
    delta_model: float
    carried: torch.Tensor
    carried_mid: torch.Tensor
    heads: Optional[torch.Tensor]
    neurons: Optional[torch.Tensor]
    edges: Optional[torch.Tensor]
    gaps: torch.Tensor
    gap_readout: float
    steps: torch.Tensor
    readout_steps: int
    rebuild: float
    cotangents: torch.Tensor = field(repr=False, default=None)
    cotangents_mid: torch.Tensor = field(repr=False, default=None)
    states: torch.Tensor = field(repr=False, default=None)
    states_mid: torch.Tensor = field(repr=False, default=None)

    @property
    def n_layers(self) -> int:
        return self.carried.shape[0] - 1

    @property
    def embeddings(self) -> torch.Tensor:
        """(S,) the token embeddings' shares (``carried[0]``)."""
        return self.carried[0]

    @property
    def gap(self) -> float:
        """``carried[0].sum() - delta``: every quadrature gap together (the graph's whole incompleteness)."""
        return float(self.carried[0].sum() - self.delta)

    def restoration(self) -> torch.Tensor:
        """(S, n+1) ``carried.T / delta``: each state's share of ``delta`` in the layout of
        :attr:`iglens_causal.CausalTrace.restoration` (a state holding all of ``delta`` reads 1)."""
        return self.carried.T / self.delta


def _readout64(model, adapter) -> Readout:
    """The model's readout in float64: a float64 copy of its final norm and of its head (kept for the model's
    lifetime like the blocks', while it fits :data:`COPY_BUDGET`), read by :class:`iglens_core.Readout`, whose
    segment gradients take three head products whatever the number of nodes."""
    head = adapter.head
    versions = _versions(head, adapter.norm)
    kept = _COPIES.get(head, {}).get(torch.float64)
    if kept is not None and kept[0] == versions:
        return Readout(model, norm=kept[1][0], head=kept[1][1])
    norm = copy.deepcopy(adapter.norm).to(torch.float64)
    float64_forward(norm)
    weight = head.weight.detach()
    bias = getattr(head, "bias", None)
    head64 = nn.Linear(weight.shape[1], weight.shape[0], bias=isinstance(bias, torch.Tensor), dtype=torch.float64,
                       device=weight.device)
    with torch.no_grad():
        head64.weight.copy_(weight)
        if isinstance(bias, torch.Tensor):
            head64.bias.copy_(bias)
    if 8 * weight.numel() <= COPY_BUDGET:
        _COPIES.setdefault(head, {})[torch.float64] = (versions, (norm, head64))
    return Readout(model, norm=norm, head=head64)


@functools.lru_cache(maxsize=64)
def _nodes(steps: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Legendre nodes and weights on [0, 1] (cached: numpy computes them afresh on every call)."""
    return tuple(t.to(dtype) for t in quadrature("gauss_legendre", steps))


def _pull(fn, start: torch.Tensor, end: torch.Tensor, cot: torch.Tensor, steps: int, batch: int):
    """``sum_k w_k J_fn(x_k)^T cot`` over the Gauss-Legendre nodes of the straight path start -> end (S, d)."""
    alphas, weights = _nodes(steps, start.dtype)
    delta = end - start
    out = torch.zeros_like(start)
    for i in range(0, steps, batch):
        a, w = alphas[i:i + batch], weights[i:i + batch]
        x = (start + a[:, None, None] * delta).requires_grad_(True)  # (b, S, d)
        with torch.enable_grad():
            y = fn(x)
            (grad,) = torch.autograd.grad((y * cot).sum(-1).sum(-1) @ w, x)
        out += grad.sum(0)
    return out


def _attention_parts(attn, start, end, cot, steps, batch, edges: bool):
    """Heads (H, S) and edges (H, S, S', 3) of one attention sublayer ``attn`` (a map of the states (B, S, d)
    of S positions to its increments there; S' keys) for the cotangent ``cot`` on its output."""
    alphas, weights = _nodes(steps, start.dtype)
    delta = end - start
    heads_out, edges_out = 0.0, 0.0
    for i in range(0, steps, batch):
        a, w = alphas[i:i + batch], weights[i:i + batch]
        x = start + a[:, None, None] * delta
        _CAPTURE.append({})
        try:
            with torch.no_grad(), fwAD.dual_level():
                attn(fwAD.make_dual(x, delta.expand_as(x).contiguous()))
                tangents = {k: fwAD.unpack_dual(v).tangent for k, v in _CAPTURE[-1].items() if isinstance(v, torch.Tensor)}
            _CAPTURE[-1] = {}
            with torch.enable_grad():
                x = x.requires_grad_(True)
                y = attn(x)
                seen = _CAPTURE[-1]
                g_heads, g_raw = torch.autograd.grad((y * cot).sum(-1).sum(-1) @ w, [seen["heads"], seen["raw"]])
        finally:
            _CAPTURE.pop()
        heads_out = heads_out + (g_heads * tangents["heads"]).sum(-1).sum(0)  # (H, S); w is in g
        if edges:
            groups = seen["query"].shape[1] // seen["key"].shape[1]
            q, k = seen["query"].detach(), seen["key"].detach().repeat_interleave(groups, 1)
            dq, dk = tangents["query"], tangents["key"].repeat_interleave(groups, 1)
            dv = tangents["value"].repeat_interleave(groups, 1)
            value = seen["pattern"].detach() * (g_heads @ dv.transpose(-1, -2))  # (b, H, S, S)
            query = g_raw * seen["scaling"] * (dq @ k.transpose(-1, -2))
            key = g_raw * seen["scaling"] * (q @ dk.transpose(-1, -2))
            edges_out = edges_out + torch.stack([value, query, key], -1).sum(0)
    return heads_out, (edges_out if edges else None)


def _mlp_parts(sub: _Sublayers, start, end, cot, steps, batch):
    """(S, d_ff) the neurons' shares of one MLP sublayer for the cotangent ``cot`` on its output."""
    alphas, weights = _nodes(steps, start.dtype)
    delta = end - start
    out = 0.0
    for i in range(0, steps, batch):
        a, w = alphas[i:i + batch], weights[i:i + batch]
        x = start + a[:, None, None] * delta
        with torch.no_grad(), fwAD.dual_level():
            _, u = sub.neurons(fwAD.make_dual(x, delta.expand_as(x).contiguous()))
            du = fwAD.unpack_dual(u).tangent
        with torch.enable_grad():
            y, u = sub.neurons(x.requires_grad_(True))
            (g_u,) = torch.autograd.grad((y * cot).sum(-1).sum(-1) @ w, u)
        out = out + (g_u * du).sum(0)
    return out


def _check_int(name: str, value, low: int, high: int) -> int:
    value = plain_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


def _refined(compute, gap_of, steps: int, limit: float, max_steps: int):
    """``compute(steps)``, with twice the nodes while ``|gap_of(result)| > limit`` and steps < max_steps."""
    result = compute(steps)
    while abs(gap_of(result)) > limit and steps * 2 <= max_steps:
        steps *= 2
        result = compute(steps)
    return result, steps


def counterfactual_graph(model, clean_ids, corrupted_ids, target: int, *, quantity: str = "prob", foil=None,
                         steps: Optional[int] = None, tolerance: Optional[float] = None,
                         max_steps: int = MAX_STEPS, parts: bool = True, edges: bool = False,
                         batch: int = 16, min_delta: float = 0.0, dtype: torch.dtype = torch.float64,
                         readout: Optional[Readout] = None, progress: bool = False) -> CounterfactualGraph:
    """The exact counterfactual graph of ``target`` at the last position of ``clean_ids`` against
    ``corrupted_ids`` (see the module docstring).

    Args:
        model: a Hugging Face causal LM in eval mode (Llama family, Qwen2/3, Gemma 2/3, GPT-2, ...).
        clean_ids, corrupted_ids: (1, S) or (S,) token ids of the same length, differing somewhere.
        target: token id of the answer read at the last position; foil: a token id for f = f(y) - f(foil).
        quantity: ``"prob"`` (p(y)) or ``"logprob"`` (log p(y); with a foil the logit difference).
        steps: Gauss-Legendre nodes per sublayer and for the readout to start with, 1..max_steps. None:
            :data:`DEFAULT_STEPS` (float64), :data:`FLOAT32_STEPS` (float32).
        tolerance: a sublayer whose gap exceeds ``tolerance * |delta|`` is integrated again with twice the
            nodes, up to ``max_steps``; the gaps left are reported (``gaps``, ``gap_readout``). None:
            :data:`DEFAULT_TOLERANCE` (float64), :data:`FLOAT32_TOLERANCE` (float32).
        parts: also split each block over heads and neurons (a second, forward-mode pass per node).
        edges: also split each head over (query, key) edges and value / query / key parts ((n, H, S, S, 3)).
        batch: path nodes per pass (memory); min_delta: smallest |delta| accepted.
        dtype: the chain's precision, ``torch.float64`` (exact to the quadrature gaps) or ``torch.float32``
            (about half the time; its gaps hold float32 rounding).
        readout: the model's :class:`iglens_core.Readout`, shared between calls (a new one checks the final norm's
            form once, ~0.1 s); None makes one.
        progress: a progress bar over the blocks.

    Returns:
        :class:`CounterfactualGraph`.

    Raises:
        ValueError: lengths differ, the inputs are identical, the corruption moves f by no more than
            ``min_delta`` (or not at all), a bad argument (named, with its valid range), an architecture whose
            blocks this construction cannot rebuild.
    """
    model = as_model(model)
    check_model(model)
    if isinstance(model, nn.Module) and model.training:
        raise ValueError("the model is in training mode (dropout would change the pass): call model.eval() first")
    clean = check_sequence(model, clean_ids, None)
    corrupted = check_sequence(model, corrupted_ids, None)
    if clean.shape != corrupted.shape:
        raise ValueError(f"clean_ids and corrupted_ids must have the same length (positions align), got "
                         f"{clean.shape[1]} and {corrupted.shape[1]}: pick a corruption of the same token length")
    differ = (clean[0] != corrupted[0]).nonzero()[:, 0]
    if not len(differ):
        raise ValueError("clean_ids and corrupted_ids are identical: there is no difference to split; "
                         "corrupt the input (e.g. swap the subject)")
    check_quantity(quantity)
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype!r}")
    max_steps = _check_int("max_steps", max_steps, 1, 4096)
    steps = _check_int("steps", (DEFAULT_STEPS if dtype == torch.float64 else FLOAT32_STEPS) if steps is None else steps,
                       1, max_steps)
    batch = _check_int("batch", batch, 1, 4096)
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE
    tolerance, min_delta = plain_number(tolerance), plain_number(min_delta)
    for name, value in (("tolerance", tolerance), ("min_delta", min_delta)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    for name, flag in (("parts", parts), ("edges", edges), ("progress", progress)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    check_same_model(model, readout=readout)
    readout = readout or Readout(model)
    target = _check_int("target", target, 0, readout.vocab_size - 1)
    foils = check_foil(foil, torch.tensor([target]), readout.vocab_size)
    foil = None if foils is None else int(foils[0])
    adapter = get_adapter(model)
    n = adapter.n_layers
    H, _ = head_counts(model)
    if getattr(adapter.blocks[0], "use_parallel_residual", False) or getattr(adapter.blocks[0], "parallel_attn", False):
        raise ValueError("parallel attention and MLP blocks are not supported by the counterfactual graph")

    calls, inputs, hn = _record(model, adapter, clean, dtype)
    _, inputs_bad, hn_bad = _record(model, adapter, corrupted, dtype)
    h0, h0_bad = inputs[0], inputs_bad[0]
    first = int(differ[0])
    S = clean.shape[1]
    own = readout(torch.stack([hn[-1], hn_bad[-1]]), torch.tensor(target), None if foil is None else torch.tensor(foil),
                  quantity=quantity).double()
    delta_model = float(own[0] - own[1])

    # the chain: both runs through copies of the blocks in `dtype`, the sublayer states kept
    size = torch.finfo(dtype).bits // 8
    keep = size * sum(p.numel() for p in adapter.blocks.parameters()) <= COPY_BUDGET  # copies kept
    copies: list = [None] * n
    states = [torch.stack([h0, h0_bad]).to(dtype)]  # node states (2, S, d): clean, corrupted
    mids = []
    rebuild = 0.0
    with torch.no_grad():
        for layer in range(n):
            block = _block_copy(adapter.blocks[layer], dtype, cache=keep)
            sub = _Sublayers(block, calls[layer])
            x = states[-1]
            mid = x + sub.attn(x)
            out = mid + sub.mlp_increment(mid)
            if layer + 1 < n:  # against the model's own states (the last block's against h_n below)
                model_states = torch.stack([inputs[layer + 1], inputs_bad[layer + 1]]).to(dtype)
                rebuild = max(rebuild, float((out - model_states).norm() / model_states.norm().clamp_min(1e-30)))
            out[:, :first] = out[0, :first]  # equal inputs give equal states: make it exact
            mid[:, :first] = mid[0, :first]
            mids.append(mid)
            states.append(out)
            if keep:
                copies[layer] = sub
    final = torch.stack([hn, hn_bad]).to(dtype)
    for what, tensors in (("the model's own pass", [h0, h0_bad, hn, hn_bad]), ("the block copies' pass", states + mids)):
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            raise non_finite_error(model, f"in {what} (clean or corrupted run)")
    rebuild = max(rebuild, float((states[-1] - final).norm() / final.norm().clamp_min(1e-30)))
    if not rebuild <= REBUILD_TOLERANCE:
        raise ValueError(f"the copies of the blocks do not rebuild the model's states (relative gap {rebuild:.1e}): "
                         "this architecture computes its blocks otherwise than this construction assumes")

    read = readout if dtype != torch.float64 or readout.dtype == torch.float64 else _readout64(model, adapter)
    top_clean, top_bad = states[-1][0, -1], states[-1][1, -1]
    ids = (torch.tensor([target]), None if foil is None else torch.tensor([foil]))
    f_corrupted, f_clean = read(torch.stack([top_bad, top_clean]), ids[0], ids[1], quantity=quantity).tolist()
    delta = f_clean - f_corrupted
    if not abs(delta) > min_delta:
        raise ValueError(f"the corruption moves f by {delta:+.3e} (f(clean) {f_clean:.6g}, f(corrupted) {f_corrupted:.6g}), "
                         f"not more than min_delta={min_delta}: there is nothing to split; pick a corruption that changes "
                         "the answer's probability")
    limit = tolerance * abs(delta)
    dh = top_clean - top_bad

    def top(m):
        alphas, weights = _nodes(m, torch.float64)
        gbar, _ = read.along_segments(torch.stack([top_bad, top_clean])[:, None], ids[0], alphas, weights=weights,
                                      foils=ids[1], quantity=quantity)  # (1, 1, d)
        return gbar[0, 0]
    gbar, readout_steps = _refined(top, lambda g: float(g @ dh) - delta, steps, limit, max_steps)
    cot = torch.zeros_like(states[-1][0])  # (S, d) on h_n
    cot[-1] = gbar
    gap_readout = float(gbar @ dh) - delta

    carried = torch.zeros(n + 1, S, dtype=torch.float64)
    carried_mid = torch.zeros(n, S, dtype=torch.float64)
    gaps = torch.zeros(n, 2, dtype=torch.float64)
    used = torch.zeros(n, 2, dtype=torch.long)
    heads = torch.zeros(n, H, S, dtype=torch.float64) if parts or edges else None
    neurons = [None] * n
    edge_out = None
    carried[n] = (cot * (states[n][0] - states[n][1])).sum(-1)
    cots, cots_mid = [None] * n + [cot], [None] * n
    for layer in tqdm(reversed(range(n)), total=n, desc="blocks", disable=not progress):
        sub = copies[layer] or _Sublayers(_block_copy(adapter.blocks[layer], dtype), calls[layer])
        x_bad, x = states[layer][1], states[layer][0]
        m_bad, m = mids[layer][1], mids[layer][0]
        d_out, d_mid, d_x = states[layer + 1][0] - states[layer + 1][1], m - m_bad, x - x_bad
        # MLP: mid' -> mid, objective <cot, M(mid)>
        def mlp_pull(k):  # position-wise: the positions before `first` (equal states) are left out
            out = cot.clone()
            out[first:] += _pull(sub.mlp_increment, m_bad[first:], m[first:], cot[first:], k, batch)
            return out
        cot_mid, used[layer, 1] = _refined(mlp_pull, lambda c: float((c * d_mid).sum() - (cot * d_out).sum()),
                                           steps, limit, max_steps)
        gaps[layer, 1] = float((cot_mid * d_mid).sum() - (cot * d_out).sum())
        if parts or edges:
            neurons[layer] = torch.zeros(S, sub.down.in_features if hasattr(sub.down, "in_features") else
                                         sub.down.weight.shape[0], dtype=torch.float64)
            neurons[layer][first:] = _mlp_parts(sub, m_bad[first:], m[first:], cot[first:], int(used[layer, 1]), batch)

        suffix = sub.after(x[:first]) if first else None  # the positions before `first` are the same in both runs
        attn, start = (sub.attn, 0) if suffix is None else (suffix, first)

        def attn_pull(k):
            out = cot_mid.clone()
            out[start:] += _pull(attn, x_bad[start:], x[start:], cot_mid[start:], k, batch)
            return out
        cot_in, used[layer, 0] = _refined(attn_pull, lambda c: float((c * d_x).sum() - (cot_mid * d_mid).sum()),
                                          steps, limit, max_steps)
        gaps[layer, 0] = float((cot_in * d_x).sum() - (cot_mid * d_mid).sum())
        if parts or edges:
            h_share, e_share = _attention_parts(attn, x_bad[start:], x[start:], cot_mid[start:],
                                                int(used[layer, 0]), batch, edges)
            heads[layer, :, start:] = h_share
            if edges:
                if edge_out is None:
                    edge_out = torch.zeros(n, H, S, S, 3, dtype=torch.float64)
                edge_out[layer, :, start:] = e_share
        carried_mid[layer] = (cot_mid * d_mid).sum(-1)
        carried[layer] = (cot_in * d_x).sum(-1)
        cot_in[:first] = 0.0  # not needed: every state before `first` is equal in both runs
        cot = cots[layer] = cot_in
        cots_mid[layer] = cot_mid
    for grid in (carried, carried_mid):
        grid[:, :first] = 0.0
    return CounterfactualGraph(
        target=target, foil=foil, quantity=quantity, input_ids=clean[0].cpu(), corrupted_ids=corrupted[0].cpu(),
        first=first, f_clean=f_clean, f_corrupted=f_corrupted, delta=delta, delta_model=delta_model,
        carried=carried, carried_mid=carried_mid, heads=heads,
        neurons=torch.stack(neurons) if parts or edges else None, edges=edge_out, gaps=gaps,
        gap_readout=gap_readout, steps=used, readout_steps=readout_steps, rebuild=rebuild,
        cotangents=torch.stack(cots), cotangents_mid=torch.stack(cots_mid), states=torch.stack(states, 1),
        states_mid=torch.stack(mids, 1))
