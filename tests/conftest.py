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
