"""The exact counterfactual graph on MIB's edges (issues 43 and 44): each edge's share of the logit difference
``f(clean) - f(corrupted)``, complete at every node; and mask IG over MIB's edge gates (:func:`mask_ig_edges`),
complete in total.

MIB's graph (:class:`iglens_mib.MIBGraph`) is a DAG of nodes: ``input``, every head ``a{L}.h{h}`` (a function of
its own query, key and value inputs, ungrouped as MIB does), every MLP ``m{L}`` and ``logits`` (MIB's logit
difference read through the final norm and the head). Every receiver's input is the sum of the earlier
senders' outputs. This module linearises each node along the straight path between its receivers' inputs in
the corrupted run and in the clean run (all positions at once, so the softmax stays inside the integral and
queries and keys get credit), ``out_v(clean) - out_v(corrupted) = Jbar_v (in_v(clean) - in_v(corrupted))`` by
the gradient theorem, and composes top-down: the cotangent on a node's output is the sum of the cotangents
on the receivers it feeds, ``cot_in(v) = Jbar_v^T cot_out(v)``, starting from the logits node. An edge u -> v
holds ``<cot_in(v), out_u(clean) - out_u(corrupted)>`` (summed over positions and items), so:

- the edges into the logits add up to ``Delta f`` (up to the readout's quadrature gap);
- for every node, the edges into it add up to the edges out of it (up to its own quadrature gap), and
  the edges out of ``input`` add up to ``Delta f`` (up to every gap): complete at every node;
- the scores are in MIB's (n_forward, n_backward) layout (``iglens_mib.contract``), so they plug into
  ``iglens_mib``'s circuits and faithfulness like EAP and EAP-IG, whose sign convention they share.

Each node is integrated with ``steps`` Gauss-Legendre nodes (the attention nodes of one block together:
they share one path); ``gaps`` reports every node's gap.

A post-attention norm (Gemma 2/3) ``P`` sits between a block's heads and the residual, and MIB's harness
applies it to the blended sum of the heads (``iglens_mib``). It is linearised the same way, on the straight
path from the corrupted run's head sum ``A'`` to the clean run's ``A``: ``P(A) - P(A') = Pbar (A - A')`` with
``A - A' = sum_h (o_h - o'_h)``, so head h's output difference in the residual is ``Pbar (o_h - o'_h)``
(what its edges are scored on) and these add up to the block's own change exactly.
"""
from __future__ import annotations

import functools
import time
from typing import NamedTuple, Sequence

import numpy as np
import torch

from iglens_core import Readout, eager_attention, quadrature
from iglens_mib import (IG_STEPS, Acts, MIBGraph, contract, edge_hooks, length_batches, logit_diff, model_layers,
                        record_acts, score_table as mib_score_table, stack_items, ungrouped)

STEPS = 8  # Gauss-Legendre nodes per node of the DAG (one block's heads share them)
METHOD = "counterfactual graph"  # its name among iglens_mib's methods in score_table
MASK_METHOD = "mask IG"  # integrated gradients over MIB's edge gates (mask_ig_edges)
MASK_STEPS = 16  # its Gauss-Legendre nodes


class CounterfactualEdges(NamedTuple):
    """Edge scores (n_forward, n_backward), summed over the items; ``delta`` (B,) each item's logit
    difference change; ``gaps``: ``{"logits": the readout's gap, "input": (edges out of input) - delta, "nodes":
    the largest |in - out| over the nodes}`` (mask IG: ``{"total": the scores' sum - delta}``), summed over items, in logits."""
    scores: torch.Tensor
    delta: torch.Tensor
    gaps: dict


class _Local:
    """The receivers' inputs of one attention call (what ``edge_hooks``' projection hooks read) and the
    heads' outputs it writes (``put_attn``)."""

    def __init__(self):
        self.inputs, self.heads = {}, None

    def mix(self, key, cols):
        return self.inputs[key]

    def put_attn(self, layer, heads):
        self.heads = heads


@functools.lru_cache(maxsize=16)
def _nodes(steps: int, dtype: torch.dtype):
    return tuple(t.to(dtype) for t in quadrature("gauss_legendre", steps))


def _record_calls(model, layers: list, ids: torch.Tensor) -> list:
    """Each attention module's call (args after the hidden states, kwargs) in a plain eager pass of ``ids``."""
    calls, handles = [None] * len(layers), []
    for L, part in enumerate(layers):
        handles.append(part.attn.register_forward_pre_hook(
            lambda m, a, k, L=L: calls.__setitem__(L, (a[1:], {n: v for n, v in k.items() if n != "hidden_states"})),
            with_kwargs=True))
    try:
        with torch.no_grad(), eager_attention(model):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        [h.remove() for h in handles]
    return calls


def _head_sum(acts: Acts, part, L: int) -> torch.Tensor:
    """(B, S, d) block ``L``'s heads' outputs summed, with the output bias (before a post-attention norm)."""
    total = acts.attn[L].sum(2)
    return total + part.bo.to(total) if part.bo is not None else total


def _residuals(acts: Acts, layers: list) -> tuple[list, list, torch.Tensor]:
    """The receivers' inputs with every edge in: before each block's attention, before its MLP, and the
    final norm's input, (B, S, d) each."""
    x, before_attn, before_mlp = acts.input, [], []
    for L, part in enumerate(layers):
        before_attn.append(x)
        total = _head_sum(acts, part, L)
        x = x + (part.post_attn(total) if part.post_attn is not None else total)
        before_mlp.append(x)
        x = x + acts.mlp[L]
    return before_attn, before_mlp, x


def _along(start: torch.Tensor, end: torch.Tensor, steps: int):
    """The path points (steps * B, ...) and the weights (steps,)."""
    alphas, weights = _nodes(steps, start.dtype)
    points = start[None] + alphas.view(-1, *([1] * start.dim())) * (end - start)[None]
    return points.flatten(0, 1), weights


def _weighted(grad: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(steps * B, ...) gradients -> (B, ...) their quadrature sum."""
    grad = grad.unflatten(0, (len(weights), -1))
    return torch.einsum("k...,k->...", grad, weights.to(grad))


def _pushed(norm, start: torch.Tensor, end: torch.Tensor, tangents: torch.Tensor, steps: int) -> torch.Tensor:
    """``sum_k w_k J_norm(x_k) t_h`` for every head's tangent ``t_h``: ``start``, ``end`` (B, S, d), ``tangents``
    (B, S, H, d) -> (B, S, H, d), the heads' output differences pushed through the norm's path-averaged Jacobian."""
    points, weights = _along(start, end, steps)  # (steps * B, S, d)
    H = tangents.shape[2]
    primal = points[:, :, None].expand(-1, -1, H, -1).contiguous()
    _, pushed = torch.func.jvp(norm, (primal,), (tangents.repeat(steps, 1, 1, 1),))
    return _weighted(pushed, weights)


@torch.no_grad()
def _batch(model, graph: MIBGraph, layers: list, head: Readout, clean, corrupted, labels, steps: int):
    """One length batch: ``(scores, delta (B,), gaps)``; ``head`` the model's last step (soft-cap included)."""
    acts = [record_acts(model, graph, layers, ids)[0] for ids in (clean, corrupted)]
    (a_clean, m_clean, n_clean), (a_bad, m_bad, n_bad) = (_residuals(a, layers) for a in acts)
    calls = _record_calls(model, layers, clean[:1])  # batch 1: its masks and rotary tables broadcast
    B, S, d = n_clean.shape
    grads = {}

    def readout(x):  # (B', S, d) final-norm inputs -> (B',) logit differences at the last position
        return logit_diff(head.logits(x[:, -1]), labels.repeat(len(x) // B, 1))

    def backward(fn, start, end, cot):
        """``sum_k w_k J_fn(x_k)^T cot`` on the straight path start -> end; fn returns outputs matching ``cot``."""
        points, weights = _along(start, end, steps)
        points.requires_grad_(True)
        with torch.enable_grad():
            out = fn(points)
            (g,) = torch.autograd.grad((out * cot.repeat(steps, *([1] * (cot.dim() - 1)))).sum(), points)
        return _weighted(g, weights)

    with torch.enable_grad():
        points, weights = _along(n_bad, n_clean, steps)
        points.requires_grad_(True)
        (g,) = torch.autograd.grad(readout(points).sum(), points)
    cot_logits = _weighted(g, weights)  # (B, S, d): zero but at the last position
    grads[("logits",)] = cot_logits[:, :, None]
    delta = (readout(n_clean) - readout(n_bad)).double()
    gaps = {"logits": float((cot_logits * (n_clean - n_bad)).sum() - delta.sum())}
    node_gaps, total = [], cot_logits.clone()  # total: the cotangent on every sender's output written so far
    diffs = {L: acts[0].attn[L] - acts[1].attn[L] for L in range(graph.n_layers)}  # (B, S, H, d) in the residual
    for L in reversed(range(graph.n_layers)):
        part = layers[L]

        def mlp(x):
            y = part.mlp(part.mlp_norm(x))
            return part.post_mlp(y) if part.post_mlp is not None else y
        cot = backward(mlp, m_bad[L], m_clean[L], total)
        grads[("mlp", L)] = cot[:, :, None]
        node_gaps.append(float((cot * (m_clean[L] - m_bad[L])).sum() - (total * (acts[0].mlp[L] - acts[1].mlp[L])).sum()))
        total = total + cot
        # the block's heads: every head's q, k and v input on the same path, the outputs per head
        local, (args, kwargs) = _Local(), calls[L]
        points, weights = _along(a_bad[L], a_clean[L], steps)
        leaves = {g: points[:, :, None].expand(-1, -1, graph.n_heads, -1).clone().requires_grad_(True) for g in "qkv"}
        local.inputs = {("attn", L, g): leaves[g] for g in "qkv"}
        handles = edge_hooks(model, graph, layers, local)
        head_cot = total  # the cotangent on each head's output
        if part.post_attn is not None:
            A_bad, A_clean = _head_sum(acts[1], part, L), _head_sum(acts[0], part, L)
            head_cot = backward(part.post_attn, A_bad, A_clean, total)
            diffs[L] = _pushed(part.post_attn, A_bad, A_clean, diffs[L], steps)
        try:
            with torch.enable_grad(), eager_attention(model), ungrouped(layers):
                part.attn(points, *args, **kwargs)
                objective = (local.heads * head_cot.repeat(steps, 1, 1)[:, :, None]).sum()
                head_grads = torch.autograd.grad(objective, [leaves[g] for g in "qkv"])
        finally:
            [h.remove() for h in handles]
        d_in = (a_clean[L] - a_bad[L])[:, :, None]
        d_out = diffs[L]  # (B, S, H, d)
        for g, grad in zip("qkv", head_grads):
            grads[("attn", L, g)] = _weighted(grad, weights)
        inflow = sum((grads[("attn", L, g)] * d_in).sum((0, 1, 3)) for g in "qkv")  # (H,)
        node_gaps.append(float((inflow - (total[:, :, None] * d_out).sum((0, 1, 3))).abs().max()))
        total = total + sum(grads[("attn", L, g)].sum(2) for g in "qkv")
    gaps["input"] = float((total * (acts[0].input - acts[1].input)).sum() - delta.sum())
    gaps["nodes"] = max(abs(v) for v in node_gaps)
    diff = Acts(acts[0].input - acts[1].input, [diffs[L] for L in range(graph.n_layers)],
                [m - m_ for m, m_ in zip(acts[0].mlp, acts[1].mlp)]).flat()
    return contract(graph, diff, grads), delta, gaps


def counterfactual_edges(model, items: Sequence, *, steps: int = STEPS, batch_size: int = 8) -> CounterfactualEdges:
    """The counterfactual graph's MIB edge scores over IOI ``items`` (:func:`iglens_mib.ioi_items`), summed
    over the items (divide by ``len(items)`` for MIB's mean), with ``steps`` Gauss-Legendre nodes per node."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= 256:
        raise ValueError(f"steps must be an integer in 1..256, got {steps!r}")
    if not items:
        raise ValueError("items must hold at least one IOI item, got none")
    graph, layers = MIBGraph.from_model(model), model_layers(model)
    device, head = next(model.parameters()).device, Readout(model)
    total, deltas, gaps = torch.zeros(graph.n_forward, graph.n_backward, dtype=torch.float64), [], {}
    for rows in length_batches(items, batch_size):
        scores, delta, batch_gaps = _batch(model, graph, layers, head, *stack_items(items, rows, device), steps)
        total += scores.double()
        deltas.append(delta)
        gaps = {k: gaps.get(k, 0.0) + v if k != "nodes" else max(gaps.get(k, 0.0), v) for k, v in batch_gaps.items()}
    return CounterfactualEdges(total, torch.cat(deltas), gaps)


class _Gated:
    """Every edge of MIB's graph at gate ``t`` (rows, 1, 1): each receiver reads ``sum_k t out_k + (1 - t) out'_k``
    (``out'`` the counterfactual run's; a post-attention norm on the blended heads' sum, as ``iglens_mib``'s
    harness), kept in ``receivers`` for their gradients; ``sums`` the blended heads' sums (before the norm)."""

    def __init__(self, layers: list, corrupted: Acts, t: torch.Tensor):
        self.layers, self.corr, self.t = layers, corrupted, t
        self.input, self.attn, self.mlp, self.sums, self.receivers, self.resid = None, [], [], [], {}, None

    def put_input(self, x):
        self.input = x.detach().requires_grad_(True)
        self.resid = self.t * self.input + (1 - self.t) * self.corr.input

    def put_attn(self, layer, heads):
        part = self.layers[layer]
        self.attn.append(heads)
        total = self.t * heads.sum(2) + (1 - self.t) * self.corr.attn[layer].sum(2)
        self.sums.append(total + part.bo.to(total) if part.bo is not None else total)
        self.resid = self.resid + (part.post_attn(self.sums[-1]) if part.post_attn is not None else self.sums[-1])

    def put_mlp(self, layer, out):
        self.mlp.append(out)
        self.resid = self.resid + self.t * out + (1 - self.t) * self.corr.mlp[layer]

    def mix(self, key, cols):
        self.receivers[key] = self.resid[:, :, None].expand(-1, -1, cols.stop - cols.start, -1).clone()
        return self.receivers[key]


def _repeat_acts(acts: Acts, copies: int) -> Acts:
    rep = lambda x: x.repeat(copies, *([1] * (x.dim() - 1)))
    return Acts(rep(acts.input), [rep(a) for a in acts.attn], [rep(m) for m in acts.mlp])


def mask_ig_edges(model, items: Sequence, *, steps: int = MASK_STEPS, batch_size: int = 8,
                  rows_per_pass: int = 16) -> CounterfactualEdges:
    """Mask IG on MIB's edges: integrated gradients of the logit difference over the edge gates ``w``
    (n_forward, n_backward) of MIB's own patching (:func:`iglens_mib.patched_logits`: a gate at 0 carries the
    counterfactual run's sender output), on the straight path from every gate off (the corrupted run) to every
    gate on (the clean run), ``steps`` Gauss-Legendre nodes, summed over the items. With every gate at ``t``,
    ``dm/dw_(u,v) = <dm/d in_v, Pbar (out_u - out'_u)>`` (``Pbar`` a post-attention norm's Jacobian at the
    blended heads' sum, else 1), so one forward and backward per node gives every edge (``rows_per_pass`` rows of
    nodes x items at a time). The scores add up to ``m(clean) - m(corrupted)`` up to the quadrature:
    ``gaps["total"]`` (summed over items, in logits). It attributes the very patched model whose circuits MIB's
    faithfulness scores."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= 256:
        raise ValueError(f"steps must be an integer in 1..256, got {steps!r}")
    if not items:
        raise ValueError("items must hold at least one IOI item, got none")
    graph, layers = MIBGraph.from_model(model), model_layers(model)
    device, total, deltas = next(model.parameters()).device, None, []
    for rows in length_batches(items, batch_size):
        clean, corrupted, labels = stack_items(items, rows, device)
        (acts, bad), (_, good) = (record_acts(model, graph, layers, ids) for ids in (corrupted, clean))
        deltas.append((logit_diff(good, labels) - logit_diff(bad, labels)).double())
        alphas, weights = _nodes(steps, acts.input.dtype)
        B, per = len(rows), max(1, rows_per_pass // len(rows))
        for first in range(0, steps, per):
            k = len(alphas[first:first + per])
            t = alphas[first:first + per].repeat_interleave(B).view(-1, 1, 1)
            gated = _Gated(layers, _repeat_acts(acts, k), t)
            handles = edge_hooks(model, graph, layers, gated)
            try:
                with torch.enable_grad(), eager_attention(model), ungrouped(layers):
                    out = model(input_ids=clean.repeat(k, 1), use_cache=False, logits_to_keep=1).logits[:, -1]
                    m = (logit_diff(out, labels.repeat(k, 1)) * weights[first:first + per].repeat_interleave(B)).sum()
                    keys = list(gated.receivers)
                    grads = torch.autograd.grad(m, [gated.receivers[key] for key in keys], allow_unused=True)
            finally:
                [h.remove() for h in handles]
            grads = {key: g if g is not None else torch.zeros_like(gated.receivers[key]) for key, g in zip(keys, grads)}
            diff = [gated.attn[L] - gated.corr.attn[L] for L in range(graph.n_layers)]
            for L, part in enumerate(layers):
                if part.post_attn is not None:
                    primal = gated.sums[L][:, :, None].expand_as(diff[L]).contiguous()
                    diff[L] = torch.func.jvp(part.post_attn, (primal.detach(),), (diff[L].detach(),))[1]
            flat = Acts(gated.input - gated.corr.input, diff, [m_ - c for m_, c in zip(gated.mlp, gated.corr.mlp)]).flat()
            same = (flat == 0).flatten(2).all(-1).all(0)  # (S,) positions before the first difference
            s0 = int(same.logical_not().nonzero()[0]) if not bool(same.all()) else flat.shape[1]
            scores = contract(graph, flat.detach()[:, s0:], {key: g[:, s0:] for key, g in grads.items()},
                              dtype=flat.dtype)
            total = scores if total is None else total + scores
    delta = torch.cat(deltas)
    return CounterfactualEdges(total, delta, {"total": float(total.sum() - delta.sum())})


def score_table(model, items: Sequence, methods: Sequence[str], *, steps: int = IG_STEPS, graph_steps: int = STEPS,
                mask_steps: int = MASK_STEPS, batch_size: int = 8) -> dict:
    """:func:`iglens_mib.score_table` with the counterfactual graph (:data:`METHOD`, at ``graph_steps``) and mask
    IG (:data:`MASK_METHOD`, at ``mask_steps``) as more methods; their gaps, summed over the items, go in
    ``seconds`` as ``"<method> gap: <where>"``, and the change they split as ``"<method>: delta"``."""
    ours = {METHOD: functools.partial(counterfactual_edges, steps=graph_steps),
            MASK_METHOD: functools.partial(mask_ig_edges, steps=mask_steps)}
    table = mib_score_table(model, items, [m for m in methods if m not in ours], steps=steps, batch_size=batch_size)
    graph = MIBGraph.from_model(model)
    for method in [m for m in methods if m in ours]:
        start = time.perf_counter()
        result = ours[method](model, items, batch_size=batch_size)
        table["scores"][method] = result.scores[graph.edge_src, graph.edge_dst].float().numpy()
        table["seconds"][method] = [(time.perf_counter() - start) / len(items)]
        for name, value in result.gaps.items():
            table["seconds"][f"{method} gap: {name}"] = [value]
        table["seconds"][f"{method}: delta"] = [float(result.delta.sum())]
    return table
