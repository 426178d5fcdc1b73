"""Checks of a model's recorded pass that the graphs share (issue 47): non-finite weights or activations, named
where they first appear, and the rebuild tolerance of a low-precision model."""
from __future__ import annotations

import torch

from iglens_core import as_model

REBUILD_TOLERANCE = 1e-3  # relative gap between the linearised block and the recorded states
# A bfloat16 or float16 model's recorded states are rounded to its dtype (bfloat16: 2^-8 relative): the float64
# rebuild from them misses them by about that, so the tolerance is at least twice the dtype's epsilon there
# (measured on tiny Llama, Gemma 3, GPT-2, Qwen3, plain and sharpened: gaps up to 5.4e-3 in bfloat16, 6.2e-4 in
# float16). Float32 and float64 keep REBUILD_TOLERANCE.


def rebuild_tolerance(model) -> float:
    """The relative gap allowed between a frozen norm or linearised block and the recorded pass:
    :data:`REBUILD_TOLERANCE`, or twice the epsilon of a bfloat16 or float16 model's dtype, whose
    recorded states are rounded to it (the graph is computed in float64 from them, as ``components``)."""
    dtype = next(as_model(model).parameters()).dtype
    return max(REBUILD_TOLERANCE, 2 * torch.finfo(dtype).eps) if dtype.is_floating_point else REBUILD_TOLERANCE


def non_finite_parameters(model) -> list[str]:
    """Names of the model's parameters holding NaN or inf (offloaded ``meta`` ones are skipped)."""
    model = as_model(model)
    return [name for name, p in model.named_parameters()
            if p.is_floating_point() and not p.is_meta and not bool(torch.isfinite(p).all())]


def non_finite_error(model, where: str) -> ValueError:
    """The ValueError for a pass that is NaN or inf ``where`` ("first at the output of block 2"): it names
    the non-finite parameters, or, with none, says that the activations overflow the model's dtype."""
    bad, dtype = non_finite_parameters(model), next(model.parameters()).dtype
    cause = (f"the parameters {bad[:5]}{f' (and {len(bad) - 5} more)' if len(bad) > 5 else ''} hold NaN or inf: "
             "fix or reload the weights" if bad else
             f"no parameter is NaN or inf, so the activations overflow {dtype}: run the model in float32 "
             "(model.float())")
    return ValueError(f"the model's pass holds NaN or inf {where}; {cause}")


_RECORDED = {"h": "the input of block {}", "norm1": "block {}'s input norm", "norm2": "block {}'s pre-MLP norm",
             "post_attn": "block {}'s post-attention norm", "post_mlp": "block {}'s post-MLP norm",
             "pattern": "block {}'s attention pattern", "gate": "block {}'s MLP gate projection",
             "up": "block {}'s MLP up projection", "gate_up": "block {}'s MLP gate-up projection",
             "fc": "block {}'s MLP input projection", "values": "block {}'s value projection",
             "heads": "block {}'s attention heads (the output projection's input)"}


def check_finite_pass(model, store: dict) -> None:
    """A ValueError (:func:`non_finite_error`) where a recorded pass (``iglens_graph``'s store, in pass order)
    first holds NaN or inf."""
    for key, value in store.items():
        if not bool(torch.isfinite(value).all()):
            name, layer = key[0] if isinstance(key[0], tuple) else key
            side = f" ({key[1]}put)" if isinstance(key[0], tuple) else ""
            where = ("the token embeddings (the input of block 1)" if key == ("h", 0) else
                     f"the output of block {layer}" if name == "h" else _RECORDED[name].format(layer + 1) + side)
            raise non_finite_error(model, "first at " + where)


def check_memory(n: int, H: int, S: int, edges: bool, budget: int) -> None:
    """Refuse, before any work, a sequence whose recorded patterns and (``edges``) edges, each (n, H, S, S)
    float64, would exceed ``budget`` bytes (``iglens_graph.GRAPH_MEMORY_BUDGET``)."""
    one = 8 * n * H * S * S
    if one * (2 if edges else 1) <= budget:
        return
    size = f"{n} blocks x {H} heads x {S}^2 positions in float64"
    if edges and one <= budget:
        raise ValueError(f"edges=True needs about {2 * one / 2**30:.1f} GiB for the edges and the recorded patterns "
                         f"({size}, {one / 2**30:.1f} GiB each), beyond iglens_graph.GRAPH_MEMORY_BUDGET = "
                         f"{budget / 2**30:.1f} GiB: pass edges=False (heads, neurons and carried maps need the "
                         "patterns only), a shorter sequence, or raise the budget")
    raise ValueError(f"the recorded attention patterns alone need about {one / 2**30:.1f} GiB ({size}), beyond "
                     f"iglens_graph.GRAPH_MEMORY_BUDGET = {budget / 2**30:.1f} GiB: pass a shorter sequence "
                     "(at most the predicting positions' prefix), or raise the budget")
