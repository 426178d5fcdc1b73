"""MIB's circuit-localization protocol, run offline (Mueller et al. 2025, arXiv 2504.13151; code:
hannamw/MIB-circuit-track and its EAP-IG submodule hannamw/EAP-IG, whose conventions are followed here).

Imports :mod:`iglens_core` through public names only and holds, in reading order:
1. IOI data from templates (``ioi_items``, ``keep_solved``), MIB's ``s2_io_flip`` counterfactual (MCQA: iglens_mib_tasks).
2. MIB's graph (``MIBGraph``): nodes ``input``, ``a{L}.h{H}``, ``m{L}``, ``logits``; an edge from every
   earlier node to every later one, edges into a head split into ``<q>``, ``<k>``, ``<v>``. Edge scores are
   a ``(n_forward, n_backward)`` tensor in MIB's own index layout (``graph.scores`` in eap.graph), and
   ``edge_dict`` / ``scores_from_dict`` turn it into a dict keyed by MIB's edge names and back, so any
   method can plug in. ``top_edges`` (``Graph.apply_topn``), ``prune`` and ``circuit_json`` (MIB's JSON).
3. The edge-patched forward (``patched_logits``), built with hooks on the Hugging Face model: each
   receiver's input (a head's q, k or v, an MLP, the logits) is its own mixture of sender outputs:
   for edges in the circuit the sender's output in this run, for the others the counterfactual run's
   (eap.evaluate.evaluate_graph). ``Evaluation`` and ``faithfulness_curve``: f(C) = (m(C) - m(empty)) /
   (m(full) - m(empty)) on means over items, at MIB's percentages; ``cpr_cmd`` integrates them.
4. Methods (``edge_scores``): ``EAP``, ``EAP-IG-inputs``, ``EAP-IG-activations`` (eap.attribute), ``random``.
5. A long run in length batches, each a record (``score_table``, ``curve_circuits``, ``metric_table``).

Shapes: B items (one length per batch), S positions, d model width, H attention heads (GQA is
ungrouped as MIB does: every query head has its own key and value input), R receivers of one group.
"""
from __future__ import annotations

import gzip
import json
import math
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from iglens_core import (eager_attention, get_adapter, head_counts, projection_weight, sublayer_module,
                         sublayer_norm, sublayer_projection)

PERCENTAGES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's evaluate_area_under_curve
IG_STEPS = 5  # MIB's run_attribution.py --ig-steps default
METHODS = ("EAP", "EAP-IG-inputs", "EAP-IG-activations", "random")

# ---- 1. IOI from templates ----

IOI_NAMES = ("Mary", "John", "Alice", "Bob", "Tom", "James", "David", "Michael", "Sarah", "Emma", "Daniel",
             "Paul", "Mark", "Peter", "Anna", "Laura", "Kevin", "Brian", "Jessica", "Lisa", "Steven", "Eric",
             "Jennifer", "Robert", "William", "Richard", "Thomas", "Charles", "Chris", "Matthew", "Andrew",
             "Joseph", "Jack", "Ryan", "Adam", "Kate", "Rachel", "Amy", "Ben", "Sam", "George", "Henry", "Frank",
             "Jason", "Justin", "Scott", "Jeff", "Tim", "Jane", "Linda", "Susan", "Karen", "Nancy", "Helen",
             "Emily", "Grace", "Anne", "Martin", "Simon", "Victoria", "Edward", "Luke", "Nick", "Max", "Leo",
             "Lucy", "Sophie", "Julia", "Oliver", "Harry", "Rose", "Maria", "Carl", "Dan", "Joe", "Mike")
IOI_PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "house", "station", "park",
              "market", "library", "beach", "church", "airport", "hotel", "bank", "museum", "theater", "farm",
              "zoo", "cafe", "gym", "shop", "kitchen", "mall", "lake")
IOI_OBJECTS = ("ring", "kiss", "bone", "computer", "necklace", "drink", "snack", "book", "letter", "cake",
               "key", "ball", "bag", "gift", "card", "flower", "phone", "hat", "pen", "box", "cup", "watch",
               "ticket", "map", "coin", "shirt")
# the IOI paper's BABA templates (Wang et al. 2022); {A} is the indirect object and the answer
BABA_TEMPLATES = (
    "Then, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to {A}",
    "Then, {B} and {A} had a lot of fun at the {PLACE}. {B} gave a {OBJECT} to {A}",
    "Then, {B} and {A} were working at the {PLACE}. {B} decided to give a {OBJECT} to {A}",
    "Then, {B} and {A} were thinking about going to the {PLACE}. {B} wanted to give a {OBJECT} to {A}",
    "Then, {B} and {A} had a long argument, and afterwards {B} said to {A}",
    "After {B} and {A} went to the {PLACE}, {B} gave a {OBJECT} to {A}",
    "When {B} and {A} got a {OBJECT} at the {PLACE}, {B} decided to give it to {A}",
    "When {B} and {A} got a {OBJECT} at the {PLACE}, {B} decided to give the {OBJECT} to {A}",
    "While {B} and {A} were working at the {PLACE}, {B} gave a {OBJECT} to {A}",
    "While {B} and {A} were commuting to the {PLACE}, {B} gave a {OBJECT} to {A}",
    "After the lunch, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to {A}",
    "Afterwards, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to {A}",
    "Then, {B} and {A} had a long argument. Afterwards {B} said to {A}",
    "The {PLACE} {B} and {A} went to had a {OBJECT}. {B} gave it to {A}",
    "Friends {B} and {A} found a {OBJECT} at the {PLACE}. {B} gave it to {A}",
)
ABBA_TEMPLATES = tuple(t.replace("{B} and {A}", "{A} and {B}", 1) for t in BABA_TEMPLATES)


class IOIItem(NamedTuple):
    """One IOI item. ``clean_ids`` and ``corrupted_ids``: (S,) long, the same length; ``answer_id`` (the
    indirect object, MIB's ``correct_idx``) and ``foil_id`` (the subject, its ``incorrect_idx``)."""
    clean: str
    corrupted: str
    answer: str
    foil: str
    order: str
    template: int
    clean_ids: torch.Tensor
    corrupted_ids: torch.Tensor
    answer_id: int
    foil_id: int


def single_tokens(tokenizer, words: Sequence[str]) -> list[str]:
    """The words that ``tokenizer`` encodes as one token after a space (``" " + word``)."""
    return [w for w in words if len(tokenizer(" " + w, add_special_tokens=False).input_ids) == 1]


def encode_prompt(tokenizer, text: str, bos: bool = True) -> list[int]:
    """``text``'s token ids, after the tokenizer's BOS token where it has one and ``bos`` (MIB's ``prepend_bos``)."""
    start = [tokenizer.bos_token_id] if bos and tokenizer.bos_token_id is not None else []
    return start + list(tokenizer(text, add_special_tokens=False).input_ids)


def ioi_items(tokenizer, n: int, *, seed: int = 0, bos: bool = True) -> list[IOIItem]:
    """``n`` IOI items, half ABBA and half BABA (alternating), templates, names, places and objects drawn
    with ``random.Random(seed)`` among those that are single tokens for ``tokenizer``.

    The counterfactual is MIB's ``s2_io_flip``: the same sentence with the second mention of the subject
    (S2) replaced by the indirect object, so that the answer flips to the subject. ``bos``: prepend the
    tokenizer's BOS token where it has one (TransformerLens' ``prepend_bos=True``, as MIB tokenizes).
    Items whose clean and counterfactual encodings differ in length are redrawn."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    names, places, objects = (single_tokens(tokenizer, w) for w in (IOI_NAMES, IOI_PLACES, IOI_OBJECTS))
    if len(names) < 2 or not places or not objects:
        raise ValueError(f"the tokenizer has too few single-token words: {len(names)} names (need >= 2), "
                         f"{len(places)} places, {len(objects)} objects (need >= 1)")
    rng, items, tries = random.Random(seed), [], 0
    while len(items) < n:
        tries += 1
        if tries > 50 * n:
            raise ValueError(f"could not draw {n} IOI items of equal clean/counterfactual length")
        order = "ABBA" if len(items) % 2 == 0 else "BABA"
        index = rng.randrange(len(BABA_TEMPLATES))
        template = (ABBA_TEMPLATES if order == "ABBA" else BABA_TEMPLATES)[index]
        a, b = rng.sample(names, 2)
        place, obj = rng.choice(places), rng.choice(objects)
        full = template.format(A=a, B=b, PLACE=place, OBJECT=obj)
        prompt = full[: full.rindex(" " + a)]
        s2 = prompt.rindex(" " + b)  # the second mention of the subject
        corrupted = prompt[:s2] + " " + a + prompt[s2 + len(b) + 1:]
        clean_ids, corrupted_ids = encode_prompt(tokenizer, prompt, bos), encode_prompt(tokenizer, corrupted, bos)
        if len(clean_ids) != len(corrupted_ids):
            continue
        answer_id = tokenizer(" " + a, add_special_tokens=False).input_ids[0]
        foil_id = tokenizer(" " + b, add_special_tokens=False).input_ids[0]
        items.append(IOIItem(prompt, corrupted, " " + a, " " + b, order, index, torch.tensor(clean_ids),
                             torch.tensor(corrupted_ids), int(answer_id), int(foil_id)))
    return items


def length_batches(items: Sequence[IOIItem], batch_size: int) -> list[list[int]]:
    """Indices of ``items`` grouped by token length, in chunks of at most ``batch_size`` (a run's records)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    by_length: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_length.setdefault(len(item.clean_ids), []).append(i)
    return [rows[k:k + batch_size] for _, rows in sorted(by_length.items()) for k in range(0, len(rows), batch_size)]


def stack_items(items: Sequence[IOIItem], rows: Sequence[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(clean (B, S), corrupted (B, S), labels (B, 2))`` long tensors on ``device``."""
    clean = torch.stack([items[i].clean_ids for i in rows]).to(device)
    corrupted = torch.stack([items[i].corrupted_ids for i in rows]).to(device)
    labels = torch.tensor([[items[i].answer_id, items[i].foil_id] for i in rows], device=device)
    return clean, corrupted, labels


def logit_diff(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """MIB's ``logit_diff`` (mean=False, loss=False): ``logits (B, V)`` at the last position, ``labels
    (B, 2)`` = (answer, foil) -> (B,) answer logit minus foil logit."""
    return logits.gather(1, labels[:, :1])[:, 0] - logits.gather(1, labels[:, 1:])[:, 0]


@torch.no_grad()
def _plain_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, V) the model's own last-position logits (no hooks), eager attention."""
    with eager_attention(model):
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()


def logit_diffs(model, items: Sequence[IOIItem], *, corrupted: bool = False, batch_size: int = 16) -> np.ndarray:
    """(N,) the model's logit difference (answer - foil) on each item's clean (or counterfactual) prompt."""
    device, out = next(model.parameters()).device, np.zeros(len(items))
    for rows in length_batches(items, batch_size):
        clean, corr, labels = stack_items(items, rows, device)
        out[rows] = logit_diff(_plain_logits(model, corr if corrupted else clean), labels).cpu().numpy()
    return out


def keep_solved(model, items: Sequence[IOIItem], *, batch_size: int = 16, quiet: bool = False):
    """The items the model solves (clean logit difference > 0), and how many of how many; prints the count
    unless ``quiet``. Returns ``(kept items, {"solved": k, "total": n, "logit_diffs": (n,) array})``."""
    diffs = logit_diffs(model, items, batch_size=batch_size)
    kept = [item for item, ld in zip(items, diffs) if ld > 0]
    if not quiet:
        print(f"the model solves {len(kept)} of {len(items)} {'MCQA' if items and items[0].order == 'MCQA' else 'IOI'} "
              f"items (logit difference > 0)")
    return kept, {"solved": len(kept), "total": len(items), "logit_diffs": diffs}


# ---- 2. MIB's graph ----

class MIBGraph:
    """MIB's edge graph of a model with ``n_layers`` blocks of ``n_heads`` heads (eap.graph.Graph.from_model,
    sequential attention then MLP). Forward (sender) index: ``input`` 0, ``a{L}.h{H}`` 1 + L (H' + 1) + H,
    ``m{L}`` 1 + L (H' + 1) + H'; backward (receiver) index: ``a{L}.h{H}<q|k|v>`` L (3 H' + 1) + (0|1|2) H' + H,
    ``m{L}`` L (3 H' + 1) + 3 H', ``logits`` the last. ``real``: (n_forward, n_backward) bool, the edges."""

    def __init__(self, n_layers: int, n_heads: int, d_model: Optional[int] = None):
        for name, value in (("n_layers", n_layers), ("n_heads", n_heads)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.n_layers, self.n_heads, self.d_model = int(n_layers), int(n_heads), d_model
        self.n_forward = 1 + n_layers * (n_heads + 1)
        self.n_backward = n_layers * (3 * n_heads + 1) + 1
        self.nodes = ["input"] + [f"a{L}.h{h}" if h < n_heads else f"m{L}"
                                  for L in range(n_layers) for h in range(n_heads + 1)] + ["logits"]
        self.receivers = [f"a{L}.h{h}<{x}>" for L in range(n_layers) for x in "qkv" for h in range(n_heads)]
        self.receivers = [r for L in range(n_layers) for r in self.receivers[L * 3 * n_heads:(L + 1) * 3 * n_heads]
                          + [f"m{L}"]] + ["logits"]
        self.real = torch.zeros(self.n_forward, self.n_backward, dtype=torch.bool)
        self.forward_to_backward = torch.zeros(self.n_forward, self.n_backward, dtype=torch.bool)
        names, src, dst = [], [], []

        def add(parent: int, child: str, qkv: Optional[str] = None):
            col = self.backward_index(child, qkv)
            names.append(f"{self.nodes[parent]}->{child}" + (f"<{qkv}>" if qkv else ""))
            src.append(parent)
            dst.append(col)

        stream = [0]
        for L in range(n_layers):
            heads = [self.forward_index(f"a{L}.h{h}") for h in range(n_heads)]
            for h, f in enumerate(heads):
                for x in "qkv":
                    self.forward_to_backward[f, self.backward_index(f"a{L}.h{h}", x)] = True
            self.forward_to_backward[self.forward_index(f"m{L}"), self.backward_index(f"m{L}")] = True
            for node in stream:
                for h in range(n_heads):
                    for x in "qkv":
                        add(node, f"a{L}.h{h}", x)
            stream += heads
            for node in stream:
                add(node, f"m{L}")
            stream.append(self.forward_index(f"m{L}"))
        for node in stream:
            add(node, "logits")
        self.edges = names
        self.edge_src, self.edge_dst = torch.tensor(src), torch.tensor(dst)
        self.real[self.edge_src, self.edge_dst] = True
        self.edge_index = {name: i for i, name in enumerate(names)}

    @classmethod
    def from_model(cls, model) -> "MIBGraph":
        """The graph of a Hugging Face causal LM (its blocks and attention heads)."""
        H, _ = head_counts(model)
        config = getattr(model.config, "text_config", None) or model.config
        return cls(get_adapter(model).n_layers, H, getattr(config, "hidden_size", None))

    @property
    def cfg(self) -> dict:
        """MIB's JSON ``cfg`` (the keys eap.graph.Graph.from_model reads)."""
        return {"n_layers": self.n_layers, "n_heads": self.n_heads, "parallel_attn_mlp": False,
                "d_model": self.d_model}

    @property
    def n_edges(self) -> int:
        return len(self.edges)

    def forward_index(self, node: str) -> int:
        """The sender index of ``node`` (``input``, ``a{L}.h{H}``, ``m{L}``)."""
        if node == "input":
            return 0
        layer, head = self._parse(node)
        return 1 + layer * (self.n_heads + 1) + (self.n_heads if head is None else head)

    def backward_index(self, node: str, qkv: Optional[str] = None) -> int:
        """The receiver index of ``node`` (``a{L}.h{H}`` with ``qkv`` in q, k, v; ``m{L}``; ``logits``)."""
        if node == "logits":
            return self.n_backward - 1
        layer, head = self._parse(node)
        if head is None:
            return layer * (3 * self.n_heads + 1) + 3 * self.n_heads
        if qkv not in ("q", "k", "v"):
            raise ValueError(f"an edge into head {node} needs qkv in 'q', 'k', 'v', got {qkv!r}")
        return layer * (3 * self.n_heads + 1) + "qkv".index(qkv) * self.n_heads + head

    def _parse(self, node: str) -> tuple[int, Optional[int]]:
        try:
            if node.startswith("m"):
                layer, head = int(node[1:]), None
            elif node.startswith("a"):
                a, h = node.split(".")
                layer, head = int(a[1:]), int(h[1:])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"node must be 'input', 'a{{L}}.h{{H}}', 'm{{L}}' or 'logits', got {node!r}") from None
        if not 0 <= layer < self.n_layers or (head is not None and not 0 <= head < self.n_heads):
            raise ValueError(f"node {node!r} outside the graph: layers 0..{self.n_layers - 1}, heads "
                             f"0..{self.n_heads - 1}")
        return layer, head

    def prev_index(self, receiver: int) -> int:
        """Senders ``0 .. prev_index - 1`` feed receiver column ``receiver`` (eap.graph.Graph.prev_index)."""
        if receiver == self.n_backward - 1:
            return self.n_forward
        layer, within = divmod(receiver, 3 * self.n_heads + 1)
        return 1 + layer * (self.n_heads + 1) + (self.n_heads if within == 3 * self.n_heads else 0)


def _check_scores(graph: MIBGraph, scores) -> torch.Tensor:
    scores = torch.as_tensor(scores, dtype=torch.float32)
    if scores.shape != (graph.n_forward, graph.n_backward):
        raise ValueError(f"scores must be ({graph.n_forward}, {graph.n_backward}) (senders, receivers), got "
                         f"{tuple(scores.shape)}")
    if not torch.isfinite(scores[graph.real]).all():
        raise ValueError("scores must be finite on every edge of the graph")
    return scores


def edge_dict(graph: MIBGraph, scores) -> dict:
    """``{MIB edge name: score}`` from a (n_forward, n_backward) score tensor, in MIB's edge order."""
    values = _check_scores(graph, scores)[graph.edge_src, graph.edge_dst].tolist()
    return dict(zip(graph.edges, values))


def scores_from_dict(graph: MIBGraph, scores: dict) -> torch.Tensor:
    """The (n_forward, n_backward) tensor of ``{MIB edge name: score}`` (every edge of the graph)."""
    missing = [name for name in graph.edges if name not in scores]
    unknown = [name for name in scores if name not in graph.edge_index]
    if missing or unknown:
        raise ValueError(f"scores must name every edge of the graph once: {len(missing)} missing (e.g. "
                         f"{missing[:3]}), {len(unknown)} unknown (e.g. {unknown[:3]})")
    out = torch.zeros(graph.n_forward, graph.n_backward)
    out[graph.edge_src, graph.edge_dst] = torch.tensor([float(scores[name]) for name in graph.edges])
    return out


def top_edges(graph: MIBGraph, scores, n: int, *, absolute: bool) -> torch.Tensor:
    """(n_forward, n_backward) bool: the top ``n`` edges by score (by |score| if ``absolute``), MIB's
    Graph.apply_topn at edge level (argsort descending over the edges; a stable sort here, so ties go
    to the earlier index)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= graph.n_edges:
        raise ValueError(f"n must be an integer in 0..{graph.n_edges} (the graph's edges), got {n!r}")
    values = _check_scores(graph, scores).clone()
    values = values.abs() if absolute else values
    values[~graph.real] = -math.inf
    order = torch.argsort(values.view(-1), descending=True, stable=True)
    chosen = torch.zeros(values.numel(), dtype=torch.bool)
    chosen[order[:n]] = True
    return chosen.view_as(values)


def prune(graph: MIBGraph, in_graph: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MIB's Graph.prune: drop nodes without an incoming (input exempt) or outgoing edge, then edges
    from or into dropped nodes, until nothing changes. Returns ``(edges (n_forward, n_backward),
    nodes (n_forward,))`` bool. It does not change a circuit's faithfulness (a node without incoming
    edges outputs its counterfactual value anyway)."""
    edges = in_graph.clone() & graph.real
    f2b = graph.forward_to_backward.float()
    while True:
        incoming = (f2b @ edges.any(0).float()) > 0
        incoming[0] = True
        nodes = edges.any(1) & incoming
        receivers = (nodes.float() @ f2b) > 0
        receivers[-1] = True
        new = edges & nodes[:, None] & receivers[None, :]
        if torch.equal(new, edges):
            return edges, nodes
        edges = new


def circuit_json(graph: MIBGraph, scores, in_graph: Optional[torch.Tensor] = None) -> dict:
    """MIB's circuit JSON (eap.graph.Graph.to_json): ``{"cfg": ..., "nodes": {name: {"in_graph"}},
    "edges": {name: {"score", "in_graph"}}}``; ``in_graph`` (n_forward, n_backward) bool is pruned
    first (every edge in by default)."""
    values = _check_scores(graph, scores)
    edges, nodes = prune(graph, graph.real if in_graph is None else in_graph)
    node_flags = {name: bool(nodes[i]) for i, name in enumerate(graph.nodes[:-1])}
    node_flags["logits"] = True
    return {"cfg": graph.cfg, "nodes": {name: {"in_graph": flag} for name, flag in node_flags.items()},
            "edges": {name: {"score": float(values[s, r]), "in_graph": bool(edges[s, r])}
                      for name, s, r in zip(graph.edges, graph.edge_src.tolist(), graph.edge_dst.tolist())}}


def save_circuit(path, graph: MIBGraph, scores, in_graph: Optional[torch.Tensor] = None) -> Path:
    """Write :func:`circuit_json` to ``path`` (folders made; gzip-compressed when it ends in ``.gz``)."""
    path, text = Path(path), json.dumps(circuit_json(graph, scores, in_graph))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode(), mtime=0) if path.suffix == ".gz" else text.encode())
    return path


# ---- 3. The edge-patched forward ----

class _Layer(NamedTuple):
    """One block's parts. ``Wq, Wk, Wv``: (H, hd, d), GQA ungrouped; ``bq, bk, bv``: (H, hd) or None;
    ``Wo``: (d, H, hd); ``bo``: (d,) or None; ``post_attn`` / ``post_mlp``: Gemma's output norms or None."""
    attn: nn.Module
    projections: tuple  # (q_proj, k_proj, v_proj) or (c_attn,)
    o_proj: nn.Module
    in_norm: nn.Module
    mlp: nn.Module
    mlp_norm: nn.Module
    post_attn: Optional[nn.Module]
    post_mlp: Optional[nn.Module]
    W: tuple
    b: tuple
    Wo: torch.Tensor
    bo: Optional[torch.Tensor]


def _split_heads(weight: torch.Tensor, bias, heads: int, H: int):
    """(heads * hd, d) -> (H, hd, d) with query head h reading head h // (H / heads) (repeat_kv)."""
    index = torch.arange(H, device=weight.device) // (H // heads)
    w = weight.view(heads, -1, weight.shape[-1])[index]
    return w, (bias.view(heads, -1)[index] if bias is not None else None)


def model_layers(model) -> list[_Layer]:
    """Each block's parts, for a sequential (attention then MLP) Hugging Face causal LM with q/k/v
    projections (Llama, Qwen2/3, Mistral, Gemma 2/3, OLMo) or GPT-2's fused ``c_attn``."""
    adapter, (H, H_kv) = get_adapter(model), head_counts(model)
    config = getattr(model.config, "text_config", None) or model.config
    if getattr(config, "use_parallel_residual", False) or getattr(config, "parallel_attn", False):
        raise ValueError(f"{type(model).__name__}: parallel attention and MLP is not supported by MIB's graph here")
    layers = []
    for block in adapter.blocks:
        attn, mlp = sublayer_module(block, "attn"), sublayer_module(block, "mlp")
        (o_proj, post_attn), (_, post_mlp) = sublayer_projection(block, "attn"), sublayer_projection(block, "mlp")
        if all(isinstance(getattr(attn, n, None), nn.Module) for n in ("q_proj", "k_proj", "v_proj")):
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            splits = [_split_heads(*projection_weight(p), k, H) for p, k in zip(projections, (H, H_kv, H_kv))]
        elif isinstance(getattr(attn, "c_attn", None), nn.Module):
            projections = (attn.c_attn,)
            weight, bias = projection_weight(attn.c_attn)
            biases = bias.chunk(3, 0) if bias is not None else (None,) * 3
            splits = [_split_heads(w, b, H, H) for w, b in zip(weight.chunk(3, 0), biases)]
        else:
            raise ValueError(f"{type(attn).__name__}: no q_proj/k_proj/v_proj or c_attn (looked for both); "
                             "this architecture is not supported by the edge-patched forward")
        wo, bo = projection_weight(o_proj)
        layers.append(_Layer(attn, projections, o_proj, sublayer_norm(block, "attn"), mlp, sublayer_norm(block, "mlp"),
                             post_attn, post_mlp, tuple(s[0] for s in splits), tuple(s[1] for s in splits),
                             wo.view(wo.shape[0], H, -1), bo))
    return layers


class Acts(NamedTuple):
    """One run's sender outputs: ``input`` (B, S, d) (the first block's input), ``attn`` per block (B, S, H, d)
    (each head's share of the output projection, its bias left out), ``mlp`` per block (B, S, d) (after
    Gemma's post-MLP norm)."""
    input: torch.Tensor
    attn: list
    mlp: list

    def flat(self) -> torch.Tensor:
        """(B, S, n_forward, d) in MIB's sender order."""
        parts = [self.input[:, :, None]]
        for a, m in zip(self.attn, self.mlp):
            parts += [a, m[:, :, None]]
        return torch.cat(parts, 2)


class _Mixer:
    """The receivers' inputs of one run. ``weights`` (n_forward, n_backward) in [0, 1] (1: the edge carries
    the sender's output in this run, 0: the counterfactual run's ``corrupted`` output); None: every edge
    in (the plain forward, no counterfactual needed). ``overrides``: ``{("input",) | ("attn", L) |
    ("mlp", L): (rows (B,) bool, value)}`` replaces a sender's output on those rows (EAP-IG).
    ``grad``: make the input a leaf and keep every receiver's input (in ``self.receivers``)."""

    def __init__(self, graph: MIBGraph, layers: list, weights=None, corrupted: Optional[Acts] = None,
                 overrides: Optional[dict] = None, grad: bool = False):
        if weights is not None and corrupted is None:
            raise ValueError("a circuit (weights) needs the counterfactual run's activations (corrupted)")
        self.graph, self.layers, self.weights, self.corrupted = graph, layers, weights, corrupted
        self.overrides, self.grad = overrides or {}, grad
        self.input, self.attn, self.mlp = None, [], []
        self.resid = None  # the running residual stream (weights None)
        self.receivers, self.corr_sums = {}, {}  # corr_sums: block -> (B, S, 1, d) the counterfactual heads' sum
        # no post-attention norm: a receiver's input is the counterfactual senders' sum + its weights @ their differences
        self.linear = weights is not None and not weights.requires_grad and all(p.post_attn is None for p in layers)
        self.base, self.diffs, self.filled = None, None, 0

    def _keep(self, new: torch.Tensor, old: torch.Tensor, bias=None) -> None:
        """Append senders (B, S, K, d) to ``diffs`` and their counterfactual sum (+ ``bias``) to ``base``."""
        if self.diffs is None:
            self.diffs, self.base = new.new_empty(self.graph.n_forward, new[:, :, 0].numel()), 0
        K = new.shape[2]
        self.diffs[self.filled:self.filled + K] = (new - old).permute(2, 0, 1, 3).reshape(K, -1)
        self.base, self.filled = self.base + old.sum(2) + (bias.to(old) if bias is not None else 0), self.filled + K

    def _override(self, key, value: torch.Tensor) -> torch.Tensor:
        if key not in self.overrides:
            return value
        rows, new = self.overrides[key]
        return torch.where(rows.view(-1, *([1] * (value.dim() - 1))), new.to(value), value)

    def _attn_sum(self, layer: int, total: torch.Tensor) -> torch.Tensor:
        """A block's attention output in the residual from the sum of its heads' outputs (+ bias, norm)."""
        part = self.layers[layer]
        total = total + part.bo.to(total) if part.bo is not None else total
        return part.post_attn(total) if part.post_attn is not None else total

    def put_input(self, x: torch.Tensor) -> None:
        x = self._override(("input",), x.detach())
        if self.grad:
            x = x.detach().requires_grad_(True)
        self.input, self.resid = x, x
        self.linear and self._keep(x[:, :, None], self.corrupted.input[:, :, None])

    def put_attn(self, layer: int, heads: torch.Tensor) -> None:
        heads = self._override(("attn", layer), heads)
        self.attn.append(heads)
        self.linear and self._keep(heads, self.corrupted.attn[layer], self.layers[layer].bo)
        if self.weights is None:
            self.resid = self.resid + self._attn_sum(layer, heads.sum(-2))

    def put_mlp(self, layer: int, out: torch.Tensor) -> None:
        out = self._override(("mlp", layer), out)
        self.mlp.append(out)
        self.linear and self._keep(out[:, :, None], self.corrupted.mlp[layer][:, :, None])
        if self.weights is None:
            self.resid = self.resid + out

    def mix(self, key, cols: slice) -> torch.Tensor:
        """(B, S, R, d) the inputs of receivers ``cols`` (a group in one block: its heads' q, k or v, its
        MLP, or the logits), from the senders so far."""
        R = cols.stop - cols.start
        if self.weights is None:
            x = self.resid[:, :, None].expand(-1, -1, R, -1)
            x = x.clone() if self.grad else x
        elif self.linear:
            w = self.weights[:self.filled, cols].to(self.diffs)
            rows = w.any(1).nonzero()[:, 0]  # the senders with an edge in (copied only when they are few)
            rows, w = (slice(0, self.filled), w) if 4 * len(rows) > self.filled else (rows, w[rows])
            x = (self.base[:, :, None] + (0 if not w.any() else (w.T @ self.diffs[rows]).view(
                R, *self.base.shape).permute(1, 2, 0, 3))).expand(-1, -1, R, -1)
        else:
            w, corr, H = self.weights[:, cols].to(self.input), self.corrupted, self.graph.n_heads
            x = _blend(w[:1], self.input[:, :, None], corr.input[:, :, None])
            for layer, heads in enumerate(self.attn):
                i = 1 + layer * (H + 1)
                if layer not in self.corr_sums:
                    self.corr_sums[layer] = corr.attn[layer].sum(2, keepdim=True)  # (B, S, 1, d)
                x = x + self._attn_sum(layer, _blend(w[i:i + H], heads, corr.attn[layer], self.corr_sums[layer]))
                if layer < len(self.mlp):  # not yet for the MLP of this block
                    x = x + _blend(w[i + H:i + H + 1], self.mlp[layer][:, :, None], corr.mlp[layer][:, :, None])
            x = x.expand(-1, -1, R, -1).clone() if self.grad else x.expand(-1, -1, R, -1)
        if self.grad:
            self.receivers[key] = x
        return x


def _blend(w: torch.Tensor, new: torch.Tensor, old: torch.Tensor, old_sum: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_k (w[k, r] new_k + (1 - w[k, r]) old_k)``: ``w`` (K, R), ``new`` / ``old`` (B, S, K, d) ->
    (B, S, R, d), or (B, S, 1, d) when every receiver takes all of ``new`` or all of ``old``."""
    if not w.requires_grad and bool((w == 1).all()):
        return new.sum(2, keepdim=True)
    if not w.requires_grad and bool((w == 0).all()):
        return old_sum if old_sum is not None else old.sum(2, keepdim=True)
    base = old_sum if old_sum is not None else old.sum(2, keepdim=True)
    return base + torch.einsum("bskd,kr->bsrd", new - old, w)


def _receiver_cols(graph: MIBGraph, layer: int, group: str) -> slice:
    base = layer * (3 * graph.n_heads + 1)
    if group == "m":
        return slice(base + 3 * graph.n_heads, base + 3 * graph.n_heads + 1)
    start = base + "qkv".index(group) * graph.n_heads
    return slice(start, start + graph.n_heads)


def edge_hooks(model, graph: MIBGraph, layers: list, mixer: _Mixer) -> list:
    """The hooks that make the model's forward MIB's edge-patched forward (see the module docstring)."""
    adapter, handles = get_adapter(model), []

    def first_block(module, args, kwargs):
        mixer.put_input(args[0] if args else kwargs["hidden_states"])

    def projection(layer: int, groups: str):
        part = layers[layer]

        def hook(module, args, output):
            outs = []
            for group in groups:
                i = "qkv".index(group)
                x = part.in_norm(mixer.mix(("attn", layer, group), _receiver_cols(graph, layer, group)))
                y = torch.einsum("bshd,hkd->bshk", x, part.W[i].to(x))
                if part.b[i] is not None:
                    y = y + part.b[i].to(x)
                outs.append(y.flatten(2))
            return torch.cat(outs, -1).to(output.dtype)
        return hook

    def o_proj(layer: int):
        part = layers[layer]

        def hook(module, args):
            z = args[0].unflatten(-1, (graph.n_heads, -1))  # (B, S, H, hd)
            mixer.put_attn(layer, torch.einsum("bshk,dhk->bshd", z, part.Wo.to(z)))
        return hook

    def mlp_in(layer: int):
        part = layers[layer]

        def hook(module, args):
            x = part.mlp_norm(mixer.mix(("mlp", layer), _receiver_cols(graph, layer, "m"))[:, :, 0])
            return (x,) + tuple(args[1:])
        return hook

    def mlp_out(layer: int):
        part = layers[layer]

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            mixer.put_mlp(layer, part.post_mlp(out) if part.post_mlp is not None else out)
        return hook

    def final_norm(module, args):
        x = mixer.mix(("logits",), slice(graph.n_backward - 1, graph.n_backward))[:, :, 0]
        return (x,) + tuple(args[1:])

    handles.append(adapter.blocks[0].register_forward_pre_hook(first_block, with_kwargs=True))
    for layer, part in enumerate(layers):
        groups = ("q", "k", "v") if len(part.projections) == 3 else ("qkv",)
        for proj, group in zip(part.projections, groups):
            handles.append(proj.register_forward_hook(projection(layer, group)))
        handles.append(part.o_proj.register_forward_pre_hook(o_proj(layer)))
        handles.append(part.mlp.register_forward_pre_hook(mlp_in(layer)))
        handles.append(part.mlp.register_forward_hook(mlp_out(layer)))
    handles.append(adapter.norm.register_forward_pre_hook(final_norm))
    return handles


@contextmanager
def ungrouped(layers: list):
    """Every query head reads its own key and value (MIB's ``ungroup_grouped_query_attention``): the
    attention's ``num_key_value_groups`` is 1 for the duration."""
    saved = [(part.attn, part.attn.num_key_value_groups) for part in layers
             if hasattr(part.attn, "num_key_value_groups")]
    try:
        [setattr(attn, "num_key_value_groups", 1) for attn, _ in saved]
        yield
    finally:
        [setattr(attn, "num_key_value_groups", groups) for attn, groups in saved]


def _run(model, graph: MIBGraph, layers: list, ids: torch.Tensor, mixer: _Mixer) -> torch.Tensor:
    """(B, V) last-position logits of the model's forward on ``ids`` (B, S) with ``mixer``'s receivers."""
    handles = edge_hooks(model, graph, layers, mixer)
    try:
        with eager_attention(model), ungrouped(layers):
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        [handle.remove() for handle in handles]
    if len(mixer.attn) != graph.n_layers or len(mixer.mlp) != graph.n_layers or mixer.input is None:
        raise ValueError(f"{type(model).__name__}: the hooks reached {len(mixer.attn)} of {graph.n_layers} "
                         "attention blocks; this architecture is not supported by the edge-patched forward")
    return out.logits[:, -1]


def record_acts(model, graph: MIBGraph, layers: list, ids: torch.Tensor) -> tuple[Acts, torch.Tensor]:
    """``(sender outputs, (B, V) logits)`` of the plain forward on ``ids`` (B, S), no gradients."""
    mixer = _Mixer(graph, layers)
    with torch.no_grad():
        logits = _run(model, graph, layers, ids, mixer)
    return Acts(mixer.input, mixer.attn, mixer.mlp), logits


def patched_logits(model, graph: MIBGraph, layers: list, ids: torch.Tensor, weights, corrupted: Acts) -> torch.Tensor:
    """(B, V) last-position logits of ``ids`` (B, S) with the circuit ``weights`` (n_forward, n_backward)
    (1 in the circuit, 0 out: those edges carry ``corrupted``, the counterfactual run's outputs)."""
    weights = torch.as_tensor(weights)
    if weights.shape != (graph.n_forward, graph.n_backward):
        raise ValueError(f"weights must be ({graph.n_forward}, {graph.n_backward}), got {tuple(weights.shape)}")
    weights = weights if weights.is_floating_point() else weights.double()
    with torch.no_grad():
        return _run(model, graph, layers, ids, _Mixer(graph, layers, weights, corrupted))


class Evaluation:
    """MIB's faithfulness on a fixed set of items (eap.evaluate): per length batch the counterfactual run's
    activations, ``m_full`` (N,) the clean logit differences (evaluate_baseline) and ``m_empty`` (N,)
    those with no edge in the circuit (evaluate_graph after apply_topn(0))."""

    def __init__(self, model, items: Sequence[IOIItem], *, batch_size: int = 16):
        if not items:
            raise ValueError("items must hold at least one IOI item, got none")
        self.model, self.items = model, list(items)
        self.graph, self.layers = MIBGraph.from_model(model), model_layers(model)
        self.batches = []
        for rows in length_batches(self.items, batch_size):
            clean, corrupted, labels = stack_items(self.items, rows, next(model.parameters()).device)
            self.batches.append((rows, clean, labels, record_acts(model, self.graph, self.layers, corrupted)[0]))
        self.m_full = logit_diffs(model, self.items, batch_size=batch_size)
        self.m_empty = self.circuit_metric(torch.zeros(self.graph.n_forward, self.graph.n_backward))

    def circuit_metric(self, in_graph) -> np.ndarray:
        """(N,) logit differences with circuit ``in_graph`` (n_forward, n_backward)."""
        out = np.zeros(len(self.items))
        for rows, clean, labels, acts in self.batches:
            logits = patched_logits(self.model, self.graph, self.layers, clean, torch.as_tensor(in_graph), acts)
            out[rows] = logit_diff(logits.float(), labels).cpu().numpy()
        return out

    def faithfulness(self, in_graph) -> float:
        """(mean m(C) - mean m(empty)) / (mean m(full) - mean m(empty)), MIB's normalisation."""
        return float((self.circuit_metric(in_graph).mean() - self.m_empty.mean())
                     / (self.m_full.mean() - self.m_empty.mean()))


def faithfulness_curve(evaluation: Evaluation, scores, *, absolute: bool,
                       percentages: Sequence[float] = PERCENTAGES) -> dict:
    """MIB's evaluate_area_under_curve at edge level: for each percentage the top ``int(p * n_edges)``
    edges (apply_topn, pruned), their faithfulness. Returns ``{"percentages", "n_edges" (after pruning,
    MIB's weighted_edge_counts), "faithfulness", "area_under", "area_from_1"}``."""
    graph, f, counts = evaluation.graph, [], []
    for p in percentages:
        if not 0 < p <= 1:
            raise ValueError(f"percentages must lie in (0, 1], got {p!r}")
        edges, _ = prune(graph, top_edges(graph, scores, int(p * graph.n_edges), absolute=absolute))
        counts.append(int(edges.sum()))
        f.append(evaluation.faithfulness(edges))
    under, from_1 = areas(percentages, f)
    return {"percentages": list(percentages), "n_edges": counts, "faithfulness": f,
            "area_under": under, "area_from_1": from_1}


def areas(percentages: Sequence[float], faithfulness: Sequence[float]) -> tuple[float, float]:
    """``(area under f, area under |1 - f|)``: MIB's trapezoids on the linear percentage axis."""
    under = from_1 = 0.0
    for i in range(len(faithfulness) - 1):
        width = percentages[i + 1] - percentages[i]
        under += width * (faithfulness[i] + faithfulness[i + 1]) / 2
        from_1 += width * (abs(1 - faithfulness[i]) + abs(1 - faithfulness[i + 1])) / 2
    return under, from_1


def cpr_cmd(evaluation: Evaluation, scores, percentages: Sequence[float] = PERCENTAGES) -> dict:
    """MIB's two numbers (print_results.py): CPR = area under f with the top edges by signed score,
    CMD = area under |1 - f| with the top edges by absolute score; both curves are returned."""
    signed = faithfulness_curve(evaluation, scores, absolute=False, percentages=percentages)
    absolute = faithfulness_curve(evaluation, scores, absolute=True, percentages=percentages)
    return {"CPR": signed["area_under"], "CMD": absolute["area_from_1"], "signed": signed, "absolute": absolute}


# ---- 4. Methods: a (n_forward, n_backward) score per edge ----

def contract(graph: MIBGraph, diff: torch.Tensor, grads: dict, dtype=torch.float64) -> torch.Tensor:
    """(n_forward, n_backward) float64 sum over items, positions and width of ``diff`` (B, S, n_forward, d)
    times each receiver's input gradient (``grads``: group -> (B, S, R, d)), on the graph's edges, in ``dtype``."""
    cols, parts = [], []
    for key, g in grads.items():
        cols.extend(range(graph.n_backward)[slice(-1, None) if key == ("logits",) else
                                            _receiver_cols(graph, key[1], "m" if key[0] == "mlp" else key[2])])
        parts.append(g)
    g = torch.cat(parts, 2)  # (B, S, n_backward, d) in ``cols`` order
    out = torch.zeros(graph.n_forward, graph.n_backward, dtype=torch.float64)
    out[:, cols] = torch.einsum("bsfd,bsrd->fr", diff.to(dtype), g.to(dtype)).double().cpu()
    return out * graph.real


def _gradients(model, graph, layers, ids, labels, overrides=None) -> dict:
    """Receiver-input gradients of the summed logit difference, plain forward (every edge in)."""
    mixer = _Mixer(graph, layers, overrides=overrides, grad=True)
    with torch.enable_grad():
        metric = logit_diff(_run(model, graph, layers, ids, mixer), labels).sum()
        keys = list(mixer.receivers)
        grads = torch.autograd.grad(metric, [mixer.receivers[k] for k in keys], allow_unused=True)
    return {k: (g if g is not None else torch.zeros_like(mixer.receivers[k])).detach() for k, g in zip(keys, grads)}


def _add(total: Optional[dict], grads: dict, steps: int, B: int) -> dict:
    """Sum (steps * B, ...) gradients over their ``steps`` copies into (B, ...)."""
    grads = {k: g.unflatten(0, (steps, B)).sum(0) for k, g in grads.items()}
    return grads if total is None else {k: total[k] + grads[k] for k in total}


def _repeat(ids: torch.Tensor, copies: int) -> torch.Tensor:
    return ids.repeat(copies, *([1] * (ids.dim() - 1)))


def eap_scores(model, graph, layers, clean, corrupted, labels) -> torch.Tensor:
    """EAP (eap.attribute.get_scores_eap, patching): per edge, summed over the B items, (clean - corrupted
    sender output) . (gradient of the logit difference at the receiver's input, clean run). MIB writes
    (corrupted - clean) . grad(-logit difference) (loss=True): the same number; it divides by its batch
    size as well (a constant factor)."""
    corr, _ = record_acts(model, graph, layers, corrupted)
    clean_acts, _ = record_acts(model, graph, layers, clean)
    grads = _gradients(model, graph, layers, clean, labels)
    return contract(graph, clean_acts.flat() - corr.flat(), grads)


def eap_ig_inputs_scores(model, graph, layers, clean, corrupted, labels, steps: int = IG_STEPS) -> torch.Tensor:
    """EAP-IG on inputs (get_scores_eap_ig): the first block's input at ``corrupted + k / steps (clean -
    corrupted)``, k = 0 .. steps - 1 (MIB's left sum), gradients averaged over the steps, dotted with
    (clean - corrupted) sender outputs; summed over the B items."""
    corr, _ = record_acts(model, graph, layers, corrupted)
    clean_acts, _ = record_acts(model, graph, layers, clean)
    B = clean.shape[0]
    alpha = (torch.arange(steps, dtype=corr.input.dtype, device=clean.device) / steps).repeat_interleave(B)
    path = _repeat(corr.input, steps) + alpha.view(-1, 1, 1) * _repeat(clean_acts.input - corr.input, steps)
    rows = torch.ones(steps * B, dtype=torch.bool, device=clean.device)
    grads = _gradients(model, graph, layers, _repeat(clean, steps), _repeat(labels, steps), {("input",): (rows, path)})
    grads = {k: g.unflatten(0, (steps, B)).sum(0) / steps for k, g in grads.items()}
    return contract(graph, clean_acts.flat() - corr.flat(), grads)


def eap_ig_activations_scores(model, graph, layers, clean, corrupted, labels, steps: int = IG_STEPS,
                              chunk: int = 16) -> torch.Tensor:
    """EAP-IG on activations (get_scores_ig_activations): for each node of ``input, a{L} (all heads), m{L}``
    and k = 1 .. steps, that node's output set to ``k / steps clean + (1 - k / steps) corrupted``; the
    receiver gradients of every such run (clean input otherwise) averaged over all (node, step) runs,
    dotted with (clean - corrupted) sender outputs; summed over the B items. ``chunk``: runs per forward."""
    corr, _ = record_acts(model, graph, layers, corrupted)
    clean_acts, _ = record_acts(model, graph, layers, clean)
    B = clean.shape[0]
    nodes = [("input",)] + [key for L in range(graph.n_layers) for key in (("attn", L), ("mlp", L))]
    runs = [(node, k / steps) for node in nodes for k in range(1, steps + 1)]

    def value(acts: Acts, node):
        return acts.input if node[0] == "input" else getattr(acts, node[0])[node[1]]

    total = None
    for start in range(0, len(runs), chunk):
        part = runs[start:start + chunk]
        overrides = {}
        for node in nodes:
            rows = torch.tensor([r[0] == node for r in part], device=clean.device).repeat_interleave(B)
            if rows.any():
                alpha = torch.tensor([r[1] for r in part], dtype=corr.input.dtype, device=clean.device)
                alpha = alpha.repeat_interleave(B).view(-1, *([1] * (value(corr, node).dim() - 1)))
                c, k = _repeat(value(clean_acts, node), len(part)), _repeat(value(corr, node), len(part))
                overrides[node] = (rows, alpha * c + (1 - alpha) * k)
        grads = _gradients(model, graph, layers, _repeat(clean, len(part)), _repeat(labels, len(part)), overrides)
        total = _add(total, grads, len(part), B)
    total = {k: g / len(runs) for k, g in total.items()}
    return contract(graph, clean_acts.flat() - corr.flat(), total)


def random_scores(graph: MIBGraph, seed: int = 0) -> torch.Tensor:
    """Standard normal scores on the graph's edges (``torch.Generator().manual_seed(seed)``)."""
    return torch.randn(graph.n_forward, graph.n_backward, generator=torch.Generator().manual_seed(seed)) * graph.real


class Scores(NamedTuple):
    """A method's edge scores (n_forward, n_backward), mean over items, and its seconds per item."""
    scores: torch.Tensor
    seconds_per_item: float
    method: str


def edge_scores(model, items: Sequence[IOIItem], method: str, *, steps: int = IG_STEPS, seed: int = 0,
                batch_size: int = 8) -> Scores:
    """One method's MIB edge scores over ``items`` (``METHODS``): the mean over items of the per-item
    scores (MIB sums its per-batch scores and divides by the number of items)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    graph, layers = MIBGraph.from_model(model), model_layers(model)
    start = time.perf_counter()
    if method == "random":
        return Scores(random_scores(graph, seed), 0.0, method)
    device, total = next(model.parameters()).device, torch.zeros(graph.n_forward, graph.n_backward)
    for rows in length_batches(items, batch_size):
        args = (model, graph, layers, *stack_items(items, rows, device))
        total += (eap_scores(*args) if method == "EAP" else eap_ig_inputs_scores(*args, steps)
                  if method == "EAP-IG-inputs" else eap_ig_activations_scores(*args, steps))
    return Scores(total / len(items), (time.perf_counter() - start) / len(items), method)


# ---- 5. A long run, one group of items at a time (each a record: iglens_tables.recorded) ----

def score_table(model, items: Sequence[IOIItem], methods: Sequence[str], *, steps: int = IG_STEPS,
                batch_size: int = 8) -> dict:
    """``{"scores": per method but random, the sum over ``items`` of its edge scores in ``graph.edges`` order
    (float32), "seconds": per method its seconds per item, and "items"}`` (a run's mean: the sums' sum / N)."""
    import pandas as pd
    graph, out = MIBGraph.from_model(model), {m: edge_scores(model, items, m, steps=steps, batch_size=batch_size)
                                              for m in methods if m != "random"}
    return {"scores": pd.DataFrame({m: (r.scores[graph.edge_src, graph.edge_dst] * len(items)).numpy() for m, r in out.items()}),
            "seconds": pd.DataFrame({"items": [len(items)], **{m: [r.seconds_per_item] for m, r in out.items()}})}


def curve_circuits(graph: MIBGraph, scores: dict, percentages: Sequence[float] = PERCENTAGES) -> dict:
    """``{"method/kind/p": pruned (n_forward, n_backward) bool}``: the circuits of :func:`faithfulness_curve`
    for each method's ``scores``, kind ``signed`` (CPR's top edges) and ``absolute`` (CMD's)."""
    return {f"{method}/{kind}/{p!r}": prune(graph, top_edges(graph, values, int(p * graph.n_edges),
                                                            absolute=kind == "absolute"))[0]
            for method, values in scores.items() for kind in ("signed", "absolute") for p in percentages}


def metric_table(model, items: Sequence[IOIItem], circuits: dict):
    """Logit differences of ``items`` (one length), a row per item: ``full`` (the clean run, MIB's m(full)),
    ``empty`` (its m(empty)), ``corrupted`` (the plain counterfactual run: a check of ``empty``) and one
    column per circuit of ``circuits`` (name -> edges); equal circuits run once."""
    import pandas as pd
    ev, done = Evaluation(model, items, batch_size=len(items)), {}
    out = {"full": ev.m_full, "empty": ev.m_empty, "corrupted": logit_diffs(model, items, corrupted=True, batch_size=len(items))}
    for name, edges in circuits.items():
        key = torch.as_tensor(edges).numpy().tobytes()
        out[name] = done[key] if key in done else done.setdefault(key, ev.circuit_metric(edges))
    return pd.DataFrame(out)
