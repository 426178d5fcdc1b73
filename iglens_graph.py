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

Precision (issue 45): a float32 model's graph runs its blocks and sweep in float32 on the model's own weights
and recorded activations, ``a`` from a table checked against the 64-node rule
(:func:`iglens_graph_blocks.path_table`); its identities hold to float32 rounding. ``dtype=torch.float64``
gives the float64 graph above (and is the default for float64, bfloat16 and float16 models).

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

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from iglens_core import (ESTIMATORS, Readout, check_foil, check_quantity, check_same_model, check_sequence,
                         get_adapter, head_counts, plain_number, quadrature)
from iglens_core import as_model  # a TransformerLens or nnsight model: the Hugging Face model inside
from iglens_checks import (REBUILD_TOLERANCE, check_memory,  # noqa: F401 (public names here too)
                           non_finite_error, non_finite_parameters, rebuild_tolerance)
from iglens_graph_blocks import (PATH_CHECK, PATH_NODES, PATH_TIERS, TABLE_CHECK, LinearBlock,  # noqa: F401
                                 block_parts, freeze_norm, path_coefficients, path_coefficients_tabulated,
                                 path_table, record_pass)

# bytes the recorded patterns and, with edges=True, the edges may take, each (n, H, S, S) float64 (read at each call)
GRAPH_MEMORY_BUDGET = 4 * 2**30
GRAPH_COPY_BUDGET = 2 * 2**30  # bytes of float64 weight copies the graph keeps; above, each map casts its weight at use
_Block = LinearBlock  # the linearised block (iglens_graph_blocks)
# The graph's default m (issue 45). Prediction-aware weights keep delta = f(h_n) - f(h_0) exact at any m; the
# shares move with m. Measured against m = 16 on 12 facts of data/facts.csv (SmolLM2, relative L1 of the heads,
# neurons, embeddings): m = 8 median 0.08-0.13%, max 0.37%; m = 4 median 0.18-0.57%, max 1.0%; m = 2 median
# 0.8-2.3%, max 34%; m = 1 median 3.5-12%. 4 is the smallest m within 1% of m = 16 on every fact; the readout
# costs about a quarter of m = 16's softmax work there.
GRAPH_STEPS = 4


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
                seeds = torch.zeros(n, 2, *h0.shape, dtype=h0.dtype)  # (n, 2, S, d)
                seeds[:, :, self.position] = self.gbar.to(h0.dtype)
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



def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


@torch.no_grad()
def attribution_graph(model, input_ids, prompt_len: int, *, token: int = 0, estimator: str = "prediction_aware",
                      steps: int = GRAPH_STEPS, quantity: str = "prob", foil=None, readout: Optional[Readout] = None,
                      edges: bool = True, maps: bool = False, dtype=None, check: Optional[bool] = None) -> Graph:
    """The exact attribution graph of answer token ``token`` (see the module docstring).

    Args:
        model: a Hugging Face causal LM in eval mode (Llama family, Qwen2/3, Gemma 3, GPT-2, ...).
        input_ids: (1, S) or (S,); prompt_len: first answer position, in ``1..S-1``.
        token: answer token index in ``0..S-prompt_len-1``; its predicting position is
            ``t = prompt_len - 1 + token``.
        estimator, steps: IG-Lens's gradient estimator for the top terms (as ``components``; ``steps``
            :data:`GRAPH_STEPS` = 4 by default, within 1% of m = 16's shares, see there);
            ``"prediction_aware"`` makes ``delta`` equal ``f(h_n) - f(h_0)`` exactly.
        quantity, foil, readout: as ``ig_lens`` (foil: one id or one per answer token).
        edges: also return the (n, H, S, S) edges (float64; skip them for long sequences: with the
            recorded patterns, of the same size, they must fit :data:`GRAPH_MEMORY_BUDGET`).
        maps: keep every block's linearised maps (copies of its weights in ``dtype``) on the graph, for
            :meth:`Graph.adjacency`.
        dtype: the working precision of the linearised blocks and the sweep: ``torch.float64`` (or
            ``"float64"``), ``torch.float32`` (``"float32"``), or None: float32 for a float32 model, float64
            otherwise. The top terms, ``delta`` and the graph's fields are float64 either way.
        check: rebuild every block's gate, up, value and head activations from the weights and check the
            block against the recorded states (``Graph.rebuild``); False reuses the activations the recorded
            pass kept (``Graph.rebuild`` NaN: not measured). None: True in float64, False in float32.

    Precision: in float64, from the model's own recorded activations, for a bfloat16 or float16 model too;
    its states are rounded to its dtype, so the rebuild checks allow :func:`rebuild_tolerance` and the
    identities hold to that rounding. In float32 (a float32 model's default) the blocks use the model's own
    weights (no copies) and activations, ``a(g)`` comes from a table (:func:`iglens_graph_blocks.path_table`,
    within float32's half-ulp of the 64-node rule), and the identities hold to float32 rounding: each
    within about ``eps_32 * sqrt(K)`` times the scale of the summed shares (K the length of the sums).

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
                                   quantity=quantity, foil=foil, readout=readout, edges=edges, maps=maps,
                                   dtype=dtype, check=check))


def _check_dtype(model, dtype) -> torch.dtype:
    """The graph's working dtype: ``dtype`` (torch.float32 or torch.float64, or their names), or for None
    float32 for a float32 model and float64 otherwise; a ValueError naming the valid values."""
    named = {"float32": torch.float32, "float64": torch.float64, torch.float32: torch.float32,
             torch.float64: torch.float64}
    if dtype is None:
        return torch.float32 if next(model.parameters()).dtype == torch.float32 else torch.float64
    if isinstance(dtype, (str, torch.dtype)) and dtype in named:
        return named[dtype]
    raise ValueError(f"dtype must be None (float32 for a float32 model, else float64), torch.float32, torch.float64, "
                     f"'float32' or 'float64', got {dtype!r}")


def _check_model_mode(model) -> None:
    if isinstance(model, nn.Module) and model.training:
        raise ValueError("the model is in training mode (dropout would change the pass): call model.eval() first")


@torch.no_grad()
def attribution_graphs(model, input_ids, prompt_len: int, *, tokens: Optional[Sequence[int]] = None,
                       estimator: str = "prediction_aware", steps: int = GRAPH_STEPS, quantity: str = "prob", foil=None,
                       readout: Optional[Readout] = None, edges: bool = False,
                       maps: bool = False, dtype=None, check: Optional[bool] = None) -> Iterator[Graph]:
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
    work = _check_dtype(model, dtype)
    if check is not None and not isinstance(check, bool):
        raise ValueError(f"check must be None, True or False, got {check!r}")
    check = work == torch.float64 if check is None else check
    check_same_model(model, readout=readout)
    readout = readout or Readout(model)
    adapter = get_adapter(model)
    n = adapter.n_layers
    targets = input_ids[0, prompt_len:]
    foils = check_foil(foil, targets, readout.vocab_size)
    H, H_kv = head_counts(model)
    check_memory(n, H, S, edges, GRAPH_MEMORY_BUDGET)
    parts = [block_parts(block, layer) for layer, block in enumerate(adapter.blocks)]
    store = record_pass(model, adapter, parts, input_ids, work, inner=not check, head=False)
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
    where = "in the logits (the final norm and the head, reading out the recorded states)"
    try:  # the recorded pass stopped at the final norm: the head is first read here
        gbars, lenses = readout.along_segments(nodes, targets[picked], alphas, weights=weights,
                                               foils=None if foils is None else foils[picked],
                                               quantity=quantity)  # (2n, T', d), (2n+1, T')
    except RuntimeError as error:  # the readout's first check of its form, on non-finite logits
        if non_finite_parameters(model):
            raise non_finite_error(model, where) from error
        raise
    gbars, lenses = gbars.double().cpu(), lenses.double().cpu()
    if not bool(torch.isfinite(gbars).all() and torch.isfinite(lenses).all()):
        raise non_finite_error(model, where)

    copies = work.itemsize * sum(p.numel() for block in adapter.blocks for p in block.parameters() if p.dtype != work)
    keep = maps or copies <= GRAPH_COPY_BUDGET  # copies of every block's weights in `work`, or a cast at each use
    tol = rebuild_tolerance(model)
    blocks = [_Block(parts[layer], store, layer, H, H_kv, keep=keep, tol=tol, check=check) for layer in range(n)]
    rebuild = max(block.rebuild for block in blocks) if check else float("nan")
    if check and not rebuild <= tol:  # NaN too
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
    work = h[0].dtype  # the blocks' dtype; the top terms in float64
    attn_terms = torch.stack([(mid[l][t].double() - h[l][t].double()) @ gbar[l, 0] for l in range(n)])  # (n,)
    mlp_terms = torch.stack([(h[l + 1][t].double() - mid[l][t].double()) @ gbar[l, 1] for l in range(n)])  # (n,)
    delta = float((attn_terms + mlp_terms).sum())
    delta_p = float(lens[-1] - lens[0])
    readable = torch.cat([torch.zeros(1, dtype=torch.float64), (attn_terms + mlp_terms).cumsum(0)])  # (n+1,)
    carried = torch.zeros(n + 1, S, dtype=work)
    constants = torch.zeros(n, 2, dtype=torch.float64)
    heads_out = torch.zeros(n, H, S, dtype=work)
    heads_direct = torch.zeros(n, H, dtype=work)
    edges_out = torch.zeros(n, H, S, S, dtype=work) if shared["edges"] else None
    neurons_out = torch.zeros(n, S, blocks[0].m.shape[-1], dtype=work)
    gbar_work = gbar.to(work)
    neurons_direct = [None] * n
    cotangents = []  # per block: (neuron cotangents (S, d_ff), head cotangents (S, H, hd))
    cot = torch.zeros_like(h[0])  # (S, d) cotangent on h_n: nothing reads it but the top terms
    for layer in reversed(range(n)):
        block = blocks[layer]
        seed = torch.zeros_like(cot)
        seed[t] = gbar_work[layer, 1]
        c_m, const_out, direct = block.mlp_from_output(cot + seed, direct=(t, seed[t]))  # (S, d_ff), .., (d_ff,)
        neurons_out[layer, :used] = c_m * block.m
        neurons_direct[layer] = direct * block.m[t]
        c_mid, const_in = block.mlp_to_input(c_m)
        constants[layer, 1] = const_out + const_in
        cot_mid = cot + c_mid  # (S, d)
        seed = torch.zeros_like(cot)
        seed[t] = gbar_work[layer, 0]
        back, const_out, direct = block.attn_from_output(cot_mid + seed, direct=(t, seed[t]))  # (S, H, hd), .., (H, hd)
        heads_out[layer, :, :used] = (block.zh * back).sum(-1).T
        heads_direct[layer] = (block.zh[t] * direct).sum(-1)
        if edges_out is not None:
            edges_out[layer, :, :used, :used] = block.A * torch.einsum("qhd,khd->hqk", back, block.v_heads)
        c_x, const_in = block.attn_to_input(back)
        constants[layer, 0] = const_out + const_in
        cotangents.append((c_m, back))
        cot = cot_mid + c_x
        carried[layer, :used] = (cot * h[layer]).sum(-1)
    above = constants.sum(1).flip(0).cumsum(0).flip(0)  # (n,) constants of blocks >= L+1
    constants_above = torch.cat([above, torch.zeros(1, dtype=torch.float64)])  # (n+1,)
    carried, heads_out, neurons_out = carried.double(), heads_out.double(), neurons_out.double()
    graph = Graph(token, t, target, foil, shared["quantity"], shared["estimator"], shared["steps"],
                  shared["input_ids"], delta, delta_p, abs(delta - delta_p), attn_terms, mlp_terms,
                  readable, carried, constants, constants_above, float(constants.sum()), carried[0].clone(),
                  heads_out, heads_direct.double(), neurons_out, torch.stack(neurons_direct).double(),
                  None if edges_out is None else edges_out.double(), shared["rebuild"],
                  max(block.defect for block in blocks), gbar)
    if shared["maps"]:
        graph._maps = (blocks, cotangents[::-1], h[0])
    return graph

