"""Dual Path Attribution's ablation protocol (issues 23, 34): the batched ablation against a by-hand
reference (one unbatched forward per fraction, the post-softmax weights zeroed at the softmax and
the activations at the MLP's act_fn, as the original's nnsight code does), the BOS and the kinds a
method leaves out against the original's rule written out (lowest score, not counted in N), the
context against the original's offset rule, the methods' scores against finite differences, eager
attention's own weights, the activation function's output and IG-Lens's head shares (the graph and
mask IG: tests/test_dpa_methods.py)."""
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import iglens_dpa as igdpa
import iglens_core as ig
from conftest import blocks, tiny_model

ARCHS = ["llama", "gemma3"]  # both with gated MLPs and GQA (4 query heads, 2 key/value heads)
HEADS, D_FF, LENGTH = 4, 64, 9


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    """A float64 tiny model (randomised norms), a random prompt and its arg-max next token."""
    torch.set_grad_enabled(False)
    model = tiny_model(request.param, seed=3 + ARCHS.index(request.param), dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    target = int(model(ids).logits[0, -1].argmax())
    return request.param, model, ids, target


@contextmanager
def zeroed_by_hand(model, edges=None, neurons=None, edge_add=None):
    """Eager attention with ``torch.nn.functional.softmax`` wrapped: its output (the attention
    weights (1, H, S, S) of the block whose attention is running) times ``edges[block]`` (plus
    ``edge_add[block]``), and a forward hook multiplying each ``mlp.act_fn`` output by
    ``neurons[block]`` (1, S, d_ff). Found by name here, independently of iglens_compare."""
    model.set_attn_implementation("eager")
    current, hooks = [None], []
    softmax = torch.nn.functional.softmax

    def patched(*args, **kwargs):
        out = softmax(*args, **kwargs)
        layer = current[0]
        if edges is not None:
            out = out * edges[layer].to(out)
        if edge_add is not None:
            out = out + edge_add[layer].to(out)
        return out

    for layer, block in enumerate(blocks(model)):
        hooks.append(block.self_attn.register_forward_pre_hook(
            lambda mod, args, layer=layer: current.__setitem__(0, layer)))
        if neurons is not None:
            hooks.append(block.mlp.act_fn.register_forward_hook(
                lambda mod, args, out, layer=layer: out * neurons[layer].to(out)))
    torch.nn.functional.softmax = patched
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax
        for hook in hooks:
            hook.remove()
        model.set_attn_implementation("sdpa")


def prob_by_hand(model, ids, target, **gates):
    with zeroed_by_hand(model, **gates):
        logits = model(ids, use_cache=False).logits[0, -1]
    return float(torch.softmax(logits.double(), -1)[target])


def reference_drops(model, ids, target, edges, neurons, mode, fractions, seed=0):
    """Per fraction: rank every component by its score (descending; exactly equal scores, e.g.
    zeros, in the order of the seed's permutation, dpa_ablation's default tie rule), zero the top
    ceil(N x) or the rest, one unbatched forward each."""
    n, S = len(blocks(model)), ids.shape[1]
    flat = np.concatenate([edges.numpy().ravel(), neurons.numpy().ravel()])
    order = np.lexsort((np.random.default_rng(seed).permutation(flat.size), -flat))
    p_base = prob_by_hand(model, ids, target)
    drops = []
    for x in fractions:
        top = np.zeros(flat.size, bool)
        top[order[:math.ceil(flat.size * x)]] = True
        keep = torch.from_numpy(~top if mode == "disrupt" else top).double()
        edge_keep = keep[:edges.numel()].view(n, 1, HEADS, S, S)
        neuron_keep = keep[edges.numel():].view(n, 1, S, D_FF)
        p = prob_by_hand(model, ids, target, edges=edge_keep, neurons=neuron_keep)
        drops.append((p_base - p) / p_base * 100)
    return np.array(drops)


def random_scores(model, ids, seed):
    gen = torch.Generator().manual_seed(seed)
    n, S = len(blocks(model)), ids.shape[1]
    # scales that differ between edges and neurons, so the pooled ranking mixes both kinds
    return (torch.randn(n, HEADS, S, S, generator=gen, dtype=torch.float64),
            0.7 * torch.randn(n, S, D_FF, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("mode", igdpa.DPA_MODES)
def test_ablation_matches_zeroing_by_hand(case, mode):
    arch, model, ids, target = case
    edges, neurons = random_scores(model, ids, seed=7)
    fractions = list(igdpa.DPA_FRACTIONS) + [0.0, 1.0]
    ours = igdpa.dpa_ablation(model, ids, target, {"edges": edges, "neurons": neurons}, mode=mode,
                            fractions=fractions)
    reference = reference_drops(model, ids, target, edges, neurons, mode, fractions)
    assert ours.shape == (len(fractions),)
    assert np.abs(reference).max() > 1.0  # the ablations move p
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-8)
    # nothing zeroed: no drop (disrupt at x = 0, recover at x = 1)
    assert abs(ours[-2 if mode == "disrupt" else -1]) < 1e-9
    # one row per forward pass gives the same drops as all rows in one pass
    single = igdpa.dpa_ablation(model, ids, target, {"edges": edges, "neurons": neurons}, mode=mode,
                              fractions=fractions, batch_size=1)
    np.testing.assert_allclose(single, ours, rtol=0, atol=1e-9)


def original_drops(model, ids, target, edges, neurons, mode, fractions, context=None):
    """The original's rule written out (ablation_pipe.py, utils.py ComponentCollator), for scores with
    no ties: a kind given as None is not concatenated; components outside the context get the lowest
    score (-inf here, bfloat16's min there); N counts the context only; recover zeroes the rest of
    the context only. One unbatched forward per fraction through the by-hand hooks."""
    n, S = len(blocks(model)), ids.shape[1]
    context = torch.ones(S, dtype=torch.bool) if context is None else torch.as_tensor(context)
    kinds = [(edges, (context[:, None] & context[None, :]).expand(n, HEADS, S, S)),
             (neurons, context[:, None].expand(n, S, D_FF))]
    flat = torch.cat([torch.where(inside, value, -math.inf).flatten() for value, inside in kinds if value is not None])
    inside = torch.cat([inside.flatten() for value, inside in kinds if value is not None])
    order = torch.argsort(flat, descending=True)
    N = int(inside.sum())
    p_base = prob_by_hand(model, ids, target)
    drops = []
    for x in fractions:
        top = torch.zeros(flat.numel(), dtype=torch.bool)
        top[order[:math.ceil(N * x)]] = True
        zero = top if mode == "disrupt" else ~top & inside
        keep, at, gates = (~zero).double(), 0, {}
        for name, (value, _), shape in (("edges", kinds[0], (n, 1, HEADS, S, S)), ("neurons", kinds[1], (n, 1, S, D_FF))):
            if value is not None:
                gates[name] = keep[at:at + value.numel()].view(shape)
                at += value.numel()
        drops.append((p_base - prob_by_hand(model, ids, target, **gates)) / p_base * 100)
    return np.array(drops)


@pytest.mark.parametrize("mode", igdpa.DPA_MODES)
def test_bos_and_left_out_kinds_as_the_original(case, mode):
    """The BOS (context False) and a kind given as None: never zeroed in disrupt, always kept in
    recover, not counted in N (the original's rule, written out independently)."""
    arch, model, ids, target = case
    S = ids.shape[1]
    edges, neurons = random_scores(model, ids, seed=9)
    fractions = list(igdpa.DPA_FRACTIONS) + [0.3, 1.0]
    bos = np.ones(S, bool)
    bos[0] = False
    two = bos.copy()
    two[[0, 4]] = False  # any positions, as the original's mask allows
    for context in (bos, two):
        for given in ({"edges": edges, "neurons": neurons}, {"edges": edges}, {"edges": None, "neurons": neurons}):
            ours = igdpa.dpa_ablation(model, ids, target, given, mode=mode, fractions=fractions, context=context)
            reference = original_drops(model, ids, target, given.get("edges"), given.get("neurons"), mode,
                                       fractions, context=context)
            np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-8)
    # the rule matters: with the BOS counted and ranked the drops differ
    everything = igdpa.dpa_ablation(model, ids, target, {"edges": edges, "neurons": neurons}, mode=mode,
                                    fractions=fractions)
    bos_out = igdpa.dpa_ablation(model, ids, target, {"edges": edges, "neurons": neurons}, mode=mode,
                                 fractions=fractions, context=bos)
    assert np.abs(everything - bos_out).max() > 1e-3
    if mode == "recover":  # x = 1: the whole context kept, nothing zeroed
        assert abs(bos_out[-1]) < 1e-9


def test_left_out_kinds_and_ties(case):
    """Everything scored 0 among the edges, the neurons left out: with ties="index" the flat order is
    kept, with ties="random" the seed's permutation over the ranked components decides."""
    arch, model, ids, target = case
    edges, _ = random_scores(model, ids, seed=8)
    fractions = [1e-3, 0.05, 0.3]
    N = edges.numel()
    for ties, seed, rank in (("index", 0, np.arange(N)), ("random", 3, np.random.default_rng(3).permutation(N))):
        tied = igdpa.dpa_ablation(model, ids, target, {"edges": torch.zeros_like(edges), "neurons": None},
                                  fractions=fractions, ties=ties, seed=seed)
        ordered = torch.from_numpy(N - rank.astype(np.float64)).view_as(edges)  # higher score = earlier
        np.testing.assert_allclose(tied, original_drops(model, ids, target, ordered, None, "disrupt", fractions),
                                   rtol=0, atol=1e-8)
    random_ties = igdpa.dpa_ablation(model, ids, target, {"edges": torch.zeros_like(edges)}, fractions=fractions, seed=3)
    assert np.abs(random_ties - igdpa.dpa_ablation(model, ids, target, {"edges": torch.zeros_like(edges)},
                                                   fractions=fractions, ties="index")).max() > 1e-6


def word_tokenizer(template):
    """A word-level fast tokenizer built offline; ``template`` its single-sequence post-processor
    (e.g. "<bos> $A"), None for a tokenizer that adds nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = ["<pad>", "<bos>", "<eos>", "the", "capital", "of", "france", "is", "paris", "a", "city"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<bos>", 1), ("<eos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def original_context(tokenizer, text):
    """attribution_pipe.py's DataHandler.collate_fn on utils.py's collate_known, written out."""
    prompt = tokenizer.decode(tokenizer.encode(text, add_special_tokens=True))
    encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    start = prompt.find(text)
    end = start + len(text)
    offsets = encoded["offset_mapping"]
    first = next(k for k, (_, e) in enumerate(offsets) if e > start)
    last = next(k + 1 for k, (_, e) in enumerate(offsets) if e >= end - 1)
    return encoded["input_ids"], np.array([first <= k < last for k in range(len(offsets))])


@pytest.mark.parametrize("template", ["<bos> $A", None, "<bos> $A <eos>"])
def test_context_as_the_original_decides(template):
    tokenizer = word_tokenizer(template)
    for text in ("the capital of france is", "paris is a city of france"):
        ids, reference = original_context(tokenizer, text)
        assert ids == tokenizer(text)["input_ids"]
        context = igdpa.dpa_context(tokenizer, torch.tensor([ids]))
        np.testing.assert_array_equal(context, reference)
        assert context.sum() == len(text.split())  # the BOS (and EOS) out, every word in
    # ids encoded without the BOS: every position is context
    plain = tokenizer("the capital of france is", add_special_tokens=False)["input_ids"]
    assert igdpa.dpa_context(tokenizer, plain).all()


@pytest.mark.parametrize("ties", ["index", "random"])
def test_order_ties(ties):
    """Only exactly equal scores tie (as the original's sort); they go by the seed's permutation (or
    the index); distinct scores, however close, go by value, and nothing chains."""
    gen = np.random.default_rng(0)
    x = gen.permutation(1000) * 0.01 - 5.0
    x[[10, 500, 900]] = 10.0 + np.array([1e-9, 0.0, -1e-9])  # close but distinct: by value
    x[[20, 30, 40, 50]] = -20.0  # exactly equal
    order = igdpa.dpa_order(x, ties=ties, seed=5)
    key = np.arange(1000) if ties == "index" else np.random.default_rng(5).permutation(1000)
    assert list(order[:3]) == [10, 500, 900]
    assert list(order[-4:]) == sorted([20, 30, 40, 50], key=lambda i: key[i])
    assert (np.diff(x[order]) <= 0).all() and sorted(order) == list(range(1000))
    # by-hand reference: descending value, exact ties by the key
    reference = sorted(range(1000), key=lambda i: (-x[i], key[i]))
    assert list(order) == reference


@pytest.mark.parametrize("seed", [0, 3, 11])
def test_order_many_ties_against_lexsort(seed):
    """Mostly tied scores (a few distinct values, +0.0 and -0.0 among them, as unscored components leave):
    the order is numpy's lexsort by (-score, the seed's permutation), the definition it implements faster."""
    gen = np.random.default_rng(seed)
    n = int(gen.integers(1, 20_000))
    x = gen.integers(-3, 4, n) * (gen.random(n) < 0.4) * 0.5
    x[gen.random(n) < 0.1] = -0.0
    key = np.random.default_rng(seed).permutation(n)
    np.testing.assert_array_equal(igdpa.dpa_order(x, ties="random", seed=seed), np.lexsort((key, -x)))
    np.testing.assert_array_equal(igdpa.dpa_order(x, ties="index"), np.lexsort((np.arange(n), -x)))


def test_order_does_not_chain():
    """200,000 distinct heavy-tailed scores keep their value order (the earlier single-linkage rule
    left 198,704 of them out of it)."""
    x = np.random.default_rng(1).standard_cauchy(200_000)
    np.testing.assert_array_equal(igdpa.dpa_order(x, ties="random", seed=0), np.argsort(-x, kind="stable"))


def test_order_rejects_bad_tie_rule():
    with pytest.raises(ValueError, match="ties must be"):
        igdpa.dpa_order(np.zeros(3), ties="first")
    with pytest.raises(ValueError, match="seed must be"):
        igdpa.dpa_order(np.zeros(3), seed=-1)


def test_areas_against_trapezoids_by_hand():
    gen = np.random.default_rng(1)
    disrupt, recover = 100 * gen.random((5, 10)), 100 * gen.random((5, 10)) - 20
    areas = igdpa.dpa_areas(disrupt, recover)
    xs = list(igdpa.DPA_FRACTIONS)

    def trapezoid(points):
        points = sorted(points)
        return sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))

    expected_d = trapezoid([(1e-10, 100.0)] + [(x, 100 - disrupt[:, i].mean()) for i, x in enumerate(xs)])
    expected_r = trapezoid([(1e-6, 0.0), (1.0, 100.0)] + [(x, 100 - recover[:, i].mean()) for i, x in enumerate(xs)])
    assert math.isclose(areas["disturb_aoc"], expected_d, rel_tol=1e-12)
    assert math.isclose(areas["recover_aoc"], expected_r, rel_tol=1e-12)
    assert math.isclose(areas["total"], expected_r - expected_d, rel_tol=1e-12)
    bare = igdpa.dpa_areas(disrupt, recover, anchors=False)
    assert math.isclose(bare["disturb_aoc"], trapezoid([(x, 100 - disrupt[:, i].mean()) for i, x in enumerate(xs)]),
                        rel_tol=1e-12)
    # log scale: the trapezoid over ln x, divided by its range; the fractions are evenly spaced in
    # ln x (step 1.8), so it is the mean height with half weight at both ends
    log = igdpa.dpa_areas(disrupt, recover, scale="log")
    y = 100 - recover.mean(0)
    assert math.isclose(log["recover_aoc"], (y.sum() - (y[0] + y[-1]) / 2) / 9, rel_tol=1e-12)
    flat = igdpa.dpa_areas(np.full((2, 10), 30.0), np.full((2, 10), 30.0), scale="log")
    assert math.isclose(flat["disturb_aoc"], 70.0) and math.isclose(flat["total"], 0.0, abs_tol=1e-12)
    # cap: each item's negative drops (p rose) count as 0 before the mean; NaN entries stay out
    recover[0, 3] = -500.0
    recover[1, 3] = np.nan
    capped = igdpa.dpa_areas(disrupt, recover, cap=True)
    kept = [(x, 100 - np.nanmean(np.maximum(recover[:, i], 0))) for i, x in enumerate(xs)]
    assert math.isclose(capped["recover_aoc"], trapezoid([(1e-6, 0.0), (1.0, 100.0)] + kept), rel_tol=1e-12)
    assert capped["recover_aoc"] < igdpa.dpa_areas(disrupt, recover)["recover_aoc"]
    assert math.isclose(capped["disturb_aoc"], expected_d, rel_tol=1e-12)  # disrupt drops here are all >= 0
    with pytest.raises(ValueError, match="cap must be True or False, got 'yes'"):
        igdpa.dpa_areas(disrupt, recover, cap="yes")


def test_atp_against_autograd_and_finite_differences(case):
    """AtP = a * d p / d a for every edge and neuron, against autograd through the by-hand hooks
    (an additive zero on every softmax output, a unit gate on every act_fn output), and against a
    central difference for a few entries (coarse: transformers runs the eager softmax in float32)."""
    arch, model, ids, target = case
    n, S = len(blocks(model)), ids.shape[1]
    atp = igdpa.dpa_scores(model, ids, target, "atp_prob")  # AtP on p(y)
    logit = igdpa.dpa_scores(model, ids, target, "atp")  # DPA's AtP: on the target logit
    weights = igdpa.dpa_scores(model, ids, target, "activation")["edges"]
    add = torch.zeros(n, 1, HEADS, S, S, dtype=torch.float64, requires_grad=True)
    gate = torch.ones(n, 1, S, D_FF, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad(), zeroed_by_hand(model, edge_add=add, neurons=gate):
        logits = model(ids, use_cache=False).logits[0, -1]
        prob_grads = torch.autograd.grad(torch.softmax(logits, -1)[target], (add, gate), retain_graph=True)
        logit_grads = torch.autograd.grad(logits[target], (add, gate))
    for ours, (by_add, by_gate) in ((atp, prob_grads), (logit, logit_grads)):
        assert float(ours["edges"].abs().max()) > 1e-5 and float(ours["neurons"].abs().max()) > 1e-6
        torch.testing.assert_close(ours["edges"], weights * by_add[:, 0], rtol=1e-7, atol=1e-14)
        torch.testing.assert_close(ours["neurons"], by_gate[:, 0], rtol=1e-7, atol=1e-14)
    step = 1e-2
    for layer, head, query, key in [(0, 1, S - 1, 2), (n - 1, 3, S - 1, S - 1)]:
        probs = []
        for sign in (1, -1):
            shift = torch.zeros(n, 1, HEADS, S, S, dtype=torch.float64)
            shift[layer, 0, head, query, key] = sign * step * weights[layer, head, query, key]
            probs.append(prob_by_hand(model, ids, target, edge_add=shift))
        assert math.isclose(float(atp["edges"][layer, head, query, key]), (probs[0] - probs[1]) / (2 * step),
                            rel_tol=2e-2)
    # the earlier names give the same scores
    for old, new in (("grad_x_act", logit), ("atp_last", igdpa.dpa_scores(model, ids, target, "atp_prob_last"))):
        scores = igdpa.dpa_scores(model, ids, target, old)
        torch.testing.assert_close(scores["edges"], new["edges"], rtol=0, atol=0)
    # the control: AtP on the last query row and position only
    last = igdpa.dpa_scores(model, ids, target, "atp_prob_last")
    torch.testing.assert_close(last["edges"][:, :, -1], atp["edges"][:, :, -1], rtol=0, atol=0)
    torch.testing.assert_close(last["neurons"][:, -1], atp["neurons"][:, -1], rtol=0, atol=0)
    assert float(last["edges"][:, :, :-1].abs().max()) == 0 and float(last["neurons"][:, :-1].abs().max()) == 0


def test_activation_scores_are_the_models_own(case):
    arch, model, ids, target = case
    scores = igdpa.dpa_scores(model, ids, target, "activation")
    eager = tiny_model(arch, seed=3 + ARCHS.index(arch), dtype=torch.float64)
    eager.set_attn_implementation("eager")
    acts = {}
    hooks = [block.mlp.down_proj.register_forward_pre_hook(
        lambda mod, args, layer=layer: acts.__setitem__(layer, args[0][0]))
        for layer, block in enumerate(blocks(eager))]
    attentions = eager(ids, output_attentions=True, use_cache=False).attentions
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(scores["edges"], torch.cat(attentions), rtol=0, atol=1e-7)  # float32 softmax
    torch.testing.assert_close(scores["neurons"], torch.stack([acts[i] for i in range(len(acts))]).abs(),
                               rtol=1e-6, atol=1e-7)  # downstream of the float32 softmax


def test_split_activation_baselines(case):
    """attn_act: the attention weights alone; mlp_act: the activation function's output alone, signed
    (the original's ``mlp.act_fn.output``), read here by a hook found by name."""
    arch, model, ids, target = case
    attn, mlp = (igdpa.dpa_scores(model, ids, target, method) for method in ("attn_act", "mlp_act"))
    assert attn["neurons"] is None and mlp["edges"] is None
    torch.testing.assert_close(attn["edges"], igdpa.dpa_scores(model, ids, target, "activation")["edges"],
                               rtol=0, atol=0)
    outputs = {}
    hooks = [block.mlp.act_fn.register_forward_hook(lambda mod, args, out, layer=layer: outputs.__setitem__(layer, out[0]))
             for layer, block in enumerate(blocks(model))]
    model(ids)
    for hook in hooks:
        hook.remove()
    expected = torch.stack([outputs[i] for i in range(len(outputs))])
    assert float(expected.min()) < 0  # signed, not |a|
    torch.testing.assert_close(mlp["neurons"], expected, rtol=1e-6, atol=1e-7)  # eager vs sdpa attention before it


def test_ig_lens_edges_add_up_to_head_shares(case):
    arch, model, ids, target = case
    S = ids.shape[1]
    trace = ig.collect_components(model, torch.cat([ids, torch.tensor([[target]])], 1), S)
    for method, estimator in (("ig_lens", "prediction_aware"), ("ig_lens_gauss", "gauss_legendre")):
        scores = igdpa.dpa_scores(model, ids, target, method, steps=8)
        parts = ig.components(model, trace, steps=8, estimator=estimator)
        torch.testing.assert_close(scores["edges"][:, :, S - 1].sum(-1), parts.heads[0, :, :-1], rtol=0, atol=1e-9)
        torch.testing.assert_close(scores["neurons"][:, S - 1], parts.neurons[0, :, :-1], rtol=0, atol=1e-9)
        assert float(scores["edges"][:, :, :S - 1].abs().max()) == 0
        assert float(scores["neurons"][:, :S - 1].abs().max()) == 0
        assert float(scores["edges"].abs().max()) > 1e-4


def test_exhaustive_and_random(case):
    arch, model, ids, target = case
    n, S = len(blocks(model)), ids.shape[1]
    scores = igdpa.dpa_scores(model, ids, target, "exhaustive", subset=6, seed=4)
    flat = torch.cat([scores["edges"].flatten(), scores["neurons"].flatten()])
    chosen = torch.nonzero(flat).flatten()
    assert 1 <= len(chosen) <= 6
    p_base = prob_by_hand(model, ids, target)
    for index in chosen.tolist():
        keep = torch.ones(flat.numel(), dtype=torch.float64)
        keep[index] = 0
        p = prob_by_hand(model, ids, target, edges=keep[:scores["edges"].numel()].view(n, 1, HEADS, S, S),
                         neurons=keep[scores["edges"].numel():].view(n, 1, S, D_FF))
        assert math.isclose(float(flat[index]), p_base - p, rel_tol=0, abs_tol=1e-10)
    again = igdpa.dpa_scores(model, ids, target, "random", seed=5)
    first = igdpa.dpa_scores(model, ids, target, "random", seed=5)
    torch.testing.assert_close(again["edges"], first["edges"], rtol=0, atol=0)
    assert not torch.equal(igdpa.dpa_scores(model, ids, target, "random", seed=6)["edges"], first["edges"])


def test_bad_input(case):
    arch, model, ids, target = case
    scores = {"edges": None, "neurons": None}
    with pytest.raises(ValueError, match="mode must be one of .*disrupt.*'sideways'"):
        igdpa.dpa_ablation(model, ids, target, scores, mode="sideways")
    with pytest.raises(ValueError, match=r"fractions must be .* in \[0, 1\].*1.5"):
        igdpa.dpa_ablation(model, ids, target, scores, fractions=[0.1, 1.5])
    with pytest.raises(ValueError, match=r"target must be a token id in 0\.\.96, got 97"):
        igdpa.dpa_ablation(model, ids, 97, scores)
    with pytest.raises(ValueError, match=r"scores\['edges'\] must have shape \(3, 4, 9, 9\), got \(3, 4, 9\)"):
        igdpa.dpa_ablation(model, ids, target, {"edges": torch.zeros(3, 4, 9)})
    with pytest.raises(ValueError, match="scores must be a dict with keys"):
        igdpa.dpa_ablation(model, ids, target, {"heads": torch.zeros(3)})
    with pytest.raises(ValueError, match="must be finite"):
        igdpa.dpa_ablation(model, ids, target, {"neurons": torch.full((3, 9, 64), math.nan)})
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1 or None, got 0"):
        igdpa.dpa_ablation(model, ids, target, scores, batch_size=0)
    with pytest.raises(ValueError, match=r"token ids must lie in 0\.\.96"):
        igdpa.dpa_ablation(model, ids + 200, target, scores)
    with pytest.raises(ValueError, match="method must be one of .*'atp'.*'magic'"):
        igdpa.dpa_scores(model, ids, target, "magic")
    with pytest.raises(ValueError, match="subset must be an integer >= 1, got 0"):
        igdpa.dpa_scores(model, ids, target, "exhaustive", subset=0)
    with pytest.raises(ValueError, match="nothing to rank"):
        igdpa.dpa_ablation(model, ids, target, {"edges": None, "neurons": None})
    with pytest.raises(ValueError, match=r"context must be None or \(9,\) booleans .*int64 of shape \(9,\)"):
        igdpa.dpa_ablation(model, ids, target, {"edges": torch.zeros(3, 4, 9, 9)}, context=np.ones(9, int))
    with pytest.raises(ValueError, match=r"context must be .*none True"):
        igdpa.dpa_scores(model, ids, target, "exhaustive", context=np.zeros(9, bool))
    with pytest.raises(ValueError, match=r"disrupt drops must have shape \(items, 10\), got \(1, 3\)"):
        igdpa.dpa_areas(np.zeros(3), np.zeros(10))
    with pytest.raises(ValueError, match="scale"):
        igdpa.dpa_areas(np.zeros(10), np.zeros(10), scale="ln")


def test_kept_filter_as_the_original():
    """attribution_pipe.py's filter written out: arg-max = target, p > 0.1, the target's token string
    longer than one character, at most 400 (here max_context) context tokens."""
    from iglens_facts import tiny_model as facts_tiny
    tokenizer = word_tokenizer("<bos> $A")
    model = facts_tiny("llama", seed=3, vocab_size=11)
    ids = torch.tensor([tokenizer("the capital of france is")["input_ids"]])  # <bos> + 5 words: context 5
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits[0, -1].double(), -1)
    seen = set()
    for target in range(11):
        for max_context in (4, 5):
            for min_prob in (0.0, 0.1):
                want = (int(probs.argmax()) == target and float(probs[target]) > min_prob
                        and len(tokenizer.convert_ids_to_tokens([target])[0]) > 1 and 5 <= max_context)
                kept, p = igdpa.dpa_kept(model, tokenizer, ids, target, min_prob=min_prob, max_context=max_context)
                assert kept == want and abs(p - float(probs[target])) < 1e-6, (target, max_context, min_prob)
                seen.add(kept)
    assert seen == {True, False}  # both outcomes met (the arg-max is a word of several letters)
    with pytest.raises(ValueError, match="max_context"):
        igdpa.dpa_kept(model, tokenizer, ids, 3, max_context=0)
