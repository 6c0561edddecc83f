"""The cost model of the model being trained (training/calibrate.py): timed on the configured
SeqRec on the training device, cached per device name, model config and torch version, named
(with its device) in the shard set it balanced; a noisy fit is measured again, never cached."""

import json

import pytest

from dataprep.build import build_shards
from dataprep.cost import load_cost_model
from dataprep.synth import write_synthetic
from training import calibrate
from training.config import ModelConfig

FAKE_GPU = "FakeGPU H999 (test)"  # the training device's name, injected: no GPU here
CFG = ModelConfig(dim=32)  # big enough that c(L) grows over 2..64 on a shared CPU


def test_a_model_is_calibrated_once_per_device_and_grows_with_length(tmp_path):
    first = calibrate.cached(CFG, 64, tmp_path, device="cpu", name=FAKE_GPU)
    m = load_cost_model(first)
    # a constant fit (every length the same cost) is no cost model: this fails on one
    assert m.source == "calibrated:training" and m(64) > m(2) > 0 and (m.a > 0 or m.b > 0)
    fit = json.loads(open(first).read())["fit"]
    assert fit["lengths"] == [2, 4, 8, 16, 32, 64] and fit["device"] == FAKE_GPU
    assert fit["key"]["model"]["dim"] == 32 and fit["key"]["device"] == FAKE_GPU and fit["key"]["torch"]
    if "noisy" in fit:  # this shared CPU was too loaded for ATTEMPTS measurements: used once, not cached
        assert fit["attempts"] == calibrate.ATTEMPTS and "/noisy/" in first
        assert not list(tmp_path.glob("cost-*.json"))
        return
    mtime = (tmp_path / first.rsplit("/", 1)[1]).stat().st_mtime_ns
    assert calibrate.cached(CFG, 64, tmp_path, device="cpu", name=FAKE_GPU) == first  # found, not timed again
    assert (tmp_path / first.rsplit("/", 1)[1]).stat().st_mtime_ns == mtime
    # another device, another model: their own files
    assert calibrate.cached(CFG, 64, tmp_path, device="cpu", name=FAKE_GPU + " 2") != first
    assert calibrate.model_config(["model.dim=24", "train.epochs=3"]).dim == 24


def test_the_manifest_names_the_training_device_that_was_timed(tmp_path):
    data = tmp_path / "events.txt"
    write_synthetic(str(data), users=200, items=100, seed=0, fmt="sasrec")
    cm = calibrate.cached(CFG, 32, tmp_path / "cache", device="cpu", name=FAKE_GPU)
    m = build_shards(
        str(data), "sasrec", str(tmp_path / "shards"), world_size=2, batch_size=8, max_len=32, cost_model=cm
    )
    assert m["config"]["cost_model"]["source"] == "calibrated:training"
    assert m["config"]["cost_model"]["device"] == FAKE_GPU
    assert m["config"]["cost_model"]["a"] == load_cost_model(cm).a
    # without a name: the trainer's own device (rank_device: the CPU here)
    assert calibrate.training_device() == "cpu"
    assert calibrate.device_name("cpu").startswith("cpu: ")


def _fit(timings, a=0.01, b=2.0, r2=0.99, c0=5.0):
    return {"a": a, "b": b, "c0": c0, "r2": r2, "timings": timings}


GROWING = [[2, 8, 100.0], [4, 8, 180.0], [8, 8, 350.0], [2, 16, 190.0], [4, 16, 350.0], [8, 16, 700.0]]


@pytest.mark.parametrize(
    "fit, why",
    [
        (_fit(GROWING), None),
        (_fit(GROWING, a=0.0, b=0.0), "constant fit"),
        (_fit(GROWING, a=0.0, b=1e-9), "constant fit"),  # growth by rounding only
        (_fit(GROWING, r2=0.85), "r^2 0.850"),
        (_fit([[2, 8, 100.0], [4, 8, 60.0], [8, 8, 350.0]]), "non-monotone timings at batch 8"),
        (_fit([[2, 8, 100.0], [4, 8, 95.0], [8, 8, 350.0]]), None),  # within DIP: noise a fit absorbs
    ],
)
def test_noise_rule(fit, why):
    got = calibrate.noise(fit)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_a_noisy_fit_is_measured_again_and_not_cached(tmp_path, monkeypatch):
    from dataprep import cost

    calls = []

    def flat_step(length, batch):  # every length costs the same: a constant fit, every time
        def step():
            calls.append(length)

        return step

    monkeypatch.setattr(calibrate, "probe", lambda cfg, device="cpu": flat_step)
    monkeypatch.setattr(cost, "_best_time", lambda step, repeats: (step(), 1e-3)[1])
    path = calibrate.cached(CFG, 16, tmp_path, device="cpu", name=FAKE_GPU)
    m = load_cost_model(path)
    assert m.fit["attempts"] == calibrate.ATTEMPTS and "constant fit" in m.fit["noisy"]
    assert "/noisy/" in path and not list(tmp_path.glob("cost-*.json"))  # used once, never found again
    assert len(set(calls)) == 4 and len(calls) == calibrate.ATTEMPTS * 4 * 2


def test_a_training_pool_publishes_its_calibration_for_the_shard_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="training pool 'gpu'"):
        calibrate.from_pool(tmp_path, CFG, 32, "gpu")
    rc = calibrate.main(
        ["--max-len", "32", "--set", "model.dim=32", "--cache-dir", str(tmp_path), "--pool", "gpu", "--device", "cpu"]
    )
    assert rc == 0
    path = calibrate.from_pool(tmp_path, CFG, 32, "gpu")
    assert load_cost_model(path).fit["device"] == calibrate.device_name("cpu")
    with pytest.raises(FileNotFoundError):
        calibrate.from_pool(tmp_path, ModelConfig(dim=48), 32, "gpu")  # another model: its own
