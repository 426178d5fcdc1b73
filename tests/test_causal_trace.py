"""causal_trace against independent spliced full reruns, its identities and its bad input."""
import numpy as np
import pytest
import torch

import iglens_causal as igc
from conftest import tiny_model

TRACE_ARCHS = ["llama", "gemma3", "gpt2", "neox", "qwen2"]
SUBLAYERS = {"attn": ("self_attn", "attn", "attention"), "mlp": ("mlp",)}
LENGTH, SUBJECT = 10, slice(2, 5)  # 10 tokens: beyond gemma3's sliding window of 8
GAP = 1e-4  # min_gap: tiny random models have flat outputs (V = 97: rounding ~1e-8, not 1e-5)


def _blocks(model):
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.h


def _module(block, kind):
    return next(getattr(block, name) for name in SUBLAYERS[kind] if hasattr(block, name))


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _with_first(output, tensor):
    return (tensor,) + tuple(output[1:]) if isinstance(output, tuple) else tensor


def _hook_points(model, kind, column, window):
    """(module, is_pre_hook) pairs whose output (input for the pre-hook) a restoration replaces:
    node 0 the input of block 1, node L the output of block L; a sublayer kind the module of each
    block of ROME's window, 0-based ``range(max(0, l - w//2), min(n, l - (-w//2)))``."""
    blocks = _blocks(model)
    if kind == "hidden":
        return [(blocks[0], True)] if column == 0 else [(blocks[column - 1], False)]
    layer = column  # column j is block j + 1, 0-based block j
    return [(_module(blocks[b], kind), False)
            for b in range(max(0, layer - window // 2), min(len(blocks), layer - (-window // 2)))]


def _run(model, ids, hooks=(), pre_hooks=()):
    handles = [m.register_forward_hook(h) for m, h in hooks] + \
              [m.register_forward_pre_hook(h, with_kwargs=True) for m, h in pre_hooks]
    try:
        with torch.no_grad():
            return torch.softmax(model(ids, use_cache=False).logits[:, -1].double(), -1)  # (B, V)
    finally:
        for handle in handles:
            handle.remove()


def _noise_hook(noise, seed, width):
    draw = noise * torch.randn((SUBJECT.stop - SUBJECT.start, width), generator=torch.Generator().manual_seed(seed))

    def hook(module, args, output):
        output = output.clone()
        output[:, SUBJECT] += draw.to(output)
        return output
    return hook


def _record(model, ids, kind, window, n):
    """Clean values at every hook point of every column: {(column, index): (S, d)}."""
    values, hooks, pre = {}, [], []
    columns = range(n + 1) if kind == "hidden" else range(n)
    for column in columns:
        for index, (module, is_pre) in enumerate(_hook_points(model, kind, column, window)):
            if is_pre:
                pre.append((module, lambda m, a, k, key=(column, index): values.__setitem__(
                    key, (a[0] if a else k["hidden_states"])[0].clone())))
            else:
                hooks.append((module, lambda m, a, o, key=(column, index): values.__setitem__(key, _first(o)[0].clone())))
    _run(model, ids, hooks, pre)
    return values


def _spliced_grid(model, clean, corrupted, target, kind, window, embed_hooks):
    """Independent reference: per cell a fresh full forward of the corrupted ids with hooks putting
    the clean value back at one position; probability from the model's own logits, mean over the
    noise draws (``embed_hooks``: one hook per draw, or ``[None]``)."""
    n = len(_blocks(model))
    clean_values = _record(model, clean, kind, window, n)
    columns = range(n + 1) if kind == "hidden" else range(n)
    grid = np.zeros((clean.shape[1], len(columns)))
    for column in columns:
        for s in range(clean.shape[1]):
            hooks, pre = [], []
            for index, (module, is_pre) in enumerate(_hook_points(model, kind, column, window)):
                value = clean_values[(column, index)][s]
                if is_pre:
                    def splice(m, args, kwargs, value=value, s=s):
                        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
                        hidden[:, s] = value
                        return ((hidden,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
                    pre.append((module, splice))
                else:
                    def replace(m, args, output, value=value, s=s):
                        out = _first(output).clone()
                        out[:, s] = value
                        return _with_first(output, out)
                    hooks.append((module, replace))
            probs = [_run(model, corrupted, hooks + ([(model.get_input_embeddings(), h)] if h else []), pre)[0, target]
                     for h in embed_hooks]
            grid[s, column] = float(np.mean(probs))
    return grid


def _swap_fixture(arch, seed=0):
    """A tiny model, clean ids, a subject-swap corruption (the subject tokens replaced) and the
    target the swap moves most (so that the gap is well above MIN_GAP)."""
    model = tiny_model(arch, seed=seed)
    gen = torch.Generator().manual_seed(seed + 11)
    vocab = model.config.vocab_size
    clean = torch.randint(0, vocab, (1, LENGTH), generator=gen)
    corrupted = clean.clone()
    corrupted[0, SUBJECT] = torch.randint(0, vocab, (SUBJECT.stop - SUBJECT.start,), generator=gen)
    gap = _run(model, clean)[0] - _run(model, corrupted)[0]
    return model, clean, corrupted, int(gap.abs().argmax())


@pytest.mark.parametrize("arch", TRACE_ARCHS)
@pytest.mark.parametrize("kind,window", [("hidden", 1), ("attn", 2), ("mlp", 3)])
def test_subject_swap_equals_spliced_reruns(arch, kind, window):
    model, clean, corrupted, target = _swap_fixture(arch, seed=TRACE_ARCHS.index(arch))
    result = igc.causal_trace(model, clean, corrupted, target, kind=kind, window=window, batch_size=7,
                              min_gap=GAP)
    expected = _spliced_grid(model, clean, corrupted, target, kind, window, [None])
    n = model.config.num_hidden_layers
    assert result.probs.shape == (LENGTH, n + 1 if kind == "hidden" else n)
    torch.testing.assert_close(result.probs.double(), torch.tensor(expected), atol=2e-6, rtol=1e-5)
    assert np.ptp(expected) > 2e-5  # 10x the tolerance: the cells differ, so the check can fail
    assert result.p_clean == pytest.approx(float(_run(model, clean)[0, target]), abs=2e-6)
    assert result.p_corrupted == pytest.approx(float(_run(model, corrupted)[0, target]), abs=2e-6)
    torch.testing.assert_close(result.restoration, (result.probs.double() - result.p_corrupted)
                               / (result.p_clean - result.p_corrupted))
    if kind == "hidden":
        r = result.restoration
        tol = 4e-6 / abs(result.p_clean - result.p_corrupted)
        assert r[-1, -1].item() == pytest.approx(1.0, abs=tol)  # the final state at the last position
        assert r[:-1, -1].abs().max().item() < tol  # node n elsewhere: no later block, p' unchanged
        assert r[:SUBJECT.start, 0].abs().max().item() < tol  # node 0 before the subject: not corrupted


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("kind,window", [("hidden", 1), ("mlp", 2)])
def test_noise_equals_spliced_reruns(arch, kind, window):
    model, clean, _, _ = _swap_fixture(arch)
    noise, seeds = 0.5, [3, 8]
    width = model.get_input_embeddings().embedding_dim
    hooks = [_noise_hook(noise, seed, width) for seed in seeds]
    corrupted = np.mean([_run(model, clean, [(model.get_input_embeddings(), h)])[0].numpy() for h in hooks], 0)
    target = int(np.abs(_run(model, clean)[0].numpy() - corrupted).argmax())
    result = igc.causal_trace(model, clean, None, target, kind=kind, window=window, noise=noise,
                              subject=SUBJECT, seeds=seeds, batch_size=6, min_gap=GAP)
    expected = _spliced_grid(model, clean, clean, target, kind, window, hooks)
    torch.testing.assert_close(result.probs.double(), torch.tensor(expected), atol=2e-6, rtol=1e-5)
    assert np.ptp(expected) > 2e-5
    assert result.p_corrupted == pytest.approx(corrupted[target], abs=2e-6)


def test_noise_is_seeded_and_reproducible():
    model, clean, _, target = _swap_fixture("llama")
    kwargs = dict(noise=1.0, subject=(2, 5), min_gap=GAP)
    first = igc.causal_trace(model, clean, None, target, seeds=[0, 1], **kwargs)
    again = igc.causal_trace(model, clean, None, target, seeds=[0, 1], **kwargs)
    other = igc.causal_trace(model, clean, None, target, seeds=[2, 3], **kwargs)
    assert torch.equal(first.probs, again.probs) and first.p_corrupted == again.p_corrupted
    assert (first.probs - other.probs).abs().max() > 1e-4  # other draws, another grid
    default = igc.causal_trace(model, clean, None, target, subject=SUBJECT, min_gap=0.0)
    assert default.probs.shape == first.probs.shape  # default: 3 x embedding std, ten draws


def test_float64_exact():
    model = tiny_model("llama", seed=2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 97, (1, 7), generator=gen)
    corrupted = clean.clone()
    corrupted[0, 1:3] = torch.randint(0, 97, (2,), generator=gen)
    target = int((_run(model, clean)[0] - _run(model, corrupted)[0]).abs().argmax())
    result = igc.causal_trace(model, clean, corrupted, target)
    assert result.probs.dtype == torch.float64
    expected = _spliced_grid(model, clean, corrupted, target, "hidden", 1, [None])
    torch.testing.assert_close(result.probs, torch.tensor(expected), atol=1e-12, rtol=1e-10)


def test_embedding_std_against_numpy():
    model = tiny_model("gemma3", seed=0)  # Gemma scales its embedding by sqrt(d) inside the module
    with torch.no_grad():
        values = model.get_input_embeddings()(torch.arange(97)).double().numpy()
    assert igc.embedding_std(model) == pytest.approx(values.std(ddof=1), rel=1e-9)
    assert igc.embedding_std(model, [4, 9, 9]) == pytest.approx(values[[4, 9, 9]].std(ddof=1), rel=1e-9)


def test_rome_window():
    assert list(igc.rome_window(12, 10, 30)) == list(range(7, 17))
    assert list(igc.rome_window(1, 10, 30)) == list(range(1, 6))
    assert list(igc.rome_window(30, 10, 30)) == list(range(25, 31))
    assert list(igc.rome_window(4, 1, 30)) == [4]


def test_bad_input():
    model, clean, corrupted, target = _swap_fixture("llama")
    cases = [
        (dict(corrupted_ids=clean), "min_gap"),  # no corruption: the gap is rounding
        (dict(corrupted_ids=corrupted[:, :-1]), "same length"),
        (dict(corrupted_ids=corrupted.float()), "corrupted_ids"),
        (dict(corrupted_ids=corrupted + 200), "0..96"),
        (dict(corrupted_ids=corrupted, target=97), "target"),
        (dict(corrupted_ids=corrupted, target=True), "target"),
        (dict(corrupted_ids=corrupted, kind="resid"), "kind"),
        (dict(corrupted_ids=corrupted, window=3), "window"),
        (dict(corrupted_ids=corrupted, kind="mlp", window=0), "window"),
        (dict(corrupted_ids=corrupted, batch_size=0), "batch_size"),
        (dict(corrupted_ids=corrupted, min_gap=-0.1), "min_gap"),
        (dict(corrupted_ids=corrupted, subject=SUBJECT), "noise"),
        (dict(corrupted_ids=None), "subject"),
        (dict(corrupted_ids=None, subject=slice(4, 4)), "subject"),
        (dict(corrupted_ids=None, subject=slice(0, 6, 2)), "subject"),
        (dict(corrupted_ids=None, subject=SUBJECT, noise=0.0), "noise"),
        (dict(corrupted_ids=None, subject=SUBJECT, seeds=[]), "seeds"),
    ]
    for kwargs, match in cases:
        kwargs = {"target": target, **kwargs}
        with pytest.raises(ValueError, match=match):
            igc.causal_trace(model, clean, **kwargs)


def _readout(probs, target, foil, quantity):
    """f of (V,) probabilities: p(y) [- p(foil)], log p(y) [- log p(foil) = z_y - z_foil]."""
    values = probs.log() if quantity == "logprob" else probs
    return float(values[target] - (values[foil] if foil is not None else 0.0))


@pytest.mark.parametrize("arch,quantity,with_foil", [("llama", "prob", False), ("gemma3", "prob", False), ("gpt2", "prob", False),
                                                      ("llama", "logprob", False), ("gpt2", "logprob", True),
                                                      ("gemma3", "prob", True)])
def test_atp_states_is_the_derivative_of_a_spliced_rerun(arch, quantity, with_foil):
    """atp_states(s, L) * gap = d/de f(corrupted run with h_L(s) <- h' + e (h - h')) at e = 0, by
    central differences through the model's own forward with hooks (float64), for every readout f."""
    model = tiny_model(arch, seed=11, dtype=torch.float64)
    n = len(_blocks(model))
    gen = torch.Generator().manual_seed(5)
    clean = torch.randint(0, 97, (1, LENGTH), generator=gen)
    corrupted = clean.clone()
    corrupted[0, SUBJECT] = torch.randint(0, 97, (SUBJECT.stop - SUBJECT.start,), generator=gen)
    target = int(_run(model, clean)[0].argmax())
    foil = int(_run(model, corrupted)[0].index_fill(0, torch.tensor([target]), -1.0).argmax()) if with_foil else None  # any other token
    grid = igc.atp_states(model, clean, corrupted, target, quantity=quantity, foil=foil, min_gap=0.0)
    assert grid.shape == (LENGTH, n + 1)
    clean_values, corrupted_values = _record(model, clean, "hidden", 1, n), _record(model, corrupted, "hidden", 1, n)
    gap = _readout(_run(model, clean)[0], target, foil, quantity) - _readout(_run(model, corrupted)[0], target, foil, quantity)
    rng = np.random.default_rng(0)
    cells = [(s, L) for s in range(LENGTH) for L in range(n + 1)]
    for s, L in [cells[i] for i in rng.choice(len(cells), size=12, replace=False)] + [(SUBJECT.stop - 1, 1)]:
        module, is_pre = _hook_points(model, "hidden", L, 1)[0] if L < n + 1 else None
        base, change = corrupted_values[(L, 0)][s], clean_values[(L, 0)][s] - corrupted_values[(L, 0)][s]

        def probe(eps):
            def put(hidden):
                hidden = hidden.clone()
                hidden[:, s] = base + eps * change
                return hidden
            if is_pre:
                hook = (lambda m, a, k: ((put(a[0]),) + a[1:], k) if a else (a, {**k, "hidden_states": put(k["hidden_states"])}))
                return _readout(_run(model, corrupted, pre_hooks=[(module, hook)])[0], target, foil, quantity)
            return _readout(_run(model, corrupted, hooks=[(module, lambda m, a, o: _with_first(o, put(_first(o))))])[0],
                            target, foil, quantity)

        eps = 1e-4
        derivative = (probe(eps) - probe(-eps)) / (2 * eps)
        assert abs(grid[s, L].item() * gap - derivative) <= 1e-7 + 1e-5 * abs(derivative), (s, L)


def test_atp_states_bad_input():
    model = tiny_model("llama", seed=1)
    clean = torch.randint(0, 97, (1, LENGTH))
    with pytest.raises(ValueError, match="same length"):
        igc.atp_states(model, clean, clean[:, :-1], 3)
    with pytest.raises(ValueError, match="target"):
        igc.atp_states(model, clean, clean, 97)
    with pytest.raises(ValueError, match="min_gap"):
        igc.atp_states(model, clean, clean, 3)
    with pytest.raises(ValueError, match="quantity"):
        igc.atp_states(model, clean, clean, 3, quantity="logit")
    with pytest.raises(ValueError, match="foil"):
        igc.atp_states(model, clean, clean, 3, foil=3)
