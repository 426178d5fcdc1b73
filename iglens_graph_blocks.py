"""The attribution graph's linearised blocks (:mod:`iglens_graph`): the recorded eager pass, each
norm at its fixed denominator, the gated MLP's path coefficients ``a(g)``, ``b(g)`` and one block's four
backward maps. Split from :mod:`iglens_graph` by what it holds (issue 45); :mod:`iglens_dpa_method`'s sweep
reuses the same blocks."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from iglens_core import (eager_attention, first_output, hidden_arg, logits_at_end, projection_weight,
                         sublayer_module, sublayer_norm, sublayer_projection)
from iglens_checks import REBUILD_TOLERANCE, check_finite_pass, non_finite_error


PATH_NODES = 64  # Gauss-Legendre nodes of the neuron path coefficients a(g)
# Smaller rules tried first where |g| is small (the integrand t act'(t g) is then smooth on [0, 1]): (largest
# |g|, nodes). Each is kept only where it agrees with the PATH_NODES rule to PATH_CHECK at its largest |g|.
# SiLU and GELU-tanh: 8 nodes reach rounding (< 1e-15) up to |g| = 1, 12 up to 2, 16 up to 4, 24 up to 8,
# 32 up to 16 (SiLU); half of SmolLM2's gates have |g| <= 0.52 and 96% <= 2: ~10 evaluations per entry, not 64.
PATH_TIERS = ((1.0, 8), (2.0, 12), (4.0, 16), (8.0, 24), (16.0, 32))
PATH_CHECK = 1e-15  # largest gap to the PATH_NODES rule, relative to max(1, |a|), for a smaller rule to be used

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


# a(g) tabulated once per activation function (issue 45), for blocks in float32: linear interpolation on a
# grid of step 2^-TABLE_BITS over |g| <= TABLE_RANGE (entries beyond use the rule), checked at every cell's
# midpoint (where linear interpolation errs most) against the PATH_NODES rule: kept if its largest gap,
# relative to max(1, |a|), is within TABLE_CHECK (float32's half-ulp, 2^-24), else the rule is used throughout.
TABLE_RANGE, TABLE_BITS, TABLE_CHECK = 32.0, 10, 2.0 ** -24
_TABLES: dict = {}  # activation fingerprint -> (a on the grid (N,) float64, largest midpoint gap) or None


def _fingerprint(act: Callable) -> tuple:
    """An activation function known by its values (one instance per block, the same function)."""
    probe = torch.tensor([-7.3, -2.1, -0.37, 0.0, 0.21, 1.3, 4.7, 11.9], dtype=torch.float64)
    return type(act).__qualname__, tuple(act(probe).tolist())


def path_table(act: Callable) -> Optional[tuple[torch.Tensor, float]]:
    """``(a on the grid, gap)`` of :data:`TABLE_BITS`'s grid over ``[-TABLE_RANGE, TABLE_RANGE]``, built once per
    activation by the :data:`PATH_NODES` rule, and its largest gap to that rule at the cells' midpoints (relative
    to ``max(1, |a|)``); None where the gap exceeds :data:`TABLE_CHECK` (the rule is then used)."""
    key = _fingerprint(act)
    if key not in _TABLES:
        step = 2.0 ** -TABLE_BITS
        grid = torch.arange(-TABLE_RANGE, TABLE_RANGE + step / 2, step, dtype=torch.float64)
        a, _ = _path_rule(act, grid, PATH_NODES, 2 ** 20)
        mid, _ = _path_rule(act, grid[:-1] + step / 2, PATH_NODES, 2 ** 20)
        gap = float(((a[:-1] + a[1:]) / 2 - mid).abs().div(mid.abs().clamp_min(1.0)).max())
        _TABLES[key] = (a, gap) if gap <= TABLE_CHECK else None
    return _TABLES[key]


def path_coefficients_tabulated(act: Callable, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """:func:`path_coefficients` in ``g``'s dtype from :func:`path_table` (entries with ``|g| >``
    :data:`TABLE_RANGE` by the rule; the rule everywhere where the table failed its check). ``b = act(g) - g a``
    in ``g``'s dtype, so ``g a + b = act(g)`` to its rounding. ``defect``: the table's largest gap to the
    :data:`PATH_NODES` rule at its cells' midpoints (relative to ``max(1, |a|)``; the rule's own
    ``int_0^1 act(t g) dt`` is not evaluated)."""
    table = path_table(act)
    if table is None:
        a, b, defect = path_coefficients(act, g)
        return a.to(g.dtype), act(g) - g * a.to(g.dtype), defect
    values, gap = table
    flat = g.reshape(-1).double()
    where = (flat + TABLE_RANGE) * 2.0 ** TABLE_BITS  # (m,) position on the grid
    cell = where.floor().clamp(0, len(values) - 2)
    frac, cell = where - cell, cell.long()
    a = torch.lerp(values[cell], values[cell + 1], frac)
    outside = torch.nonzero(flat.abs() > TABLE_RANGE)[:, 0]
    if len(outside):
        a[outside] = path_coefficients(act, flat[outside])[0]
    a = a.to(g.dtype).view_as(g)
    return a, act(g) - g * a, gap


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
    """The norm ``norm`` at its recorded input ``x`` (S, d) (float64, or float32 for float32 blocks: its
    parameters are cast to ``x``'s dtype), as a :class:`_Norm`; checked against its recorded output
    (relative gap up to ``tol``, :func:`rebuild_tolerance`)."""
    name = type(norm).__name__
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    weight = weight.detach().to("cpu", x.dtype) if isinstance(weight, torch.Tensor) else None
    bias = bias.detach().to("cpu", x.dtype) if isinstance(bias, torch.Tensor) else None
    if isinstance(norm, nn.LayerNorm):
        sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)  # (S, 1)
        gain = weight if weight is not None else torch.ones(x.shape[-1], dtype=x.dtype)
        candidates = [_Norm(gain / sigma, bias, True)]
    elif name.lower().endswith("layernorm") and weight is None and bias is None:  # OLMo: no weight, eps 1e-5
        sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + float(getattr(norm, "eps", 1e-5)))
        candidates = [_Norm(torch.ones(x.shape[-1], dtype=x.dtype) / sigma, None, True)]
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


def _weights(proj: nn.Module, keep: bool = True,
             dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(W (out, in), bias (out,) or None)``, the bias in ``dtype`` on the CPU; the weight a copy in ``dtype``
    there (``keep``; the module's own tensor where it already is one) or the module's own tensor, cast where it
    is used (:func:`_cast`)."""
    weight, bias = projection_weight(proj)
    return (_cast(weight, dtype) if keep else weight.detach()), (_cast(bias, dtype) if bias is not None else None)


def _cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` on the CPU: itself when it is one, else a copy made for this use."""
    return weight if weight.dtype == dtype and weight.device.type == "cpu" else weight.to("cpu", dtype)


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


class _Stop(Exception):
    """Ends the recorded pass at the final norm (``_record(..., head=False)``)."""


def _record(model, adapter, parts: list[dict], input_ids: torch.Tensor, dtype: torch.dtype = torch.float64,
            inner: bool = False, head: bool = True) -> dict:
    """One eager forward pass; every block's input, patterns, norm inputs and outputs, and
    output, at all positions, in ``dtype`` on the CPU. ``inner``: also each block's gate and up (or
    input) projections' outputs, its value projection's output and its output projection's input (the
    heads), which :class:`_Block` then reuses instead of rebuilding them. ``head=False``: the pass stops at the
    final norm (the graph reads the states out itself, with their finiteness check)."""
    store: dict = {}

    def keep(key, tensor):
        store[key] = tensor.detach()[0].to("cpu", dtype)

    def keep_output(key):
        return lambda module, args, output: keep(key, first_output(output))

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
            if inner:
                mlp = part["mlp"]
                projections = ((("gate_up", mlp.gate_up_proj),) if isinstance(getattr(mlp, "gate_up_proj", None),
                                                                              nn.Module) else
                               (("gate", mlp.gate_proj), ("up", mlp.up_proj)) if part["kind"] == "gated" else
                               (("fc", mlp.c_fc),)) + (("values", part["values"][1]),)
                hooks += [module.register_forward_hook(keep_output((name, layer))) for name, module in projections]
                hooks.append(part["out_proj"].register_forward_pre_hook(
                    lambda mod, args, layer=layer: keep(("heads", layer), args[0])))
            for hook in hooks:
                stack.callback(hook.remove)
        if not head:
            stack.callback(adapter.norm.register_forward_pre_hook(lambda module, args: _raise(_Stop())).remove)
        stack.enter_context(eager_attention(model))
        stack.enter_context(_float64_softmax(next(model.parameters()).dtype == torch.float64))
        logits = None
        try:
            with torch.no_grad():
                logits = logits_at_end(model, 1, input_ids=input_ids.to(next(model.parameters()).device))
        except _Stop:
            pass
    check_finite_pass(model, store)
    if logits is not None and not bool(torch.isfinite(logits).all()):
        raise non_finite_error(model, "in the logits (the final norm and the head)")
    return store


def _raise(error: Exception):
    raise error


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




class _Block:
    """One block linearised at the recorded pass: patterns and norm denominators fixed, the MLP by its
    path integral from 0. Holds what the sweep reads (S positions, in the recorded states' dtype: float64,
    or float32 for float32 blocks) and its four backward maps, each returning the credit of the constants
    it passes."""

    def __init__(self, part: dict, store: dict, layer: int, H: int, H_kv: int, path: bool = True, keep: bool = True,
                 tol: float = REBUILD_TOLERANCE, check: bool = True):
        where = f"block {layer + 1}"  # path=False: a gated MLP's a, b are left to the caller (DPA)
        # tol: the norms' rebuild tolerance (:func:`rebuild_tolerance`)
        # keep=False: the weights stay the model's tensors, cast to the working dtype at each use (a 1.5B model's
        # float64 copies of every block would take ~10 GB); the numbers are the same
        # check=False: the gate, up (or input) and value projections' outputs and the heads are the recorded
        # ones (store's, :func:`_record` with inner=True) where the store holds them, not rebuilt from the
        # weights, and the rebuild gap is not measured (NaN); True: rebuilt and checked against the recorded states
        x, mid, out = store[("h", layer)], store[("norm2", layer), "in"], store[("h", layer + 1)]  # (S, d)
        S, d = x.shape
        self.dtype = dtype = x.dtype
        reuse = not check and ("heads", layer) in store

        def linear(inputs, weight, bias=None):
            return inputs @ _cast(weight, dtype).T + (bias if bias is not None else 0.0)
        # ---- the MLP, frozen at its recorded input
        self.norm2 = _freeze_norm(part["norm2"], mid, store[("norm2", layer), "out"], where + " pre-MLP norm", tol)
        z = None if reuse else self.norm2.forward(mid)  # (S, d)
        self.W_down, self.b_down = _weights(part["down_proj"], keep, dtype)  # (d, d_ff), (d,)
        act, self.kind, self.defect = part["act"], part["kind"], 0.0
        if self.kind == "gated":
            if isinstance(getattr(part["mlp"], "gate_up_proj", None), nn.Module):  # Phi-3: gate, then up
                self.W_g, self.W_u = _weights(part["mlp"].gate_up_proj, keep, dtype)[0].chunk(2, 0)  # (d_ff, d) each
                recorded = store[("gate_up", layer)].chunk(2, -1) if reuse else None
            else:
                self.W_g = _weights(part["mlp"].gate_proj, keep, dtype)[0]
                self.W_u = _weights(part["mlp"].up_proj, keep, dtype)[0]
                recorded = (store[("gate", layer)], store[("up", layer)]) if reuse else None
            # (S, d_ff) gate and up pre-activations
            self.g, self.u = recorded if reuse else (linear(z, self.W_g), linear(z, self.W_u))
            coefficients = path_coefficients if dtype == torch.float64 else path_coefficients_tabulated
            self.a, self.b, self.defect = coefficients(act, self.g) if path else (None, None, 0.0)
            self.m = act(self.g) * self.u  # (S, d_ff) neuron outputs
        else:
            self.W_1, b_1 = _weights(part["mlp"].c_fc, keep, dtype)  # (d_ff, d), (d_ff,)
            b_1 = b_1 if b_1 is not None else torch.zeros(self.W_1.shape[0], dtype=dtype)
            p = store[("fc", layer)] - b_1 if reuse else linear(z, self.W_1)  # (S, d_ff)
            self.m, self.m_const = act(p + b_1), act(b_1).expand_as(p)
            self.slope = torch.where(p != 0, (self.m - self.m_const) / torch.where(p != 0, p, 1.0),
                                     _derivative(act, b_1).expand_as(p))  # (S, d_ff)
        y = (store[("post_mlp", layer), "in"] if reuse and part["post_mlp"] is not None else None if reuse else
             linear(self.m, self.W_down, self.b_down))  # (S, d)
        self.post2 = (_freeze_norm(part["post_mlp"], y, store[("post_mlp", layer), "out"], where + " post-MLP norm",
                                   tol) if part["post_mlp"] is not None else None)
        self.rebuild = float("nan") if reuse else _gap(mid + (self.post2.forward(y) if self.post2 is not None else y),
                                                       out)
        # ---- the attention, patterns and denominators fixed
        self.norm1 = _freeze_norm(part["norm1"], x, store[("norm1", layer), "out"], where + " input norm", tol)
        name, module = part["values"]
        W_v, b_v = _weights(module, keep, dtype)
        v = store[("values", layer)] if reuse else None
        if name == "c_attn":  # GPT-2: queries, keys, values stacked
            W_v, b_v, v = W_v[2 * d:], (b_v[2 * d:] if b_v is not None else None), (v[:, 2 * d:] if reuse else None)
        elif name == "qkv_proj":  # Phi-3: H query heads, H_kv key heads, H_kv value heads
            cut = W_v.shape[0] * (H + H_kv) // (H + 2 * H_kv)
            W_v, b_v, v = W_v[cut:], (b_v[cut:] if b_v is not None else None), (v[:, cut:] if reuse else None)
        self.W_v, self.b_v, self.kv = W_v, b_v, (H if name == "c_attn" else H_kv)
        v = v if reuse else linear(self.norm1.forward(x), W_v, b_v)  # (S, H_kv * hd)
        self.group = torch.arange(H) // (H // self.kv)
        self.v_heads = v.reshape(S, self.kv, -1)[:, self.group]  # (S, H, hd)
        self.A = store[("pattern", layer)]  # (H, S, S) query, key
        if self.A.shape != (H, S, S):
            raise ValueError(f"{where}: attention pattern of shape {tuple(self.A.shape)}, expected {(H, S, S)}")
        self.zh = (store[("heads", layer)].reshape(S, H, -1) if reuse else
                   torch.einsum("hqk,khd->qhd", self.A, self.v_heads))  # (S, H, hd)
        self.W_o, self.b_o = _weights(part["out_proj"], keep, dtype)  # (d, H * hd)
        o = (store[("post_attn", layer), "in"] if reuse and part["post_attn"] is not None else None if reuse else
             linear(self.zh.reshape(S, -1), self.W_o, self.b_o))  # (S, d)
        self.post1 = (_freeze_norm(part["post_attn"], o, store[("post_attn", layer), "out"],
                                   where + " post-attention norm", tol) if part["post_attn"] is not None else None)
        if not reuse:
            self.rebuild = max(self.rebuild, _gap(x + (self.post1.forward(o) if self.post1 is not None else o), mid))

    def mlp_from_output(self, c_y: torch.Tensor, rows=slice(None), direct: Optional[tuple] = None) -> tuple:
        """Cotangent (S, d) on the MLP increment (or on its ``rows``) -> (S, d_ff) on each neuron's output;
        the down bias's credit. ``direct``: ``(t, c)`` also maps the cotangent ``c`` (d,) on row t alone, in the
        same product (the weight is read once), returned third, (d_ff,)."""
        c_u = self.post2.back(c_y, rows) if self.post2 is not None else c_y  # (S, d)
        const = float((c_u * self.b_down).sum()) if self.b_down is not None else 0.0
        if direct is None:
            return c_u @ _cast(self.W_down, self.dtype), const
        t, c = direct
        both = torch.cat([c_u, self.post2.back(c[None], slice(t, t + 1)) if self.post2 is not None else c[None]])
        both = both @ _cast(self.W_down, self.dtype)
        return both[:-1], const, both[-1]

    def mlp_to_input(self, c_m: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(S, d_ff) on the neurons' outputs -> (S, d) on ``mid``; the MLP's constants' credit."""
        if self.kind == "gated":
            c_z, const = (c_m * self.u * self.a) @ _cast(self.W_g, self.dtype) + (c_m * self.b) @ _cast(self.W_u, self.dtype), 0.0  # (S, d)
        else:
            c_z, const = (c_m * self.slope) @ _cast(self.W_1, self.dtype), float((c_m * self.m_const).sum())
        if self.norm2.beta is not None:
            const += float((c_z * self.norm2.beta).sum())
        return self.norm2.back(c_z), const

    def attn_from_output(self, c_y: torch.Tensor, rows=slice(None), direct: Optional[tuple] = None) -> tuple:
        """(S, d) on the attention increment (or on its ``rows``) -> (S, H, hd) on each head's output; the
        output bias's credit. ``direct``: as :meth:`mlp_from_output`'s, third, (H, hd)."""
        c_o = self.post1.back(c_y, rows) if self.post1 is not None else c_y  # (S, d)
        const = float((c_o * self.b_o).sum()) if self.b_o is not None else 0.0
        if direct is not None:
            t, c = direct
            c_o = torch.cat([c_o, self.post1.back(c[None], slice(t, t + 1)) if self.post1 is not None else c[None]])
        back = (c_o @ _cast(self.W_o, self.dtype)).view(c_o.shape[0], self.zh.shape[1], -1)  # (S, H, hd)
        return (back, const) if direct is None else (back[:-1], const, back[-1])

    def attn_to_input(self, back: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(S, H, hd) on the heads' outputs -> (S, d) on the block input, through the fixed pattern and
        the values; the value bias's and the input norm's constants' credit."""
        c_vh = torch.einsum("hqk,qhd->khd", self.A, back)  # (S, H, hd) on each head's values
        S = c_vh.shape[0]
        c_v = torch.zeros(S, self.kv, c_vh.shape[-1], dtype=c_vh.dtype).index_add_(1, self.group, c_vh)
        c_v = c_v.reshape(S, -1)  # (S, H_kv * hd)
        const = float((c_v * self.b_v).sum()) if self.b_v is not None else 0.0
        c_x1 = c_v @ _cast(self.W_v, self.dtype)  # (S, d)
        if self.norm1.beta is not None:
            const += float((c_x1 * self.norm1.beta).sum())
        return self.norm1.back(c_x1), const




# public names, for iglens_graph and the methods that reuse the frozen pass (iglens_dpa_method)
LinearBlock, block_parts, record_pass, freeze_norm = _Block, _block_parts, _record, _freeze_norm
