"""Fixtures shared by every area's tests."""

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The real datasets beside the project; tests skip when a fresh clone lacks them."""
    if not (SHARED_DATA / "beauty.txt").exists():
        pytest.skip(f"shared datasets not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # Two cores are shared by every test process; keep torch from oversubscribing them.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def torchrun_train(shards: str, out: str, port: int, settings: list[str], nproc: int = 2,
                   timeout: float = 240) -> str:
    """`python -m training train` under torchrun on 127.0.0.1; returns its output.
    Bounded: on timeout the whole torchrun tree is ended by its process group."""
    import subprocess
    import sys

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "training", "train", "--shards", shards, "--out", out, "--set", *settings]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    assert p.returncode == 0, text[-3000:]
    return text
