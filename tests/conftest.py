"""Tiny random models built from configs, with randomised norm weights and biases."""
import pytest
import torch
import transformers

import iglens_core as ig

transformers.logging.set_verbosity_error()


def _randomise_norms(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if "norm" in type(module).__name__.lower() or "ln" in name.split(".")[-1]:
                for pname, param in module.named_parameters(recurse=False):
                    noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
                    param.copy_(param + 0.3 * noise if pname == "weight" else 0.1 * noise)
    return model


def tiny_model(arch: str, seed: int = 0, dtype=torch.float32, vocab_size: int = 97):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64)
    if arch == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=2, **common)
    elif arch == "llama32":
        config = transformers.LlamaConfig(
            num_key_value_heads=2, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            **common)
    elif arch == "gemma3":
        config = transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=8,
                                               final_logit_softcapping=3.0,
                                               sliding_window=8, **common)
    elif arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=3, n_head=4,
                                         n_positions=64)
    elif arch == "neox":  # parallel attention + MLP, rotary on a quarter of each head
        config = transformers.GPTNeoXConfig(use_parallel_residual=True, rotary_pct=0.25, **common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=2, **common)
    elif arch == "qwen3":  # RMSNorm on queries and keys too
        config = transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    elif arch == "mistral":
        config = transformers.MistralConfig(num_key_value_heads=2, sliding_window=8, **common)
    elif arch == "phi3":
        config = transformers.Phi3Config(num_key_value_heads=2, pad_token_id=0, **common)
    elif arch == "gemma2":  # both soft-caps small enough to bite at these logit sizes
        config = transformers.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=8,
                                           attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                                           **common)
    elif arch == "olmo":  # LayerNorm without weight or bias
        config = transformers.OlmoConfig(num_key_value_heads=2, pad_token_id=0, **common)
    else:
        raise KeyError(arch)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return _randomise_norms(model, seed)


def sharp_model(arch: str, seed: int = 0, dtype=torch.float32, scale: float = 6.0):
    """tiny_model (randomised norms) with its matrices scaled up ``scale`` times, so that the
    probabilities move far from uniform along the path and the integrals are not near-linear."""
    model = tiny_model(arch, seed=seed, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(scale)
    return model


def order_tolerance(dtype, scale: float, length: int) -> float:
    """The tolerance for one quantity computed in ``dtype`` (float32, bfloat16) along two computation
    orders: batched rows against one row, another thread count, another BLAS kernel (MKL_CBWR), a
    GPU. Not for exactness claims: those are checked in float64 at 1e-12.

    Why: summing ``length`` terms ``x_i`` in any order in a precision with unit roundoff
    ``u = eps / 2`` gives ``|fl(sum) - sum| <= (length - 1) * u * sum |x_i|`` (to first order in u;
    Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 4.4, for recursive summation;
    blocked and pairwise orders have smaller bounds). Two orders each obey it, so they differ by at
    most ``2 * length * u * sum |x_i| = eps * length * scale`` with ``scale = sum |x_i|``. A dot
    product of length ``d`` (a matrix product's entry) is such a sum of ``d`` products.

    Args:
        dtype: the precision the two orders ran in (``torch.float32``, ``torch.bfloat16``...).
        scale: the sum of the absolute values of the terms whose order differs, in the quantity's own
            units; where a quantity is several such sums combined linearly, the caller sums their
            scales (and says so). Not the size of the result: cancellation makes that smaller.
        length: the number of terms of the reduction whose order differs (e.g. the hidden size
            of a product with the unembedding).

    Returns:
        ``eps(dtype) * length * scale`` as a float, for ``atol=`` / ``abs=``.
    """
    if not (dtype.is_floating_point if isinstance(dtype, torch.dtype) else False):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if length < 1 or not scale >= 0:
        raise ValueError(f"length must be >= 1 and scale >= 0, got {length!r}, {scale!r}")
    return float(torch.finfo(dtype).eps) * int(length) * float(scale)


def blocks(model):
    """The block list of a Hugging Face causal LM, found here independently of the core."""
    base = model.base_model
    return getattr(base, "layers", None) or getattr(base, "h", None)


ARCHS = ["llama", "llama32", "gemma3", "gpt2", "neox"]
# further architectures, checked by tests/test_architectures.py only (keeps the other suites short)
MORE_ARCHS = ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "olmo"]


@pytest.fixture(params=ARCHS)
def arch_model(request):
    return tiny_model(request.param, seed=ARCHS.index(request.param))


def random_trace(model, length=12, prompt_len=5, seed=0, sublayer=False):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen)
    return ig.collect(model, ids, prompt_len, sublayer=sublayer)


@pytest.fixture(scope="session")
def packaged():
    return ig.load_model()
