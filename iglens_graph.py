"""An exact attribution graph in probability space (issue 31): IG-Lens's credit at the predicting
position carried back to every earlier position, head, edge, neuron and token embedding.

Construction. Fix, at the actual forward pass, every attention pattern and every norm's denominator
(RMSNorm's ``rms(x)``; LayerNorm's standard deviation, its mean subtraction being linear; Gemma's
sandwich post-norms ``g * u / rms(u)`` become diagonal maps at fixed ``rms(u)``). Each attention
output at query q is then a linear map of the block-input states at keys k <= q (input norm,
values, pattern, output projection, post-norm). Every MLP is split exactly by its path integral
from 0: with ``z`` its normed input, ``J(z) = int_0^1 J_mlp(t z) dt`` satisfies
``J(z) z = y(z) - y(0)``. For a gated MLP ``y = W_down(act(W_g z) * (W_u z))`` neuron i, with
``g = W_g z``, ``u = W_u z``, sends a cotangent ``c`` on its output back to z as
``c * (u a(g) W_g + b(g) W_u)`` where ``a(g) = int_0^1 t act'(t g) dt`` and
``b(g) = int_0^1 act(t g) dt``; ``g a(g) + b(g) = act(g)`` (integrate ``d/dt [t act(t g)]``) makes
it exact. ``a`` comes from a 64-node Gauss-Legendre rule in float64 (no pass through the model; 8 to 32
nodes where |g| is small and such a rule agrees with the 64-node one to 1e-15) and
``b`` is set to ``act(g) - g a(g)``, so the split is exact whatever the rule's error; the rule's
own ``b`` is kept as a check (``Graph.quadrature_defect``). A non-gated MLP with biases (GPT-2,
``act(W1 z + b1)`` then ``W2``) uses the closed form ``(act(p + b1) - act(b1)) / p`` per neuron
(``p = W1 z``) times the input map; ``act(b1)`` is a constant. Every constant (biases, LayerNorm's
beta, ``y(0)``, the value bias through the pattern) is a leaf of its own: the constants.

The network is then affine in its residual states, identically at the actual input. The top credit
is IG-Lens's sublayer terms at the predicting position t: block M's attention and MLP increments
``Delta(t)`` read against the path-averaged readout gradient ``gbar`` on their segment (as
``iglens_core.components``). One backward sweep, block n down to the embeddings, carries a
cotangent on every residual state (node L, position s): the cotangent on block M's MLP increment
at s is ``cot_M(s) + [s == t] gbar_mlp_M``; it goes back through the linearised MLP and its input
norm to ``mid_M(s)``, plus the residual ``cot_M(s)``; the cotangent on the attention increment is
``cot_mid_M(s) + [s == t] gbar_attn_M``, back through post-norm, output projection, the pattern
(rows at every query), values and input norm to the keys' states ``h_(M-1)(k)``.

Node to node: :meth:`Graph.adjacency` seeds the same sweep with one node's own cotangent, which
splits that node's share exactly over every node upstream of it, the embeddings and the constants;
with ``direct=True`` the sweep stops at every chosen node it meets, so each node's (and the logit's,
:meth:`Graph.logit_node`) incoming links within the chosen set add up to its share with the
embeddings and constants: a pruned graph with nothing left over.

No credit flows through queries and keys: the patterns are fixed (as in circuit-tracer and DePass;
DPA sends part of its credit through them: ``iglens_dpa.dpa_attribution``). Unlike them, this is in probability, needs no transcoder and has no error node.

Identities (tests/test_graph.py): for every node L,
``readable[L] + carried[L].sum() + constants_above[L] == delta``; the leaves (embeddings and
constants) add up to ``delta``; each head's edges add up to its share; with the prediction-aware
estimator ``delta`` is ``f(h_n) - f(h_0)`` exactly. At the predicting position the direct part of
the head and neuron shares (from ``gbar`` alone) is ``components``'s.

Many answer tokens: :func:`attribution_graphs` shares the recorded pass, the linearised blocks and one
readout pass among a sequence's tokens; :func:`iglens_tables.graph_frame` writes graphs as the long table that
``iglens_data.attribute_dataset(resolution="graph")`` and ``iglens --resolution graph`` store.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from iglens_core import (ESTIMATORS, Readout, check_foil, check_quantity, check_same_model, check_sequence,
                         eager_attention, first_output, get_adapter, head_counts, hidden_arg, logits_at_end,
                         plain_number, projection_weight, quadrature, sublayer_module, sublayer_norm,
                         sublayer_projection)
from iglens_core import as_model  # a TransformerLens or nnsight model: the Hugging Face model inside
from iglens_checks import (REBUILD_TOLERANCE, check_finite_pass, check_memory,  # noqa: F401 (public names here too)
                           non_finite_error, non_finite_parameters, rebuild_tolerance)

PATH_NODES = 64  # Gauss-Legendre nodes of the neuron path coefficients a(g)
# Smaller rules tried first where |g| is small (the integrand t act'(t g) is then smooth on [0, 1]): (largest
# |g|, nodes). Each is kept only where it agrees with the PATH_NODES rule to PATH_CHECK at its largest |g|.
# SiLU and GELU-tanh: 8 nodes reach rounding (< 1e-15) up to |g| = 1, 12 up to 2, 16 up to 4, 24 up to 8,
# 32 up to 16 (SiLU); half of SmolLM2's gates have |g| <= 0.52 and 96% <= 2: ~10 evaluations per entry, not 64.
PATH_TIERS = ((1.0, 8), (2.0, 12), (4.0, 16), (8.0, 24), (16.0, 32))
PATH_CHECK = 1e-15  # largest gap to the PATH_NODES rule, relative to max(1, |a|), for a smaller rule to be used
# bytes the recorded patterns and, with edges=True, the edges may take, each (n, H, S, S) float64 (read at each call)
GRAPH_MEMORY_BUDGET = 4 * 2**30
GRAPH_COPY_BUDGET = 2 * 2**30  # bytes of float64 weight copies the graph keeps; above, each map casts its weight at use
_RULES: dict = {}  # nodes -> Gauss-Legendre (t (m,), w (m,)) on [0, 1]


def _derivative(act: Callable, x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``act'(x)`` by autograd (``act`` acts elementwise), same shape as ``x``."""
    return _values_and_derivatives(act, x.detach().clone())[1]


def _values_and_derivatives(act: Callable, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(x), act'(x))`` elementwise from one autograd pass; ``x`` a fresh tensor (it is marked)."""
    with torch.enable_grad():
        x.requires_grad_(True)
        values = act(x)
        (grad,) = torch.autograd.grad(values.sum(), x)
    return values.detach(), grad.detach()


def _rule(nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    if nodes not in _RULES:
        t, w = np.polynomial.legendre.leggauss(nodes)
        _RULES[nodes] = torch.from_numpy((t + 1) / 2), torch.from_numpy(w / 2)
    return _RULES[nodes]


def _path_rule(act: Callable, flat: torch.Tensor, nodes: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(m,) entries -> ``(a, b_rule)`` (m,) by the ``nodes``-point Gauss-Legendre rule."""
    t, w = _rule(nodes)
    a, b_rule = torch.empty_like(flat), torch.empty_like(flat)
    step = max(1, chunk // nodes)
    for start in range(0, len(flat), step):
        values, slopes = _values_and_derivatives(act, flat[start:start + step, None] * t)  # (c, nodes) each
        a[start:start + step], b_rule[start:start + step] = slopes @ (t * w), values @ w
    return a, b_rule


def path_coefficients(act: Callable, g: torch.Tensor, nodes: int = PATH_NODES, chunk: int = 2 ** 20,
                      tiers: Sequence[tuple[float, int]] = PATH_TIERS) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A gated neuron's path coefficients from 0, elementwise.

    Args:
        act: the elementwise activation; g: (...) gate pre-activations (cast to float64).
        nodes: Gauss-Legendre nodes on [0, 1]; chunk: entries per batch of ``nodes`` evaluations.
        tiers: ``(largest |g|, nodes)`` pairs, increasing: the entries with |g| up to that bound (not
            taken by an earlier tier) use that smaller rule when it agrees with the ``nodes`` rule within
            :data:`PATH_CHECK` at the tier's 16 largest and 16 most negative g (the rule's error grows with
            |g|); otherwise they go on to the next tier. ``()``: the ``nodes`` rule everywhere.

    Returns:
        ``(a, b, defect)``: ``a = int_0^1 t act'(t g) dt`` by the rule, ``b = act(g) - g a`` (so that
        ``g a + b = act(g)`` holds to rounding), and ``defect`` the largest gap between that ``b``
        and the rule's own ``int_0^1 act(t g) dt``: the quadrature error.
    """
    g = torch.as_tensor(g).detach().double()
    flat = g.reshape(-1)
    a, b_rule = torch.empty_like(flat), torch.empty_like(flat)
    left, size = torch.ones(len(flat), dtype=torch.bool), flat.abs()
    for bound, tier_nodes in tiers:
        tier = torch.nonzero(left & (size <= bound))[:, 0]
        if tier_nodes >= nodes or not len(tier):
            continue
        values = flat[tier]
        tier_a, tier_b = _path_rule(act, values, tier_nodes, chunk)
        probe = torch.cat([values.topk(min(16, len(tier))).indices,
                           (-values).topk(min(16, len(tier))).indices])  # where the rule is worst
        check, _ = _path_rule(act, values[probe], nodes, chunk)
        if bool(((tier_a[probe] - check).abs() <= PATH_CHECK * check.abs().clamp_min(1.0)).all()):
            a[tier], b_rule[tier], left[tier] = tier_a, tier_b, False
    rest = torch.nonzero(left)[:, 0]
    if len(rest):
        a[rest], b_rule[rest] = _path_rule(act, flat[rest], nodes, chunk)
    b = act(flat) - flat * a
    defect = float((b - b_rule).abs().max()) if len(flat) else 0.0
    return a.view_as(g), b.view_as(g), defect


@dataclass
class _Norm:
    """A norm at fixed denominator: ``y = scale * (x - mean(x) if centred else x) + beta``."""
    scale: torch.Tensor  # (S, d)
    beta: Optional[torch.Tensor]  # (d,) or None
    centred: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(-1, keepdim=True) if self.centred else x
        return self.scale * x + (self.beta if self.beta is not None else 0.0)

    def back(self, cot: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        """(S, d) the transpose of the linear part applied to a cotangent on the output (at ``rows``)."""
        cot = self.scale[rows] * cot
        return cot - cot.mean(-1, keepdim=True) if self.centred else cot


def _freeze_norm(norm: nn.Module, x: torch.Tensor, recorded: torch.Tensor, where: str,
                 tol: float = REBUILD_TOLERANCE) -> _Norm:
    """The norm ``norm`` at its recorded input ``x`` (S, d) float64, as a :class:`_Norm`; checked
    against its recorded output (relative gap up to ``tol``, :func:`rebuild_tolerance`)."""
    name = type(norm).__name__
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    weight = weight.detach().double().cpu() if isinstance(weight, torch.Tensor) else None
    bias = bias.detach().double().cpu() if isinstance(bias, torch.Tensor) else None
    if isinstance(norm, nn.LayerNorm):
        sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)  # (S, 1)
        gain = weight if weight is not None else torch.ones(x.shape[-1], dtype=torch.float64)
        candidates = [_Norm(gain / sigma, bias, True)]
    elif name.lower().endswith("layernorm") and weight is None and bias is None:  # OLMo: no weight, eps 1e-5
        sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + float(getattr(norm, "eps", 1e-5)))
        candidates = [_Norm(torch.ones(x.shape[-1], dtype=torch.float64) / sigma, None, True)]
    elif "rmsnorm" in name.lower() and weight is not None and bias is None:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if not isinstance(eps, (int, float)):
            raise ValueError(f"{where}: cannot read the epsilon of {name}")
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + float(eps))  # (S, 1)
        candidates = [_Norm(weight / rms, None, False), _Norm((1.0 + weight) / rms, None, False)]
    else:
        raise ValueError(f"{where}: the norm {name} is neither a LayerNorm nor a weighted RMSNorm; "
                         "the attribution graph does not support it")
    gaps = [float((c.forward(x) - recorded).norm() / recorded.norm().clamp_min(1e-30)) for c in candidates]
    best = int(np.argmin(gaps))
    if not gaps[best] <= tol:  # NaN too
        raise ValueError(f"{where}: the norm {name} at a fixed denominator does not reproduce its "
                         f"output (relative gap {gaps[best]:.1e}, tolerance {tol:.0e}); unsupported norm"
                         + ("; or, in this bfloat16 or float16 model, an overflow or its rounding: run it in "
                            "float32 (model.float())" if tol > REBUILD_TOLERANCE else ""))
    return candidates[best]


def _weights(proj: nn.Module, keep: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(W (out, in), bias (out,) or None)``, the bias float64 on the CPU; the weight a float64 copy
    there (``keep``) or the module's own tensor, cast where it is used (:func:`_f64`)."""
    weight, bias = projection_weight(proj)
    return (weight.double().cpu() if keep else weight.detach()), (bias.double().cpu() if bias is not None else None)


def _f64(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as float64 on the CPU: itself when it is one, else a copy made for this use."""
    return weight if weight.dtype == torch.float64 and weight.device.type == "cpu" else weight.to("cpu", torch.float64)


def _block_parts(block: nn.Module, layer: int) -> dict:
    """The modules of one block the graph reads, or a ValueError naming what is missing."""
    where = f"block {layer + 1} ({type(block).__name__})"
    if getattr(block, "use_parallel_residual", False) or getattr(block, "parallel_attn", False):
        raise ValueError(f"{where}: parallel attention and MLP are not supported by the attribution graph")
    try:
        attention, mlp = sublayer_module(block, "attn"), sublayer_module(block, "mlp")
        out_proj, post_attn = sublayer_projection(block, "attn")
        down_proj, post_mlp = sublayer_projection(block, "mlp")
        norm1, norm2 = sublayer_norm(block, "attn"), sublayer_norm(block, "mlp")
    except ValueError as error:
        raise ValueError(f"{where}: {error}; the attribution graph does not support it") from error
    if isinstance(getattr(attention, "v_proj", None), nn.Module):
        values = ("v_proj", attention.v_proj)
    elif isinstance(getattr(attention, "c_attn", None), nn.Module):
        values = ("c_attn", attention.c_attn)
    elif isinstance(getattr(attention, "qkv_proj", None), nn.Module):  # Phi-3
        values = ("qkv_proj", attention.qkv_proj)
    else:
        raise ValueError(f"{where}: cannot find the value projection of {type(attention).__name__} "
                         "(looked for v_proj, c_attn, qkv_proj); the attribution graph does not support it")
    gates = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "gate_up_proj")]
    if all(isinstance(g, nn.Module) for g in gates[:2]) or isinstance(gates[2], nn.Module):
        kind, act = "gated", getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
        if any(getattr(g, "bias", None) is not None for g in gates):
            raise ValueError(f"{where}: a gated MLP with gate or up biases is not supported")
    elif isinstance(getattr(mlp, "c_fc", None), nn.Module):
        kind, act = "plain", getattr(mlp, "act", None)
    else:
        raise ValueError(f"{where}: cannot read the MLP {type(mlp).__name__} (looked for gate_proj, "
                         "up_proj (or gate_up_proj), down_proj or c_fc, c_proj); the attribution graph does not support it")
    if act is None:
        raise ValueError(f"{where}: cannot find the MLP's activation (act_fn or act)")
    return dict(attention=attention, mlp=mlp, out_proj=out_proj, post_attn=post_attn, down_proj=down_proj,
                post_mlp=post_mlp, norm1=norm1, norm2=norm2, values=values, kind=kind, act=act)


class Node(NamedTuple):
    """One node of a pruned graph: ``kind`` ``"head"`` (index: head), ``"neuron"`` (index: neuron),
    ``"embedding"`` (block 0, index 0) or ``"logit"`` (block n+1, index: the target id; see
    :meth:`Graph.logit_node`); ``block`` 1..n for heads and neurons; ``position`` in the sequence;
    ``share`` its credit in the unit of f."""
    kind: str
    block: int
    position: int
    index: int
    share: float


@dataclass
class Adjacency:
    """Node-to-node credit among chosen nodes (:meth:`Graph.adjacency`), in the unit of f.

    Attributes:
        nodes: the N nodes; weights: (N, N) ``[i, j]`` the part of node j's share that flows through
            node i (0 unless i is upstream of j: an earlier block, or a head of a neuron's own block).
        embeddings: (N, S) node j's share split over every token embedding (all positions, chosen or
            not); constants: (N,) the part from the constants between. Row sums: ``embeddings[j].sum()
            + constants[j]`` is node j's share.
    """
    nodes: list
    weights: torch.Tensor
    embeddings: torch.Tensor
    constants: torch.Tensor


@dataclass
class Graph:
    """The attribution graph of one answer token, in the unit of f (float64).

    A node's share is ``<cotangent on its output, its output>``: all the top credit that flows
    through it, its own constants included (a GPT-2 neuron's ``act(b1)``, a head's value bias).
    Identities: ``readable[L] + carried[L].sum() + constants_above[L] == delta`` for every L;
    ``embeddings.sum() + constants == delta``; ``edges.sum(-1) == heads``.

    Attributes:
        token: index of the answer token in the trace; position: its predicting position t;
            target, foil: token ids (foil None); quantity, estimator, steps: as IG-Lens.
        input_ids: (S,) the sequence; S its length (positions after t carry nothing).
        delta: the sum of the top terms; delta_p: ``f(h_n) - f(h_0)``; residual ``|delta - delta_p|``.
        attn_terms, mlp_terms: (n,) the top terms ``<Delta_M(t), gbar_M>`` of each block.
        readable: (n+1,) the top terms of blocks <= L, cumulated (the lens's term at t).
        carried: (n+1, S) ``<cot_L(s), h_L(s)>``: what the state at node L, position s carries up.
        constants_by_block: (n, 2) credit of the constants of each block's attention and MLP.
        constants_above: (n+1,) constants of blocks > L; constants: their total (a leaf).
        embeddings: (S,) ``carried[0]``, the token-embedding leaves.
        heads: (n, H, S) head h of block L at query s; heads_direct: (n, H) at t from gbar alone.
        edges: (n, H, S, S) (query, key) ``A(q, k) <v(k), back(q)>``; sums over keys to heads; or None.
        neurons: (n, S, d_ff); neurons_direct: (n, d_ff) at t from gbar alone.
        rebuild: largest relative gap between the linearised blocks and the recorded states.
        quadrature_defect: largest error of the neuron path rule (see :func:`path_coefficients`).
        gbar: (n, 2, d) the segment gradients at t (attention, MLP) that seed the sweep.
    """
    token: int
    position: int
    target: int
    foil: Optional[int]
    quantity: str
    estimator: str
    steps: int
    input_ids: torch.Tensor
    delta: float
    delta_p: float
    residual: float
    attn_terms: torch.Tensor
    mlp_terms: torch.Tensor
    readable: torch.Tensor
    carried: torch.Tensor
    constants_by_block: torch.Tensor
    constants_above: torch.Tensor
    constants: float
    embeddings: torch.Tensor
    heads: torch.Tensor
    heads_direct: torch.Tensor
    neurons: torch.Tensor
    neurons_direct: torch.Tensor
    edges: Optional[torch.Tensor] = None
    rebuild: float = 0.0
    quadrature_defect: float = 0.0
    gbar: Optional[torch.Tensor] = field(default=None, repr=False)  # (n, 2, d) attn, mlp
    _maps: Optional[tuple] = field(default=None, repr=False, compare=False)  # attribution_graph(maps=True)

    @property
    def n_layers(self) -> int:
        return self.heads.shape[0]

    @property
    def positions(self) -> torch.Tensor:
        """(S,) the sequence positions, the columns of ``carried``, ``heads``, ``neurons``, ``edges``."""
        return torch.arange(len(self.input_ids))

    def tokens(self, tokenizer) -> list[str]:
        """The sequence's tokens as text, one per position."""
        return [tokenizer.decode([i]) for i in self.input_ids.tolist()]

    def logit_node(self) -> Node:
        """The answer token's readout as a node: kind ``"logit"``, block n+1, the predicting position,
        index the target id, share ``delta`` (the sum of the top terms). As a target of
        :meth:`adjacency` it splits ``delta`` itself."""
        return Node("logit", self.n_layers + 1, self.position, self.target, self.delta)

    def adjacency(self, nodes: Sequence[Node], *, direct: bool = False) -> Adjacency:
        """How each node's share reaches it through the others: one seeded sweep per node.

        Node j's share is ``<c_j, out_j>`` with ``c_j`` its cotangent in the graph's sweep. Seeding
        the sweep with ``c_j`` alone, at node j's output, and sweeping down to the embeddings splits
        that share exactly over every upstream node i (``<its cotangent, its output>``), over the
        token embeddings and the constants in between, as the whole graph splits ``delta``.
        Needs ``attribution_graph(..., maps=True)``; costs one partial sweep per head, neuron or logit.

        Args:
            nodes: e.g. :meth:`pruned`'s, and :meth:`logit_node` (seeded with the top terms' gradients
                at the predicting position: it splits ``delta``). Each must be this graph's: kind, block,
                position and index in range and its share this graph's there (:meth:`share_of`); a node
                out of range or of another graph is a ValueError naming it and the valid ranges.
            direct: False: ``weights[i, j]`` is all of j's share that flows through i, by any path.
                True: only the paths that meet no other node of ``nodes`` between i and j (the sweep
                stops at every node it credits), so that when ``nodes`` holds every token embedding
                up to j's position, ``weights[:, j].sum() + constants[j]`` is node j's share: the
                direct links of the pruned graph, with nothing left over and no error node.

        Returns:
            :class:`Adjacency` over ``nodes`` (in their order).
        """
        if self._maps is None:
            raise ValueError("the graph kept no maps: build it with attribution_graph(..., maps=True)")
        if not isinstance(direct, bool):
            raise ValueError(f"direct must be True or False, got {direct!r}")
        blocks, cotangents, h0 = self._maps
        nodes = self._check_nodes(nodes)
        n, N, used, S = len(blocks), len(nodes), h0.shape[0], len(self.input_ids)  # positions >= used carry nothing
        weights = torch.zeros(N, N, dtype=torch.float64)
        embeddings = torch.zeros(N, S, dtype=torch.float64)
        constants = torch.zeros(N, dtype=torch.float64)
        slots: dict = {}  # (kind, block) -> [(i, position, index)]
        for i, node in enumerate(nodes):
            slots.setdefault((node.kind, node.block), []).append((i, node.position, node.index))

        def credit(j, kind, layer, cot, out):
            """Credit the nodes of one kind and block from the cotangent on their outputs, (S, H, hd)
            on heads, (S, d_ff) on neurons; with ``direct`` the sweep stops at them."""
            shares = (cot * out).sum(-1) if kind == "head" else cot * out  # (S, H) or (S, d_ff)
            kept = slots.get((kind, layer + 1), [])
            for i, position, index in kept:
                if position < used:
                    weights[i, j] = shares[position, index]
            if direct and kept:
                cot = cot.clone()
                for i, position, index in kept:
                    if position < used:
                        cot[position, index] = 0
            return cot

        for j, node in enumerate(nodes):
            top = node.kind == "logit"
            if node.kind == "embedding":
                embeddings[j, node.position] = self.embeddings[node.position]
                continue
            if not top and node.position >= used:  # after the predicting position: its share is 0, so are its parts
                continue
            cot, const, start = torch.zeros_like(h0), 0.0, n
            if not top:
                start, block = node.block - 1, blocks[node.block - 1]
                if node.kind == "neuron":
                    c_m = torch.zeros_like(cotangents[start][0])
                    c_m[node.position, node.index] = cotangents[start][0][node.position, node.index]
                    cot, const = block.mlp_to_input(c_m)
                    back, k = block.attn_from_output(cot)
                    c_x, k2 = block.attn_to_input(credit(j, "head", start, back, block.zh))
                    cot, const = cot + c_x, const + k + k2
                else:
                    back = torch.zeros_like(cotangents[start][1])
                    back[node.position, node.index] = cotangents[start][1][node.position, node.index]
                    cot, const = block.attn_to_input(back)
            else:  # the logit: the top terms' own gradients at t seed every block's increments
                seeds = torch.zeros(n, 2, *h0.shape, dtype=torch.float64)  # (n, 2, S, d)
                seeds[:, :, self.position] = self.gbar
            for below in reversed(range(start)):
                block = blocks[below]
                c_m, k = block.mlp_from_output(cot + seeds[below, 1] if top else cot)
                c_mid, k2 = block.mlp_to_input(credit(j, "neuron", below, c_m, block.m))
                cot = cot + c_mid
                back, k3 = block.attn_from_output(cot + seeds[below, 0] if top else cot)
                c_x, k4 = block.attn_to_input(credit(j, "head", below, back, block.zh))
                cot, const = cot + c_x, const + k + k2 + k3 + k4
            embeddings[j, :used] = (cot * h0).sum(-1)
            constants[j] = const
            for i, position, _ in slots.get(("embedding", 0), []):
                weights[i, j] = embeddings[j, position]
        return Adjacency(nodes, weights, embeddings, constants)

    def share_of(self, kind: str, block: int, position: int, index: int) -> float:
        """The share of one node of this graph (see :class:`Node`); a ValueError naming the valid ranges."""
        return float(self._check_nodes([(kind, block, position, index, None)], shares=False)[0].share)

    def _check_nodes(self, nodes, shares: bool = True) -> list[Node]:
        """``nodes`` as :class:`Node` s of this graph, each its share filled in (``shares=False``) or checked
        against this graph's (``shares``: a node of another graph has another share), or a ValueError naming
        the bad node and the valid ranges."""
        if isinstance(nodes, (str, bytes, Node)) or not isinstance(nodes, Sequence):
            raise ValueError(f"nodes must be a list of Node (kind, block, position, index, share), e.g. "
                             f"graph.pruned()'s, got {type(nodes).__name__} {str(nodes)[:80]!r}")
        n, S, (H, d_ff) = self.n_layers, len(self.input_ids), (self.heads.shape[1], self.neurons.shape[-1])
        ranges = {"embedding": f"block 0, position 0..{S - 1}, index 0",
                  "head": f"block 1..{n}, position 0..{S - 1}, index (head) 0..{H - 1}",
                  "neuron": f"block 1..{n}, position 0..{S - 1}, index (neuron) 0..{d_ff - 1}",
                  "logit": f"block {n + 1}, position {self.position}, index {self.target} (graph.logit_node())"}
        out = []
        for j, node in enumerate(nodes):
            fields = tuple(node) if isinstance(node, (tuple, list)) else ()
            if len(fields) != 5:
                raise ValueError(f"nodes[{j}] = {node!r} is not a Node (kind, block, position, index, share)")
            kind, block, position, index, share = (plain_number(x) for x in fields)
            whole = all(not isinstance(x, bool) and isinstance(x, int) for x in (block, position, index))
            if not isinstance(kind, str) or kind not in ranges or not whole or not (
                    (block, position, index) == (n + 1, self.position, self.target) if kind == "logit" else
                    block == 0 and index == 0 and 0 <= position < S if kind == "embedding" else
                    1 <= block <= n and 0 <= position < S and 0 <= index < (H if kind == "head" else d_ff)):
                valid = f"a {kind} node has {ranges[kind]}" if isinstance(kind, str) and kind in ranges else \
                    f"kind must be one of {list(ranges)}"
                raise ValueError(f"nodes[{j}] = {Node(*fields)} is not a node of this graph: {valid} "
                                 f"(integers; {n} blocks, {H} heads, {d_ff} neurons, {S} positions)")
            own = float(self.delta if kind == "logit" else self.embeddings[position] if kind == "embedding" else
                        self.heads[block - 1, index, position] if kind == "head" else
                        self.neurons[block - 1, position, index])
            if shares and not (isinstance(share, (int, float)) and not isinstance(share, bool)
                               and abs(share - own) <= 1e-9 * max(abs(own), abs(self.delta))):
                raise ValueError(f"nodes[{j}] = {Node(*fields)} has share {share!r}, but this graph's {kind} there "
                                 f"has {own!r}: a node of another graph, or a share set by hand (give this graph's "
                                 "nodes: pruned(), logit_node(), or share_of() for the share)")
            out.append(Node(kind, int(block), int(position), int(index), own))
        return out

    def pruned(self, fraction: float = 0.8) -> list[Node]:
        """The nodes that together carry ``fraction`` of the total |share| of their layer-kind.

        Rule: the nodes are grouped by (kind, block): the heads of one block (all queries), the
        neurons of one block (all positions), the embeddings. In each group, nodes are sorted by
        |share| descending (ties: lower position, then lower index first) and the shortest prefix
        whose |share| sum reaches ``fraction`` of the group's total is kept (none for a group whose
        total is 0). Returned group by group, block order, largest first within a group.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
        groups = [("embedding", 0, self.embeddings[:, None])]  # (S, 1)
        for layer in range(self.n_layers):
            groups.append(("head", layer + 1, self.heads[layer].T))  # (S, H)
            groups.append(("neuron", layer + 1, self.neurons[layer]))  # (S, d_ff)
        out = []
        for kind, block, shares in groups:
            flat = shares.reshape(-1)
            size = flat.abs()
            total = float(size.sum())
            if total == 0:
                continue
            order = np.argsort(-size.numpy(), kind="stable")  # row-major: position, then index
            cumulative = np.cumsum(size.numpy()[order])
            keep = int(np.searchsorted(cumulative, fraction * total * (1 - 1e-12))) + 1
            for k in order[:keep]:
                position, index = divmod(int(k), shares.shape[1])
                out.append(Node(kind, block, position, index, float(flat[k])))
        return out


def _record(model, adapter, parts: list[dict], input_ids: torch.Tensor) -> dict:
    """One eager forward pass; every block's input, patterns, norm inputs and outputs, and
    output, at all positions, float64 on the CPU."""
    store: dict = {}

    def keep(key, tensor):
        store[key] = tensor.detach()[0].double().cpu()

    def keep_pattern(layer):
        def hook(module, args, output):
            probs = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
            if not isinstance(probs, torch.Tensor):
                raise ValueError(f"the attention of block {layer + 1} ({type(module).__name__}) returned no "
                                 "attention probabilities in eager mode; the attribution graph needs them")
            keep(("pattern", layer), probs)
        return hook

    def keep_norm(key):
        def hook(module, args, output):
            keep((key, "in"), args[0])
            keep((key, "out"), first_output(output))
        return hook

    with ExitStack() as stack:
        for layer, (block, part) in enumerate(zip(adapter.blocks, parts)):
            hooks = [block.register_forward_pre_hook(
                         lambda mod, args, kwargs, layer=layer: keep(("h", layer), hidden_arg(args, kwargs)),
                         with_kwargs=True),
                     block.register_forward_hook(
                         lambda mod, args, out, layer=layer: keep(("h", layer + 1), first_output(out))),
                     part["attention"].register_forward_hook(keep_pattern(layer))]
            for name in ("norm1", "norm2", "post_attn", "post_mlp"):
                if part[name] is not None:
                    hooks.append(part[name].register_forward_hook(keep_norm((name, layer))))
            for hook in hooks:
                stack.callback(hook.remove)
        stack.enter_context(eager_attention(model))
        stack.enter_context(_float64_softmax(next(model.parameters()).dtype == torch.float64))
        with torch.no_grad():
            logits = logits_at_end(model, 1, input_ids=input_ids.to(next(model.parameters()).device))
    check_finite_pass(model, store)
    if not bool(torch.isfinite(logits).all()):
        raise non_finite_error(model, "in the logits (the final norm and the head)")
    return store


@contextmanager
def _float64_softmax(enabled: bool):
    """While ``enabled``: ``torch.nn.functional.softmax(x, dtype=torch.float32)`` on a float64 ``x``
    stays in float64. Eager attention (Llama, Qwen, Gemma) computes its softmax in float32 whatever
    the dtype: a float64 model's patterns then round at 1e-8 and its states miss the sdpa pass's by
    1e-10 in probability (measured on a sharpened tiny Llama)."""
    if not enabled:
        yield
        return
    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dtype == torch.float32 and isinstance(input, torch.Tensor) and input.dtype == torch.float64:
            dtype = None
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


def _gap(rebuilt: torch.Tensor, recorded: torch.Tensor) -> float:
    return float((rebuilt - recorded).norm() / recorded.norm().clamp_min(1e-30))





def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


class _Block:
    """One block linearised at the recorded pass: patterns and norm denominators fixed, the MLP by its
    path integral from 0. Holds what the sweep reads (S positions, float64) and its four backward maps,
    each returning the credit of the constants it passes."""

    def __init__(self, part: dict, store: dict, layer: int, H: int, H_kv: int, path: bool = True, keep: bool = True,
                 tol: float = REBUILD_TOLERANCE):
        where = f"block {layer + 1}"  # path=False: a gated MLP's a, b are left to the caller (DPA)
        # tol: the norms' rebuild tolerance (:func:`rebuild_tolerance`)
        # keep=False: the weights stay the model's tensors, cast to float64 at each use (a 1.5B model's
        # float64 copies of every block would take ~10 GB); the numbers are the same
        x, mid, out = store[("h", layer)], store[("norm2", layer), "in"], store[("h", layer + 1)]  # (S, d)
        S, d = x.shape
        # ---- the MLP, frozen at its recorded input
        self.norm2 = _freeze_norm(part["norm2"], mid, store[("norm2", layer), "out"], where + " pre-MLP norm", tol)
        z = self.norm2.forward(mid)  # (S, d)
        self.W_down, self.b_down = _weights(part["down_proj"], keep)  # (d, d_ff), (d,)
        act, self.kind, self.defect = part["act"], part["kind"], 0.0
        if self.kind == "gated":
            if isinstance(getattr(part["mlp"], "gate_up_proj", None), nn.Module):  # Phi-3: gate, then up
                self.W_g, self.W_u = _weights(part["mlp"].gate_up_proj, keep)[0].chunk(2, 0)  # (d_ff, d) each
            else:
                self.W_g, self.W_u = _weights(part["mlp"].gate_proj, keep)[0], _weights(part["mlp"].up_proj, keep)[0]
            self.g, self.u = z @ _f64(self.W_g).T, z @ _f64(self.W_u).T  # (S, d_ff) gate and up pre-activations
            self.a, self.b, self.defect = path_coefficients(act, self.g) if path else (None, None, 0.0)
            self.m = act(self.g) * self.u  # (S, d_ff) neuron outputs
        else:
            self.W_1, b_1 = _weights(part["mlp"].c_fc, keep)  # (d_ff, d), (d_ff,)
            b_1 = b_1 if b_1 is not None else torch.zeros(self.W_1.shape[0], dtype=torch.float64)
            p = z @ _f64(self.W_1).T  # (S, d_ff)
            self.m, self.m_const = act(p + b_1), act(b_1).expand_as(p)
            self.slope = torch.where(p != 0, (self.m - self.m_const) / torch.where(p != 0, p, 1.0),
                                     _derivative(act, b_1).expand_as(p))  # (S, d_ff)
        y = self.m @ _f64(self.W_down).T + (self.b_down if self.b_down is not None else 0.0)  # (S, d)
        self.post2 = (_freeze_norm(part["post_mlp"], y, store[("post_mlp", layer), "out"], where + " post-MLP norm",
                                   tol) if part["post_mlp"] is not None else None)
        self.rebuild = _gap(mid + (self.post2.forward(y) if self.post2 is not None else y), out)
        # ---- the attention, patterns and denominators fixed
        self.norm1 = _freeze_norm(part["norm1"], x, store[("norm1", layer), "out"], where + " input norm", tol)
        name, module = part["values"]
        W_v, b_v = _weights(module, keep)
        if name == "c_attn":  # GPT-2: queries, keys, values stacked
            W_v, b_v = W_v[2 * d:], (b_v[2 * d:] if b_v is not None else None)
        elif name == "qkv_proj":  # Phi-3: H query heads, H_kv key heads, H_kv value heads
            cut = W_v.shape[0] * (H + H_kv) // (H + 2 * H_kv)
            W_v, b_v = W_v[cut:], (b_v[cut:] if b_v is not None else None)
        self.W_v, self.b_v, self.kv = W_v, b_v, (H if name == "c_attn" else H_kv)
        v = self.norm1.forward(x) @ _f64(W_v).T + (b_v if b_v is not None else 0.0)  # (S, H_kv * hd)
        self.group = torch.arange(H) // (H // self.kv)
        self.v_heads = v.view(S, self.kv, -1)[:, self.group]  # (S, H, hd)
        self.A = store[("pattern", layer)]  # (H, S, S) query, key
        if self.A.shape != (H, S, S):
            raise ValueError(f"{where}: attention pattern of shape {tuple(self.A.shape)}, expected {(H, S, S)}")
        self.zh = torch.einsum("hqk,khd->qhd", self.A, self.v_heads)  # (S, H, hd)
        self.W_o, self.b_o = _weights(part["out_proj"], keep)  # (d, H * hd)
        o = self.zh.reshape(S, -1) @ _f64(self.W_o).T + (self.b_o if self.b_o is not None else 0.0)  # (S, d)
        self.post1 = (_freeze_norm(part["post_attn"], o, store[("post_attn", layer), "out"],
                                   where + " post-attention norm", tol) if part["post_attn"] is not None else None)
        self.rebuild = max(self.rebuild, _gap(x + (self.post1.forward(o) if self.post1 is not None else o), mid))

    def mlp_from_output(self, c_y: torch.Tensor, rows=slice(None)) -> tuple[torch.Tensor, float]:
        """Cotangent (S, d) on the MLP increment (or on its ``rows``) -> (S, d_ff) on each neuron's output;
        the down bias's credit."""
        c_u = self.post2.back(c_y, rows) if self.post2 is not None else c_y  # (S, d)
        return c_u @ _f64(self.W_down), (float((c_u * self.b_down).sum()) if self.b_down is not None else 0.0)

    def mlp_to_input(self, c_m: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(S, d_ff) on the neurons' outputs -> (S, d) on ``mid``; the MLP's constants' credit."""
        if self.kind == "gated":
            c_z, const = (c_m * self.u * self.a) @ _f64(self.W_g) + (c_m * self.b) @ _f64(self.W_u), 0.0  # (S, d)
        else:
            c_z, const = (c_m * self.slope) @ _f64(self.W_1), float((c_m * self.m_const).sum())
        if self.norm2.beta is not None:
            const += float((c_z * self.norm2.beta).sum())
        return self.norm2.back(c_z), const

    def attn_from_output(self, c_y: torch.Tensor, rows=slice(None)) -> tuple[torch.Tensor, float]:
        """(S, d) on the attention increment (or on its ``rows``) -> (S, H, hd) on each head's output; the
        output bias's credit."""
        c_o = self.post1.back(c_y, rows) if self.post1 is not None else c_y  # (S, d)
        back = (c_o @ _f64(self.W_o)).view(c_o.shape[0], self.zh.shape[1], -1)  # (S, H, hd)
        return back, (float((c_o * self.b_o).sum()) if self.b_o is not None else 0.0)

    def attn_to_input(self, back: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(S, H, hd) on the heads' outputs -> (S, d) on the block input, through the fixed pattern and
        the values; the value bias's and the input norm's constants' credit."""
        c_vh = torch.einsum("hqk,qhd->khd", self.A, back)  # (S, H, hd) on each head's values
        S = c_vh.shape[0]
        c_v = torch.zeros(S, self.kv, c_vh.shape[-1], dtype=torch.float64).index_add_(1, self.group, c_vh)
        c_v = c_v.reshape(S, -1)  # (S, H_kv * hd)
        const = float((c_v * self.b_v).sum()) if self.b_v is not None else 0.0
        c_x1 = c_v @ _f64(self.W_v)  # (S, d)
        if self.norm1.beta is not None:
            const += float((c_x1 * self.norm1.beta).sum())
        return self.norm1.back(c_x1), const


@torch.no_grad()
def attribution_graph(model, input_ids, prompt_len: int, *, token: int = 0, estimator: str = "prediction_aware",
                      steps: int = 16, quantity: str = "prob", foil=None, readout: Optional[Readout] = None,
                      edges: bool = True, maps: bool = False) -> Graph:
    """The exact attribution graph of answer token ``token`` (see the module docstring).

    Args:
        model: a Hugging Face causal LM in eval mode (Llama family, Qwen2/3, Gemma 3, GPT-2, ...).
        input_ids: (1, S) or (S,); prompt_len: first answer position, in ``1..S-1``.
        token: answer token index in ``0..S-prompt_len-1``; its predicting position is
            ``t = prompt_len - 1 + token``.
        estimator, steps: IG-Lens's gradient estimator for the top terms (as ``components``);
            ``"prediction_aware"`` makes ``delta`` equal ``f(h_n) - f(h_0)`` exactly.
        quantity, foil, readout: as ``ig_lens`` (foil: one id or one per answer token).
        edges: also return the (n, H, S, S) edges (float64; skip them for long sequences: with the
            recorded patterns, of the same size, they must fit :data:`GRAPH_MEMORY_BUDGET`).
        maps: keep every block's linearised maps (float64 copies of its weights) on the graph, for
            :meth:`Graph.adjacency`.

    Precision: float64 from the model's own recorded activations, for a bfloat16 or float16 model too;
    its states are rounded to its dtype, so the rebuild checks allow :func:`rebuild_tolerance` and the
    identities hold to that rounding.

    Returns:
        :class:`Graph`.

    Raises:
        ValueError: a model in training mode, an unsupported architecture, a bad argument (named,
            with its valid range), a readout from another model, a pass holding NaN or inf (naming
            where, and the non-finite parameters), edges or patterns beyond the memory budget.
    """
    model = as_model(model)
    _check_model_mode(model)
    input_ids = check_sequence(model, input_ids, prompt_len)
    token = _check_int("token", token, 0, input_ids.shape[1] - prompt_len - 1)
    return next(attribution_graphs(model, input_ids, prompt_len, tokens=[token], estimator=estimator, steps=steps,
                                   quantity=quantity, foil=foil, readout=readout, edges=edges, maps=maps))


def _check_model_mode(model) -> None:
    if isinstance(model, nn.Module) and model.training:
        raise ValueError("the model is in training mode (dropout would change the pass): call model.eval() first")


@torch.no_grad()
def attribution_graphs(model, input_ids, prompt_len: int, *, tokens: Optional[Sequence[int]] = None,
                       estimator: str = "prediction_aware", steps: int = 16, quantity: str = "prob", foil=None,
                       readout: Optional[Readout] = None, edges: bool = False,
                       maps: bool = False) -> Iterator[Graph]:
    """:func:`attribution_graph` of several answer tokens of one sequence, sharing the work that does
    not depend on the token: one recorded pass, the linearised blocks, one readout pass for every
    token's segment gradients. Each graph equals :func:`attribution_graph`'s of its token (up to the
    float rounding of the batched readout in a float32 model).

    Everything is checked and computed up to the sweeps when called; the graphs are made one at a time
    as the iterator is read, so memory holds one graph's (n, S, d_ff) neuron shares at a time.

    Args:
        tokens: answer token indices, each in ``0..S-prompt_len-1``; None: every answer token, in order.
        the rest: as :func:`attribution_graph` (``edges`` off by default here).

    Returns:
        An iterator of :class:`Graph`, one per token, in the order of ``tokens``.
    """
    model = as_model(model)
    _check_model_mode(model)
    input_ids = check_sequence(model, input_ids, prompt_len)
    S = input_ids.shape[1]
    answers = S - prompt_len
    if tokens is None:
        tokens = list(range(answers))
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or not len(tokens):
        raise ValueError(f"tokens must be None or a non-empty sequence of answer token indices in "
                         f"0..{answers - 1}, got {tokens!r}")
    tokens = [_check_int(f"tokens[{i}]", token, 0, answers - 1) for i, token in enumerate(tokens)]
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    steps = _check_int("steps", steps, 1, 10 ** 6)
    check_quantity(quantity)
    for name, flag in (("edges", edges), ("maps", maps)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    check_same_model(model, readout=readout)
    readout = readout or Readout(model)
    adapter = get_adapter(model)
    n = adapter.n_layers
    targets = input_ids[0, prompt_len:]
    foils = check_foil(foil, targets, readout.vocab_size)
    H, H_kv = head_counts(model)
    check_memory(n, H, S, edges, GRAPH_MEMORY_BUDGET)
    parts = [_block_parts(block, layer) for layer, block in enumerate(adapter.blocks)]
    store = _record(model, adapter, parts, input_ids)
    at = torch.tensor([prompt_len - 1 + token for token in tokens])  # (T',) predicting positions
    used = int(at.max()) + 1  # later positions carry nothing to them: the blocks are linearised without them
    store = {key: value[:, :used, :used] if key[0] == "pattern" else value[:used] for key, value in store.items()}
    h = [store[("h", layer)] for layer in range(n + 1)]  # n+1 x (S', d)
    mid = [store[("norm2", layer), "in"] for layer in range(n)]  # n x (S', d)

    # top credit: IG-Lens's segment gradients at each predicting position, as components() computes them
    nodes = torch.stack([h[0][at]] + [x[at] for layer in range(n) for x in (mid[layer], h[layer + 1])])
    nodes = nodes.to(readout.dtype)  # (2n+1, T', d)
    if estimator == "prediction_aware":
        alphas, weights = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps, "observed"
    else:
        alphas, weights = quadrature(estimator, steps)
    picked = torch.tensor(tokens)
    gbars, lenses = readout.along_segments(nodes, targets[picked], alphas, weights=weights,
                                           foils=None if foils is None else foils[picked],
                                           quantity=quantity)  # (2n, T', d), (2n+1, T')
    gbars, lenses = gbars.double().cpu(), lenses.double().cpu()
    if not bool(torch.isfinite(gbars).all() and torch.isfinite(lenses).all()):
        raise non_finite_error(model, "in the readout of the recorded states (the final norm and the head)")

    copies = 8 * sum(p.numel() for block in adapter.blocks for p in block.parameters() if p.dtype != torch.float64)
    keep = maps or copies <= GRAPH_COPY_BUDGET  # float64 copies of every block's weights, or a cast at each use
    tol = rebuild_tolerance(model)
    blocks = [_Block(parts[layer], store, layer, H, H_kv, keep=keep, tol=tol) for layer in range(n)]
    rebuild = max(block.rebuild for block in blocks)
    if not rebuild <= tol:  # NaN too
        raise ValueError(f"the linearised blocks do not rebuild the recorded states (relative gap {rebuild:.1e}, "
                         f"tolerance {tol:.0e}): this architecture computes its blocks otherwise than the graph "
                         "assumes")
    shared = dict(blocks=blocks, h=h, mid=mid, H=H, S=S, edges=edges, maps=maps, rebuild=rebuild,
                  quantity=quantity, estimator=estimator, steps=steps, input_ids=input_ids[0].clone())

    def one_at_a_time():
        for column, token in enumerate(tokens):
            with torch.no_grad():  # not around the yield: the caller's code runs there
                graph = _sweep(shared, token, prompt_len - 1 + token, int(targets[token]),
                               None if foils is None else int(foils[token]),
                               gbars[:, column].reshape(n, 2, -1), lenses[:, column])
            yield graph
    return one_at_a_time()


def _sweep(shared: dict, token: int, t: int, target: int, foil: Optional[int], gbar: torch.Tensor,
           lens: torch.Tensor) -> Graph:
    """One answer token's graph: its top terms from ``gbar`` (n, 2, d) and ``lens`` (2n+1,), and the
    backward sweep over the blocks linearised once for the sequence (``shared``)."""
    blocks, h, mid, H, S = shared["blocks"], shared["h"], shared["mid"], shared["H"], shared["S"]
    n, used = len(blocks), h[0].shape[0]  # the blocks hold positions 0..used-1; the rest carry 0
    attn_terms = torch.stack([(mid[l][t] - h[l][t]) @ gbar[l, 0] for l in range(n)])  # (n,)
    mlp_terms = torch.stack([(h[l + 1][t] - mid[l][t]) @ gbar[l, 1] for l in range(n)])  # (n,)
    delta = float((attn_terms + mlp_terms).sum())
    delta_p = float(lens[-1] - lens[0])
    readable = torch.cat([torch.zeros(1, dtype=torch.float64), (attn_terms + mlp_terms).cumsum(0)])  # (n+1,)
    carried = torch.zeros(n + 1, S, dtype=torch.float64)
    constants = torch.zeros(n, 2, dtype=torch.float64)
    heads_out = torch.zeros(n, H, S, dtype=torch.float64)
    heads_direct = torch.zeros(n, H, dtype=torch.float64)
    edges_out = torch.zeros(n, H, S, S, dtype=torch.float64) if shared["edges"] else None
    neurons_out = torch.zeros(n, S, blocks[0].m.shape[-1], dtype=torch.float64)
    neurons_direct = [None] * n
    cotangents = []  # per block: (neuron cotangents (S, d_ff), head cotangents (S, H, hd))
    cot = torch.zeros_like(h[0])  # (S, d) cotangent on h_n: nothing reads it but the top terms
    for layer in reversed(range(n)):
        block = blocks[layer]
        seed = torch.zeros_like(cot)
        seed[t] = gbar[layer, 1]
        c_m, const_out = block.mlp_from_output(cot + seed)  # (S, d_ff)
        neurons_out[layer, :used] = c_m * block.m
        neurons_direct[layer] = block.mlp_from_output(seed[t:t + 1], slice(t, t + 1))[0][0] * block.m[t]
        c_mid, const_in = block.mlp_to_input(c_m)
        constants[layer, 1] = const_out + const_in
        cot_mid = cot + c_mid  # (S, d)
        seed = torch.zeros_like(cot)
        seed[t] = gbar[layer, 0]
        back, const_out = block.attn_from_output(cot_mid + seed)  # (S, H, hd)
        heads_out[layer, :, :used] = (block.zh * back).sum(-1).T
        heads_direct[layer] = (block.zh[t] * block.attn_from_output(seed[t:t + 1], slice(t, t + 1))[0][0]).sum(-1)
        if edges_out is not None:
            edges_out[layer, :, :used, :used] = block.A * torch.einsum("qhd,khd->hqk", back, block.v_heads)
        c_x, const_in = block.attn_to_input(back)
        constants[layer, 0] = const_out + const_in
        cotangents.append((c_m, back))
        cot = cot_mid + c_x
        carried[layer, :used] = (cot * h[layer]).sum(-1)
    above = constants.sum(1).flip(0).cumsum(0).flip(0)  # (n,) constants of blocks >= L+1
    constants_above = torch.cat([above, torch.zeros(1, dtype=torch.float64)])  # (n+1,)
    graph = Graph(token, t, target, foil, shared["quantity"], shared["estimator"], shared["steps"],
                  shared["input_ids"], delta, delta_p, abs(delta - delta_p), attn_terms, mlp_terms,
                  readable, carried, constants, constants_above, float(constants.sum()), carried[0].clone(),
                  heads_out, heads_direct, neurons_out, torch.stack(neurons_direct),
                  edges_out, shared["rebuild"], max(block.defect for block in blocks), gbar)
    if shared["maps"]:
        graph._maps = (blocks, cotangents[::-1], h[0])
    return graph


# public names of the frozen pass, for the methods that reuse it (iglens_dpa.dpa_attribution)
LinearBlock, block_parts, record_pass, freeze_norm = _Block, _block_parts, _record, _freeze_norm
