"""IG-Lens on the models people already hold: TransformerLens and nnsight, and results under their names.

``import iglens_interop`` once; from then on every IG-Lens entry point (``collect``, ``ig_lens``,
``components``, ``iglens_graph.attribution_graph(s)``, ``iglens_causal.causal_trace``,
``iglens_dpa.dpa_scores``...) accepts, beside a Hugging Face model:

- a TransformerLens 4 ``TransformerBridge`` (``TransformerBridge.boot_transformers(...)``): the Hugging
  Face model is inside it, its modules wrapped by the bridge's components. IG-Lens computes on a *view*
  of it: the same modules, parameters and buffers (shared, not copied), without the wrappers, so its
  hooks never touch the bridge and the numbers are the Hugging Face model's. A bridge whose weights
  ``enable_compatibility_mode()`` processed (``fold_ln``, ``center_writing_weights``,
  ``center_unembed``, ``fold_value_biases``: TransformerLens rewrites the Hugging Face weights in place,
  and ``_weights_processed`` records only that it did) is refused: the raw model is no longer there,
  and the processing moves per-head credit (value biases into the output bias) and logits
  (``center_unembed``). ``enable_compatibility_mode(no_processing=True)`` keeps the legacy hook names
  and the raw weights; TransformerLens's own exact-lens tools make the same demand.
- an nnsight ``LanguageModel`` (or any nnsight model object with a local module): the Hugging Face model
  is its ``_module``; IG-Lens computes on the same kind of view (nnsight's instrumented ``forward``s
  dropped; outside a trace they pass through anyway). A model without local weights (not dispatched:
  built for a remote NDIF backend, or lazily) is refused: IG-Lens runs the model here.
- a legacy ``HookedTransformer`` (TransformerLens < 4; 4.x removed it) is refused with the way to the
  bridge: it is TransformerLens's re-implementation, not a Hugging Face model, and by default holds
  processed weights (``from_pretrained`` folds the norms and centres the writing weights and the
  unembedding), from which IG-Lens's Hugging Face modules cannot be rebuilt exactly in general.

Names users know: :func:`tl_node`, :func:`tl_head_hook`, :func:`tl_neuron_hook` give TransformerLens's hook
names for our nodes, heads and neurons; :func:`with_tl_names` adds them to any IG-Lens table, and
:func:`head_dict` / :func:`neuron_dict` turn a per-head or per-neuron result into a dict keyed by
``(hook name, index)``. Off by one: our blocks are 1..n and node L is the stream after block L (node 0
the embedding output), TransformerLens's blocks are 0..n-1: node 0 is ``blocks.0.hook_resid_pre``,
node L >= 1 ``blocks.{L-1}.hook_resid_post``, the stream between attention and MLP of our block L
``blocks.{L-1}.hook_resid_mid``.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

import iglens_core as ig

__all__ = ["unwrap", "hf_model", "tl_node", "tl_segment", "tl_head_hook", "tl_neuron_hook", "with_tl_names",
           "head_dict", "neuron_dict"]

_VIEW = "_iglens_view"  # (root module, view) cached on the wrapper, outside its module tree
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _packages(obj) -> set:
    """Top-level packages of the classes ``obj`` is an instance of (its class and their bases)."""
    return {cls.__module__.split(".")[0] for cls in type(obj).__mro__}


def _named(obj, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(obj).__mro__)


def _unwrapped(module: nn.Module, memo: dict) -> nn.Module:
    """A shallow copy of ``module`` (below any TransformerLens wrapper) with the same parameters and
    buffers (the same dicts, so later moves and casts show), children copied the same way, no hooks,
    and no instance ``forward`` that a wrapper installed."""
    inner = module
    while isinstance(inner._modules.get("_original_component"), nn.Module):  # a bridge component
        inner = inner._modules["_original_component"]
    if id(inner) in memo:
        return memo[id(inner)]
    clone = copy.copy(inner)
    memo[id(inner)] = clone
    state = clone.__dict__
    for name in _HOOK_DICTS:
        if name in state:
            state[name] = type(state[name])()
    for name in [name for name in state if name.startswith("_iglens")]:
        del state[name]  # IG-Lens's own notes on the wrapped model (float64 patching, parts given by hand)
    forward = state.get("forward")
    origin = {getattr(forward, "__module__", None) or ""} | _packages(forward)
    if forward is not None and {"nnsight", "transformer_lens", "iglens_core"} & {o.split(".")[0] for o in origin}:
        del state["forward"]  # nnsight's Controller (the class's forward, as outside a trace), our float64 patch
    elif forward is not None:
        raise ValueError(f"{type(inner).__name__} has a forward replaced on the instance ({type(forward).__name__}: "
                         "accelerate's offloading hooks?); IG-Lens cannot compute on this wrapped model: load it "
                         "on one device (no device_map) and wrap it again")
    state.pop("__nnsight__", None)
    state["_modules"] = {name: None if child is None else _unwrapped(child, memo)
                         for name, child in inner._modules.items()}
    return clone


def _view(wrapper, root: nn.Module) -> nn.Module:
    """The cached unwrapped view of ``root`` (rebuilt when the wrapper holds another root), in the
    root's train / eval mode."""
    cached = wrapper.__dict__.get(_VIEW)
    if cached is None or cached[0] is not root:
        cached = (root, _unwrapped(root, {}))
        wrapper.__dict__[_VIEW] = cached
    view = cached[1]
    if view.training != root.training:
        view.train(root.training)
    return view


def _from_bridge(bridge) -> nn.Module:
    if getattr(bridge, "_weights_processed", False):
        raise ValueError(
            "this TransformerBridge's weights were processed (enable_compatibility_mode() or process_weights(): "
            "fold_ln, center_writing_weights, center_unembed, fold_value_biases rewrite the Hugging Face weights "
            "in place), so the raw model is no longer there to attribute. Boot the bridge again and call "
            "enable_compatibility_mode(no_processing=True) for the legacy hook names (or skip it), or pass "
            "the Hugging Face model itself")
    try:
        root = bridge.original_model
    except AttributeError as error:
        raise ValueError(f"this TransformerBridge holds no local torch model ({error}): IG-Lens runs the "
                         "Hugging Face model here") from None
    if not isinstance(root, nn.Module) or not hasattr(root, "get_output_embeddings"):
        raise ValueError(f"this TransformerBridge wraps a {type(root).__name__}, not a Hugging Face causal LM "
                         "(a TransformerLens-native model, boot_native or a legacy TransformerLens checkpoint?): "
                         "IG-Lens reads the Hugging Face modules; boot it with "
                         "TransformerBridge.boot_transformers(<Hugging Face id or model>)")
    return _view(bridge, root)


def _from_nnsight(model) -> nn.Module:
    root = model.__dict__.get("_module")
    if not isinstance(root, nn.Module):
        raise ValueError(f"this nnsight object ({type(model).__name__}) holds no torch module: pass the "
                         "LanguageModel itself")
    meta = any(p.is_meta for p in root.parameters())
    if getattr(model, "dispatched", True) is False or meta:
        raise ValueError(
            "this nnsight model has no weights here (not dispatched: built for a remote backend such as "
            "NDIF, remote=True, or loaded lazily). IG-Lens runs the model locally and cannot use a remote "
            "backend: load it with LanguageModel(<model>, dispatch=True) (or call model.dispatch()), or "
            "pass a loaded Hugging Face model")
    if any(getattr(module, "_hf_hook", None) is not None for module in root.modules()):
        return root  # accelerate's device_map: its hooks live on the modules; nnsight's pass through outside a trace
    return _view(model, root)


def unwrap(model) -> Optional[nn.Module]:
    """The Hugging Face model IG-Lens computes on for a TransformerLens or nnsight model; None for any
    other object (IG-Lens then takes it as it is). Registered with the core on import.

    Raises:
        ValueError: a model that cannot be attributed exactly: a bridge with processed weights, a legacy
            ``HookedTransformer``, an nnsight model without local weights (remote), an offloaded bridge.
    """
    packages = _packages(model)
    if "nnsight" in packages:
        return _from_nnsight(model)
    if "transformer_lens" not in packages:
        return None
    if _named(model, "TransformerBridge"):
        return _from_bridge(model)
    if _named(model, "HookedTransformer"):
        raise ValueError(
            "a HookedTransformer (TransformerLens < 4) is TransformerLens's own re-implementation, loaded by "
            "default with processed weights (fold_ln, center_writing_weights, center_unembed, "
            "fold_value_biases), from which the Hugging Face model cannot be rebuilt exactly in general. "
            "IG-Lens takes the model it came from: with TransformerLens >= 4, "
            "TransformerBridge.boot_transformers(name) (raw weights; enable_compatibility_mode(no_processing=True) "
            "for the legacy hook names), or the Hugging Face model itself")
    raise ValueError(f"IG-Lens does not know this TransformerLens object ({type(model).__name__}): pass a "
                     "TransformerBridge or the Hugging Face model")


def hf_model(model) -> nn.Module:
    """The torch model IG-Lens computes on for ``model`` (a wrapper's unwrapped view, or ``model``)."""
    return ig.as_model(model)


ig.register_model_unwrapper(unwrap)


# ---------------------------------------------------------------------------
# TransformerLens's names for our nodes, heads and neurons
# ---------------------------------------------------------------------------

def _check_index(value, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int,)) and not hasattr(value, "__index__"):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
    return value


def tl_node(layer: int) -> str:
    """TransformerLens's hook for our node ``layer`` (the residual stream after block ``layer``; 0: the
    embedding output): ``blocks.0.hook_resid_pre`` for 0, else ``blocks.{layer-1}.hook_resid_post``."""
    layer = _check_index(layer, 0, "layer")
    return "blocks.0.hook_resid_pre" if layer == 0 else f"blocks.{layer - 1}.hook_resid_post"


def tl_segment(label: str) -> str:
    """TransformerLens's hook for the end of one of our segments, by its label: ``"L12"`` and
    ``"L12.mlp"`` -> ``blocks.11.hook_resid_post``, ``"L12.attn"`` -> ``blocks.11.hook_resid_mid``."""
    name, _, part = str(label).partition(".")
    if not name.startswith("L") or not name[1:].isdigit() or part not in ("", "attn", "mlp"):
        raise ValueError(f"not a segment label (L<layer>, L<layer>.attn or L<layer>.mlp): {label!r}")
    layer = int(name[1:])
    return f"blocks.{layer - 1}.hook_resid_mid" if part == "attn" else tl_node(layer)


def tl_head_hook(block: int, hook: str = "hook_z") -> str:
    """TransformerLens's per-head hook of our block ``block`` (1..n): ``blocks.{block-1}.attn.hook_z``
    (``hook="hook_result"``: the head's output through its slice of W_O, what our head shares split)."""
    if hook not in ("hook_z", "hook_result"):
        raise ValueError(f"hook must be 'hook_z' or 'hook_result', got {hook!r}")
    return f"blocks.{_check_index(block, 1, 'block') - 1}.attn.{hook}"


def tl_neuron_hook(block: int) -> str:
    """TransformerLens's per-neuron hook of our block ``block`` (1..n): ``blocks.{block-1}.mlp.hook_post``."""
    return f"blocks.{_check_index(block, 1, 'block') - 1}.mlp.hook_post"


def with_tl_names(frame, *, head_hook: str = "hook_z"):
    """A copy of an IG-Lens table (``Attribution.to_frame``, ``attribute_dataset``'s results and parts,
    ``iglens_tables.graph_frame``...) with two more columns: ``tl_hook``, TransformerLens's hook name of
    the row's node, head or neuron, and ``tl_index``, the head or neuron index within it (null for a
    node). A row with ``head`` is ``tl_head_hook(block)``, with ``neuron`` ``tl_neuron_hook(block)``,
    with ``node`` ``tl_node(node)``, with a segment ``label`` ``tl_segment(label)``; other rows
    (biases, the rest) get nulls."""
    import pandas as pd

    def value(row, name):
        got = row.get(name)
        return None if got is None or pd.isna(got) else got

    hooks, indices = [], []
    for row in frame.to_dict("records"):
        block, head, neuron = value(row, "block"), value(row, "head"), value(row, "neuron")
        hook, index = None, None
        if block is not None and head is not None:
            hook, index = tl_head_hook(int(block), head_hook), int(head)
        elif block is not None and neuron is not None:
            hook, index = tl_neuron_hook(int(block)), int(neuron)
        elif value(row, "node") is not None:
            hook = tl_node(int(row["node"]))
        elif value(row, "label") is not None:
            hook = tl_segment(row["label"])
        hooks.append(hook)
        indices.append(index)
    out = frame.copy()
    out["tl_hook"] = pd.Series(hooks, index=frame.index, dtype="object")
    out["tl_index"] = pd.array(indices, dtype="Int64")
    return out


def _per_part(values, field: str, token: int) -> tuple[torch.Tensor, bool]:
    """(n, P) values and whether the last column is a bias, from Components or a tensor."""
    if isinstance(values, ig.Components):
        parts = getattr(values, field)
        if parts is None:
            raise ValueError(f"these Components hold no {field}: compute them with a resolution that has them")
        if not -parts.shape[0] <= token < parts.shape[0]:
            raise ValueError(f"token must index one of the {parts.shape[0]} answer tokens, got {token}")
        return parts[token].double(), True
    values = torch.as_tensor(values).double()
    if values.dim() != 2:
        raise ValueError(f"expected Components or an (n, parts) tensor, got shape {tuple(values.shape)}")
    return values, False


def head_dict(values, *, token: int = 0, hook: str = "hook_z", bias: bool = True) -> dict:
    """Per-head credit keyed by TransformerLens's names: ``{("blocks.0.attn.hook_z", head): value}``.

    Args:
        values: :class:`iglens_core.Components` (its ``heads`` of answer token ``token``; the output
            bias, last, under ``("blocks.{l}.attn.b_O", None)`` unless ``bias=False``) or an (n, H)
            tensor, block 1 first.
        hook: ``"hook_z"`` or ``"hook_result"``.
    """
    grid, has_bias = _per_part(values, "heads", token)
    out = {}
    for layer, row in enumerate(grid.tolist(), start=1):
        name = tl_head_hook(layer, hook)
        for head, share in enumerate(row[:-1] if has_bias else row):
            out[(name, head)] = share
        if has_bias and bias:
            out[(f"blocks.{layer - 1}.attn.b_O", None)] = row[-1]
    return out


def neuron_dict(values, *, token: int = 0, bias: bool = True) -> dict:
    """Per-neuron credit keyed by TransformerLens's names: ``{("blocks.0.mlp.hook_post", neuron): value}``
    (as :func:`head_dict`; the down-projection bias under ``("blocks.{l}.mlp.b_out", None)``)."""
    grid, has_bias = _per_part(values, "neurons", token)
    out = {}
    for layer, row in enumerate(grid.tolist(), start=1):
        name = tl_neuron_hook(layer)
        for neuron, share in enumerate(row[:-1] if has_bias else row):
            out[(name, neuron)] = share
        if has_bias and bias:
            out[(f"blocks.{layer - 1}.mlp.b_out", None)] = row[-1]
    return out
