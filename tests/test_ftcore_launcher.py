"""ftcore's launcher on its own: ftcore.launcher.Launcher runs the toy worker without the trainer's
front end (training/launch.py), and ftcore imports nothing of the rest of the repository."""

import ast
import json
from pathlib import Path

import pytest
from conftest import ROOT, run_python

from ftcore.launcher import TOY, LaunchConfig, Launcher

OTHERS = {"training", "dataprep", "ftrec_airflow", "benchmarks", "dags"}

# The launch in a process of its own: what it imported is printed as its last line.
SCRIPT = """
import json, sys
from ftcore.launcher import LaunchConfig, Launcher
cfg = LaunchConfig(replica_groups=2, out=sys.argv[1], faults=sys.argv[2], timeout=120,
                   extra=["--steps", "30", "--step-sleep", "0.04"])
code = Launcher(cfg).run()
print("imported", json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[3:]))))
sys.exit(code)
"""


def imports(folder: Path) -> dict[str, set[str]]:
    """Each module file under folder -> the top-level packages it imports."""
    out = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def test_ftcore_imports_nothing_of_the_repository_and_training_no_airflow_glue():
    ftcore = {f: n & OTHERS for f, n in imports(ROOT / "ftcore").items() if n & OTHERS}
    assert not ftcore, f"ftcore depends on nothing else in the repository: {ftcore}"
    training = {f: n & {"ftrec_airflow"} for f, n in imports(ROOT / "training").items() if "ftrec_airflow" in n}
    assert not training, f"training imports the Airflow glue: {training}"


def test_the_worker_module_is_a_parameter(tmp_path):
    """The base launcher runs any module: `-m MODULE` with the toy's arguments; a spare preloads
    only the worker unless a front end names more."""
    la = Launcher(LaunchConfig(out=str(tmp_path), worker="some.worker", shards="/data", extra=["--x", "1"]))
    assert la.worker_argv(1) == ["--out", str(tmp_path), "--shards", "/data", "--x", "1"]
    assert la.spare_preload() == [] and la.worker_module() == "some.worker"
    words = la.torchrun_command(1).split()
    assert words[words.index("-m") + 1 :] == ["some.worker", *la.worker_argv(1)]
    assert LaunchConfig().worker == TOY


@pytest.mark.integ
@pytest.mark.slow
def test_ftcore_launcher_alone_restarts_a_killed_toy_group_that_heals_identical(tmp_path):
    out, plan = tmp_path / "run", tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "kill", "group": 1, "at_step": 10}]}))
    r = run_python(["-c", SCRIPT, str(out), str(plan), *sorted(OTHERS)], 180)
    assert r.returncode == 0, r.stdout[-4000:]
    assert r.stdout.strip().splitlines()[-1] == "imported []", r.stdout[-2000:]
    assert not (out / "timeline.json").exists(), "the timeline is the trainer front end's, not ftcore's"
    started = [json.loads(x.split(" ", 2)[2]) for x in r.stdout.splitlines() if x.startswith("[launch] group_started ")]
    restarted = [e["group"] for e in started if e["incarnation"] == 1]
    assert restarted == [1], r.stdout[-3000:]
    s0, s1 = ((out / f"replica_{g}" / "state.safetensors").read_bytes() for g in (0, 1))
    assert s0 == s1, "the restarted group did not heal to the other group's state"
