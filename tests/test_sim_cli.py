"""`python -m benchmarks.sim`: table, JSON, PNG plots, calibration from benchmark files,
clear one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sim import calibration
from benchmarks.sim.config import SimConfig
from benchmarks.sim.report import ftrec_config, run

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "--set",
    "job.days=3",
    "--set",
    "job.seeds=2",
    "--set",
    "sweep.scales=[1024, 98304]",
    "--set",
    "sweep.replica_groups=[1, 12]",
    "--set",
    "sweep.mtbf_min=[18, 60]",
    "--set",
    "balance.world_sizes=[8, 64]",
    "--set",
    "balance.windows=1",
]


def sim(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.sim", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_cli_writes_table_json_and_plots(tmp_path):
    p = sim("--out", str(tmp_path), "--bench-dir", str(tmp_path / "none"), *SMALL)
    assert p.returncode == 0, p.stderr
    assert "effective training time" in p.stdout and "Paper check" in p.stdout
    rep = json.loads((tmp_path / "sim.json").read_text())
    assert set(rep["results"]) == {"sync", "fthsdp"}
    assert rep["paper"]["within_tolerance"] == {"sync": True, "fthsdp": True}
    assert [r["gpus"] for r in rep["sweeps"]["scale"]] == [1024, 98304]
    assert [r["world_size"] for r in rep["bubbles"]["rows"]] == [8, 64]
    for name in ("ett-vs-scale", "ett-vs-groups", "ett-vs-failure-rate", "bubble-vs-world"):
        png = tmp_path / f"sim-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "job.gpus=abc"], "job.gpus"),
        (["--config", "/nonexistent/sim.toml"], "config file /nonexistent/sim.toml not found"),
        (["--set", "balance.lengths=/nonexistent/lengths.txt"], "balance.lengths"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, args, needle):
    p = sim("--out", str(tmp_path), "--no-sweeps", *args)
    assert p.returncode == 2
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "sim.json").exists()


def test_calibration_reads_benchmark_files(tmp_path):
    (tmp_path / "ftcore.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"scenario": "crash", "failover_s": {"median": 0.25}, "heal_s": 1.5, "stall_per_failure_s": 0.75}
                ]
            }
        )
    )
    (tmp_path / "dataprep.json").write_text(
        json.dumps({"manifest": {"config": {"cost_model": {"a": 1, "b": 2, "c0": 3}}}})
    )
    cal = calibration.load(tmp_path)
    assert {k: v["value"] for k, v in cal["ftcore"].items()} == {
        "failover_s": 0.25,
        "heal_s": 1.5,
        "stall_per_failure_s": 0.75,
        "step_overhead": 0.0,
    }
    assert cal["ftcore"]["heal_s"]["source"].endswith("ftcore.json")
    assert cal["ftcore"]["step_overhead"]["source"] == "default"
    assert {k: cal["cost_model"][k] for k in "abc0" if k in cal["cost_model"]} == {"a": 1.0, "b": 2.0}
    cfg = ftrec_config(SimConfig(), cal)
    assert cfg.fthsdp.reconfigure_s == 0.25 and cfg.fthsdp.heal_s == 1.5
    assert cfg.fthsdp.join_stall_s == pytest.approx(0.5)
    assert {k.name: k.ft_detect_s for k in cfg.failures.kinds}["crash"] == 0.0
    # ftrec's sub-second failover leaves mostly the degraded time of the group being replaced
    res = run(cfg, ("fthsdp",), seeds=2)
    assert res["fthsdp"]["ett"]["mean"] > 0.9
    assert res["fthsdp"]["stall_per_failure_min"]["mean"] < 0.1


def test_calibration_defaults_when_absent(tmp_path):
    cal = calibration.load(tmp_path)
    assert all(v["source"] == "default" for v in cal["ftcore"].values())
    assert cal["cost_model"]["source"].startswith("default")
    # the default cost model is dataprep's own, not a copy that can drift from it
    from dataprep.cost import DEFAULT

    assert {k: cal["cost_model"][k] for k in ("a", "b", "c0")} == {"a": DEFAULT.a, "b": DEFAULT.b, "c0": DEFAULT.c0}


def test_calibration_ignores_unusable_values(tmp_path):
    (tmp_path / "ftcore.json").write_text(json.dumps({"failover_s": -1, "heal_s": "fast", "step_overhead": 3}))
    (tmp_path / "training.json").write_text(json.dumps({"bench": {"step_overhead": 0.04, "step_s": 0.02}}))
    cal = calibration.load(tmp_path)
    assert cal["ftcore"]["failover_s"]["source"] == "default"
    assert cal["ftcore"]["heal_s"]["source"] == "default"
    assert cal["ftcore"]["step_overhead"] == {"value": 0.04, "source": str(tmp_path / "training.json")}
    assert cal["step_s"]["value"] == 0.02
    assert ftrec_config(SimConfig(), cal).fthsdp.step_overhead == 0.04


def test_example_config_runs():
    from benchmarks.sim.config import load

    cfg = load(ROOT / "benchmarks" / "sim" / "example.toml", ["job.days=5", "job.seeds=2"])
    assert cfg.job.gpus == 16384 and cfg.checkpoint.policy == "young_daly"
    res = run(cfg)
    assert 0 < res["sync"]["ett"]["mean"] < res["fthsdp"]["ett"]["mean"] < 1
