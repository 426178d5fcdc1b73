"""ablation_effects against independent computations, and the onset metrics."""
import copy

import numpy as np
import pytest
import torch

import iglens_core as ig
import iglens_causal as igc
import iglens_stats as igs
import iglens_facts as igf
from conftest import ARCHS, random_trace, tiny_model


def _probs(model, trace, pre_hooks=()):
    """Target probabilities of a forward pass with optional (module, pre-hook) replacements."""
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module, hook in pre_hooks]
    try:
        with torch.no_grad():
            logits = model(trace.input_ids, use_cache=False).logits[0, trace.positions]
    finally:
        for handle in handles:
            handle.remove()
    return torch.softmax(logits, -1)[torch.arange(len(trace.targets)), trace.targets]


def _clean_stream(model, trace):
    """(n+1, L, d) residual stream of an unablated run at every position."""
    adapter = ig.get_adapter(model)
    stream = {}
    hooks = ig.stream_hooks(adapter, lambda i, tensor: stream.__setitem__(i, tensor[0].clone()))
    try:
        with torch.no_grad():
            model(trace.input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([stream[i] for i in range(adapter.n_layers + 1)])


def _replace_input(value):
    """Pre-hook feeding ``value`` (L, d) into a block (or the final norm) instead of its input."""
    def hook(module, args, kwargs):
        if args:
            return (value[None],) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value[None]}
    return hook


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablation_equals_rerun_from_replaced_stream(arch, mode):
    """Independent: splice h_(L-1) (+ mean update) into the next block's input, from a clean run."""
    model = tiny_model(arch, seed=ARCHS.index(arch))
    trace = random_trace(model)
    adapter = ig.get_adapter(model)
    n = adapter.n_layers
    stream = _clean_stream(model, trace)
    effects = igc.ablation_effects(model, trace, mode=mode, batch_size=2)
    assert effects.shape == (len(trace.targets), n)
    for layer in range(1, n + 1):
        update = stream[layer] - stream[layer - 1]
        kept = torch.zeros_like(update) if mode == "zero" else update.mean(0, keepdim=True).expand_as(update)
        spliced = stream[layer - 1] + kept
        after = adapter.blocks[layer] if layer < n else adapter.norm
        expected = trace.model_probs - _probs(model, trace, [(after, _replace_input(spliced))])
        torch.testing.assert_close(effects[:, layer - 1], expected, atol=2e-6, rtol=1e-5)
    assert effects.abs().max() > 2e-5  # well above the tolerance: the check can fail


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_zero_ablation_equals_model_without_that_block(arch):
    model = igf.tiny_model(arch, seed=1)  # init_scale 0.3: blocks move the probabilities a lot
    trace = random_trace(model, seed=4)
    effects = igc.ablation_effects(model, trace, batch_size=4)
    for layer in range(1, trace.n_layers + 1):
        pruned = copy.deepcopy(model)
        blocks = ig.get_adapter(pruned).blocks
        del blocks[layer - 1]
        expected = trace.model_probs - _probs(pruned, trace)
        torch.testing.assert_close(effects[:, layer - 1], expected, atol=2e-6, rtol=1e-5)
    assert effects.abs().max() > 1e-3  # the blocks do matter, so the check can fail


def _zero_weights(module):
    with torch.no_grad():
        for param in module.parameters():
            param.zero_()


_OUT_PROJ = {"llama": ("self_attn.o_proj", "mlp.down_proj"), "gpt2": ("attn.c_proj", "mlp.c_proj"),
             "neox": ("attention.dense", "mlp.dense_4h_to_h")}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "neox"])
@pytest.mark.parametrize("part", ["attn", "mlp"])
def test_part_ablation_equals_zeroed_output_projection(arch, part):
    """Independent: zero the sub-module's output projection (weights and bias) in a copy."""
    model = tiny_model(arch, seed=2)
    trace = random_trace(model, seed=5)
    effects = igc.ablation_effects(model, trace, part=part)
    name = _OUT_PROJ[arch][0 if part == "attn" else 1]
    for layer in range(1, 4):
        edited = copy.deepcopy(model)
        _zero_weights(ig.get_adapter(edited).blocks[layer - 1].get_submodule(name))
        expected = trace.model_probs - _probs(edited, trace)
        torch.testing.assert_close(effects[:, layer - 1], expected, atol=2e-6, rtol=1e-5)
    assert effects.abs().max() > 1e-4


def test_parts_differ_and_do_not_add_to_block():
    model = igf.tiny_model("llama", seed=3)
    trace = random_trace(model)
    attn, mlp = (igc.ablation_effects(model, trace, part=part) for part in ("attn", "mlp"))
    assert (attn - mlp).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablating_a_block_that_does_nothing_changes_nothing(mode):
    model = igf.tiny_model("llama", seed=0)
    for part in ("self_attn.o_proj", "mlp.down_proj"):
        _zero_weights(ig.get_adapter(model).blocks[1].get_submodule(part))
    trace = random_trace(model)
    effects = igc.ablation_effects(model, trace, mode=mode)
    assert effects[:, 1].abs().max() < 1e-6
    for part in ("attn", "mlp"):
        assert igc.ablation_effects(model, trace, mode=mode, part=part, layers=[2]).abs().max() < 1e-6
    assert effects.abs().max() > 1e-3


def test_hooks_are_removed_and_batching_does_not_matter():
    model = igf.tiny_model("gpt2", seed=0)
    trace = random_trace(model)
    before = _probs(model, trace)
    one = igc.ablation_effects(model, trace, batch_size=1)
    many = igc.ablation_effects(model, trace, batch_size=8)
    torch.testing.assert_close(one, many, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(igc.ablation_effects(model, trace, layers=[3, 1]), one[:, [2, 0]],
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(_probs(model, trace), before, atol=0, rtol=0)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_bad_ablation_arguments():
    model = tiny_model("llama")  # 3 blocks
    trace = random_trace(model)
    with pytest.raises(ValueError, match=r"mode must be one of \('zero', 'mean'\)"):
        igc.ablation_effects(model, trace, mode="resample")
    with pytest.raises(ValueError, match=r"part must be one of \(None, 'attn', 'mlp'\)"):
        igc.ablation_effects(model, trace, part="ffn")
    with pytest.raises(ValueError, match=r"1\.\.3"):
        igc.ablation_effects(model, trace, layers=[0, 2])
    with pytest.raises(ValueError, match="batch_size"):
        igc.ablation_effects(model, trace, batch_size=0)


# --- onset metrics -----------------------------------------------------------------------

def test_spearman_rows_matches_ranks_by_hand():
    rng = np.random.default_rng(0)
    scores, effects = rng.normal(size=(5, 9)), rng.normal(size=(5, 9))
    got = igs.spearman_rows(scores, effects)
    for t in range(5):
        ra, rb = scores[t].argsort().argsort(), effects[t].argsort().argsort()
        assert got[t] == pytest.approx(np.corrcoef(ra, rb)[0, 1])
    assert igs.spearman_rows(scores, scores) == pytest.approx(np.ones(5))
    assert np.isnan(igs.spearman_rows(np.zeros((1, 4)), effects[:1, :4])[0])
    with pytest.raises(ValueError, match="shape"):
        igs.spearman_rows(scores, effects[:, :3])


def test_top1_and_onset_beats_median():
    scores = np.array([[0.0, 0.9, 0.1, 0.0], [0.5, 0.1, 0.2, 0.0], [1.0, 1.0, 1.0, 1.0]])
    effects = np.array([[0.1, 0.8, 0.0, 0.0], [0.0, 0.3, 0.0, 0.1], [0.0, 0.1, 0.0, 0.0]])
    assert igs.top1_agreement(scores, effects).tolist() == [1.0, 0.0, 0.0]
    got = igs.onset_beats_median(scores, effects)
    assert got[:2].tolist() == [1.0, 0.0] and np.isnan(got[2])  # no lower-scored layer in row 3
    # naming a layer explicitly: layer 1 of row 2 beats the median of the layers scored below it
    assert igs.onset_beats_median(scores[1:2], effects[1:2], named=[1]).tolist() == [1.0]
    with pytest.raises(ValueError, match="named"):
        igs.onset_beats_median(scores, effects, named=[0, 9, 0])


def test_non_monotone():
    lens = np.array([[0.0, 0.2, 0.5, 0.9], [0.0, 0.9, 0.8, 0.95], [0.0, 0.9, 0.5, 0.95]])
    assert igs.non_monotone(lens).tolist() == [False, True, True]
    assert igs.non_monotone(lens, drop=0.2).tolist() == [False, False, True]
    with pytest.raises(ValueError, match="drop"):
        igs.non_monotone(lens, drop=1.5)


def test_bootstrap_ci_is_seeded_and_covers_the_mean():
    rng = np.random.default_rng(1)
    values = rng.normal(0.3, 1.0, size=400)
    est, low, high = igs.bootstrap_ci(values, seed=3)
    assert est == pytest.approx(values.mean())
    assert low < est < high
    half = 1.96 * values.std(ddof=1) / np.sqrt(len(values))  # normal theory interval
    assert (high - low) / 2 == pytest.approx(half, rel=0.15)
    assert igs.bootstrap_ci(values, seed=3) == (est, low, high)
    assert igs.bootstrap_ci(values, seed=4) != (est, low, high)
    with_nan = np.concatenate([values, [np.nan]])
    assert igs.bootstrap_ci(with_nan, seed=3)[0] == pytest.approx(est)
    with pytest.raises(ValueError, match="level"):
        igs.bootstrap_ci(values, level=1.5)
