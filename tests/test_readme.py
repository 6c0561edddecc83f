"""README's commands still work. The step-by-step block is read from README.md itself: its cheap
commands run as written, in a folder of their own (dataprep builds and verifies the shard set
of ../shared/data/video.txt, a checkpoint key is made), and each command too long for a test
(training, the launch, the scale model) answers `--help` with its usage. A command added to
the block is tried the same way."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RUN_AS_WRITTEN = {("dataprep", "shards"), ("dataprep", "verify"), ("training.checkpoint", "new-key")}


def step_by_step() -> list[list[str]]:
    """The `python ...` commands of README's "Step by step" block, continuation lines joined,
    comments dropped."""
    text = (ROOT / "README.md").read_text()
    block = text.split("### Step by step", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv[:1] == ["python"]:
            commands.append(argv)
    return commands


def _here(arg: str, tmp: Path) -> str:
    """An argument as it resolves for a run in `tmp`: ../shared/data is the real one."""
    if arg.startswith("../shared/data/"):
        return str(DATA / arg.removeprefix("../shared/data/"))
    return str(tmp / arg) if arg.startswith("work/") else arg


def test_the_step_by_step_commands_run(tmp_path):
    if not (DATA / "video.txt").exists():
        pytest.skip(f"{DATA / 'video.txt'} is missing (the shared datasets sit beside the checkout)")
    commands = step_by_step()
    assert len(commands) >= 7, commands  # the block was found and read whole
    tried = set()
    for argv in commands:
        module, sub = argv[2], argv[3] if len(argv) > 3 and not argv[3].startswith("-") else ""
        if (module, sub) in RUN_AS_WRITTEN:
            run = [sys.executable, *(_here(a, tmp_path) for a in argv[1:])]
        else:
            run = [sys.executable, "-m", module, *([sub] if sub else []), "--help"]
        r = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{shlex.join(argv)}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        if (module, sub) not in RUN_AS_WRITTEN:
            assert "usage:" in r.stdout, f"{shlex.join(run)} printed no usage: {r.stdout[:500]}"
        tried.add((module, sub))
    assert RUN_AS_WRITTEN <= tried, f"README's block lost {sorted(RUN_AS_WRITTEN - tried)}"
    assert (tmp_path / "work" / "video" / "manifest.json").exists()
    assert (tmp_path / "work" / "checkpoint.key").stat().st_mode & 0o077 == 0  # a secret: the owner's only


def test_the_command_line_params_example_is_accepted():
    """README's `local_run --set ...` example: each item a DAG param or a trainer setting that
    make run's front end takes (run_conf checks names and types before anything runs)."""
    from ftrec_airflow.local_run import run_conf

    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if "-m ftrec_airflow.local_run --set" in ln)
    argv = shlex.split(line.split("`")[1])
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert len(sets) >= 2, line
    conf = run_conf({}, sets)
    assert conf and all(s.split("=")[0].removeprefix("params.") in conf or s in conf["train_overrides"] for s in sets)
