"""activation_patching against naive spliced full reruns, and its identities."""
import numpy as np
import pytest
import torch

import iglens_core as ig
import iglens_causal as igc
import iglens_stats as igs
from conftest import ARCHS, random_trace, tiny_model


def _spliced_probs(model, ids, layer, value, target):
    """Independent: the full model on ``ids`` with h_layer at the last position replaced by ``value``
    (a pre-hook on block layer+1, or on the final norm for layer n), softmax of the model's logits."""
    adapter = ig.get_adapter(model)
    module = adapter.blocks[layer] if layer < adapter.n_layers else adapter.norm

    def hook(mod, args, kwargs):
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        hidden[:, -1] = value
        if args:
            return (hidden,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0, -1]
    finally:
        handle.remove()
    return torch.softmax(logits.double(), -1)[target].item()


def _corrupt(ids, upto, seed, vocab, length_change=0):
    """The clean ids through position ``upto`` with two random tokens replaced (and some inserted)."""
    gen = torch.Generator().manual_seed(seed)
    out = ids[:, :upto + 1].clone()
    out[0, 1:3] = torch.randint(0, vocab, (2,), generator=gen)
    if length_change:
        out = torch.cat([out[:, :2], torch.randint(0, vocab, (1, length_change), generator=gen), out[:, 2:]], 1)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("length_change", [0, 2])
def test_patching_equals_spliced_full_reruns(arch, length_change):
    model = tiny_model(arch, seed=ARCHS.index(arch))
    trace = random_trace(model, length=12, prompt_len=5, seed=3)
    target = 2
    vocab = model.config.vocab_size
    corrupted = _corrupt(trace.input_ids, int(trace.positions[target]), seed=7, vocab=vocab,
                         length_change=length_change)
    result = igc.activation_patching(model, trace, corrupted, target=target, min_gap=0)
    n = trace.n_layers
    y = int(trace.targets[target])
    assert result.probs.shape == (n + 1,)
    expected = [_spliced_probs(model, corrupted, layer, trace.hidden[layer, target], y) for layer in range(n + 1)]
    torch.testing.assert_close(result.probs.double(), torch.tensor(expected, dtype=torch.float64),
                               atol=2e-6, rtol=1e-5)
    with torch.no_grad():
        p_corrupted = torch.softmax(model(corrupted, use_cache=False).logits[0, -1].double(), -1)[y].item()
    assert result.p_corrupted == pytest.approx(p_corrupted, abs=2e-6)
    assert result.p_clean == pytest.approx(float(trace.model_probs[target]), abs=2e-6)
    spread = np.ptp(expected)
    assert spread > 2e-5  # 10x the tolerance: the restored layers differ, so the check can fail
    r = result.restoration
    assert r[-1].item() == pytest.approx(1.0, abs=1e-12)  # r(n) = 1: node n is the clean h_n
    torch.testing.assert_close(r, (result.probs.double() - result.p_corrupted)
                               / (result.p_clean - result.p_corrupted))


def test_patching_float64_exact():
    model = tiny_model("llama", seed=2, dtype=torch.float64)
    trace = random_trace(model, seed=5)
    corrupted = _corrupt(trace.input_ids, int(trace.positions[0]), seed=1, vocab=model.config.vocab_size)
    result = igc.activation_patching(model, trace, corrupted, min_gap=0)
    assert result.probs.dtype == torch.float64
    y = int(trace.targets[0])
    expected = [_spliced_probs(model, corrupted, layer, trace.hidden[layer, 0], y) for layer in range(trace.n_layers + 1)]
    torch.testing.assert_close(result.probs, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_clean_prompt_as_corruption_restores_nothing_to_restore(arch):
    """With the clean sequence itself as the corruption every node gives the clean probability."""
    model = tiny_model(arch, seed=1)
    trace = random_trace(model, seed=2)
    target = 3
    result = igc.activation_patching(model, trace, trace.input_ids[:, :int(trace.positions[target]) + 1],
                                     target=target, min_gap=0)
    torch.testing.assert_close(result.probs, torch.full_like(result.probs, float(trace.model_probs[target])),
                               atol=2e-6, rtol=1e-5)
    assert result.p_corrupted == pytest.approx(result.p_clean, abs=2e-6)


def test_restoration_half_against_loop():
    rng = np.random.default_rng(0)
    r = np.cumsum(rng.normal(0.05, 0.3, size=(50, 9)), -1)
    r[:, -1] = 1.0
    r[3] = np.nan
    got = igs.restoration_half(r, level=0.5)
    for row, value in zip(r, got):
        if np.isnan(row).all():
            assert value == -1
        else:
            assert value == next(k for k, x in enumerate(row) if x >= 0.5)
    assert len(set(got.tolist())) > 3  # varied rows: the comparison can fail
    patched = igc.Patching(probs=torch.tensor([0.1, 0.2, 0.5, 0.9]), p_clean=0.9, p_corrupted=0.1)
    assert patched.half_layer() == 2


def test_patching_bad_input():
    model = tiny_model("llama", seed=0)
    trace = random_trace(model)
    ok = trace.input_ids[:, :5]
    with pytest.raises(ValueError, match="target"):
        igc.activation_patching(model, trace, ok, target=len(trace.targets))
    with pytest.raises(ValueError, match="corrupted_ids"):
        igc.activation_patching(model, trace, ok.float())
    with pytest.raises(ValueError, match="0..96"):
        igc.activation_patching(model, trace, ok + 200)
    with pytest.raises(ValueError, match="level"):
        igs.restoration_half(np.zeros((2, 3)), level=0.0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_pattern_swap_against_own_patterns_and_by_hand(arch):
    """The two runs are the model's own eager forward; a run given its own patterns is itself; the clean
    patterns move the corrupted run (they matter on these models)."""
    model = tiny_model(arch, seed=3)
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(0, model.config.vocab_size, (1, 8), generator=gen)
    corrupted = clean.clone()
    corrupted[0, 2] = (clean[0, 2] + 5) % model.config.vocab_size
    target = int(model(clean).logits[0, -1].argmax())
    out = igc.pattern_swap(model, clean, corrupted, target)
    with torch.no_grad(), ig.eager_attention(model):
        p = {name: float(torch.softmax(model(ids).logits[0, -1].double(), -1)[target])
             for name, ids in (("clean", clean), ("corrupted", corrupted))}
    assert out["clean"] == pytest.approx(p["clean"], abs=1e-6) and out["corrupted"] == pytest.approx(p["corrupted"], abs=1e-6)
    same = igc.pattern_swap(model, clean, clean, target)
    assert same["corrupted_clean_patterns"] == pytest.approx(same["clean"], abs=1e-6)
    assert out["corrupted_clean_patterns"] != pytest.approx(out["corrupted"], abs=1e-9)  # the patterns matter here


def test_pattern_swap_bad_input():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="same length"):
        igc.pattern_swap(model, torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="target must be a token id"):
        igc.pattern_swap(model, torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long), 10**6)
