"""The prepared GPU check, as the offline GPU machine would run it, on CPU (--cpu): the wheel set
`make gpu-wheels` downloads resolves for Python 3.12, and `benchmarks/gpu_check.sh` runs the whole
check end to end from a clean folder with an interpreter that has only that machine's packages
(torch, numpy, pyarrow, uvloop, psutil, matplotlib, pytest) and the wheels: a module the check
needs beyond those, and not in benchmarks/gpu_check_wheels.txt, fails it. CPU figures mean nothing;
claims about CUDA are SKIP, the rest must PASS, and no part may fail."""

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from conftest import run_bounded
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.integ

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ["torch", "numpy", "pyarrow", "uvloop", "psutil", "matplotlib", "pytest"]  # what it has
OFFLINE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution", "timed out")


def _needed() -> list[str]:
    lines = (ROOT / "benchmarks" / "gpu_check_wheels.txt").read_text().splitlines()
    return [re.split(r"[=<>;~ ]", ln.split("#")[0].strip())[0] for ln in lines if ln.split("#")[0].strip()]


def _closure(names: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions `names` need: theirs and their requirements', no extras."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            seen[name] = dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional one this platform does not install
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _machine_site(dst: Path) -> None:
    """A site folder with only the GPU machine's packages (links into this venv's)."""
    dst.mkdir()
    for dist in _closure(MACHINE).values():
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            link, src = dst / top, Path(str(dist.locate_file(top)))
            if not link.exists() and src.exists():
                link.symlink_to(src)


def _wheels_from_venv(dst: Path) -> None:
    """The wheels of gpu_check_wheels.txt for this interpreter, zipped from their installed files
    (a wheel is a zip of them): the .sh unpacks them as it unpacks the downloaded ones."""
    dst.mkdir()
    for name in _needed():
        dist = metadata.distribution(name)
        with zipfile.ZipFile(dst / f"{name}-{dist.version}-py3-none-any.whl", "w") as z:
            for f in dist.files or []:
                if f.parts[0] != ".." and "__pycache__" not in f.parts:
                    z.write(Path(str(dist.locate_file(f))), str(f))


def test_the_wheel_set_resolves_for_python_312(tmp_path):
    env = {**os.environ, "GPU_WHEELS": str(tmp_path / "w")}
    r = run_bounded(["make", "-s", "gpu-wheels", f"GPU_WHEELS={tmp_path / 'w'}"], 180, env)
    if r.returncode != 0 and any(s in r.stdout for s in OFFLINE):
        pytest.skip(f"no package index reachable: {r.stdout[-300:]}")
    assert r.returncode == 0, r.stdout[-3000:]
    wheels = sorted(p.name for p in (tmp_path / "w").glob("*.whl"))
    got = {canonicalize_name(w.split("-")[0]) for w in wheels}
    assert got == {canonicalize_name(n) for n in _needed()}, wheels
    for w in wheels:  # for CPython 3.12 on manylinux x86-64, or pure Python
        tags = w[: -len(".whl")].split("-")[-3:]
        assert tags[0] in ("py3", "cp312") and (tags[2] == "any" or "manylinux" in tags[2]), w


def test_gpu_check_sh_runs_on_cpu_with_the_machines_packages_and_the_wheels(tmp_path):
    site, wheels, out = tmp_path / "machine-site", tmp_path / "wheels", tmp_path / "out"
    _machine_site(site)
    _wheels_from_venv(wheels)
    bare = tmp_path / "bare"  # an interpreter without this venv's site-packages
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "PYTHON": str(bare / "bin" / "python"),
        "PYTHONPATH": str(site),
        "FTREC_GPU_WHEELS": str(wheels),
        "FTREC_GPU_CHECK_LIMIT_S": "420",
        "OMP_NUM_THREADS": "1",
    }
    missing = run_bounded([env["PYTHON"], "-c", "import tenacity"], 60, env)
    assert missing.returncode != 0, "the bare interpreter must not see this venv's packages"
    r = run_bounded(["bash", "benchmarks/gpu_check.sh", str(out), "--cpu"], 480, env)
    assert r.returncode == 0, r.stdout[-5000:]
    assert f"{len(_needed())} wheel(s)" in r.stdout
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["ok"] and res["mode"] == "cpu"
    ft = res["ft"]
    assert ft["identical"] and ft["restarts"] == 1 and ft["healed"] and ft["fails"] == []
    assert res["table"]["sharded"] and res["table"]["eval_equal"] and res["table"]["fails"] == []
    sd = res["slowdown"]
    assert set(sd["rows"]) == {"none", "gloo_all_to_all", "smfree_copy_engines"} and sd["fails"] == []
    tp = res["throughput"]["rows"]
    assert {(r["attention"], r["shards"]) for r in tp} == {
        (a, s) for a in ("sasrec", "hstu") for s in ("balanced", "random")
    }
    claims = {c["claim"]: c for c in res["claims"]}
    assert len(claims) == 10 and not [c for c in claims.values() if c["status"] == "FAIL"]
    assert claims["balanced shards pad less than random"]["status"] == "PASS"
    skipped = [c for c in claims.values() if c["status"] == "SKIP"]
    assert skipped and all(c["note"] for c in skipped)  # every SKIP says why
    table = (out / "gpu_check.txt").read_text()
    assert all(c in table for c in ("PASS", "SKIP")) and (out / "gpu_check.log").exists()
    for head in ("## 1. ft", "## 3. slowdown", "## 4. non-padding tokens/s", "## claims"):
        assert head in r.stdout
    assert not list(tmp_path.glob("ftrec-gpu-check.*"))  # its temporary site is removed


def test_gpu_check_sh_names_the_missing_wheels(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), "PYTHON": str(bare / "bin" / "python"),
           "FTREC_GPU_WHEELS": str(tmp_path / "none")}  # fmt: skip
    r = run_bounded(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out"), "--cpu"], 60, env)
    assert r.returncode == 3 and "make gpu-wheels" in r.stdout, r.stdout[-2000:]
