"""iglens_interop: a TransformerLens TransformerBridge or an nnsight LanguageModel gives the numbers of the
Hugging Face model inside it, at every entry point; the wrappers that cannot be attributed exactly are
refused; TransformerLens's hook names for our nodes, heads and neurons."""
import os
import re
from pathlib import Path

import pytest
import torch
import transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bridge and nnsight must not look for anything online

import iglens_causal as igc  # noqa: E402
import iglens_counterfactual as igcf  # noqa: E402
import iglens_core as ig  # noqa: E402
import iglens_dpa as igdpa  # noqa: E402
import iglens_graph as igg  # noqa: E402
import iglens_interop as igi  # noqa: E402
import iglens_tables as igt  # noqa: E402
from conftest import tiny_model  # noqa: E402
from nnsight import LanguageModel  # noqa: E402
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "gpt2", "gemma3")  # Llama with GQA, GPT-2 (LayerNorm, Conv1D), Gemma 3 (post-norms, soft-cap)
CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "gemma3": "Gemma3ForCausalLM"}
IDS = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(3))
PROMPT_LEN = 6


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(ig.resolve_model_path(ig.DEFAULT_MODEL))


def hf_model(arch, vocab_size=97):
    model = tiny_model(arch, seed=ARCHS.index(arch), vocab_size=vocab_size)
    model.config.architectures = [CLASSES[arch]]  # what the bridge reads to pick its adapter
    return model


def boot_bridge(model, tokenizer, **compatibility):
    bridge = TransformerBridge.boot_transformers(f"tiny-{model.config.model_type}", hf_model=model,
                                                 tokenizer=tokenizer, device="cpu")
    if compatibility:
        bridge.enable_compatibility_mode(**compatibility)
    return bridge


@pytest.fixture(scope="module", params=[(kind, arch) for kind in ("bridge", "nnsight") for arch in ARCHS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tokenizer):
    """(the Hugging Face model, the same model wrapped): the bridge switches its model to eager attention,
    so the reference runs eager too; nnsight leaves it as it is."""
    kind, arch = request.param
    reference, inner = hf_model(arch), hf_model(arch)
    if kind == "bridge":
        reference.set_attn_implementation("eager")
        return reference, boot_bridge(inner, tokenizer)
    return reference, LanguageModel(inner, tokenizer=tokenizer)


def same(got, want, what=""):
    """Equal to float32 rounding (float32 models)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert got.shape == want.shape, what
    scale = float(want.abs().max()) if want.numel() else 0.0
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * max(scale, 1e-3)), (what, float((got - want).abs().max()))


def test_collect_and_ig_lens(pair):
    reference, wrapped = pair
    want, got = ig.collect(reference, IDS, PROMPT_LEN, sublayer=True), ig.collect(wrapped, IDS, PROMPT_LEN, sublayer=True)
    same(got.hidden, want.hidden, "hidden")
    same(got.mid, want.mid, "mid")
    same(got.model_probs, want.model_probs, "model_probs")
    for settings in (dict(), dict(estimator="gauss_legendre", steps=8, resolution="sublayer"),
                     dict(estimator="riemann_mid", steps=4, baseline="zero", quantity="logprob", foil=5)):
        a, b = ig.ig_lens(reference, want, **settings), ig.ig_lens(wrapped, got, **settings)
        same(b.values, a.values, f"values {settings}")
        same(b.lens, a.lens, f"lens {settings}")
    same(ig.logit_lens(wrapped, got), ig.logit_lens(reference, want), "logit lens")
    # a trace collected through the wrapper is the model's: the core's checks take either
    ig.ig_lens(reference, got)


def test_components(pair):
    reference, wrapped = pair
    want = ig.components(reference, ig.collect_components(reference, IDS, PROMPT_LEN, sources=True), resolution="all")
    got = ig.components(wrapped, ig.collect_components(wrapped, IDS, PROMPT_LEN, sources=True), resolution="all")
    for name in ("heads", "neurons", "sources", "attn", "mlp", "lens"):
        same(getattr(got, name), getattr(want, name), name)


def test_graphs(pair):
    reference, wrapped = pair
    want = igg.attribution_graph(reference, IDS, PROMPT_LEN, token=1, edges=True)
    got = igg.attribution_graph(wrapped, IDS, PROMPT_LEN, token=1, edges=True)
    for name in ("carried", "readable", "heads", "edges", "neurons", "embeddings", "constants_above"):
        same(getattr(got, name), getattr(want, name), name)
    assert abs(got.delta - want.delta) < 1e-6
    many = list(igg.attribution_graphs(wrapped, IDS, PROMPT_LEN, tokens=[0, 2]))
    same(many[1].carried, list(igg.attribution_graphs(reference, IDS, PROMPT_LEN, tokens=[0, 2]))[1].carried, "graphs")


def test_causal_trace(pair):
    reference, wrapped = pair
    corrupted = IDS.clone()
    corrupted[0, 2] = (corrupted[0, 2] + 7) % 97
    target = int(IDS[0, -1])
    for settings in (dict(kind="hidden", min_gap=1e-9), dict(kind="mlp", window=2, min_gap=1e-9)):
        want = igc.causal_trace(reference, IDS, corrupted, target, **settings)
        got = igc.causal_trace(wrapped, IDS, corrupted, target, **settings)
        same(got.probs, want.probs, f"probs {settings}")
        assert got.p_clean == pytest.approx(want.p_clean, rel=1e-5)
    noise = igc.causal_trace(wrapped, IDS, None, target, subject=(1, 3), seeds=[0, 1], min_gap=1e-9)
    same(noise.probs, igc.causal_trace(reference, IDS, None, target, subject=(1, 3), seeds=[0, 1], min_gap=1e-9).probs, "noise")


def test_counterfactual_graph(pair):
    reference, wrapped = pair
    corrupted = IDS.clone()
    corrupted[0, 2] = (corrupted[0, 2] + 7) % 97
    target = int(IDS[0, -1])
    want = igcf.counterfactual_graph(reference, IDS, corrupted, target, quantity="logprob", edges=True, steps=4)
    got = igcf.counterfactual_graph(wrapped, IDS, corrupted, target, quantity="logprob", edges=True, steps=4)
    for name in ("carried", "carried_mid", "heads", "edges", "neurons"):
        same(getattr(got, name), getattr(want, name), name)


def test_dpa_scores(pair):
    reference, wrapped = pair
    target = int(IDS[0, -1])
    gated = type(reference).__name__ != "GPT2LMHeadModel"  # DPA itself needs gated MLPs
    for method in ("ig_lens", "ig_lens_graph", "atp") + (("dpa",) if gated else ()):
        want = igdpa.dpa_scores(reference, IDS, target, method)
        got = igdpa.dpa_scores(wrapped, IDS, target, method)
        assert got.keys() == want.keys()
        for key in want:
            same(got[key], want[key], f"{method} {key}")


def test_the_wrapped_model_is_left_as_it_was(tokenizer):
    """IG-Lens computes on a view: no hook left on the wrapper's modules, its forward and its own
    tracing unchanged, and a float64 model's patched norms stay in the view."""
    reference, eager = hf_model("llama").double(), hf_model("llama").double()
    eager.set_attn_implementation("eager")  # as the bridge runs its model
    bridge = boot_bridge(hf_model("llama").double(), tokenizer)
    lm = LanguageModel(hf_model("llama").double(), tokenizer=tokenizer)
    def hooks():
        return [(len(m._forward_hooks), len(m._forward_pre_hooks), "_iglens_float32_parts" in m.__dict__)
                for root in (bridge.original_model, lm._module) for m in root.modules()]

    before_bridge = bridge(IDS).detach()  # the bridge wires some hooks of its own on its first run
    with lm.trace(IDS):
        before_lm = lm.output.logits.save()
    hooks_before = hooks()
    for wrapped, plain in ((bridge, eager), (lm, reference)):
        got = ig.ig_lens(wrapped, ig.collect(wrapped, IDS, PROMPT_LEN), estimator="gauss_legendre", steps=4)
        want = ig.ig_lens(plain, ig.collect(plain, IDS, PROMPT_LEN), estimator="gauss_legendre", steps=4)
        assert torch.allclose(got.values, want.values, rtol=0, atol=1e-12)  # float64 end to end
        assert igi.hf_model(wrapped) is igi.hf_model(wrapped)  # one cached view
    assert hooks() == hooks_before  # no hook of ours left on the wrapper's modules, no float64 patch either
    assert torch.equal(bridge(IDS), before_bridge)
    with lm.trace(IDS):
        after_lm = lm.output.logits.save()
    assert torch.equal(after_lm, before_lm)


def test_bridge_names_are_ours_off_by_one(tokenizer):
    """TransformerLens's own cache of the bridge (legacy names, raw weights) holds at tl_node(L) our node
    L, at blocks.{L-1}.hook_resid_mid our mid-block state, and the head and neuron hooks exist."""
    bridge = boot_bridge(hf_model("llama"), tokenizer, no_processing=True)
    trace = ig.collect_components(bridge, IDS, PROMPT_LEN)
    _, cache = bridge.run_with_cache(IDS)
    positions = trace.positions
    for layer in range(trace.n_layers + 1):
        same(cache[igi.tl_node(layer)][0, positions], trace.hidden[layer], igi.tl_node(layer))
    for block in range(1, trace.n_layers + 1):
        same(cache[igi.tl_segment(f"L{block}.attn")][0, positions], trace.mid[block - 1], f"mid {block}")
        same(cache[igi.tl_neuron_hook(block)][0, positions], trace.neurons[block - 1], f"neurons {block}")
        z = cache[igi.tl_head_hook(block)][0, positions]  # (T, H, head_dim)
        same(z.flatten(1), trace.heads[block - 1], f"hook_z {block}")
        assert igi.tl_head_hook(block, "hook_result") in bridge.hook_dict


def test_names_in_tables_and_dicts(tokenizer):
    model = hf_model("gpt2")
    trace = ig.collect_components(model, IDS, PROMPT_LEN)
    frame = igi.with_tl_names(ig.ig_lens(model, trace, resolution="sublayer").to_frame())
    assert frame.loc[frame.label == "L1.attn", "tl_hook"].unique().tolist() == ["blocks.0.hook_resid_mid"]
    assert frame.loc[frame.label == "L3.mlp", "tl_hook"].unique().tolist() == ["blocks.2.hook_resid_post"]
    assert frame.tl_index.isna().all()
    graph = igt.graph_frame(igg.attribution_graphs(model, IDS, PROMPT_LEN, tokens=[0]), tokenizer, top_k=5)
    named = igi.with_tl_names(graph, head_hook="hook_result")
    carried = named[named.kind == "carried"]
    assert (carried.tl_hook == [igi.tl_node(node) for node in carried.node]).all()
    assert igi.tl_node(0) == "blocks.0.hook_resid_pre" and igi.tl_node(3) == "blocks.2.hook_resid_post"
    heads = named[named.kind == "head"]
    assert (heads.tl_hook == [f"blocks.{b - 1}.attn.hook_result" for b in heads.block]).all()
    assert (heads.tl_index == heads["head"]).all()
    neurons = named[named.kind == "neuron"]
    assert (neurons.tl_hook == [f"blocks.{b - 1}.mlp.hook_post" for b in neurons.block]).all()
    assert named[named.kind == "rest"].tl_hook.isna().all()
    parts = ig.components(model, trace)
    heads, neurons = igi.head_dict(parts, token=2), igi.neuron_dict(parts, token=2)
    assert heads[("blocks.1.attn.hook_z", 3)] == float(parts.heads[2, 1, 3])
    assert heads[("blocks.2.attn.b_O", None)] == float(parts.heads[2, 2, -1])
    assert neurons[("blocks.0.mlp.hook_post", 17)] == float(parts.neurons[2, 0, 17])
    n, H = parts.heads.shape[1], parts.heads.shape[2] - 1
    assert len(heads) == n * (H + 1) and sum(heads.values()) == pytest.approx(float(parts.attn[2].sum()), abs=1e-5)
    plain = igi.head_dict(parts.heads[0, :, :-1], hook="hook_result")
    assert list(plain)[:2] == [("blocks.0.attn.hook_result", 0), ("blocks.0.attn.hook_result", 1)]
    assert len(igi.neuron_dict(parts, bias=False)) == n * (parts.neurons.shape[2] - 1)
    for bad in (lambda: igi.tl_node(-1), lambda: igi.tl_head_hook(0), lambda: igi.tl_head_hook(1, "hook_q"),
                lambda: igi.tl_segment("block 3"), lambda: igi.head_dict(torch.zeros(3)),
                lambda: igi.head_dict(parts, token=9)):
        with pytest.raises(ValueError):
            bad()


def test_processed_bridge_is_refused(tokenizer):
    """enable_compatibility_mode() rewrites the Hugging Face weights (folded norms, centred writing
    weights and unembedding, value biases folded): refused, naming the option that keeps them raw;
    with no_processing=True the numbers are the model's."""
    for arch in ("gpt2", "llama"):
        bridge = boot_bridge(hf_model(arch), tokenizer, disable_warnings=True)
        for call in (lambda: ig.collect(bridge, IDS, PROMPT_LEN), lambda: ig.Readout(bridge),
                     lambda: igg.attribution_graph(bridge, IDS, PROMPT_LEN),
                     lambda: igc.causal_trace(bridge, IDS, None, 3, subject=(1, 2)),
                     lambda: igdpa.dpa_scores(bridge, IDS, 3, "ig_lens")):
            with pytest.raises(ValueError, match=r"no_processing=True"):
                call()
    reference = hf_model("gpt2")
    reference.set_attn_implementation("eager")
    bridge = boot_bridge(hf_model("gpt2"), tokenizer, no_processing=True, disable_warnings=True)
    same(ig.components(bridge, ig.collect_components(bridge, IDS, PROMPT_LEN)).heads,
         ig.components(reference, ig.collect_components(reference, IDS, PROMPT_LEN)).heads, "no_processing")


def test_remote_nnsight_model_is_refused(tmp_path, tokenizer):
    """A LanguageModel built from a name without dispatch holds meta weights (the remote / NDIF way)."""
    hf_model("llama").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lm = LanguageModel(str(tmp_path))
    assert not lm.dispatched
    with pytest.raises(ValueError, match="remote"):
        ig.collect(lm, IDS, PROMPT_LEN)
    with pytest.raises(ValueError, match="dispatch=True"):
        igg.attribution_graph(lm, IDS, PROMPT_LEN)
    lm.dispatch()  # now local: accepted
    assert ig.collect(lm, IDS, PROMPT_LEN).hidden.shape[0] == 4


def test_hooked_transformer_and_unknown_objects_are_refused(monkeypatch):
    """TransformerLens 4 removed HookedTransformer; one from TransformerLens < 4 (recognised by its
    class) is refused with the way to the bridge. Without `import iglens_interop`, a wrapper is an error
    that says to import it."""
    HookedTransformer = type("HookedTransformer", (torch.nn.Module,), {"__module__": "transformer_lens.HookedTransformer"})
    with pytest.raises(ValueError, match="boot_transformers"):
        ig.collect(HookedTransformer(), IDS, PROMPT_LEN)
    Other = type("ActivationCache", (), {"__module__": "transformer_lens.ActivationCache"})
    with pytest.raises(ValueError, match="TransformerBridge"):
        ig.Readout(Other())
    monkeypatch.setattr(ig, "_UNWRAPPERS", [])
    with pytest.raises(ValueError, match="import iglens_interop"):
        ig.collect(HookedTransformer(), IDS, PROMPT_LEN)
    assert igi.unwrap(hf_model("llama")) is None  # a Hugging Face model is taken as it is


def _readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Already using TransformerLens or nnsight?", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the README section holds one python example"
    return blocks[0]


def test_readme_example_runs(monkeypatch, tokenizer, capsys):
    """The README section's example, as written, on a tiny Llama with the packaged tokenizer in place
    of the packaged model (`make test` has both; the snippet itself loads the packaged model)."""
    monkeypatch.setattr(ig, "load_model", lambda *args, **kwargs: (hf_model("llama", vocab_size=len(tokenizer)), tokenizer))
    exec(compile(_readme_snippet(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "blocks.0.hook_resid_post" in out and "hook_z" in out
