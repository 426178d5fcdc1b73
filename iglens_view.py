"""The attribution graph, seen and shared (issue 32): one offline interactive page and circuit-tracer's
graph file.

:func:`graph_view` prunes :func:`iglens_graph.attribution_graph` of one answer token to the heads and
neurons that carry most of their block's credit, keeps every token embedding up to the predicting
position and the answer's readout (the logit node), and links them by
``Graph.adjacency(direct=True)``: link i -> j is the part of node j's share that reaches it from node
i along paths that meet no other kept node. With every embedding kept, each node's incoming links and
the constants between add up to its share, and the logit's to ``delta`` (the sum of IG-Lens's top
terms, Δp with the prediction-aware estimator): the pruned graph leaves nothing over, so it needs no
error node.

:func:`to_graph_html` writes the page (plotly, its JavaScript embedded: nothing is fetched): positions
across, blocks up, node size by |share|, colour by signed share, links by width and colour, hover with
kind, block, position, token, share and activation; a menu picks the answer token; the carried map
(node x position) beside the graph; the completeness line as the title. :func:`to_circuit_tracer`
writes the graph JSON that circuit-tracer's and Neuronpedia's graph viewers load.
:func:`write_graph` does both for the command line, ``iglens graph``.
:func:`to_contrast_html` draws a counterfactual graph (:mod:`iglens_counterfactual`): its carried map and heads,
``iglens graph --corrupted --html``.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from iglens_core import QUANTITIES, get_adapter, head_counts, sublayer_projection
from iglens_graph import Graph, Node, attribution_graph
from iglens_plot import check_html_path, token_labels

KINDS = ("embedding", "head", "neuron", "logit", "constants")
SYMBOLS = {"embedding": "triangle-up", "head": "circle", "neuron": "square", "logit": "star", "constants": "x"}
FEATURE_TYPES = {"head": "attention head", "neuron": "mlp neuron", "constants": "constants (biases)"}


@dataclass
class GraphView:
    """One answer token's pruned attribution graph, ready to draw or export (float64, unit of f).

    Attributes:
        graph: the :class:`iglens_graph.Graph` it was cut from (``maps=True``).
        nodes: (N,) the kept heads and neurons (block order), every token embedding at positions
            ``0..t``, the logit node (:meth:`Graph.logit_node`) last.
        links: (N, N) ``[i, j]`` the direct link from node i into node j (see the module docstring).
        constants: (N,) the constants' credit reaching node j along paths that meet no kept node.
        activations: (N,) a neuron's output (the down projection's input), a head's output norm
            ``|z_h(s)|`` (the output projection's input, one head's slice); NaN for embeddings and
            the logit.
        tokens: (S,) the text of every position; probability: the model's own p(target) at t.
        fraction, min_share: the pruning rule (see :func:`graph_view`).
    """
    graph: Graph
    nodes: list
    links: torch.Tensor
    constants: torch.Tensor
    activations: torch.Tensor
    tokens: list
    probability: float
    fraction: float
    min_share: float

    @property
    def label(self) -> str:
        """The answer token's text, e.g. ``' H'``."""
        return self.tokens[self.graph.position + 1] if self.graph.position + 1 < len(self.tokens) else ""

    def influence(self) -> np.ndarray:
        """(N,) circuit-tracer's ``influence``: the nodes sorted by |share| (the logit last, ties in
        node order), the cumulative fraction of the total |share| up to and including each one; the
        smallest values mark the nodes that matter most (its viewer keeps those below a threshold)."""
        size = np.abs([node.share if node.kind != "logit" else 0.0 for node in self.nodes])
        order = np.argsort(-size, kind="stable")
        out = np.empty(len(size))
        out[order] = np.cumsum(size[order]) / max(size.sum(), 1e-300)
        return out

    def completeness(self) -> dict:
        """The sums the page states: ``delta``, ``delta_p``, the leaves (``embeddings`` summed over all
        positions, ``constants``), and the links into the logit from kept heads and neurons
        (``kept``), from the embeddings (``embedded``) and the constants (``direct_constants``);
        ``gap`` the largest miss of ``delta`` by the leaves or by the logit's links."""
        graph, logit = self.graph, len(self.nodes) - 1
        kinds = np.array([node.kind for node in self.nodes])
        into = self.links[:, logit].numpy()
        kept = float(into[(kinds == "head") | (kinds == "neuron")].sum())
        embedded = float(into[kinds == "embedding"].sum())
        leaves = float(graph.embeddings.sum()) + graph.constants
        into_logit = kept + embedded + float(self.constants[logit])
        return dict(delta=graph.delta, delta_p=graph.delta_p, embeddings=float(graph.embeddings.sum()),
                    constants=graph.constants, kept=kept, embedded=embedded,
                    direct_constants=float(self.constants[logit]),
                    gap=max(abs(leaves - graph.delta), abs(into_logit - graph.delta)))


def _check_number(name: str, value, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not (
            (low < value if open_low else low <= value) and value <= high):
        raise ValueError(f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], got {value!r}")
    return float(value)


@torch.no_grad()
def activations(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward pass: ``(heads (n, S, H, head_dim), neurons (n, S, d_ff), logits (S, V))``, the
    inputs of every block's attention output projection and MLP down projection at every position
    (float64, CPU), and the model's logits."""
    adapter = get_adapter(model)
    store: dict = {}
    hooks = []
    for layer, block in enumerate(adapter.blocks):
        for sublayer in ("attn", "mlp"):
            projection = sublayer_projection(block, sublayer)[0]
            hooks.append(projection.register_forward_pre_hook(
                lambda module, args, key=(sublayer, layer): store.__setitem__(key, args[0][0].double().cpu())))
    try:
        logits = model(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    H = head_counts(model)[0]
    heads = torch.stack([store["attn", layer] for layer in range(adapter.n_layers)])  # (n, S, H * hd)
    neurons = torch.stack([store["mlp", layer] for layer in range(adapter.n_layers)])
    return heads.view(*heads.shape[:2], H, -1), neurons, logits[0].double().cpu()


def graph_view(model, input_ids, prompt_len: int, tokens: Sequence[str], *, token: int = 0,
               fraction: float = 0.5, min_share: float = 0.05, estimator: str = "prediction_aware",
               steps: int = 16, quantity: str = "prob", foil=None, graph: Optional[Graph] = None) -> GraphView:
    """The pruned attribution graph of answer token ``token``, its direct links and activations.

    Kept: per (kind, block), the heads or neurons that together carry ``fraction`` of the group's
    |share| (``Graph.pruned``), of those the ones with |share| >= ``min_share`` x |delta|; then every
    token embedding at positions ``0..t`` and the logit node. Costs one partial sweep per kept node,
    from its block down (on the packaged model about 11 ms per block at one thread, so about 0.3 s for
    a node of the top block; the Vietnam answer's ``H`` keeps 91 heads and neurons at the defaults,
    292 at ``min_share=0.02``).

    Args:
        model, input_ids (1, S), prompt_len, token, estimator, steps, quantity, foil: as
            :func:`iglens_graph.attribution_graph`.
        tokens: (S,) the text of every position, e.g. ``[tokenizer.decode([i]) for i in input_ids[0]]``.
        fraction: in (0, 1]; min_share: in [0, 1].
        graph: the same token's graph built with ``maps=True`` (else it is built here, without edges).

    Returns:
        :class:`GraphView`.
    """
    fraction = _check_number("fraction", fraction, 0.0, 1.0, open_low=True)
    min_share = _check_number("min_share", min_share, 0.0, 1.0)
    input_ids = torch.as_tensor(input_ids)
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    tokens = [str(text) for text in tokens]
    if len(tokens) != input_ids.shape[-1]:
        raise ValueError(f"tokens must give the text of each of the S = {input_ids.shape[-1]} positions, "
                         f"got {len(tokens)}")
    if graph is None:
        graph = attribution_graph(model, input_ids, prompt_len, token=token, estimator=estimator, steps=steps,
                                  quantity=quantity, foil=foil, edges=False, maps=True)
    elif graph.position != prompt_len - 1 + token or not torch.equal(graph.input_ids, input_ids[0].cpu()):
        raise ValueError(f"graph is answer token {graph.token} of another sequence, not token {token} of this one")
    t = graph.position
    kept = [node for node in graph.pruned(fraction)
            if node.kind != "embedding" and abs(node.share) >= min_share * abs(graph.delta)]
    nodes = kept + [Node("embedding", 0, s, 0, float(graph.embeddings[s])) for s in range(t + 1)]
    nodes.append(graph.logit_node())
    adjacency = graph.adjacency(nodes, direct=True)
    heads, neurons, logits = activations(model, input_ids)
    values = [float(heads[node.block - 1, node.position, node.index].norm()) if node.kind == "head"
              else float(neurons[node.block - 1, node.position, node.index]) if node.kind == "neuron"
              else math.nan for node in nodes]
    probability = float(torch.softmax(logits[t], -1)[graph.target])
    return GraphView(graph, nodes, adjacency.weights, adjacency.constants, torch.tensor(values, dtype=torch.float64),
                     tokens, probability, fraction, min_share)


# ---------------------------------------------------------------------------
# circuit-tracer's graph JSON
# ---------------------------------------------------------------------------

def _cantor(x: int, y: int) -> int:
    """circuit-tracer's feature number of (layer, index): the Cantor pairing."""
    return (x + y) * (x + y + 1) // 2 + y


def circuit_tracer_graph(view: GraphView, *, slug: str = "iglens-graph", scan: str = "iglens") -> dict:
    """The view as circuit-tracer's graph JSON (``circuit_tracer.frontend.graph_models.Model``, 0.5.0).

    Nodes: neurons and heads in place of transcoder features (``feature_type`` ``"mlp neuron"``,
    ``"attention head"``; ``layer`` the block's 0-based index as circuit-tracer counts layers;
    ``feature`` the Cantor pairing of (layer, neuron), of (layer, d_ff + head) for a head), the token
    embeddings (layer ``"E"``), the target logit (``is_target_logit``, ``token_prob`` the model's
    p), a ``"constants (biases)"`` node only where the model has constants; no error nodes.
    ``influence``: :meth:`GraphView.influence`; ``activation``: :attr:`GraphView.activations`.
    Links: every nonzero direct link, ``weight`` in the unit of f (probability by default), so the
    links into each node add up to its share and those into the logit to ``delta``. The prompt
    tokens (positions ``0..t``) are in the metadata, and IG-Lens's own numbers under
    ``metadata["iglens"]`` (ignored by the schema).
    """
    graph = view.graph
    n, t, d_ff = graph.n_layers, graph.position, graph.neurons.shape[-1]
    influence = view.influence()
    out, ids = [], []
    for k, node in enumerate(view.nodes):
        if node.kind in ("head", "neuron"):
            layer, index = node.block - 1, node.index + (d_ff if node.kind == "head" else 0)
            ident = f"{layer}_{'h' + str(node.index) if node.kind == 'head' else node.index}_{node.position}"
            entry = dict(node_id=ident, feature=_cantor(layer, index), layer=str(layer), ctx_idx=node.position,
                         feature_type=FEATURE_TYPES[node.kind], jsNodeId=f"{layer}_{index}-{node.position}",
                         clerp=f"block {node.block} {node.kind} {node.index}",
                         activation=float(view.activations[k]))
        elif node.kind == "embedding":
            vocab = int(graph.input_ids[node.position])
            entry = dict(node_id=f"E_{vocab}_{node.position}", feature=node.position, layer="E",
                         ctx_idx=node.position, feature_type="embedding", jsNodeId=f"E_{vocab}-{node.position}")
        else:  # the logit, as circuit-tracer writes its target logit
            layer = str(n + 1)
            entry = dict(node_id=f"{layer}_{graph.target}_{t}", feature=graph.target, layer=layer, ctx_idx=t,
                         feature_type="logit", token_prob=view.probability, is_target_logit=True,
                         jsNodeId=f"L_{graph.target}-{t}", clerp=f'Output "{view.label}" (p={view.probability:.3f})')
        entry["influence"] = float(influence[k])
        out.append(entry)
        ids.append(entry["node_id"])
    links = [dict(source=ids[i], target=ids[j], weight=float(view.links[i, j]))
             for i, j in torch.nonzero(view.links).tolist()]
    if bool((view.constants != 0).any()):
        out.append(dict(node_id=f"C_0_{t}", feature=-2, layer="E", ctx_idx=t, feature_type=FEATURE_TYPES["constants"],
                        jsNodeId=f"C_0-{t}", clerp="constants (biases, norm offsets)", influence=1.0))
        links += [dict(source=f"C_0_{t}", target=ids[j], weight=float(view.constants[j]))
                  for j in torch.nonzero(view.constants).flatten().tolist()]
    sums = view.completeness()
    metadata = dict(slug=slug, scan=scan, transcoder_list=[], prompt_tokens=view.tokens[:t + 1],
                    prompt="".join(view.tokens[:t + 1]), node_threshold=view.fraction, schema_version=1,
                    iglens=dict(answer_token=view.label, target=graph.target, position=t, quantity=graph.quantity,
                                foil=graph.foil, estimator=graph.estimator, steps=graph.steps, delta=graph.delta,
                                delta_p=graph.delta_p, constants=graph.constants, fraction=view.fraction,
                                min_share=view.min_share, completeness_gap=sums["gap"],
                                feature_types=dict(FEATURE_TYPES)))
    return dict(metadata=metadata, qParams=dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos=""),
                nodes=out, links=links)


def to_circuit_tracer(view: GraphView, path, *, slug: Optional[str] = None, scan: str = "iglens") -> Path:
    """Write :func:`circuit_tracer_graph` to ``path`` (a ``.json`` file in an existing folder); the
    slug defaults to the file's stem. Returns the path."""
    out = Path(path).expanduser()
    if out.suffix.lower() != ".json":
        raise ValueError(f"path must name a .json file, got {str(path)!r}")
    if not out.parent.is_dir():
        raise ValueError(f"the folder {str(out.parent)!r} of path {str(path)!r} does not exist")
    out.write_text(json.dumps(circuit_tracer_graph(view, slug=slug or out.stem, scan=scan)), encoding="utf-8")
    return out


# ---------------------------------------------------------------------------
# The offline page
# ---------------------------------------------------------------------------

def _delta_name(graph: Graph) -> str:
    if graph.quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}, got {graph.quantity!r}")
    return "Δf" if graph.foil is not None else {"prob": "Δp", "logprob": "Δ log p"}[graph.quantity]


def _layout(view: GraphView) -> tuple[np.ndarray, np.ndarray]:
    """(N,) x and y of every node: x the position (the nodes of one cell side by side, the largest
    |share| in the middle), y the block (heads a third below their block's neurons, embeddings at 0,
    the logit at n + 1)."""
    n = view.graph.n_layers
    x = np.array([node.position for node in view.nodes], dtype=np.float64)
    y = np.array([{"embedding": 0.0, "logit": n + 1.0}.get(node.kind, node.block - (0.35 if node.kind == "head" else 0.0))
                  for node in view.nodes])
    cells: dict = {}
    for k in np.argsort([-abs(node.share) for node in view.nodes], kind="stable"):
        cells.setdefault((x[k], y[k]), []).append(k)
    for members in cells.values():
        step = min(0.8 / len(members), 0.15)
        for rank, k in enumerate(members):
            x[k] += step * ((rank + 1) // 2) * (1 if rank % 2 else -1)
    return x, y


def _drawn_links(view: GraphView, min_link: float) -> list[tuple[int, int, float]]:
    """``(i, j, weight)`` of the links drawn: |weight| >= ``min_link`` x |delta|, and every link into
    the logit (so that they add up to delta on the page as in the file)."""
    logit, bound = len(view.nodes) - 1, min_link * abs(view.graph.delta)
    return [(i, j, float(view.links[i, j])) for i, j in torch.nonzero(view.links).tolist()
            if j == logit or abs(float(view.links[i, j])) >= bound]


def _node_label(view: GraphView, k: int) -> str:
    """A short name: ``L30 N511 @41`` (block, neuron or head, position), ``emb @29``, ``logit``."""
    node = view.nodes[k]
    if node.kind in ("embedding", "logit"):
        return "logit" if node.kind == "logit" else f"emb @{node.position}"
    return f"L{node.block} {'N' if node.kind == 'neuron' else 'H'}{node.index} @{node.position}"


def _traces(view: GraphView, min_link: float, visible: bool, bars: tuple[float, float]) -> tuple[list, dict]:
    """The plotly traces of one view (links by width bin and sign, their hover points, the nodes,
    the carried map; ``bars`` the x of their colour bars) and its numbers for the embedded JSON."""
    import plotly.graph_objects as go
    graph, n, t = view.graph, view.graph.n_layers, view.graph.position
    x, y = _layout(view)
    x, y = x.round(3), y.round(3)  # layout only: short numbers in the page
    links = _drawn_links(view, min_link)
    largest = max([abs(w) for _, _, w in links] + [1e-300])
    bins = [0.1, 0.3, 0.6, math.inf]
    traces = []
    for sign, colour in ((1, "214,39,40"), (-1, "31,119,180")):
        for b, (width, alpha) in enumerate(((0.6, 0.25), (1.4, 0.4), (2.8, 0.55), (5.0, 0.7))):
            low = bins[b - 1] if b else 0.0
            picked = [(i, j) for i, j, w in links if (w > 0) == (sign > 0) and low <= abs(w) / largest < bins[b]]
            xs, ys = [], []
            for i, j in picked:
                xs += [float(x[i]), float(x[j]), None]
                ys += [float(y[i]), float(y[j]), None]
            traces.append(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False, visible=visible,
                                     line=dict(width=width, color=f"rgba({colour},{alpha})")))
    labels = [html.escape(_node_label(view, k)) for k in range(len(view.nodes))]
    traces.append(go.Scatter(
        x=[round((x[i] + x[j]) / 2, 3) for i, j, _ in links], y=[round((y[i] + y[j]) / 2, 3) for i, j, _ in links],
        mode="markers",
        marker=dict(size=5, opacity=0), showlegend=False, visible=visible, name="links",
        customdata=[[labels[i], labels[j], w] for i, j, w in links],
        hovertemplate="edge (direct link)<br>from %{customdata[0]}<br>to %{customdata[1]}<br>"
                      "share %{customdata[2]:+.4f}<extra></extra>"))
    shares = np.array([node.share for node in view.nodes])
    bound = max(float(np.abs(shares).max()), 1e-300)
    influence = view.influence()
    cells = []
    for k, node in enumerate(view.nodes):
        value = float(view.activations[k])
        activation = (f"p = {view.probability:.4f}" if node.kind == "logit" else "–" if math.isnan(value)
                      else f"{value:.4g}" + (" (|z_h|)" if node.kind == "head" else ""))
        block = {"embedding": "0 (token embedding)", "logit": f"{n + 1} (readout)"}.get(node.kind, str(node.block))
        token = view.label if node.kind == "logit" else view.tokens[node.position]
        cells.append([node.kind, block, node.position, html.escape(repr(token)), float(node.share), activation,
                      float(influence[k]), node.index])
    traces.append(go.Scatter(
        x=x.tolist(), y=y.tolist(), mode="markers", visible=visible, showlegend=False, name="nodes", customdata=cells,
        marker=dict(symbol=[SYMBOLS[node.kind] for node in view.nodes],
                    size=(7 + 30 * np.sqrt(np.abs(shares) / bound)).round(1).tolist(),
                    color=shares.tolist(), colorscale="RdBu", reversescale=True, cmid=0.0, cmin=-bound, cmax=bound,
                    line=dict(width=0.6, color="black"),
                    colorbar=dict(x=bars[0], xanchor="left", thickness=12, len=0.9, tickformat=".2~g",
                                  title=dict(text=f"share ({_delta_name(graph)})", side="right"))),
        hovertemplate="%{customdata[0]} %{customdata[7]}<br>block %{customdata[1]}<br>position %{customdata[2]} "
                      "token %{customdata[3]}<br>share %{customdata[4]:+.4f}<br>activation %{customdata[5]}"
                      "<extra></extra>"))
    carried = graph.carried[:, :t + 1].numpy()
    c_bound = max(float(np.abs(carried).max()), 1e-300)
    traces.append(go.Heatmap(
        z=carried.tolist(), x=list(range(t + 1)), y=list(range(n + 1)), visible=visible, name="carried",
        colorscale="RdBu", reversescale=True, zmid=0.0, zmin=-c_bound,
        zmax=c_bound, colorbar=dict(x=bars[1], xanchor="left", thickness=12, len=0.9, tickformat=".2~g",
                                     title=dict(text=f"carried ({_delta_name(graph)})", side="right")),
        hovertemplate="node %{y} (h_%{y})<br>position %{x}<br>carried %{z:+.4f}<extra></extra>"))
    data = dict(label=view.label, target=graph.target, position=t, quantity=graph.quantity, foil=graph.foil,
                estimator=graph.estimator, steps=graph.steps, delta=graph.delta, delta_p=graph.delta_p,
                constants=graph.constants, probability=view.probability, fraction=view.fraction,
                min_share=view.min_share, min_link=min_link, tokens=view.tokens[:t + 1],
                nodes=[dict(kind=node.kind, block=node.block, position=node.position, index=node.index,
                            share=float(node.share),
                            activation=None if math.isnan(float(view.activations[k])) else float(view.activations[k]),
                            influence=float(influence[k]), x=float(x[k]), y=float(y[k]))
                       for k, node in enumerate(view.nodes)],
                links=[[i, j, w] for i, j, w in links], link_constants=view.constants.tolist(),
                carried=carried.tolist(), completeness=view.completeness())
    return traces, data


def _headline(view: GraphView) -> str:
    """The completeness line: the leaves and the links into the logit against Δ."""
    sums, name = view.completeness(), _delta_name(view.graph)
    kept = sum(node.kind in ("head", "neuron") for node in view.nodes)
    into = sums["kept"] + sums["embedded"] + sums["direct_constants"]
    return (f"answer token {html.escape(repr(view.label))} (predicted at position {view.graph.position}, p = "
            f"{view.probability:.4f}): {name} = {sums['delta_p']:+.4f}, top terms {sums['delta']:+.4f}<br>"
            f"leaves: token embeddings {sums['embeddings']:+.4f} + constants {sums['constants']:+.4f} = "
            f"{sums['embeddings'] + sums['constants']:+.4f}; links into the logit: {kept} kept heads and neurons "
            f"{sums['kept']:+.4f} + embeddings {sums['embedded']:+.4f} + constants {sums['direct_constants']:+.4f} "
            f"= {into:+.4f} (largest gap {sums['gap']:.1e})")


def to_graph_html(views: Sequence[GraphView], path, *, title: str = "", min_link: float = 0.01,
                  plotlyjs: Union[bool, str] = True) -> Path:
    """Write one self-contained, offline page of one or several answer tokens' pruned graphs.

    Left: the graph on the (position, block) plane: token embeddings (triangles) at block 0, heads
    (circles) a third below their block's neurons (squares), the logit (star) at block n + 1; area by
    |share|, colour by signed share (red adds, blue removes); the direct links with |share| >=
    ``min_link`` x |Δ| and every link into the logit, width and colour by signed share; hovering a
    node gives its kind, block, position, token, share, activation (and a link's midpoint the link).
    Right: the carried map, node L x position s. Title: the completeness line. With several views a
    menu picks the answer token. The numbers are also embedded as JSON in ``<script
    type="application/json" id="iglens-graph-data">``: ``{"views": [...]}``, per view its nodes (kind,
    block, position, index, share, activation, influence, x, y), the links drawn ``[i, j, share]``,
    ``link_constants``, ``carried`` (n+1, t+1) and the completeness sums.

    Args:
        views: from :func:`graph_view`, one per answer token (of one model).
        path: the ``.html`` file to write; its folder must exist.
        min_link: in [0, 1]. plotlyjs: ``True`` embeds plotly.js; ``"directory"`` loads it from
            ``plotly.min.js`` beside the file (still offline).

    Returns:
        The path written.
    """
    from plotly.subplots import make_subplots
    out = check_html_path(path)
    views = list(views)
    if not views or not all(isinstance(view, GraphView) for view in views):
        raise ValueError("views must be a non-empty list of GraphView (graph_view's)")
    min_link = _check_number("min_link", min_link, 0.0, 1.0)
    if plotlyjs not in (True, "directory"):
        raise ValueError(f"plotlyjs must be True or 'directory', got {plotlyjs!r}")
    n = max(view.graph.n_layers for view in views)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], horizontal_spacing=0.1,
                        subplot_titles=("pruned attribution graph (direct links)",
                                        "carried: the share of Δ that h_L(s) passes on"))
    payload, buttons, counts = [], [], []
    bars = (fig.layout.xaxis.domain[1] + 0.005, fig.layout.xaxis2.domain[1] + 0.005)
    for k, view in enumerate(views):
        traces, data = _traces(view, min_link, visible=k == 0, bars=bars)
        for trace in traces[:-1]:
            fig.add_trace(trace, row=1, col=1)
        fig.add_trace(traces[-1], row=1, col=2)
        payload.append(data)
        counts.append(len(traces))
    ticks = []
    for view in views:
        count = view.graph.position + 1
        chosen = list(range(count)) if count <= 60 else list(range(0, count, math.ceil(count / 60)))
        ticks.append(dict(tickvals=chosen, ticktext=[html.escape(label) for label in
                                                     np.array(token_labels(view.tokens[:count]))[chosen]]))
    for k, view in enumerate(views):
        visible = [u == k for u, count in enumerate(counts) for _ in range(count)]
        axes = {f"xaxis{axis}.{key}": value for axis in ("", "2") for key, value in ticks[k].items()}
        buttons.append(dict(label=html.escape(f"{k}: {view.label!r} @{view.graph.position}"), method="update",
                            args=[{"visible": visible}, {"title.text": _headline(view), **axes}]))
    fig.update_layout(title=dict(text=title + ("<br>" if title else "") + _headline(views[0]), y=0.98, yanchor="top",
                                 font=dict(size=12)),
                      width=1450, height=860, margin=dict(t=150, b=90), plot_bgcolor="white",
                      updatemenus=[dict(type="dropdown", buttons=buttons, x=0.0, xanchor="left", y=1.0,
                                        yanchor="bottom", pad=dict(b=40))] if len(views) > 1 else [])
    fig.update_layout({key.replace(".", "_"): value for key, value in buttons[0]["args"][1].items() if "axis" in key})
    for col in (1, 2):
        fig.update_xaxes(tickmode="array", tickangle=-60, tickfont=dict(size=9), title_text="position (token)",
                         row=1, col=col)
    blocks = [0] + list(range(5, n + 1, 5)) if n > 12 else list(range(n + 1))
    fig.update_yaxes(tickmode="array", tickvals=blocks + [n + 1], ticktext=["emb"] + [str(b) for b in blocks[1:]] + ["logit"],
                     range=[-0.8, n + 1.6], title_text="block (heads below, neurons at the line)", gridcolor="#eee",
                     row=1, col=1)
    fig.update_yaxes(tickmode="array", tickvals=blocks, ticktext=[str(b) for b in blocks], range=[-0.5, n + 0.5],
                     title_text="node L (h_L: after block L)", row=1, col=2)
    fig.write_html(out, include_plotlyjs=plotlyjs, full_html=True, div_id="iglens-graph",
                   config={"displaylogo": False})
    page = out.read_text(encoding="utf-8")
    embedded = json.dumps(dict(views=payload)).replace("</", "<\\/")  # no "</script>" inside the script
    at = page.rindex("</body>")
    out.write_text(page[:at] + f'<script type="application/json" id="iglens-graph-data">{embedded}</script>\n'
                   + page[at:], encoding="utf-8")
    return out


def write_graph(model, input_ids, prompt_len: int, tokens: Sequence[str], *, answer_tokens: Sequence[int] = (0,),
                html_path=None, json_path=None, fraction: float = 0.5, min_share: float = 0.05,
                min_link: float = 0.01, estimator: str = "prediction_aware", steps: int = 16,
                quantity: str = "prob", title: str = "", scan: str = "iglens") -> list[GraphView]:
    """``iglens graph`` from Python: the views of ``answer_tokens``, the page and the graph files.

    Args:
        model, input_ids (1, S), prompt_len, tokens (S,): as :func:`graph_view`.
        answer_tokens: answer token indices in ``0..S-prompt_len-1``, distinct; the page's menu
            lists them in this order.
        html_path: the page (:func:`to_graph_html`), or None. json_path: circuit-tracer's file, or
            None; with several answer tokens one file per token, ``STEM-<index>.json``.
        fraction, min_share: :func:`graph_view`; min_link: :func:`to_graph_html`; scan: the
            metadata's ``scan`` (e.g. the model's name).

    Returns:
        The views, in the order of ``answer_tokens``.
    """
    if html_path is None and json_path is None:
        raise ValueError("give html_path, json_path or both: where the graph is written")
    html_out = check_html_path(html_path) if html_path is not None else None
    answer_tokens = list(answer_tokens) if not isinstance(answer_tokens, (int, np.integer)) else [answer_tokens]
    count = torch.as_tensor(input_ids).shape[-1] - prompt_len
    if not answer_tokens or len(set(answer_tokens)) != len(answer_tokens) or any(
            isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < count for k in answer_tokens):
        raise ValueError(f"answer_tokens must be distinct integers in 0..{count - 1}, got {answer_tokens!r}")
    json_out = None
    if json_path is not None:
        json_out = Path(json_path).expanduser()
        if json_out.suffix.lower() != ".json" or not json_out.parent.is_dir():
            raise ValueError(f"json_path must name a .json file in an existing folder, got {str(json_path)!r}")
    _check_number("min_link", min_link, 0.0, 1.0)
    views = [graph_view(model, input_ids, prompt_len, tokens, token=int(k), fraction=fraction, min_share=min_share,
                        estimator=estimator, steps=steps, quantity=quantity) for k in answer_tokens]
    if html_out is not None:
        to_graph_html(views, html_out, title=title, min_link=min_link)
    if json_out is not None:
        for k, view in zip(answer_tokens, views):
            name = json_out if len(views) == 1 else json_out.with_name(f"{json_out.stem}-{k}.json")
            to_circuit_tracer(view, name, scan=scan)
    return views


def to_contrast_html(graph, tokens: Sequence[str], path, *, corrupted_tokens: Optional[Sequence[str]] = None,
                     title: str = "", plotlyjs: Union[bool, str] = True) -> Path:
    """Write one offline page of a counterfactual graph (:class:`iglens_counterfactual.CounterfactualGraph`, read
    by its fields): the carried map, node L x position s, each cell's share of ``delta = f(clean) - f(corrupted)``
    (red adds, blue removes), hovering gives the clean and the corrupted token, the share and its fraction of
    delta; beside it the heads' shares summed over queries (block x head). The title gives f(clean),
    f(corrupted), delta and the gap. The numbers are also embedded as JSON in ``<script type="application/json"
    id="iglens-contrast-data">``: ``carried`` (n+1, S), ``heads`` (n, H) or null, ``tokens``, ``corrupted_tokens``,
    ``f_clean``, ``f_corrupted``, ``delta``, ``gap``, ``first``.

    Args:
        graph: the counterfactual graph. tokens: the clean sequence's tokens as text, at least its S (more are
            ignored); corrupted_tokens: the corrupted sequence's (default: the clean ones).
        path: the ``.html`` file; its folder must exist. plotlyjs: as :func:`to_graph_html`.
    """
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go
    out = check_html_path(path)
    if not all(hasattr(graph, name) for name in ("carried", "f_clean", "f_corrupted", "corrupted_ids", "gaps")):
        raise ValueError(f"graph must be a CounterfactualGraph (counterfactual_graph's), got {type(graph).__name__}")
    clean, corrupted = list(tokens), list(tokens if corrupted_tokens is None else corrupted_tokens)
    carried = graph.carried.double().numpy()
    n, S = carried.shape[0] - 1, carried.shape[1]
    if len(clean) < S or len(corrupted) < S:
        raise ValueError(f"tokens must name the sequence's {S} positions, got {len(clean)} and {len(corrupted)}")
    labels = token_labels(clean[:S])
    swapped = [html.escape(repr(clean[s]) + (f" (corrupted {corrupted[s]!r})" if corrupted[s] != clean[s] else ""))
               for s in range(S)]
    text = [[f"node {L}, position {s}: {swapped[s]}<br>share {carried[L, s]:+.4g} = {carried[L, s] / graph.delta:+.1%} "
             "of delta" for s in range(S)] for L in range(n + 1)]
    bound = max(float(np.abs(carried).max()), 1e-12)
    heads = graph.heads.double().sum(-1).numpy() if graph.heads is not None else None
    fig = make_subplots(rows=1, cols=2, column_widths=[0.7, 0.3], horizontal_spacing=0.08,
                        subplot_titles=("carried: the share of delta that h_L(s) passes on",
                                        "heads: their share of delta (all queries)" if heads is not None else ""))
    fig.add_trace(go.Heatmap(z=carried, x=list(range(S)), y=list(range(n + 1)), text=text, hoverinfo="text",
                             colorscale="RdBu", reversescale=True, zmin=-bound, zmax=bound,
                             colorbar=dict(x=0.66, title="share")), row=1, col=1)
    if heads is not None:
        top = max(float(np.abs(heads).max()), 1e-12)
        fig.add_trace(go.Heatmap(z=heads, x=list(range(heads.shape[1])), y=list(range(1, n + 1)), colorscale="RdBu",
                                 reversescale=True, zmin=-top, zmax=top, showscale=False,
                                 hovertemplate="block %{y}, head %{x}: %{z:+.4g}<extra></extra>"), row=1, col=2)
    headline = (f"f(clean) {graph.f_clean:.4g}, f(corrupted) {graph.f_corrupted:.4g}, delta {graph.delta:+.4g} "
                f"({graph.quantity}); every node adds up to it within {abs(graph.gap):.1e}; first swapped position "
                f"{graph.first}")
    fig.update_layout(title=dict(text=html.escape(title) + ("<br>" if title else "") + headline, font=dict(size=12)),
                      width=1400, height=720, margin=dict(t=110, b=110), plot_bgcolor="white")
    fig.update_xaxes(tickmode="array", tickvals=list(range(S)), ticktext=[html.escape(t) for t in labels], tickangle=-60,
                     tickfont=dict(size=9), title_text="position (token)", row=1, col=1)
    fig.update_yaxes(title_text="node L (h_L: after block L)", row=1, col=1)
    fig.update_xaxes(title_text="head", row=1, col=2)
    fig.update_yaxes(title_text="block", row=1, col=2)
    fig.write_html(out, include_plotlyjs=plotlyjs, full_html=True, div_id="iglens-contrast", config={"displaylogo": False})
    data = dict(carried=carried.tolist(), heads=None if heads is None else heads.tolist(), tokens=clean[:S],
                corrupted_tokens=corrupted[:S], f_clean=graph.f_clean, f_corrupted=graph.f_corrupted,
                delta=graph.delta, gap=graph.gap, first=graph.first)
    page = out.read_text(encoding="utf-8")
    at = page.rindex("</body>")
    out.write_text(page[:at] + '<script type="application/json" id="iglens-contrast-data">'
                   + json.dumps(data).replace("</", "<\\/") + "</script>\n" + page[at:], encoding="utf-8")
    return out
