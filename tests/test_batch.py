"""collect_batch: left-padded batched traces equal one-at-a-time collect traces."""
import pytest
import torch

import iglens_core as ig
import iglens_data as igd
from conftest import ARCHS, tiny_model


def _sequences(model, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen)
        out.append((ids, max(1, length - 2 - i % 4)))  # different answer lengths too
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_traces_equal_single_traces(arch):
    model = tiny_model(arch, seed=ARCHS.index(arch))
    sequences = _sequences(model, [12, 5, 9, 17, 7, 12, 3])
    batched = igd.collect_batch(model, sequences, batch_size=3, sublayer=True)
    assert len(batched) == len(sequences)
    for (ids, prompt_len), got in zip(sequences, batched):
        want = ig.collect(model, ids, prompt_len, sublayer=True)
        assert got.prompt_len == want.prompt_len
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.targets, want.targets)
        assert torch.equal(got.positions, want.positions)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.mid, want.mid, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.model_probs, want.model_probs, atol=1e-5, rtol=1e-5)


def test_positions_matter_for_absolute_position_models():
    """The check can fail: without position ids a padded GPT-2 row would differ."""
    model = tiny_model("gpt2", seed=3)
    (short, prompt_len), (long, _) = _sequences(model, [6, 11])
    width = long.shape[1]
    padded = torch.cat([torch.zeros(1, width - 6, dtype=torch.long), short], 1)
    mask = torch.cat([torch.zeros(1, width - 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    with torch.no_grad():
        naive = model(input_ids=padded, attention_mask=mask).logits[0, -1]
        single = model(input_ids=short).logits[0, -1]
    assert (naive - single).abs().max() > 1e-3
    got = igd.collect_batch(model, [(short, prompt_len), (long, 5)], batch_size=2)[0]
    torch.testing.assert_close(got.model_probs, ig.collect(model, short, prompt_len).model_probs,
                               atol=1e-5, rtol=1e-5)


def test_batch_of_traces_feeds_ig_lens():
    model = tiny_model("llama")
    sequences = _sequences(model, [10, 6])
    for trace in igd.collect_batch(model, sequences):
        attribution = ig.ig_lens(model, trace)
        assert attribution.residual < 1e-6
        torch.testing.assert_close(attribution.p_final, trace.model_probs, atol=1e-5, rtol=1e-5)


def test_bad_batch_input():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="batch_size"):
        igd.collect_batch(model, _sequences(model, [6]), batch_size=0)
    with pytest.raises(ValueError, match="prompt_len"):
        igd.collect_batch(model, [(torch.arange(5), 5)])
