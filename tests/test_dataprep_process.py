"""dataprep's own processes import no pandas and allocate from glibc (dataprep.process); a library import is
left alone."""

import os
import subprocess
import sys
from pathlib import Path

from dataprep.synth import write_synthetic

ROOT = Path(__file__).resolve().parent.parent

# run `python -m dataprep ARGS` as the command line does, then report what it imported
PROBE = """
import runpy, sys
sys.argv = ["dataprep", *sys.argv[1:]]
try:
    runpy.run_module("dataprep", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert not e.code, e.code
print("pandas imported:", "pandas" in sys.modules)
import pyarrow as pa
print("arrow pool:", pa.default_memory_pool().backend_name)
"""


def _run(*args: str) -> str:
    p = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_command_line_build_imports_no_pandas(tmp_path):
    data = write_synthetic(tmp_path / "ev.parquet", users=300, items=50, seed=0, fmt="events", quiet=True)
    out = tmp_path / "shards"
    common = ["--input", str(data), "--format", "events", "--world-size", "2", "--batch-size", "8", "--quiet"]
    for extra in ([], ["--buckets", "3", "--workers", "2"]):
        stdout = _run("shards", *common, "--out", str(out), "--overwrite", *extra)
        assert "pandas imported: False" in stdout and "arrow pool: system" in stdout
        assert "pandas imported: False" in _run("verify", str(out), "--quiet")


def test_library_import_leaves_pandas_importable():
    code = "import dataprep.build, dataprep.bucketed, pandas; print('ok', pandas.__name__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert p.stdout.strip() == "ok pandas", p.stderr[-2000:]


def test_a_users_own_arrow_pool_is_kept(tmp_path):
    """The command line's environment defaults give way to the user's."""
    data = write_synthetic(tmp_path / "ev.parquet", users=100, items=30, seed=0, fmt="events", quiet=True)
    args = ["shards", "--input", str(data), "--format", "events", "--world-size", "2", "--batch-size", "8"]
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "mimalloc"}
    p = subprocess.run(
        [sys.executable, "-c", PROBE, *args, "--out", str(tmp_path / "s"), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
        env=env,
    )
    assert p.returncode == 0 and "arrow pool: mimalloc" in p.stdout, p.stderr[-2000:]
