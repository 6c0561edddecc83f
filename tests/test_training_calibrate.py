"""The cost model of the model being trained (training/calibrate.py): timed on the configured
SeqRec, cached per model config and machine, and named in the shard set it balanced."""

import json

from dataprep.build import build_shards
from dataprep.cost import load_cost_model
from dataprep.synth import write_synthetic
from training import calibrate
from training.config import ModelConfig


def test_a_model_is_calibrated_once_and_another_model_gets_its_own(tmp_path):
    cfg = ModelConfig(dim=16)
    first = calibrate.cached(cfg, 16, tmp_path)
    m = load_cost_model(first)
    assert m.source == "calibrated:training" and m(16) >= m(2) > 0  # a tiny model may be all overhead
    fit = json.loads(open(first).read())["fit"]
    assert fit["lengths"] == [2, 4, 8, 16] and fit["key"]["model"]["dim"] == 16
    mtime = (tmp_path / first.rsplit("/", 1)[1]).stat().st_mtime_ns
    assert calibrate.cached(cfg, 16, tmp_path) == first  # found, not timed again
    assert (tmp_path / first.rsplit("/", 1)[1]).stat().st_mtime_ns == mtime
    assert calibrate.cached(ModelConfig(dim=16, attention="hstu"), 16, tmp_path) != first
    assert calibrate.model_config(["model.dim=24", "train.epochs=3"]).dim == 24


def test_the_manifest_names_the_calibrated_model_that_balanced_it(tmp_path):
    data = tmp_path / "events.txt"
    write_synthetic(str(data), users=200, items=100, seed=0, fmt="sasrec")
    cm = calibrate.cached(ModelConfig(dim=16), 20, tmp_path / "cache")
    m = build_shards(
        str(data), "sasrec", str(tmp_path / "shards"), world_size=2, batch_size=8, max_len=20, cost_model=cm
    )
    assert m["config"]["cost_model"]["source"] == "calibrated:training"
    assert m["config"]["cost_model"]["a"] == load_cost_model(cm).a
