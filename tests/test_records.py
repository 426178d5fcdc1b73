"""Per-item records of long notebook runs (iglens_tables.ItemRecords, in_shard): a run resumes."""
import numpy as np
import pandas as pd
import pytest
import torch

import iglens_tables as igt


def test_in_shard_splits_the_items_into_disjoint_shards_that_cover_them():
    rng = np.random.default_rng(0)
    for k in rng.integers(1, 9, size=5):
        owners = [[r for r in range(k) if igt.in_shard(i, f"{r}/{k}")] for i in range(50)]
        assert all(len(o) == 1 for o in owners)  # every item in exactly one shard
        assert [o[0] for o in owners] == [i % k for i in range(50)]
    assert all(igt.in_shard(i, "") for i in range(10))


@pytest.mark.parametrize("bad", ["2/2", "-1/2", "1", "a/b", "1/0", "1/2/3", 3, None])
def test_in_shard_refuses_a_bad_shard_naming_it(bad):
    with pytest.raises(ValueError, match="shard must be"):
        igt.in_shard(0, bad)


def test_records_round_trip_and_resume(tmp_path):
    rng = np.random.default_rng(1)
    settings = dict(model="m", steps=16, methods=("a", "b"))
    records = igt.ItemRecords(tmp_path / "rec", settings)
    curves = pd.DataFrame(dict(id="x/1", method=rng.choice(["a", "b"], 20), drop=rng.normal(size=20)))
    gaps = pd.DataFrame(dict(gap=rng.normal(size=1)))
    assert "x/1" not in records
    records.save("x/1", curves=curves, gaps=gaps, empty=pd.DataFrame())
    assert "x/1" in records and "x" not in records  # the id is quoted, not a path
    again = igt.ItemRecords(tmp_path / "rec", dict(settings, methods=["a", "b"]))  # as JSON stores it
    loaded = again.load("x/1")
    assert sorted(loaded) == ["curves", "empty", "gaps"]
    pd.testing.assert_frame_equal(loaded["curves"], curves)
    pd.testing.assert_frame_equal(loaded["gaps"], gaps)
    assert loaded["empty"].empty


def test_records_refuse_other_settings_and_half_written_items(tmp_path):
    igt.ItemRecords(tmp_path, dict(model="m", steps=16)).save("a", curves=pd.DataFrame(dict(v=[1.0])))
    with pytest.raises(ValueError, match=r"steps: 16 in .* 8 now"):
        igt.ItemRecords(tmp_path, dict(model="m", steps=8))
    records = igt.ItemRecords(tmp_path, dict(model="m", steps=16))
    (tmp_path / "a.done.parquet").unlink()  # a run killed before its marker: the item is not done
    assert "a" not in records
    with pytest.raises(KeyError, match="no complete record"):
        records.load("a")
    with pytest.raises(ValueError, match="table names"):
        records.save("b", done=pd.DataFrame())
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "z.curves.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="no settings.json"):
        igt.ItemRecords(loose, {})


def test_records_refuse_another_models_weights_and_keep_the_first(tmp_path):
    import torch
    from conftest import tiny_model
    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    settings = dict(model="tiny", steps=4)
    records = igt.ItemRecords(tmp_path / "rec", settings, model=model)
    records.save("a", curves=pd.DataFrame(dict(x=[1.0])))
    assert "a" in igt.ItemRecords(tmp_path / "rec", settings, model=model)          # same weights resume
    assert "a" in igt.ItemRecords(tmp_path / "rec", settings, model=model.double())  # another dtype of them too
    with pytest.raises(ValueError, match="another model's weights"):
        igt.ItemRecords(tmp_path / "rec", settings, model=other)
    with torch.no_grad():  # one sampled weight moved by 10%: refused as well
        model.get_input_embeddings().weight.view(-1)[0] *= 1.1
    with pytest.raises(ValueError, match="another model's weights"):
        igt.ItemRecords(tmp_path / "rec", settings, model=model)
    igt.ItemRecords(tmp_path / "old", settings).save("a", curves=pd.DataFrame(dict(x=[1.0])))  # records without one
    assert "a" in igt.ItemRecords(tmp_path / "old", settings, model=other)                  # adopt the model given
    with pytest.raises(ValueError, match="another model's weights"):
        igt.ItemRecords(tmp_path / "old", settings, model=model)


def test_object_frame_round_trips_nested_results_bit_for_bit(tmp_path):
    """A notebook's per-item result through object_frame, ItemRecords (parquet) and frame_object: every float
    bit for bit (random float64 and float32 arrays with NaN, infinities, -0.0 and subnormals), ints, bools,
    text, None, nested dicts; compared by their bytes, not by value."""
    gen = np.random.default_rng(7)
    wide = gen.standard_normal((3, 5)) * 10.0 ** gen.integers(-300, 300, (3, 5))
    wide.flat[:4] = [np.nan, np.inf, -0.0, 5e-324]
    value = {"scores": {"IG-Lens": wide, "narrow": gen.standard_normal(7).astype(np.float32)},
             "named": {"a": np.int64(3), "b": 2}, "effects": None, "flags": np.array([True, False]),
             "p": float(gen.random()), "half": np.float64(np.nan), "text": "Ḩanoi \"x\"", "empty": np.zeros((0, 4)),
             "patch": {"probs": gen.random(6), "aligned": np.bool_(True)}}
    store = igt.ItemRecords(tmp_path / "r", {"seed": 0})
    store.save("item/1", record=igt.object_frame(value))
    back = igt.frame_object(igt.ItemRecords(tmp_path / "r", {"seed": 0}).load("item/1")["record"])
    assert set(back) == set(value)
    for got, want in ((back["scores"]["IG-Lens"], wide), (back["scores"]["narrow"], value["scores"]["narrow"]),
                      (back["flags"], value["flags"]), (back["patch"]["probs"], value["patch"]["probs"]),
                      (back["empty"], value["empty"])):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    assert back["named"] == {"a": 3, "b": 2} and back["effects"] is None and back["text"] == value["text"]
    assert back["p"] == value["p"] and np.isnan(back["half"]) and back["patch"]["aligned"] is True
    with pytest.raises(ValueError, match="numeric numpy arrays, got Tensor"):
        igt.object_frame({"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="got ndarray"):
        igt.object_frame({"x": np.array(["a", "b"])})
