"""IG-Lens: exact additive probability attribution across transformer layers.

The method and only the method, in reading order: 1. model loading, 2. architecture adapters,
3. the collector (one forward pass -> ``Trace``), 4. the head-once ``Readout``, 5. the integrator
and its estimators (``ig_lens`` -> ``Attribution``) and the split into heads, neurons and source
positions (``components`` -> ``Components``); the packaged models' files are ``iglens_models``.
Beside it, importing it (README, "Where things are"): datasets at scale (``iglens_data``,
``iglens_tables``), figures and views (``iglens_plot``), the ``iglens`` command (``iglens_cli``),
the other attribution methods (``iglens_baselines``), causal interventions (``iglens_causal``),
DPA's benchmark (``iglens_dpa``), statistics (``iglens_stats``) and fact tables
(``iglens_facts``); they use only this module's public names. Shapes: ``T`` predicting positions,
``n`` blocks, ``d`` hidden size, ``V`` vocabulary, ``K`` segments, ``m`` steps per segment.

The method: the residual stream of token ``t`` moves along ``h_base -> h_L1 -> ... -> h_n``; the
readout ``f(h) = softmax(head(norm(h)))[y_t]`` maps any point to the target's probability.
Segment ``j`` gets the integral of ``grad f`` along the line ``h_L(j-1) -> h_Lj``, which by the
gradient theorem is ``f(h_Lj) - f(h_L(j-1))``: the terms telescope to ``Δp``. The
prediction-aware estimator credits every step its observed change in ``f``, so its segment value
is exactly the logit-lens difference of the endpoints. Any scalar readout telescopes the same
way (``quantity="logprob"``, a ``foil``).
"""

from __future__ import annotations

import math
import sys
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from iglens_models import (CACHE_DIR, PACKAGED_MODELS, ROOT, check_local_model, convert_gguf,  # noqa: F401
                           looks_like_path, packaged_model_dir, quiet_transformers)  # (re-exported)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MEMORY_BUDGET = 2 * 2**30  # bytes of logits one readout chunk may hold
# On a CPU a readout chunk's logits are also kept to about the last-level cache (and >= 64 rows,
# for the product): past it the log-softmax runs at memory speed. benchmarks/bench.py measured
# 0.55 -> ~0.8 of the plain matmul rate for the profile on a 2-core EPYC (32 MiB L3).
CPU_CHUNK_BYTES = 24 * 2**20

ESTIMATORS = ("prediction_aware", "riemann_left", "riemann_right", "riemann_mid",
              "trapezoid", "gauss_legendre")
BASELINES = ("embedding", "zero", "mean")
# the scalar readout f that IG-Lens splits: the target's probability or log-probability (with a
# foil: their difference; the log-probability difference is the logit difference z_y - z_foil)
QUANTITIES = ("prob", "logprob")


# ---------------------------------------------------------------------------
# 1. Model loading
# ---------------------------------------------------------------------------

def resolve_model_path(name: str) -> str:
    """Map a model name to something ``from_pretrained`` can open without a network.

    Packaged names are converted once into ``CACHE_DIR`` (``$IGLENS_CACHE`` overrides it);
    a local directory is used as is (a name that looks like a path must be a folder with config.json,
    weights and tokenizer: :func:`iglens_models.check_local_model`); a Hugging Face id must already be
    in the local hub cache.

    Raises:
        FileNotFoundError: naming the model (or path) and how to make it available.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a packaged name {sorted(PACKAGED_MODELS)}, a local "
                         f"directory or a Hugging Face id, got {name!r}")
    if name in PACKAGED_MODELS:
        return str(packaged_model_dir(name))
    if looks_like_path(name):
        return str(check_local_model(name))
    from huggingface_hub import try_to_load_from_cache
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return name
    except ValueError as err:  # huggingface_hub's HFValidationError: not of the form owner/name
        raise FileNotFoundError(f"model {name!r} is neither a packaged model {sorted(PACKAGED_MODELS)}, a local "
                                f"folder, nor a Hugging Face id (owner/name): {err}") from None
    raise FileNotFoundError(
        f"Model {name!r} is not available offline. IG-Lens never downloads weights at run time. "
        f"Use one of the packaged models {sorted(PACKAGED_MODELS)}, pass a local directory "
        f"holding config.json and the weights, or download {name!r} into the Hugging Face cache "
        f"beforehand on a machine with network access (`huggingface-cli download {name}`).")


def load_model(name: str = DEFAULT_MODEL, *, device: Optional[str] = None,
               dtype: torch.dtype = torch.float32, device_map=None, **from_pretrained):
    """Load a causal LM and its tokenizer, offline; returns ``(model, tokenizer)``, eval mode.

    Args:
        name: a packaged model (:data:`PACKAGED_MODELS`), a local directory, or a Hugging Face id
            already in the local cache.
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available (ignored with ``device_map``).
        dtype: parameter dtype.
        device_map, **from_pretrained: passed to ``from_pretrained`` (e.g. ``device_map="auto"``,
            ``max_memory``, ``offload_folder`` for models larger than one device).
    """
    if device is not None and torch.device(device).type == "meta":
        raise ValueError("device='meta' gives a model without weights (shapes only), on which nothing "
                         "can be computed: use 'cpu' or 'cuda', or device_map='auto' to offload")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    quiet_transformers()
    path = resolve_model_path(name)
    offline = dict(local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, **offline)
    kwargs = dict(dtype=dtype, **offline, **from_pretrained)
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device_map is None:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    return model, tokenizer


# ---------------------------------------------------------------------------
# 2. Architecture adapters
# ---------------------------------------------------------------------------

_BLOCK_LISTS = ("layers", "h", "blocks")
_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_norm")
# Pre-MLP norm of a block: its input is the residual between attention and MLP. Gemma's
# `post_attention_layernorm` normalises the attention *output*, so its pre-MLP norm goes first.
_MLP_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2")
_INPUT_NORMS = ("input_layernorm", "ln_1")  # the attention's input norm


@dataclass
class Adapter:
    """Where a model keeps the parts IG-Lens needs (found from its modules, not its name).

    Attributes:
        blocks: the ``n`` transformer blocks; norm: the final norm (its input is ``h_n``); head: the
            unembedding (d -> V); softcap: ``final_logit_softcapping`` (Gemma 2/3) or None;
            logit_scale: multiplier applied to the logits after the head (1.0 for most models).
    """
    blocks: nn.ModuleList
    norm: nn.Module
    head: nn.Module
    softcap: Optional[float] = None
    logit_scale: float = 1.0

    @property
    def n_layers(self) -> int:
        return len(self.blocks)


# -- a model held by a wrapper (TransformerLens's TransformerBridge, nnsight's LanguageModel): the entry
# points call as_model first; `import iglens_interop` registers how to find the Hugging Face model inside
_UNWRAPPERS: list = []


def register_model_unwrapper(unwrap: Callable) -> None:
    """Have every entry point call ``unwrap(model)`` on the model it receives: the torch model to compute
    on, or None for a model ``unwrap`` does not handle (``iglens_interop`` registers TransformerLens's
    and nnsight's)."""
    if unwrap not in _UNWRAPPERS:
        _UNWRAPPERS.append(unwrap)


def as_model(model):
    """The model IG-Lens computes on: ``model``, or what a registered unwrapper finds inside it."""
    for unwrap in _UNWRAPPERS:
        inner = unwrap(model)
        if inner is not None:
            return inner
    package = type(model).__module__.split(".")[0]
    if package in ("transformer_lens", "nnsight"):
        raise ValueError(f"a {package} model ({type(model).__name__}): `import iglens_interop` first, "
                         "so that IG-Lens finds the Hugging Face model inside it")
    return model


def check_model(model) -> None:
    """Raise a ValueError unless ``model`` is a loaded ``nn.Module`` in eval mode whose weights are not
    on ``meta`` (shapes only) without accelerate's offloading hooks."""
    model = as_model(model)
    if not isinstance(model, nn.Module):
        hint = f"; load it first: model, tokenizer = ig.load_model({model!r})" if isinstance(model, str) else ""
        raise ValueError(f"model must be a loaded torch model (torch.nn.Module), got "
                         f"{type(model).__name__} {str(model)[:80]!r}{hint}")
    if getattr(model, "hf_device_map", None) is None and any(p.is_meta for p in model.parameters()):
        raise ValueError("the model's weights are on the 'meta' device (shapes only, no values): load "
                         "it on 'cpu' or 'cuda', or with device_map='auto' to offload what does not fit")
    if model.training:  # dropout would make every run differ
        raise ValueError(f"the model ({type(model).__name__}) is in training mode (dropout is random): call model.eval() first")


_FINGERPRINT_ENTRIES = 4  # sampled entries per tensor


def model_fingerprint(model) -> Optional[torch.Tensor]:
    """(k,) float64 sampled weights (4 entries each of the embedding, the first parameter of the first
    and last block, the final norm and the head) that tell one model from another of the same sizes.
    No sum is taken, so they do not depend on the device. None when a part is offloaded (``meta``).
    """
    model = as_model(model)
    adapter = get_adapter(model)
    tensors = [model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None,
               next(adapter.blocks[0].parameters(), None), next(adapter.blocks[-1].parameters(), None),
               getattr(adapter.norm, "weight", None), getattr(adapter.head, "weight", None)]
    picked = []
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        if tensor.is_meta:
            return None
        flat = tensor.detach().reshape(-1)
        at = torch.tensor([k * (flat.numel() - 1) // (_FINGERPRINT_ENTRIES - 1)
                           for k in range(_FINGERPRINT_ENTRIES)], device=flat.device)
        picked.append(flat[at].double().cpu())
    return torch.cat(picked)


def check_same_model(model, trace: Optional["Trace"] = None, readout: Optional["Readout"] = None) -> None:
    """Raise a ValueError unless the trace and the readout (either may be None) were made with
    ``model``: their stored :func:`model_fingerprint` must match its own within 1e-2 relative (so
    another dtype of the same model passes). A trace built by hand (no fingerprint) is not checked.
    """
    model = as_model(model)
    check_model(model)
    stored = [(what, getattr(thing, "model_fingerprint", None)) for what, thing in
              (("trace", trace), ("readout", readout)) if thing is not None]
    if all(fingerprint is None for _, fingerprint in stored):
        return
    own = model_fingerprint(model)
    for what, fingerprint in stored:
        if own is None or fingerprint is None:
            continue
        if fingerprint.shape != own.shape or not torch.allclose(fingerprint, own, rtol=1e-2, atol=1e-8):
            fix = ("collect it with this model" if what == "trace" else "build it with Readout(model)")
            raise ValueError(f"the {what} comes from another model than the one passed (their weights "
                             f"differ at the sampled entries of ig.model_fingerprint): {fix}")


def _first_attr(module: nn.Module, names: Sequence[str]):
    for name in names:
        found = getattr(module, name, None)
        if found is not None:
            return found
    return None


def get_adapter(model: nn.Module, *, blocks: Optional[nn.ModuleList] = None,
                norm: Optional[nn.Module] = None, head: Optional[nn.Module] = None) -> Adapter:
    """Find blocks, final norm and head of a Hugging Face causal LM, by attribute, not class name.

    Looked for: a ``ModuleList`` at ``.layers`` / ``.h`` / ``.blocks`` of ``model.base_model``, the
    norm at ``.norm`` / ``.ln_f`` / ``.final_layer_norm`` / ``.final_norm``, the head by
    ``get_output_embeddings()``. Parts passed by hand (``blocks``, ``norm``, ``head``) for a model on
    which they are not found are remembered on the model, so every later call finds them.

    Raises:
        ValueError: naming each part not found, where it was looked for and how to pass it.
    """
    model = as_model(model)
    check_model(model)
    float64_forward(model)
    base = getattr(model, "base_model", model)
    output_embeddings = getattr(model, "get_output_embeddings", None)
    found = dict(blocks=_first_attr(base, _BLOCK_LISTS), norm=_first_attr(base, _FINAL_NORMS),
                 head=output_embeddings() if callable(output_embeddings) else None)
    if not isinstance(found["blocks"], nn.ModuleList):
        found["blocks"] = None
    given = dict(blocks=blocks, norm=norm, head=head)
    remembered = model.__dict__.setdefault("_iglens_parts", {})  # plain attribute, not a submodule
    parts = {}
    for name in found:
        if given[name] is not None and found[name] is None:
            remembered[name] = given[name]
        parts[name] = next((part for part in (given[name], found[name], remembered.get(name))
                            if part is not None), None)
    missing = [name for name, part in parts.items() if part is None]
    if missing:
        where = "of model.base_model (or the model itself)"
        looked_for = dict(
            blocks=f"the blocks (looked for a ModuleList at .{' / .'.join(_BLOCK_LISTS)} {where})",
            norm=f"the final norm (looked for .{' / .'.join(_FINAL_NORMS)} {where})",
            head="the unembedding head (looked for model.get_output_embeddings())")
        raise ValueError(
            f"IG-Lens does not recognise the architecture {type(model).__name__}: cannot find "
            + "; ".join(looked_for[name] for name in missing) + ". Pass the missing parts by hand once: ig.get_adapter(model, blocks=model.<block "
            "ModuleList>, norm=model.<final norm>, head=model.<unembedding Linear>) (when the "
            "blocks are found, ig.Readout(model, norm=..., head=...) does it too); parts passed "
            "by hand are remembered on the model, so collect() and ig_lens() find them.")
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None) or 1.0          # Cohere multiplies
    if getattr(config, "logits_scaling", None):                   # Granite divides
        scale = 1.0 / config.logits_scaling
    return Adapter(parts["blocks"], parts["norm"], parts["head"], softcap, float(scale))


# -- float64 means float64: transformers 5.x computes RMSNorms and rotary embeddings in float32
# whatever the dtype (a `.double()` SmolLM2 missed its target logit by 1.7e-6, not ~1e-14)

def _norm_candidates(module: nn.Module) -> dict:
    """float64 reimplementations ``x -> norm(x)`` that ``module`` may be (its gain convention)."""
    eps = _first_attr(module, ("variance_epsilon", "eps"))
    eps = float(eps) if isinstance(eps, (int, float)) else 1e-5  # OLMo: eps fixed in its forward
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    out = {"layer": lambda x: nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)}
    if isinstance(weight, torch.Tensor) and bias is None:
        out.update(rms_scale=lambda x: weight * rms(x), rms_offset=lambda x: (1.0 + weight) * rms(x))
    elif weight is None:
        out["rms"] = rms
    return out


def _rotary_float64(module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type=None):
    """cos, sin (B, L, rotary_dim) of a rotary embedding, computed in float64 from its buffers."""
    prefix = f"{layer_type}_" if layer_type is not None else ""
    inv_freq = getattr(module, prefix + "inv_freq").to(x.device, torch.float64)
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq  # (B, L, rotary_dim / 2)
    emb = torch.cat([freqs, freqs], -1)
    scaling = getattr(module, prefix + "attention_scaling", 1.0)
    return emb.cos() * scaling, emb.sin() * scaling


def float64_forward(model: nn.Module) -> list[str]:
    """Make a float64 model compute in float64 where transformers computes in float32.

    For a float64 model (every entry point calls this through :func:`get_adapter`) the ``forward``
    of these modules is replaced on the instance: norms other than ``nn.LayerNorm`` (by the float64
    reimplementation that matches the module's output on a probe: RMSNorm with ``w`` or ``1 + w``,
    OLMo's weightless LayerNorm), and rotary embeddings without dynamic rope types (cos and sin in
    float64 from the model's ``inv_freq`` buffer). Other dtypes go to the original ``forward``.

    Returns:
        Names of what still computes in float32, also warned: dynamic rope types, offloaded
        modules, norms no candidate reproduces, the eager attention softmax; ``[]`` otherwise.
    """
    model = as_model(model)
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.float64:
        return []
    if "_iglens_float32_parts" in model.__dict__:
        return model.__dict__["_iglens_float32_parts"]
    left: list[str] = []
    generator = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        kind = type(module).__name__
        if getattr(module, "_hf_hook", None) is not None and ("Norm" in kind or "Rotary" in kind):
            left.append(name)
            continue
        if "norm" in kind.lower() and not isinstance(module, nn.LayerNorm) and not list(module.children()):
            width = getattr(module, "weight", None)
            width = width.shape[-1] if isinstance(width, torch.Tensor) else getattr(module, "normalized_shape", (None,))[0]
            if not width:
                continue
            probe = torch.randn(2, width, generator=generator, dtype=torch.float64) * torch.tensor([[1.0], [1e-3]])
            probe = probe.to(first.device)
            with torch.no_grad():
                want = module(probe)
                match = [f for f in _norm_candidates(module).values()
                         if torch.allclose(f(probe), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))]
            if not match:
                left.append(name)
                continue
            module.forward = (lambda x, f=match[0], original=module.forward:
                              f(x) if x.dtype == torch.float64 else original(x))
        elif kind.endswith("RotaryEmbedding") and any(key.endswith("inv_freq") for key, _ in module.named_buffers()):
            rope = getattr(module, "rope_type", "default")
            rope = set(rope.values()) if isinstance(rope, dict) else {rope}
            if rope & {"dynamic", "longrope"}:
                left.append(name)
                continue
            module.forward = (lambda x, position_ids, *args, module=module, original=module.forward, **kwargs:
                              _rotary_float64(module, x, position_ids, *args, **kwargs)
                              if x.dtype == torch.float64 else original(x, position_ids, *args, **kwargs))
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "eager":
        left.append("eager attention softmax")
    model.__dict__["_iglens_float32_parts"] = left
    if left:
        warnings.warn(f"float64 model: these parts still compute in float32: {left}", stacklevel=2)
    return left


def _norm_form(norm: nn.Module, head: nn.Module) -> tuple[Optional[str], float]:
    """``("rms" | "layer", eps)`` when ``norm(h) = s(h) A h + b`` is known to hold and the head is
    linear (see ``Readout.along_segments``); ``(None, 0.0)`` otherwise."""
    if not isinstance(head, nn.Linear):
        return None, 0.0
    if isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1:
        return "layer", float(norm.eps)
    if (type(norm).__name__.lower().endswith("layernorm") and next(norm.parameters(), None) is None
            and len(getattr(norm, "normalized_shape", ())) == 1):
        return "layer", float(getattr(norm, "eps", 1e-5))  # OLMo: weightless, eps 1e-5 in forward
    eps = _first_attr(norm, ("variance_epsilon", "eps"))
    if "rmsnorm" in type(norm).__name__.lower() and isinstance(eps, (int, float)):
        return "rms", float(eps)
    return None, 0.0


def _execution_device(module: nn.Module, default: torch.device) -> torch.device:
    """Device a module computes on: accelerate's execution device when ``device_map`` offloaded
    its weights (to the CPU or disk: they then sit on ``meta`` between calls), else its first
    parameter's device, else ``default``."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    param = next(module.parameters(), None)
    return param.device if param is not None and param.device.type != "meta" else default


def _readout_value(logits: torch.Tensor, index: torch.Tensor, quantity: str) -> torch.Tensor:
    """(...) ``p(y)``, ``log p(y)``, ``p(y) - p(foil)`` or ``log p(y) - log p(foil)`` (read as the logit
    difference ``z_y - z_foil``) from logits (..., V) and ``index`` (..., 1) target or (..., 2) target
    and foil. ``log_softmax`` + gather is the fastest here (bench.py); in float32 at V = 49152 it
    rounds up to 7e-6 in probability against float64."""
    if quantity == "logprob" and index.shape[-1] == 2:
        picked = logits.gather(-1, index)
    else:
        picked = torch.log_softmax(logits, -1).gather(-1, index)
        picked = picked.exp() if quantity == "prob" else picked
    return picked[..., 0] - picked[..., 1] if index.shape[-1] == 2 else picked[..., 0]


def _readout_slope(probs: torch.Tensor, index: torch.Tensor, quantity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``df/dz = sum_k w_k e_(index_k) - c p`` as ``(w (..., K), c (..., 1))`` from ``probs`` (..., V):
    ``p(y)``: ``p_y (e_y - p)``; ``log p(y)``: ``e_y - p``; a foil subtracts its own term."""
    signs = torch.tensor([1.0, -1.0][:index.shape[-1]], dtype=probs.dtype, device=probs.device)
    weights = probs.gather(-1, index) if quantity == "prob" else torch.ones(index.shape, dtype=probs.dtype,
                                                                             device=probs.device)
    weights = weights * signs
    return weights, weights.sum(-1, keepdim=True)


def _readout_tangent(probs: torch.Tensor, tangent: torch.Tensor, index: torch.Tensor,
                     quantity: str) -> torch.Tensor:
    """``<df/dz, tangent>`` (...) from ``probs`` and ``tangent`` (..., V); ``tangent`` is overwritten.

    A float32 einsum/bmm here accumulates over V with errors up to 1e-3 (measured on SmolLM2
    against float64); the summation kernel stays near 3e-6."""
    weights, total = _readout_slope(probs, index, quantity)
    return (weights * tangent.gather(-1, index)).sum(-1) - total[..., 0] * tangent.mul_(probs).sum(-1)


def check_quantity(quantity) -> None:
    """Raise a ValueError unless ``quantity`` is one of :data:`QUANTITIES`."""
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")


def context_length(model: nn.Module) -> Optional[int]:
    """The model's context length from its config (None where the config does not say)."""
    model = as_model(model)
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    return _first_attr(config, ("max_position_embeddings", "n_positions", "n_ctx")) if config is not None else None


# ---------------------------------------------------------------------------
# 3. The collector
# ---------------------------------------------------------------------------

@dataclass
class Trace:
    """Residual stream of one sequence at its predicting positions.

    Attributes:
        input_ids: (1, L); prompt_len: answer tokens are ``input_ids[0, prompt_len:]``.
        targets: (T,) token predicted at each position, ``T = L - prompt_len``.
        positions: (T,) the predicting positions, ``prompt_len - 1 + arange(T)``.
        hidden: (n+1, T, d) ``hidden[0]`` the embedding output, ``hidden[L]`` the output of block L,
            ``hidden[n]`` the input of the final norm.
        model_probs: (T,) the model's own probability of each target.
        mid: (n, T, d) the residual between attention and MLP (``sublayer=True``), or None.
        heads, neurons: (n, T, H * head_dim), (n, T, d_ff): the inputs of each block's attention
            output projection and MLP down projection (:func:`collect_components`), or None.
        patterns: (n, T, H, S) every head's attention row at the predicting positions (the model's
            own, after masks and soft-capping); values: (n, S, H_kv, head_dim) the value vectors
            (head h reads key/value head ``h // (H / H_kv)``); with ``sources=True``, else None.
        model_fingerprint: :func:`model_fingerprint` of the model that made it (None: built by hand).
    """
    input_ids: torch.Tensor
    prompt_len: int
    targets: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    model_probs: torch.Tensor
    mid: Optional[torch.Tensor] = None
    heads: Optional[torch.Tensor] = None
    neurons: Optional[torch.Tensor] = None
    patterns: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    model_fingerprint: Optional[torch.Tensor] = None

    @property
    def n_layers(self) -> int:
        return self.hidden.shape[0] - 1

    def tokens(self, tokenizer) -> list[str]:
        """The target tokens as text."""
        return [tokenizer.decode([t]) for t in self.targets.tolist()]


def precision(dtype: torch.dtype) -> torch.dtype:
    """Working precision of results: float64 for a float64 model, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def hidden_arg(args, kwargs):
    """The hidden state a block's forward pre-hook (``with_kwargs=True``) receives."""
    return args[0] if args else kwargs["hidden_states"]


def first_output(output):
    """The hidden state in a block's output (blocks return a tensor or a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def replace_first(output, tensor):
    """A block's output with its hidden state replaced by ``tensor``."""
    return (tensor,) + tuple(output[1:]) if isinstance(output, (tuple, list)) else tensor


def check_sequence(model, input_ids, prompt_len: Optional[int]) -> torch.Tensor:
    """Validate one sequence for the collector (``prompt_len=None``: no answer part); returns it as (1, L) long."""
    model = as_model(model)
    check_model(model)
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, L), got {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None)  # None: a custom model, not checked here
    if vocab and input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab:
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab)].unique()[:5].tolist()
        raise ValueError(f"token ids must lie in 0..{vocab - 1} (the model's vocabulary), got {bad}")
    length = input_ids.shape[1]
    if prompt_len is not None and (isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer))
                                   or not 1 <= prompt_len <= length - 1):
        raise ValueError(f"prompt_len must be in 1..{length - 1} (sequence length {length}), an "
                         f"integer, got {prompt_len!r}")
    context = context_length(model)
    if context is not None and length > context:
        raise ValueError(f"sequence of {length} tokens is longer than the model's context of {context}")
    return input_ids


def logits_at_end(model, keep: int, **inputs) -> torch.Tensor:
    """(B, keep, V) logits at the last ``keep`` columns, via ``logits_to_keep`` where the forward takes
    it (at V = 262144, 16 x 60 tokens of logits are 1 GB)."""
    model = as_model(model)
    import inspect
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(**inputs, use_cache=False, logits_to_keep=keep).logits
    return model(**inputs, use_cache=False).logits[:, -keep:]


def stream_hooks(adapter: Adapter, keep: Callable[[int, torch.Tensor], None],
                 keep_mid: Optional[Callable[[int, torch.Tensor], None]] = None) -> list:
    """Hooks handing the residual stream (B, L, d) to ``keep(index, tensor)``: index 0 the input of
    block 1, L the output of block L, n the input of the final norm; ``keep_mid(layer, tensor)`` the
    residual between attention and MLP of block ``layer + 1``."""
    n = adapter.n_layers
    hooks = [adapter.blocks[0].register_forward_pre_hook(
        lambda mod, args, kwargs: keep(0, hidden_arg(args, kwargs)), with_kwargs=True)]
    for layer, block in enumerate(adapter.blocks[:-1], start=1):
        hooks.append(block.register_forward_hook(
            lambda mod, args, out, layer=layer: keep(layer, first_output(out))))
    hooks.append(adapter.norm.register_forward_pre_hook(lambda mod, args: keep(n, args[0])))
    if keep_mid is not None:
        hooks += _mid_hooks(adapter, keep_mid)
    return hooks


@torch.no_grad()
def collect(model, input_ids: torch.Tensor, prompt_len: int, *, sublayer: bool = False) -> Trace:
    """One forward pass; record the residual stream at every block boundary (``hidden[n]`` is the
    final norm's *input*: Hugging Face's last ``hidden_states`` entry is already normalised).

    Args:
        input_ids: (1, L) or (L,); prompt_len: first answer position, in ``1..L-1``.
        sublayer: also record the residual between attention and MLP of each block.
    """
    model = as_model(model)
    input_ids = check_sequence(model, input_ids, prompt_len)
    length = input_ids.shape[1]
    adapter = get_adapter(model)
    n = adapter.n_layers
    device = next(model.parameters()).device
    positions = torch.arange(prompt_len - 1, length - 1)
    stream: list[Optional[torch.Tensor]] = [None] * (n + 1)
    mids: list[Optional[torch.Tensor]] = [None] * n

    def keep(store, index, tensor):
        store[index] = tensor[0, positions.to(tensor.device)].detach().to(precision(tensor.dtype)).cpu()

    hooks = stream_hooks(adapter, lambda index, tensor: keep(stream, index, tensor),
                          (lambda layer, tensor: keep(mids, layer, tensor)) if sublayer else None)
    try:
        # positions are the last T + 1 columns but the very last: the head runs on T + 1 rows
        logits = logits_at_end(model, len(positions) + 1, input_ids=input_ids.to(device))[0, :-1]
    finally:
        for hook in hooks:
            hook.remove()
    hidden = torch.stack(stream)  # (n+1, T, d)
    if not torch.isfinite(hidden).all():
        raise ValueError("the hidden states contain NaN or inf; check the model's dtype and weights")
    targets = input_ids[0, prompt_len:].cpu()
    model_probs = torch.softmax(logits.to(precision(logits.dtype)), -1).gather(
        -1, targets[:, None].to(logits.device))[:, 0].cpu()
    return Trace(input_ids.cpu(), prompt_len, targets, positions, hidden, model_probs,
                 torch.stack(mids) if sublayer else None, model_fingerprint=model_fingerprint(model))


def _mid_hooks(adapter: Adapter, keep: Callable[[int, torch.Tensor], None]) -> list:
    """Hooks recording the residual between attention and MLP of every block."""
    hooks = []
    for layer, block in enumerate(adapter.blocks):
        if getattr(block, "use_parallel_residual", False):
            # GPT-NeoX parallel block: h + attn(ln1(h)) + mlp(ln2(h)); the attention half-way
            # point is block input + attention output, built from the block's parts.
            inputs = {}
            hooks.append(block.register_forward_pre_hook(
                lambda mod, args, kwargs, layer=layer: inputs.__setitem__(layer, hidden_arg(args, kwargs)),
                with_kwargs=True))
            hooks.append(block.attention.register_forward_hook(
                lambda mod, args, out, layer=layer: keep(layer, inputs[layer] + first_output(out))))
            continue
        mlp_norm = sublayer_norm(block, "mlp")
        hooks.append(mlp_norm.register_forward_pre_hook(lambda mod, args, layer=layer: keep(layer, args[0])))
    return hooks


# Components of a sublayer: the attention output projection (its input holds the H heads'
# outputs side by side) and the MLP down projection (its input holds one activation per neuron).
_ATTENTIONS = ("self_attn", "attn", "attention")
_MLPS = ("mlp", "feed_forward")
_OUT_PROJS = ("o_proj", "c_proj", "dense", "out_proj")
_DOWN_PROJS = ("down_proj", "c_proj", "dense_4h_to_h", "fc2")


def sublayer_module(block: nn.Module, sublayer: Optional[str]) -> nn.Module:
    """A block's attention (``"attn"``) or MLP (``"mlp"``) module; the block itself for None."""
    if sublayer is None:
        return block
    names = _ATTENTIONS if sublayer == "attn" else _MLPS
    module = _first_attr(block, names)
    if module is None:
        raise ValueError(f"cannot find the {sublayer} module of block {type(block).__name__} (looked for {names})")
    return module


def sublayer_norm(block: nn.Module, sublayer: str) -> nn.Module:
    """The norm a block's ``"attn"`` (its input norm) or ``"mlp"`` (its pre-MLP norm) reads through."""
    names, what = (_INPUT_NORMS, "input") if sublayer == "attn" else (_MLP_NORMS, "pre-MLP")
    norm = _first_attr(block, names)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"cannot find the {what} norm of block {type(block).__name__} (looked for {names})")
    return norm


def sublayer_projection(block: nn.Module, sublayer: str) -> tuple[nn.Module, Optional[nn.Module]]:
    """The output projection of a block's ``"attn"`` or ``"mlp"`` sublayer, and the norm that acts
    on the sublayer's output before the residual add (Gemma 2/3), or None."""
    names = _OUT_PROJS if sublayer == "attn" else _DOWN_PROJS
    proj = _first_attr(sublayer_module(block, sublayer), names)
    if proj is None or not isinstance(getattr(proj, "weight", None), torch.Tensor):
        raise ValueError(f"cannot find the {sublayer} output projection of block "
                         f"{type(block).__name__} (looked for {names})")
    if sublayer == "attn":  # Llama's post_attention_layernorm is its pre-MLP norm; Gemma's is not
        post = block.post_attention_layernorm if hasattr(block, "pre_feedforward_layernorm") else None
    else:
        post = getattr(block, "post_feedforward_layernorm", None)
    return proj, post


def projection_weight(proj: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(W (d, P), bias (d,) or None)`` with ``proj(x) = W x + bias``; GPT-2's Conv1D stores W^T."""
    weight = proj.weight.detach()
    if not isinstance(proj, nn.Linear) and type(proj).__name__ == "Conv1D":
        weight = weight.T
    bias = getattr(proj, "bias", None)
    return weight, (bias.detach() if isinstance(bias, torch.Tensor) else None)


def head_counts(model) -> tuple[int, int]:
    """``(H, H_kv)``: attention heads and key/value heads per block, from the model's config."""
    model = as_model(model)
    config = getattr(model.config, "text_config", None) or model.config
    heads = _first_attr(config, ("num_attention_heads", "n_head"))
    return int(heads), int(_first_attr(config, ("num_key_value_heads",)) or heads)


def _value_reader(attention: nn.Module, heads: int, kv_heads: int) -> tuple[nn.Module, Callable]:
    """The module whose output holds a block's value vectors, and how to cut them out of it:
    ``cut(output (..., width)) -> (..., H_kv, head_dim)``."""
    if isinstance(getattr(attention, "v_proj", None), nn.Module):  # Llama, Qwen, Gemma, Mistral, OLMo
        return attention.v_proj, lambda out: out.unflatten(-1, (kv_heads, -1))
    if isinstance(getattr(attention, "qkv_proj", None), nn.Module):  # Phi-3: queries, keys, values
        return attention.qkv_proj, lambda out: out[..., out.shape[-1] * (heads + kv_heads)
                                                    // (heads + 2 * kv_heads):].unflatten(-1, (kv_heads, -1))
    if isinstance(getattr(attention, "c_attn", None), nn.Module):  # GPT-2: queries, keys, values
        return attention.c_attn, lambda out: out[..., 2 * out.shape[-1] // 3:].unflatten(-1, (heads, -1))
    if isinstance(getattr(attention, "query_key_value", None), nn.Module):  # NeoX: (q, k, v) per head
        return attention.query_key_value, lambda out: out.unflatten(-1, (heads, 3, -1))[..., 2, :]
    raise ValueError(f"cannot find the value projection of {type(attention).__name__} (looked for "
                     "v_proj, qkv_proj, c_attn, query_key_value): sources=True is not supported here")


@contextmanager
def eager_attention(model):
    """Run the model's attention in its eager implementation, which returns the probabilities."""
    model = as_model(model)
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if before in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def head_values(trace: Trace, layer: int) -> torch.Tensor:
    """(S, H, head_dim) float64: the value vectors each head of block ``layer + 1`` reads (GQA:
    head h reads key/value head ``h // (H / H_kv)``, as the model's ``repeat_kv``)."""
    values, heads = trace.values[layer].double(), trace.patterns.shape[2]  # (S, H_kv, hd)
    return values[:, torch.arange(heads) // (heads // values.shape[1])]


def _check_patterns(trace: Trace) -> None:
    """The heads' outputs rebuilt from patterns and values, ``sum_s A_h(t, s) v_h(s)``, must match
    the recorded ones (``trace.heads``): else the values were cut out of the wrong place."""
    for layer in range(trace.n_layers):
        rebuilt = torch.einsum("ths,shd->thd", trace.patterns[layer].double(),
                               head_values(trace, layer)).flatten(1)
        recorded = trace.heads[layer].double()  # (T, H * hd)
        gap = float((rebuilt - recorded).norm() / recorded.norm().clamp_min(1e-12))
        if gap > 1e-2:
            raise ValueError(f"block {layer + 1}: the heads' outputs rebuilt from the attention "
                             f"patterns and value vectors differ from the recorded ones (relative gap "
                             f"{gap:.1e}); this attention does not read its values as sources=True "
                             "assumes (an unsupported architecture?)")


@torch.no_grad()
def collect_components(model, input_ids: torch.Tensor, prompt_len: int, *, sources: bool = False) -> Trace:
    """:func:`collect` with ``sublayer=True``, plus every head's and every neuron's activation.

    Pre-hooks on each block's attention output projection and MLP down projection record their
    inputs at the predicting positions: ``heads`` (n, T, H * head_dim), ``neurons`` (n, T, d_ff).
    With ``sources=True`` the pass runs eager attention (switched back afterwards) and also records
    ``patterns`` (n, T, H, S) and ``values`` (n, S, H_kv, head_dim); they must rebuild the recorded
    head outputs, ``z_h(t) = sum_s A_h(t, s) v_h(s)``, or a ValueError says the architecture is not
    supported."""
    model = as_model(model)
    input_ids = check_sequence(model, input_ids, prompt_len)
    adapter = get_adapter(model)
    n = adapter.n_layers
    positions = torch.arange(prompt_len - 1, input_ids.shape[1] - 1)
    heads: list[Optional[torch.Tensor]] = [None] * n
    neurons: list[Optional[torch.Tensor]] = [None] * n
    patterns: list[Optional[torch.Tensor]] = [None] * n
    values: list[Optional[torch.Tensor]] = [None] * n

    def keeper(store, layer):
        def hook(module, args):
            x = args[0]
            store[layer] = x[0, positions.to(x.device)].detach().to(precision(x.dtype)).cpu()
        return hook

    def pattern_keeper(layer):
        def hook(module, args, output):
            probs = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
            if not isinstance(probs, torch.Tensor):
                raise ValueError(f"the attention of block {layer + 1} ({type(module).__name__}) "
                                 "returned no attention probabilities in eager mode: sources=True "
                                 "is not supported here")
            rows = probs[0][:, positions.to(probs.device)].transpose(0, 1)  # (T, H, S)
            patterns[layer] = rows.detach().to(precision(probs.dtype)).cpu()
        return hook

    def value_keeper(layer, cut):
        def hook(module, args, output):
            values[layer] = cut(output[0]).detach().to(precision(output.dtype)).cpu()  # (S, H_kv, hd)
        return hook

    hooks = []
    try:
        for layer, block in enumerate(adapter.blocks):
            for sublayer, store in (("attn", heads), ("mlp", neurons)):
                hooks.append(sublayer_projection(block, sublayer)[0].register_forward_pre_hook(keeper(store, layer)))
            if sources:
                attention = sublayer_module(block, "attn")
                module, cut = _value_reader(attention, *head_counts(model))
                hooks.append(attention.register_forward_hook(pattern_keeper(layer)))
                hooks.append(module.register_forward_hook(value_keeper(layer, cut)))
        with eager_attention(model) if sources else nullcontext():
            trace = collect(model, input_ids, prompt_len, sublayer=True)
    finally:
        for hook in hooks:
            hook.remove()
    trace.heads, trace.neurons = torch.stack(heads), torch.stack(neurons)
    if sources:
        trace.patterns, trace.values = torch.stack(patterns), torch.stack(values)
        _check_patterns(trace)
    return trace


# ---------------------------------------------------------------------------
# 4. The head-once readout
# ---------------------------------------------------------------------------

class Readout:
    """``f(h) = softmax(scale * softcap(head(norm(h))))[y]``: the model's last step, on one vector.

    No attention, no MLP: any number of points stack into one batch, processed in chunks whose
    (rows, V) logits stay within ``memory_budget`` bytes. ``norm``, ``head``: overrides for
    unrecognised architectures."""

    def __init__(self, model, *, norm: Optional[nn.Module] = None, head: Optional[nn.Module] = None,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET):
        model = as_model(model)
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, np.integer)) or memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive integer number of bytes, got {memory_budget!r}")
        self.adapter = get_adapter(model, norm=norm, head=head)
        self.model_fingerprint = model_fingerprint(model)
        self.memory_budget = int(memory_budget)
        weight = self.adapter.head.weight  # on "meta" when accelerate offloaded it
        self.vocab_size, self.hidden_size = weight.shape
        self.dtype = weight.dtype
        # the head's and the norm's devices (device_map="auto" may split and offload them)
        self.device = _execution_device(self.adapter.head, torch.device("cpu"))
        self.norm_device = _execution_device(self.adapter.norm, self.device)
        self.norm_kind, self.norm_eps = _norm_form(self.adapter.norm, self.adapter.head)
        self._form_checked = False
        self._norm_gain: Optional[torch.Tensor] = None

    def chunk_rows(self, extra_copies: int = 3) -> int:
        """Rows per chunk: logits plus ``extra_copies`` temporaries of the same size fit the budget.

        On a CPU at most ``max(64, CPU_CHUNK_BYTES // (4 V))`` rows as well."""
        per_row = self.vocab_size * 4 * (1 + extra_copies)
        rows = max(1, self.memory_budget // per_row)
        if self.device.type == "cpu":  # logits within the cache: see CPU_CHUNK_BYTES
            rows = min(rows, max(64, CPU_CHUNK_BYTES // (self.vocab_size * 4)))
        return rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, d) residual-stream points -> (rows, V) logits exactly as the model computes.

        float32 (float64 for a float64 model)."""
        # with device_map="auto" the final norm and the head may sit on different devices
        normed = self.adapter.norm(hidden.to(self.norm_device, self.dtype))
        return self._finish(self.adapter.head(normed.to(self.device)))

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        """Head output -> logits: working precision, logit scale, soft-cap (elementwise)."""
        logits = logits.to(precision(self.dtype))
        if self.adapter.logit_scale != 1.0:
            logits = logits * self.adapter.logit_scale
        if self.adapter.softcap:
            logits = torch.tanh(logits / self.adapter.softcap) * self.adapter.softcap
        return logits

    def _index(self, targets, foils, shape) -> torch.Tensor:
        """(points, K) the target (K = 1) and the foil (K = 2) of every point of ``shape``."""
        columns = [targets] if foils is None else [targets, foils]
        return torch.stack([torch.broadcast_to(torch.as_tensor(column), shape).reshape(-1)
                            for column in columns], -1).to(self.device)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, foils: Optional[torch.Tensor] = None,
                 *, quantity: str = "prob") -> torch.Tensor:
        """(...) f at every point of ``hidden`` (..., d): ``targets`` (and ``foils``) are token ids
        broadcastable to ``hidden.shape[:-1]``; ``quantity`` ``"prob"`` (p(y), or p(y) - p(foil)) or
        ``"logprob"`` (log p(y) in nats, or the logit difference z_y - z_foil). Working precision, on the
        input's device.
        """
        check_quantity(quantity)
        shape = hidden.shape[:-1]
        rows = hidden.reshape(-1, hidden.shape[-1])
        index = self._index(targets, foils, shape)  # (rows, K)
        out = torch.empty(rows.shape[0], dtype=precision(self.dtype), device=self.device)
        step = self.chunk_rows()
        for start in range(0, rows.shape[0], step):
            # log_softmax + gather: measured faster than gather - logsumexp on a CPU (bench.py)
            out[start:start + step] = _readout_value(self.logits(rows[start:start + step]),
                                                     index[start:start + step], quantity)
        return out.reshape(shape).to(hidden.device)

    @torch.no_grad()
    def directional(self, hidden: torch.Tensor, direction: torch.Tensor, targets: torch.Tensor,
                    foils: Optional[torch.Tensor] = None, *, quantity: str = "prob") -> torch.Tensor:
        """(...) ``<direction, grad f(hidden)>`` by forward-mode differentiation (no backward pass): the
        logits' tangent ``dz`` along ``direction`` against ``df/dz`` (:func:`_readout_slope`). Arguments
        as :meth:`__call__`, ``direction`` (..., d).
        """
        check_quantity(quantity)
        shape = hidden.shape[:-1]
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self.norm_device, self.dtype)
        dirs = torch.broadcast_to(direction, hidden.shape).reshape(rows.shape).to(rows)
        index = self._index(targets, foils, shape)  # (rows, K)
        out = torch.empty(rows.shape[0], dtype=precision(self.dtype), device=self.device)
        step = max(1, self.chunk_rows() // 2)  # logits and their tangent
        for start in range(0, rows.shape[0], step):
            sl = slice(start, start + step)
            logits, tangent = self._logits_and_tangent(rows[sl], dirs[sl])
            probs = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # softmax in place: one
            probs.div_(probs.sum(-1, keepdim=True))                    # (rows, V) buffer fewer
            out[sl] = _readout_tangent(probs, tangent, index[sl], quantity)
        return out.reshape(shape).to(hidden.device)

    def _logits_and_tangent(self, rows: torch.Tensor, dirs: torch.Tensor):
        """(rows, V) logits and their tangent along ``dirs``: the norm differentiated on its own (d-wide),
        then primal and tangent through one head product (``torch.func.jvp`` over the whole readout
        copies the head weight and runs four products: ~2x slower in bench.py).
        """
        head = self.adapter.head
        if not isinstance(head, nn.Linear):
            return torch.func.jvp(self.logits, (rows,), (dirs,))
        if getattr(self.adapter.norm, "_hf_hook", None) is None and rows.dtype != torch.float16:
            normed, normed_tangent = torch.func.jvp(self.adapter.norm, (rows,), (dirs,))
        else:  # accelerate's hooks do not run under torch.func; its float16 LayerNorm tangent overflows (rstd^3)
            with torch.enable_grad():
                normed, normed_tangent = torch.autograd.functional.jvp(self.adapter.norm, rows, dirs)
        # through the head module, so that accelerate's hooks bring offloaded weights in; a zero
        # row gives its bias, which the tangent must not carry
        extra = [torch.zeros_like(normed[:1])] if head.bias is not None else []
        both = head(torch.cat([normed, normed_tangent] + extra).to(self.device))  # (2 rows (+1), V)
        head_out, tangent = both[:len(rows)], both[len(rows):2 * len(rows)]
        if head.bias is not None:
            tangent = tangent - both[-1]
        logits = self._finish(head_out)
        return logits, self._finish_tangent(tangent, logits)

    def _finish_tangent(self, tangent: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Tangent of the head output -> tangent of the logits (the derivative of ``_finish``)."""
        tangent = tangent.to(logits.dtype)
        if self.adapter.logit_scale != 1.0:
            tangent = tangent * self.adapter.logit_scale
        if self.adapter.softcap:  # d/du [c tanh(u / c)] = 1 - tanh(u / c)^2
            tangent = tangent * (1 - (logits / self.adapter.softcap) ** 2)
        return tangent

    # -- along straight segments: ``norm(h) = s(h) A h + b`` (RMSNorm, Gemma's 1 + w, LayerNorm),
    # so the head output is ``s(h) Z(h) + c`` with ``Z = W A h`` linear. At ``a + alpha (b - a)`` it
    # is ``s(alpha) ((1 - alpha) Z(a) + alpha Z(b)) + c``: one (d x V) product per path node, then
    # V-wide elementwise work per point; the slope from ``Z(b) - Z(a)`` and ``ds/dalpha``.

    def _scale(self, points: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (...) the norm's per-point scale ``s(h) = rsqrt(mean(h'^2) + eps)``.

        ``h'`` is ``h`` (RMSNorm) or ``h`` minus its mean (LayerNorm)."""
        if self.norm_kind == "layer":
            points = points - points.mean(-1, keepdim=True)
        return torch.rsqrt(points.pow(2).mean(-1) + self.norm_eps)

    def _scale_slope(self, points: torch.Tensor, direction: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(..., d), (..., d), (...) -> (...) derivative of ``s`` along ``direction``: -s^3 mean(h' d')."""
        if self.norm_kind == "layer":
            points = points - points.mean(-1, keepdim=True)
            direction = direction - direction.mean(-1, keepdim=True)
        return -scale.pow(3) * (points * direction).mean(-1)

    def _node_products(self, rows: torch.Tensor, index: torch.Tensor, offset: Optional[torch.Tensor],
                       quantity: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Path nodes ``rows`` (r, d) -> ``(Z (r, V), f (r,))``: ``Z = (head(norm(h)) - c) / s(h)`` and f
        read from the model's own logits; ``index`` (r, K) targets (and foils), ``offset`` ``c`` or None.
        """
        head_out = self.adapter.head(self.adapter.norm(rows.to(self.norm_device, self.dtype)).to(self.device))
        f_nodes = torch.cat([_readout_value(self._finish(part), part_index, quantity)  # 16 rows
                             for part, part_index in zip(head_out.split(16), index.split(16))])  # of temporaries
        out = head_out.to(precision(self.dtype))
        if offset is not None:
            out = out.sub_(offset)
        return out.mul_((1.0 / self._scale(rows.to(self.device, out.dtype)))[:, None]), f_nodes

    def _head_offset(self) -> Optional[torch.Tensor]:
        """(V,) the constant ``c = W b + bias`` of the head output, or None when it is zero."""
        head, bias = self.adapter.head, getattr(self.adapter.norm, "bias", None)
        if bias is None and head.bias is None:
            return None
        if bias is None:  # the head module on a zero row: its bias, offloaded or not
            return head(torch.zeros(1, self.hidden_size, device=self.device, dtype=self.dtype))[0].to(
                precision(self.dtype))
        # the norm's bias: on meta when offloaded; the module's own forward brings it in
        bias = self.adapter.norm(torch.zeros(1, self.hidden_size, device=self.norm_device,
                                             dtype=self.dtype))[0]
        return head(bias[None].to(self.device))[0].to(precision(self.dtype))

    def _segment(self, z_start, z_end, start, end, alphas, index, offset, slope: bool, quantity: str) -> torch.Tensor:
        """(b, m') f (or ``df/dalpha``) at ``alphas`` along the segments ``start -> end`` (b, d) of a block
        of tokens, from their node products ``z_start``, ``z_end`` (b, V).
        """
        delta = end - start  # (b, d)
        points = start[:, None] + alphas[None, :, None] * delta[:, None]  # (b, m', d)
        scale = self._scale(points)  # (b, m')
        mix = torch.stack([1 - alphas, alphas], -1)  # (m', 2)
        pair = torch.stack([z_start, z_end], 1)  # (b, 2, V)
        head_out = torch.bmm(scale[..., None] * mix, pair)  # (b, m', V)
        if offset is not None:
            head_out += offset
        logits = self._finish(head_out)
        index = index[:, None].expand(-1, len(alphas), -1)  # (b, m', K)
        if not slope:
            return _readout_value(logits, index, quantity)
        scale_slope = self._scale_slope(points, delta[:, None].expand_as(points), scale)  # (b, m')
        ends = torch.tensor([-1.0, 1.0], dtype=mix.dtype, device=mix.device)
        tangent = torch.bmm(scale_slope[..., None] * mix + scale[..., None] * ends, pair)  # (b, m', V)
        tangent = self._finish_tangent(tangent, logits)
        probs = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # softmax in place
        probs.div_(probs.sum(-1, keepdim=True))
        return _readout_tangent(probs, tangent, index, quantity)

    def _gain(self) -> torch.Tensor:
        """(d,) the final norm's elementwise gain ``G`` in ``norm(h) = s(h) G * P h + b``.

        LayerNorm: its weight. RMSNorm (any gain convention: ``w`` or Gemma's ``1 + w``): read off
        the norm itself, ``G = (norm(1) - norm(0)) / s(1)`` with ``1`` the all-ones vector."""
        if self._norm_gain is None:
            work = precision(self.dtype)
            weight = getattr(self.adapter.norm, "weight", None)
            if self.norm_kind == "layer":
                gain = (weight.detach() if weight is not None
                        else torch.ones(self.hidden_size, device=self.device))
            else:
                probe = torch.stack([torch.ones(self.hidden_size), torch.zeros(self.hidden_size)])
                normed = self.adapter.norm(probe.to(self.norm_device, self.dtype)).to(work)
                gain = (normed[0] - normed[1]) / self._scale(probe[:1].to(work))[0]
            self._norm_gain = gain.to(self.device, work)
        return self._norm_gain

    def _segment_gradient(self, z_start, z_end, start, end, alphas, weights, index, offset, quantity):
        """``sum_s w_s grad f(start + alpha_s (end - start))`` for a block of tokens, in closed form.

        With head output ``s(h) Z(h) + c``, ``p = softmax(z)`` and ``q = (dz/du) df/dz``:
        ``grad f = J_norm^T W^T q`` and, for ``norm(h) = s(h) G * P h + b``,
        ``J_norm^T v = P (s G * v - s^3 <G * P h, v> P h / d)``. As ``<G * P h, W^T q> = <Z(h), q>``,
        the weighted sum needs one (V x d) product per segment, left to :meth:`_finish_gradients`,
        which batches many segments into one. ``weights="observed"`` (prediction-aware): ``alphas`` are
        the midpoints of m uniform steps, and step s gets ``(f(beta_s) - f(beta_(s-1))) / <b - a, grad
        f(alpha_s)>`` so that ``<b - a, sum_s w_s grad f> = f(b) - f(a)`` exactly (a step whose slope is
        below 1e-12 keeps 1/m).

        Returns:
            ``(summed (b, V), correction (b, d))``: ``sum_s w_s s_s q_s`` and the norm's second term.
        """
        delta = end - start
        points = start[:, None] + alphas[None, :, None] * delta[:, None]  # (b, m', d)
        scale = self._scale(points)  # (b, m')
        mix = torch.stack([1 - alphas, alphas], -1)  # (m', 2)
        head_out = torch.bmm(scale[..., None] * mix, torch.stack([z_start, z_end], 1))  # (b, m', V)
        if offset is not None:
            head_out += offset
        logits = self._finish(head_out)  # the same tensor when there is no scale or soft-cap
        index = index[:, None].expand(-1, len(alphas), -1)  # (b, m', K)
        probs = torch.softmax(logits, -1)
        picked, total = _readout_slope(probs, index, quantity)
        chain = probs.mul_(-total).scatter_add_(-1, index, picked)  # df/dz, in place
        chain = self._finish_tangent(chain, logits)  # (b, m', V) q: df/d(head output)
        dots = torch.linalg.vecdot(chain, head_out)  # (b, m') <s Z_s + c, q_s>, no (b, m', V) temporary
        if offset is not None:
            dots -= chain @ offset
        dots /= scale  # <Z_s, q_s>
        if isinstance(weights, str):  # "observed": the step's change over its midpoint slope
            m = len(alphas)
            bounds = torch.arange(m + 1, dtype=alphas.dtype, device=alphas.device) / m
            change = self._segment(z_start, z_end, start, end, bounds, index[:, 0], offset, False,
                                   quantity).diff(dim=-1)
            slope = (self._scale_slope(points, delta[:, None].expand_as(points), scale) * dots
                     + scale * torch.linalg.vecdot(chain, (z_end - z_start)[:, None]))  # (b, m) df/dalpha
            steady = slope.abs() > 1e-12
            weights = torch.where(steady, change / torch.where(steady, slope, 1.0), 1.0 / m)
        summed = torch.bmm((weights * scale)[:, None, :], chain)[:, 0]  # (b, V), a sum over m' only
        centred = points - points.mean(-1, keepdim=True) if self.norm_kind == "layer" else points
        coef = weights * scale.pow(3) * dots / points.shape[-1]  # (b, m')
        return summed, (coef[..., None] * centred).sum(1)

    def _finish_gradients(self, pending: list, out: torch.Tensor) -> None:
        """Write ``P (G * W^T summed - correction)`` into ``out[j, tokens]`` for every pending
        ``(j, tokens, summed, correction)``, with one head product for all of them."""
        if not pending:
            return
        weight = self.adapter.head.weight
        summed = torch.cat([item[2] for item in pending])
        # entries below the smallest normal float (p ~ 1e-40 of most tokens) add nothing a float can hold,
        # but subnormal operands slow the product ~30x on x86 CPUs (bench item 15): flush them to 0
        summed = summed.masked_fill_(summed.abs() < torch.finfo(summed.dtype).tiny, 0.0)
        back = (summed.to(weight.device, weight.dtype) @ weight).to(out)  # (rows, d)
        grad = self._gain() * back - torch.cat([item[3] for item in pending]).to(out)
        if self.norm_kind == "layer":
            grad = grad - grad.mean(-1, keepdim=True)
        row = 0
        for j, tokens, part, _ in pending:
            out[j, tokens] = grad[row:row + len(part)]
            row += len(part)
        pending.clear()

    @torch.no_grad()
    def along_segments(self, nodes: torch.Tensor, targets: torch.Tensor, alphas: torch.Tensor,
                       *, slope: bool = False, weights: Optional[torch.Tensor] = None,
                       foils: Optional[torch.Tensor] = None,
                       quantity: str = "prob") -> tuple[torch.Tensor, torch.Tensor]:
        """f, or its slope, at ``h_j + alpha (h_(j+1) - h_j)`` for every segment j and alpha.

        With a final norm of the form ``s(h) A h + b`` and a linear head this costs one head product per
        path node (whose f comes back as the lens) plus elementwise work per point; otherwise every
        point is read out on its own. The first call checks the two against each other and falls back,
        with a warning, if they disagree.

        Args:
            nodes: (K+1, T, d) path nodes, baseline first; targets: (T,); alphas: (m',).
            slope: return ``df/dalpha = <h_(j+1) - h_j, grad f>`` instead of f.
            weights: (m',) quadrature weights: return ``sum_s w_s grad f`` (K, T, d) instead
                (:meth:`_segment_gradient`); ``"observed"``: the prediction-aware weights.
            foils, quantity: as :meth:`__call__`.

        Returns:
            ``(values (K, T, m') or (K, T, d), lens (K+1, T))``, working precision.
        """
        check_quantity(quantity)
        K, T, d = nodes.shape[0] - 1, nodes.shape[1], nodes.shape[2]
        work = precision(self.dtype)
        alphas = torch.as_tensor(alphas).to(self.device, work)
        if self.norm_kind is not None and not self._form_checked and len(alphas) and K:
            self._check_form(nodes, targets, alphas, slope or weights is not None, foils, quantity)
        if weights is not None:
            if self.norm_kind is None:
                raise ValueError(f"gradient sums need a final norm of the form s(h) A h + b (RMSNorm, "
                                 f"LayerNorm) and a linear head; got {type(self.adapter.norm).__name__}"
                                 f" and {type(self.adapter.head).__name__}")
            weights = weights if isinstance(weights, str) else torch.as_tensor(weights).to(self.device, work)
            if isinstance(weights, str) and weights != "observed":
                raise ValueError(f"weights must be a tensor or 'observed', got {weights!r}")
            if not isinstance(weights, str) and weights.shape != alphas.shape:
                raise ValueError(f"weights must have the shape of alphas {tuple(alphas.shape)}, "
                                 f"got {tuple(weights.shape)}")
        if self.norm_kind is None or not len(alphas) or not K:
            starts, deltas = nodes[:-1], nodes[1:] - nodes[:-1]  # (K, T, d)
            points = starts[:, :, None] + alphas.to(nodes)[None, None, :, None] * deltas[:, :, None]
            lens = self(nodes, targets[None], None if foils is None else foils[None], quantity=quantity)
            per_point = (targets[None, :, None], None if foils is None else foils[None, :, None])
            if slope:
                return self.directional(points, deltas[:, :, None].expand_as(points), *per_point,
                                        quantity=quantity), lens
            return self(points, *per_point, quantity=quantity), lens
        out = torch.empty(K, T, len(alphas) if weights is None else d, dtype=work, device=self.device)
        lens = torch.empty(K + 1, T, dtype=work, device=self.device)
        half = max(1, self.chunk_rows() // 2)  # rows of node products, and of grid points
        # The gradient sums hold about twice the (rows, V) temporaries of f: half the grid rows
        # keeps them in a CPU's cache, and twice the rows per head product (node products and
        # gradient sums) runs the product nearer its peak (bench.py item 11: 2.7x -> 1.6x the
        # time of f on a 32 MiB L3, with the vecdot and the in-place chain of _segment_gradient).
        grid, rows = (half, half) if weights is None else (max(1, half // 2), 2 * half)
        block = max(1, min(T, grid // len(alphas)))  # tokens per block: block * m' grid rows
        group = max(1, rows // block)  # path nodes per product: group * block rows
        index, offset = self._index(targets, foils, (T,)), self._head_offset()  # (T, K)
        pending, flush = [], max(64, rows)  # gradient sums waiting for their head product
        for t0 in range(0, T, block):
            tokens = slice(t0, t0 + block)
            ends = nodes[:, tokens].to(self.device, work)  # (K+1, b, d)
            products = []  # node products of this block, j -> (b, V); dropped once used
            for j in range(K):
                if j + 1 >= len(products):  # the next group of nodes, in one product
                    if products:  # keep the carried node, free the rest of the last group's buffer
                        products[-1] = products[-1].clone()
                    new = nodes[len(products):min(K + 1, j + 1 + group), tokens]  # (g, b, d)
                    b = new.shape[1]
                    z, f_nodes = self._node_products(new.reshape(-1, d), index[tokens].repeat(len(new), 1),
                                                     offset, quantity)
                    lens[len(products):len(products) + len(new), tokens] = f_nodes.reshape(len(new), b)
                    products += list(z.reshape(len(new), b, self.vocab_size).unbind(0))
                if weights is not None:
                    pending.append((j, tokens) + self._segment_gradient(
                        products[j], products[j + 1], ends[j], ends[j + 1], alphas, weights, index[tokens],
                        offset, quantity))
                    if sum(len(item[2]) for item in pending) >= flush:
                        self._finish_gradients(pending, out)
                else:
                    out[j, tokens] = self._segment(products[j], products[j + 1], ends[j], ends[j + 1],
                                                   alphas, index[tokens], offset, slope, quantity)
                products[j] = None
        self._finish_gradients(pending, out)
        return out.to(nodes.device), lens.to(nodes.device)

    def _check_form(self, nodes, targets, alphas, slope: bool, foils, quantity: str) -> None:
        """Compare the factorised path with the direct readout on the first segment, once."""
        self._form_checked = True
        few = slice(0, 2)
        sample = nodes[:2, few]
        kind, self.norm_kind = self.norm_kind, None
        spec = dict(slope=slope, foils=None if foils is None else foils[few], quantity=quantity)
        direct = torch.cat([t.flatten() for t in self.along_segments(sample, targets[few], alphas, **spec)])
        self.norm_kind = kind
        factorised = torch.cat([t.flatten() for t in self.along_segments(sample, targets[few], alphas, **spec)])
        low = torch.finfo(self.dtype).eps if self.dtype in (torch.bfloat16, torch.float16) else 0.0  # rounded direct
        tol = 1e-4 * (1.0 + float(direct.abs().max())) + 2 * low * float(direct.abs().max())
        if not torch.allclose(factorised, direct, atol=tol, rtol=0):
            warnings.warn(f"the final norm {type(self.adapter.norm).__name__} does not behave as "
                          f"s(h) A h + b ({self.norm_kind}); IG-Lens reads out every point on its own "
                          "(slower, same values)")
            self.norm_kind = None


# ---------------------------------------------------------------------------
# 5. The integrator and its estimators
# ---------------------------------------------------------------------------

# -- ranks without rounding: float32 scores differ by machine in their last bits, so every rank,
# arg-max, top-k and threshold crossing (here and in iglens_stats.py) uses tie_tolerance
RANK_ATOL = 1e-5  # in the score's own units (probability, logit, restoration ratio)
RANK_RTOL = 1e-4  # of the row's range max - min


def tie_tolerance(values) -> np.ndarray:
    """(..., 1) float64 tie tolerance of each row: ``RANK_ATOL + RANK_RTOL * (max - min)``.

    ``RANK_ATOL = 1e-5`` is above the worst float32 rounding of a probability read by the readout
    (7e-6); ``RANK_RTOL = 1e-4`` of the row's range covers scores whose rounding grows with their
    size (logits, restoration ratios). The range, not the magnitude, sets the scale, so adding a
    constant to a row leaves its ties unchanged; float64 runs are held to the same tolerance.
    """
    x = np.asarray(torch.as_tensor(values, dtype=torch.float64))
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"values must have at least one entry along the last axis, got shape {x.shape}")
    return RANK_ATOL + RANK_RTOL * np.ptp(x, axis=-1, keepdims=True)


def quadrature(estimator: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes in [0, 1] and weights (summing to 1) of a gradient estimator with ``steps`` points.

    Returns:
        ``(alphas (m',), weights (m',))`` float64.
    """
    m = steps
    s = torch.arange(m, dtype=torch.float64)
    shifts = {"riemann_left": 0.0, "riemann_right": 1.0, "riemann_mid": 0.5}
    if estimator in shifts:
        return (s + shifts[estimator]) / m, torch.full((m,), 1.0 / m, dtype=torch.float64)
    if estimator == "trapezoid":
        weights = torch.full((m + 1,), 1.0 / m, dtype=torch.float64)
        weights[[0, -1]] /= 2
        return torch.arange(m + 1, dtype=torch.float64) / m, weights
    if estimator == "gauss_legendre":
        nodes, weights = np.polynomial.legendre.leggauss(m)
        return torch.from_numpy((nodes + 1) / 2), torch.from_numpy(weights / 2)
    raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def check_steps(readout: Readout, steps: int, estimator: str, profile: bool) -> None:
    """Bound ``steps`` so that one token's grid on one segment fits the readout's memory budget.

    The grid of a segment (``m'`` points, each a (V,) row of logits and ~3 temporaries) is the
    smallest unit :meth:`Readout.along_segments` evaluates. The exact map without a profile
    reads out only the path nodes, so ``steps`` is not bounded there (:func:`components` reads
    its grid: it passes ``profile=True``)."""
    if estimator == "prediction_aware" and not profile:
        return
    grid = steps + 1 if estimator == "trapezoid" else steps
    most = max(2, readout.memory_budget // (readout.vocab_size * 4 * 4))
    if grid > most:
        limit = most - 1 if estimator == "trapezoid" else most
        raise ValueError(f"steps={steps} puts {grid} points on every segment, and one token's "
                         f"grid of V={readout.vocab_size} logits must fit memory_budget="
                         f"{readout.memory_budget} bytes: steps must lie in 1..{limit} for "
                         f"estimator={estimator!r}{' (grid read: profile=True, components)' * (estimator == 'prediction_aware')} (or "
                         "pass readout=Readout(model, memory_budget=...) with a larger budget)")


def _check_trace(readout: Readout, trace: Trace) -> None:
    """The trace must come from the readout's model: layer count, hidden size, vocabulary."""
    n = readout.adapter.n_layers
    if trace.hidden.dim() != 3 or trace.n_layers != n or trace.hidden.shape[-1] != readout.hidden_size:
        raise ValueError(f"the trace has hidden of shape {tuple(trace.hidden.shape)} but the model "
                         f"has {n} blocks and hidden size {readout.hidden_size}, so (n+1, T, d) = "
                         f"({n + 1}, T, {readout.hidden_size}): collect the trace with this model")
    targets = trace.targets
    if targets.numel() and not 0 <= int(targets.min()) <= int(targets.max()) < readout.vocab_size:
        raise ValueError(f"trace targets must lie in 0..{readout.vocab_size - 1} (the model's "
                         f"vocabulary), got {targets.tolist()}")


def _check_run(model, trace: Trace, readout, steps, estimator, quantity, foil, profile: bool):
    """The checks :func:`ig_lens` and :func:`components` share; returns ``(readout, foils)``."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    check_quantity(quantity)
    readout = readout or Readout(model)
    _check_trace(readout, trace)
    check_same_model(model, trace, readout)
    check_steps(readout, steps, estimator, profile)
    bad = sum(int((~torch.isfinite(x)).sum()) for x in (trace.hidden, trace.mid, trace.heads, trace.neurons)
              if x is not None)
    if bad:
        raise ValueError(f"the trace holds {bad} NaN or inf entries (hidden, mid, heads or neurons): "
                         "collect it again from a model with finite weights and activations")
    return readout, check_foil(foil, trace.targets, readout.vocab_size)


@dataclass
class Attribution:
    """IG-Lens attribution of f, the target probability by default (``quantity="logprob"``: its
    log-probability; with ``foils``: ``f(y) - f(foil)``). Every value is in the unit of f.

    Attributes:
        values: (T, K) f credited to each segment; rows sum to ``p_final - p_base``.
        layers, labels: (K,) segment end layers and names (``"L12"``, ``"L12.attn"``).
        p_base, p_final: (T,) f at the baseline and at ``h_n`` (the model's own value).
        lens: (T, K+1) f at the path nodes, the baseline first: the logit lens.
        residual: max over tokens of ``|sum_j values - (p_final - p_base)|``.
        targets, positions: (T,); estimator, steps, baseline: how it was computed.
        profile: (T, K, m+1) f on the uniform grid of every segment, or None.
        quantity: one of :data:`QUANTITIES`; foils: (T,) or None.
    """
    values: torch.Tensor
    layers: list[int]
    labels: list[str]
    p_base: torch.Tensor
    p_final: torch.Tensor
    lens: torch.Tensor
    residual: float
    targets: torch.Tensor
    positions: torch.Tensor
    estimator: str
    steps: int
    baseline: str
    profile: Optional[torch.Tensor] = None
    quantity: str = "prob"
    foils: Optional[torch.Tensor] = None

    @property
    def delta_p(self) -> torch.Tensor:
        """(T,) ``p_final - p_base``: the change of f (probability by default, see ``quantity``)."""
        return self.p_final - self.p_base

    def onset(self, frac: float = 0.5) -> torch.Tensor:
        """(T,) first segment end layer where the cumulative attribution reaches ``frac`` of Δp (for a
        fall: falls to it); within :func:`tie_tolerance` of the goal counts as reached, so rounding
        never moves it. Prediction-aware: where the lens first crosses ``p_base + frac * Δp``.
        """
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"frac must be in (0, 1], got {frac}")
        cumulative = self.values.double().cumsum(-1)
        goal = frac * self.delta_p.double()[:, None]
        # within the rank tolerance of the curve [0, cumulative] counts as reached (tie_tolerance)
        tol = torch.from_numpy(tie_tolerance(torch.cat([torch.zeros_like(goal), cumulative], -1)))
        reached = torch.where(goal >= 0, cumulative >= goal - tol, cumulative <= goal + tol)
        first = reached.int().argmax(-1)
        return torch.tensor(self.layers)[first]

    def onset_index(self, frac: float = 0.5) -> torch.Tensor:
        """(T,) the segment index ``j`` of :meth:`onset`."""
        return torch.searchsorted(torch.tensor(self.layers), self.onset(frac))

    def to_frame(self, tokenizer=None):
        """Tidy pandas table: one row per (token, segment) with value, lens values and onset."""
        import pandas as pd
        tokens = ([tokenizer.decode([t]) for t in self.targets.tolist()] if tokenizer is not None
                  else [str(t) for t in self.targets.tolist()])
        onset = self.onset().tolist()
        rows = []
        for t, token in enumerate(tokens):
            for j, (layer, label) in enumerate(zip(self.layers, self.labels)):
                rows.append(dict(token_index=t, position=int(self.positions[t]), token=token,
                                 segment=j, layer=layer, label=label,
                                 value=float(self.values[t, j]),
                                 lens_start=float(self.lens[t, j]), lens_end=float(self.lens[t, j + 1]),
                                 p_base=float(self.p_base[t]), p_final=float(self.p_final[t]),
                                 onset=onset[t]))
        return pd.DataFrame(rows)


def plain_number(value):
    """A 0-d tensor or array or a numpy scalar as the Python number it holds (a bool stays a bool, for
    the caller to refuse); anything else as it is. Callers then check the type and the range."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) and np.ndim(value) == 0:
        return value.item()
    return value


def check_foil(foil, targets: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """Validate a foil: one token id, or one per predicting position; returns (T,) long or None.

    Raises:
        ValueError: a foil that is not integer ids, not of shape () or (T,), outside
            ``0..vocab_size-1``, or equal to the target at some position (f would be 0 there).
    """
    if foil is None:
        return None
    if isinstance(foil, str):
        raise ValueError(f"foil must be a token id, not text {foil!r}: pass tokenizer.encode({foil!r}, add_special_tokens=False)[0]")
    foils = torch.as_tensor(foil)
    T = len(targets)
    if foils.dtype.is_floating_point or foils.dtype.is_complex or foils.dtype == torch.bool:
        raise ValueError(f"foil must be integer token ids (one id or {T} ids), got dtype {foils.dtype}")
    if foils.dim() == 0:
        foils = foils.expand(T)
    if foils.shape != (T,):
        raise ValueError(f"foil must be one token id or one per predicting position, shape ({T},); "
                         f"got shape {tuple(foils.shape)}")
    foils = foils.long().cpu()
    bad = foils[(foils < 0) | (foils >= vocab_size)]
    if len(bad):
        raise ValueError(f"foil ids must lie in 0..{vocab_size - 1} (the model's vocabulary), "
                         f"got {bad.unique()[:5].tolist()}")
    same = (foils == targets.cpu()).nonzero()[:, 0]
    if len(same):
        raise ValueError(f"the foil equals the target at token index(es) {same.tolist()}: f(y) - "
                         "f(foil) is 0 there; pick a different foil for those positions")
    return foils.clone()


def check_layers(layers: Optional[Sequence[int]], n_layers: int) -> list[int]:
    """Validate segment end layers (strictly increasing, in 1..n); append n when missing."""
    if layers is None:
        return list(range(1, n_layers + 1))
    if isinstance(layers, (str, bytes)):
        raise ValueError(f"layers must be a sequence of integers in 1..{n_layers}, got {layers!r}")
    layers = list(layers)
    wrong = [layer for layer in layers if isinstance(layer, bool)
             or not isinstance(layer, (int, np.integer, torch.Tensor))
             or (isinstance(layer, torch.Tensor) and (layer.dim() or layer.is_floating_point()))]
    if wrong:
        raise ValueError(f"layers must be integers in 1..{n_layers}, got {wrong!r}")
    layers = [int(layer) for layer in layers]
    if not layers:
        raise ValueError(f"layers must hold at least one layer in 1..{n_layers}, got []")
    bad = [layer for layer in layers if not 1 <= layer <= n_layers]
    if bad:
        raise ValueError(f"layers must lie in 1..{n_layers} (layer 0 is the baseline, not a segment end), got {bad}")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ValueError(f"layers must be strictly increasing, got {layers}")
    return layers if layers[-1] == n_layers else layers + [n_layers]


def resolve_baseline(baseline, trace: Trace) -> tuple[torch.Tensor, str]:
    """(T, d) baseline points and their name, for a name of :data:`BASELINES` or a tensor; else ValueError."""
    start = trace.hidden[0]
    if isinstance(baseline, str):
        if baseline == "embedding":
            return start, baseline
        if baseline == "zero":
            return torch.zeros_like(start), baseline
        if baseline == "mean":  # mean embedding output over the trace's positions
            return start.mean(0, keepdim=True).expand_as(start), baseline
        raise ValueError(f"baseline must be one of {BASELINES} or a tensor, got {baseline!r}")
    tensor = torch.as_tensor(baseline, dtype=start.dtype)
    d = start.shape[-1]
    if not torch.isfinite(tensor).all():
        raise ValueError(f"baseline tensor must be finite, got {int((~torch.isfinite(tensor)).sum())} "
                         "NaN or inf entries")
    if tensor.shape == (d,):
        return tensor.expand_as(start), "custom"
    if tensor.shape == start.shape:
        return tensor, "custom"
    raise ValueError(f"baseline tensor must have shape ({d},) or {tuple(start.shape)}, got {tuple(tensor.shape)}")


def path_nodes(trace: Trace, layers: Sequence[int], resolution: str = "layer"):
    """Points of the path after the baseline, their end layers and labels.

    Returns:
        ``(nodes (K, T, d), layers (K,), labels (K,))``.
    """
    if resolution == "layer":
        return trace.hidden[list(layers)], list(layers), [f"L{layer}" for layer in layers]
    if resolution == "sublayer":
        if trace.mid is None:
            raise ValueError("resolution='sublayer' needs collect(..., sublayer=True)")
        if list(layers) != list(range(1, trace.n_layers + 1)):
            raise ValueError("resolution='sublayer' integrates every block; leave layers=None")
        nodes, ends, labels = [], [], []
        for layer in layers:
            nodes += [trace.mid[layer - 1], trace.hidden[layer]]
            ends += [layer, layer]
            labels += [f"L{layer}.attn", f"L{layer}.mlp"]
        return torch.stack(nodes), ends, labels
    raise ValueError(f"resolution must be 'layer' or 'sublayer', got {resolution!r}")


def ig_lens(model, trace: Trace, *, layers: Optional[Sequence[int]] = None,
            baseline: Union[str, torch.Tensor] = "embedding", steps: int = 16,
            estimator: str = "prediction_aware", profile: bool = False,
            resolution: str = "layer", readout: Optional[Readout] = None,
            quantity: str = "prob", foil=None) -> Attribution:
    """Telescoping Integrated Gradients of the target probability along the residual stream.

    Cost: without a profile the prediction-aware values need f only at the K+1 path nodes (one
    logit-lens pass, whatever ``steps``); ``profile=True`` reads f at all ``K*m + 1`` grid points per
    token. Gradient estimators evaluate ``<h_Lj - h_L(j-1), grad f>`` in closed form; nothing calls
    backward. Both go through :meth:`Readout.along_segments` (one head product per path node).
    Precision: the model's dtype; a float64 model runs in float64 end to end (:func:`float64_forward`).

    Args:
        model: the causal LM that produced ``trace`` (from :func:`collect`).
        layers: segment end layers in ``1..n``, strictly increasing (n appended); default every block.
        baseline: ``"embedding"`` (``hidden[0]``), ``"zero"``, ``"mean"`` (over the trace's
            positions), or a tensor (d,) or (T, d).
        steps: m >= 1; estimator: one of :data:`ESTIMATORS`.
        profile: also return f on the uniform grid of every segment, (T, K, m+1).
        resolution: ``"layer"`` or ``"sublayer"`` (attention and MLP of every block, 2n segments).
        readout: a :class:`Readout` to reuse.
        quantity: ``"prob"`` or ``"logprob"`` (the terms of all answer tokens then add up to the
            change of the answer's log-probability); foil: None, one id or (T,) ids: f becomes
            ``f(y) - f(foil)`` (with ``"logprob"``, the logit difference ``z_y - z_foil``).
    """
    model = as_model(model)
    readout, foils = _check_run(model, trace, readout, steps, estimator, quantity, foil, profile)
    spec = dict(foils=foils, quantity=quantity)
    layers = check_layers(layers, trace.n_layers)
    base, base_name = resolve_baseline(baseline, trace)
    ends, layers, labels = path_nodes(trace, layers, resolution)
    work = readout.dtype
    nodes = torch.cat([base[None], ends]).to(work)  # (K+1, T, d)
    targets = trace.targets
    m = int(steps)

    lens, grid = None, None  # lens: (T, K+1) f at the path nodes, the logit lens
    if profile:  # the K*m+1 points per token: the nodes and m-1 interior points per segment
        inner, lens = readout.along_segments(nodes, targets, torch.arange(1, m) / m, **spec)  # (K, T, m-1)
        lens = lens.T
        grid = torch.cat([lens[:, :-1, None], inner.permute(1, 0, 2), lens[:, 1:, None]], -1)

    if estimator == "prediction_aware":
        if grid is not None:
            values = (grid[..., 1:] - grid[..., :-1]).sum(-1)  # step by step, (T, K)
        else:
            lens = readout(nodes, targets[None], None if foils is None else foils[None], quantity=quantity).T
            values = lens[:, 1:] - lens[:, :-1]
    else:
        alphas, weights = quadrature(estimator, m)
        slopes, node_f = readout.along_segments(nodes, targets, alphas, slope=True, **spec)  # (K, T, m')
        lens = node_f.T if lens is None else lens
        values = (slopes * weights.to(slopes)).sum(-1).T  # (T, K)

    lens = lens.float() if work != torch.float64 else lens
    values = values.to(lens.dtype)
    p_base, p_final = lens[:, 0], lens[:, -1]
    residual = float((values.double().sum(-1) - (p_final.double() - p_base.double())).abs().max())
    return Attribution(values.cpu(), layers, labels, p_base.cpu(), p_final.cpu(), lens.cpu(), residual,
                       targets, trace.positions, estimator, m, base_name,
                       grid.cpu() if grid is not None else None, quantity, foils)


def logit_lens(model, trace: Trace, readout: Optional[Readout] = None) -> torch.Tensor:
    """(T, n+1) target probability read out of every block boundary, ``hidden[0]`` first."""
    model = as_model(model)
    check_same_model(model, trace, readout)
    readout = readout or Readout(model)
    return readout(trace.hidden, trace.targets[None]).T


# -- components: the attention increment is ``D (sum_h W_O[:, slice_h] z_h + b_O)``, the MLP's
# ``D (sum_i act_i W_down[:, i] + b_down)``; ``D`` is the identity or, under a post-norm (Gemma's
# ``G * u / rms(u)``, one rms per position), ``diag(G / rms(u))``. A fixed part delta_k gets
# ``<delta_k, gbar>``, ``gbar = sum_s w_s grad f(point_s)``; a head's part splits further over
# ``z_h(t) = sum_s A_h(t, s) v_h(s)`` (pattern rows sum to 1, so a value bias splits too).

COMPONENT_RESOLUTIONS = ("head", "neuron", "both", "source", "all")


def _post_norm_map(post: nn.Module, outputs: torch.Tensor) -> torch.Tensor:
    """(T, d) the diagonal ``D = G / rms(u)`` of an RMSNorm ``post`` at the sublayer outputs ``u``.

    ``G = (post(1) - post(0)) * sqrt(1 + eps)`` is read off the norm (any gain convention).

    Raises:
        ValueError: when ``D * u`` does not reproduce ``post(u)`` (not an RMSNorm).
    """
    eps = _first_attr(post, ("variance_epsilon", "eps"))
    param = next(post.parameters())
    probe = torch.stack([torch.ones(outputs.shape[-1]), torch.zeros(outputs.shape[-1])])
    normed = post(probe.to(param.device, param.dtype)).to(outputs)
    gain = (normed[0] - normed[1]) * math.sqrt(1.0 + float(eps or 0.0))
    diagonal = gain * torch.rsqrt(outputs.pow(2).mean(-1, keepdim=True) + float(eps or 0.0))
    actual, tol = post(outputs.to(param.device, param.dtype)).to(outputs), max(1e-3, 2 * torch.finfo(param.dtype).eps)
    if not isinstance(eps, (int, float)) or not torch.allclose(
            diagonal * outputs, actual, rtol=tol, atol=tol * 0.1 * float(actual.abs().max()) + 1e-6):
        raise ValueError(f"the norm {type(post).__name__} on the sublayer output is not an RMSNorm "
                         f"G * u / rms(u) within {param.dtype}'s rounding; its input cannot be split into parts")
    return diagonal


def _source_terms(trace: Trace, layer: int, back: torch.Tensor, memory_budget: int) -> torch.Tensor:
    """(T, H, S) float64 ``A_h(t, s) <v_h(s), back_h(t)>``: block ``layer + 1``'s head parts split
    over the source positions s (``back`` (T, H * head_dim) the projection's transpose applied to
    the gradient sum, so that a head's part is ``<z_h(t), back_h(t)>``); tokens are chunked so that
    two (tokens, H, S) float64 temporaries fit ``memory_budget``."""
    patterns = trace.patterns[layer]  # (T, H, S)
    T, H, S = patterns.shape
    values, back = head_values(trace, layer), back.view(T, H, -1)  # (S, H, hd), (T, H, hd)
    out = torch.empty(T, H, S, dtype=torch.float64)
    step = max(1, memory_budget // (2 * 8 * H * S))
    for t0 in range(0, T, step):
        tokens = slice(t0, t0 + step)
        out[tokens] = torch.einsum("thd,shd->ths", back[tokens], values).mul_(patterns[tokens])
    return out


def component_terms(model, trace: Trace, vectors: torch.Tensor, sublayer: str, *, sources: bool = False,
                    memory_budget: int = DEFAULT_MEMORY_BUDGET):
    """``<delta_k, v>`` for every part k of one sublayer of every block: heads or neurons, bias last.

    Args:
        trace: from :func:`collect_components`; vectors: (n, T, d) or (T, d).
        sublayer: ``"attn"`` (the H heads, then the bias) or ``"mlp"`` (the d_ff neurons, then the bias).
        sources: ``"attn"`` only: also split each head's part over its source positions.

    Returns:
        ``(terms (T, n, P + 1), increments (n, T, d), sources (T, n, H, S) or None)`` float64; the
        increments are rebuilt from the parts, for the caller to check against the stream.
    """
    model = as_model(model)
    if sublayer not in ("attn", "mlp"):
        raise ValueError(f"sublayer must be 'attn' or 'mlp', got {sublayer!r}")
    acts = trace.heads if sublayer == "attn" else trace.neurons
    if acts is None:
        raise ValueError(f"the trace has no {'heads' if sublayer == 'attn' else 'neurons'}: "
                         "record it with collect_components(model, input_ids, prompt_len)")
    if sources and (sublayer != "attn" or trace.patterns is None):
        raise ValueError("sources need sublayer='attn' and a trace from collect_components(model, "
                         "input_ids, prompt_len, sources=True)")
    adapter = get_adapter(model)
    n, T = acts.shape[0], acts.shape[1]
    vectors = torch.as_tensor(vectors).double().cpu()
    vectors = vectors.expand(n, *vectors.shape[-2:]) if vectors.dim() == 2 else vectors
    if vectors.shape[:2] != (n, T):
        raise ValueError(f"vectors must have shape ({n}, {T}, d) or ({T}, d), got {tuple(vectors.shape)}")
    groups = head_counts(model)[0] if sublayer == "attn" else acts.shape[-1]
    terms, increments, per_source = [], [], []
    for layer, block in enumerate(adapter.blocks):
        proj, post = sublayer_projection(block, sublayer)
        weight, bias = projection_weight(proj)
        weight = weight.double().cpu()  # (d, P)
        bias = bias.double().cpu() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
        act = acts[layer].double()  # (T, P)
        outputs = act @ weight.T + bias  # (T, d) the sublayer output before any post-norm
        diagonal = _post_norm_map(post, outputs) if post is not None else torch.ones_like(outputs)
        read = diagonal * vectors[layer]  # (T, d): D is diagonal, <D u, v> = <u, D v>
        back = read @ weight  # (T, P) what a unit of each activation is worth
        parts = (act * back).reshape(T, groups, -1).sum(-1)  # (T, H) or (T, d_ff)
        terms.append(torch.cat([parts, (read * bias).sum(-1, keepdim=True)], -1))
        increments.append(diagonal * outputs)
        if sources:
            per_source.append(_source_terms(trace, layer, back, memory_budget))
    return (torch.stack(terms, 1), torch.stack(increments), torch.stack(per_source, 1) if sources else None)


@dataclass
class Components:
    """IG-Lens at component resolution, in the unit of f (as :class:`Attribution`).

    Attributes:
        heads: (T, n, H + 1) f credited to each head, the output bias last; or None.
        neurons: (T, n, d_ff + 1) the same for each MLP neuron, the down-projection bias last; or None.
        attn, mlp: (T, n) the sublayer terms ``f(mid_L) - f(h_(L-1))``, ``f(h_L) - f(mid_L)``.
        residual_heads, residual_neurons, residual_sources: ``max |parts.sum(-1) - term|`` (NaN
            when not computed): the estimator's quadrature error.
        rebuild: max gap between the parts' sum and the recorded increment, relative to the increment
            plus ``100 eps (|start| + |end|)`` of the model's dtype (the stream's rounding); below 1e-2.
        lens: (T, 2n+1) f at ``h_0, mid_1, h_1, ..., mid_n, h_n``.
        sources: (T, n, H, S) or None: f credited to head h of block L for what it moved into the
            predicting position from position s (zero after it); sums over s to ``heads[..., :H]``.
    """
    heads: Optional[torch.Tensor]
    neurons: Optional[torch.Tensor]
    attn: torch.Tensor
    mlp: torch.Tensor
    residual_heads: float
    residual_neurons: float
    rebuild: float
    lens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    estimator: str
    steps: int
    sources: Optional[torch.Tensor] = None
    residual_sources: float = math.nan
    quantity: str = "prob"
    foils: Optional[torch.Tensor] = None

    @property
    def delta_p(self) -> torch.Tensor:
        """(T,) ``f(h_n) - f(h_0)``: the attention and MLP terms of all blocks add up to it."""
        return self.lens[:, -1] - self.lens[:, 0]

    def by_source(self) -> torch.Tensor:
        """(T, S + 1) f moved in from each source position by all heads of all blocks, then, last,
        the rest: the MLPs, the attention output biases and the estimator's residual. Each row
        adds up to ``delta_p``. One hop: what built the stream at s is earlier blocks' work."""
        if self.sources is None:
            raise ValueError("no sources: compute components(..., resolution='source' or 'all') "
                             "on a trace from collect_components(..., sources=True)")
        moved = self.sources.sum((1, 2))  # (T, S)
        return torch.cat([moved, (self.delta_p.to(moved) - moved.sum(-1))[:, None]], -1)


@torch.no_grad()
def components(model, trace: Trace, *, resolution: str = "both", steps: int = 16,
               estimator: str = "gauss_legendre", readout: Optional[Readout] = None,
               quantity: str = "prob", foil=None) -> Components:
    """Every attention head and every MLP neuron of every block, in probability, adding up.

    On the 2n sublayer segments of ``ig_lens(resolution="sublayer")``, part k (a head through its
    slice of the output projection, or a neuron through its column of the down projection, each
    through the post-norm's diagonal map where there is one; the bias last) gets
    ``phi_k = sum_s w_s <delta_k, grad f(a + alpha_s (b - a))>``; the parts add up to the segment's
    gradient-estimator value (``residual_*``). ``"prediction_aware"`` splits each of m uniform steps'
    observed change among the parts by ``<delta_k, grad f>`` at the midpoint: exact at every m.

    Sources: ``z_h(t) = sum_s A_h(t, s) v_h(s)`` is linear in the values given the pattern, so a
    head's part splits exactly over source positions. Read it as one hop: "head h of block L moved
    this much into t from the stream at s"; the pattern is taken as given.

    Cost: the gradient sums in closed form (no backward), then one (d x P) product per block and
    sublayer, and one (T x head_dim x S) product per head for sources; chunked to the readout's
    ``memory_budget``. Precision: the parts in float64 from the model's own activations (of a
    bfloat16 or float16 model too), results in float32 (float64 for a float64 model).

    Args:
        trace: from :func:`collect_components` (``sources=True`` for the sources).
        resolution: one of :data:`COMPONENT_RESOLUTIONS`: ``"head"``, ``"neuron"``, ``"both"``,
            ``"source"`` (heads and sources) or ``"all"``.
        steps, estimator, readout, quantity, foil: as :func:`ig_lens` (Gauss-Legendre by default).
    """
    model = as_model(model)
    if resolution not in COMPONENT_RESOLUTIONS:
        raise ValueError(f"resolution must be one of {COMPONENT_RESOLUTIONS}, got {resolution!r}")
    wanted = {"head": ("heads",), "neuron": ("neurons",), "both": ("heads", "neurons"),
              "source": ("heads", "patterns"), "all": ("heads", "neurons", "patterns")}[resolution]
    missing = [name for name in ("mid",) + wanted if getattr(trace, name) is None]
    if missing:
        raise ValueError(f"the trace has no {missing}: record it with collect_components(model, "
                         f"input_ids, prompt_len{', sources=True' if 'patterns' in missing else ''})")
    readout, foils = _check_run(model, trace, readout, steps, estimator, quantity, foil, True)
    n = trace.n_layers
    ends, _, _ = path_nodes(trace, list(range(1, n + 1)), "sublayer")
    nodes = torch.cat([trace.hidden[:1], ends]).to(readout.dtype)  # (2n+1, T, d)
    if estimator == "prediction_aware":  # m uniform steps, each split at its midpoint
        alphas, weights = (torch.arange(int(steps), dtype=torch.float64) + 0.5) / int(steps), "observed"
    else:
        alphas, weights = quadrature(estimator, int(steps))
    gbar, lens = readout.along_segments(nodes, trace.targets, alphas, weights=weights, foils=foils,
                                        quantity=quantity)  # (2n, T, d)
    lens = lens.T.double()  # (T, 2n+1)
    terms = (lens[:, 1:] - lens[:, :-1]).view(-1, n, 2)  # (T, n, 2) exact attention, MLP terms
    work, eps = precision(readout.dtype), torch.finfo(readout.dtype).eps
    out, residuals, rebuild = {}, {}, 0.0
    for name, sublayer, col in (("heads", "attn", 0), ("neurons", "mlp", 1)):
        if name not in wanted:
            continue
        sources = "patterns" in wanted and sublayer == "attn"
        shares, parts, per_source = component_terms(model, trace, gbar[col::2], sublayer, sources=sources,
                                                    memory_budget=readout.memory_budget)
        start, end = (trace.hidden[:-1], trace.mid) if col == 0 else (trace.mid, trace.hidden[1:])
        recorded = (end - start).double()  # (n, T, d), with the rounding of start and end in the model's dtype
        scale = recorded.norm(dim=-1) + 100 * eps * (start.double().norm(dim=-1) + end.double().norm(dim=-1))
        rebuild = max(rebuild, float(((parts - recorded).norm(dim=-1) / scale.clamp_min(1e-12)).max()))
        if rebuild > 1e-2:
            raise ValueError(f"the {sublayer} parts do not rebuild the recorded increment (gap {rebuild:.1e} of it, beyond "
                             f"{readout.dtype}'s rounding): was the model run with dropout, or in another precision?")
        out[name] = shares.to(work)
        residuals[name] = float((shares.sum(-1) - terms[..., col]).abs().max())
        if sources:
            out["sources"] = per_source.to(work)
            residuals["sources"] = float((per_source.sum(-1) - shares[..., :-1]).abs().max())
    return Components(out.get("heads"), out.get("neurons"), terms[..., 0].to(work), terms[..., 1].to(work),
                      residuals.get("heads", math.nan), residuals.get("neurons", math.nan), rebuild,
                      lens.to(work), trace.targets, trace.positions, estimator, int(steps),
                      out.get("sources"), residuals.get("sources", math.nan), quantity, foils)
