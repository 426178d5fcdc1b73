"""Two processes converting one packaged model into an empty cache at once (torchrun's ranks, shards
side by side): the first converts under the cache lock, the second waits and loads its folder; no
process writes into another's temporary folder."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import iglens_core as ig

ROOT = Path(__file__).resolve().parents[1]

# The conversion's slow part (reading the GGUF) is replaced by a tiny random Llama with the packaged
# tokenizer, made slow enough (1 s) that the two processes overlap; the lock, the private temporary
# folder, save_pretrained and the rename are the real code.
SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {root!r}]
    import iglens_models as igm
    import iglens_core as ig
    import transformers
    from conftest import tiny_model

    def slow_load(gguf_path):
        with open(Path(igm.CACHE_DIR) / "conversions.log", "a") as log:
            log.write("converted\\n")
        time.sleep(1.0)
        return tiny_model("llama", seed=1, vocab_size=49152), transformers.AutoTokenizer.from_pretrained({tok!r})

    igm._load_gguf = slow_load
    igm.PACKAGED_MODELS["tiny-test"] = lambda: Path("tiny.gguf")
    ig.PACKAGED_MODELS["tiny-test"] = igm.PACKAGED_MODELS["tiny-test"]
    model, tokenizer = ig.load_model("tiny-test", device="cpu")
    print("loaded", model.config.num_hidden_layers, len(tokenizer))
""")


def test_two_processes_on_an_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "load.py"
    script.write_text(SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"),
                                    tok=ig.resolve_model_path(ig.DEFAULT_MODEL)))
    env = dict(os.environ, IGLENS_CACHE=str(cache), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "loaded 3 49152" in out
    assert (cache / "conversions.log").read_text() == "converted\n"  # one converted, the other waited
    assert sorted(path.name for path in cache.iterdir()) == ["conversions.log", "tiny-test", "tiny-test.lock"]
    assert (cache / "tiny-test" / "config.json").exists() and (cache / "tiny-test" / "model.safetensors").exists()
    # the converting process said so; the waiting one found the folder made
    assert sum("converting packaged model 'tiny-test'" in err for _, err in outs) == 1


def test_a_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    import iglens_models as igm

    def broken(gguf_path):
        raise RuntimeError("not a GGUF file")

    monkeypatch.setattr(igm, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(igm, "_load_gguf", broken)
    monkeypatch.setitem(igm.PACKAGED_MODELS, "broken-test", lambda: Path("broken.gguf"))
    try:
        igm.packaged_model_dir("broken-test")
    except RuntimeError as err:
        assert "not a GGUF file" in str(err)
    else:
        raise AssertionError("no error")
    assert [path.name for path in tmp_path.iterdir()] == ["broken-test.lock"]
