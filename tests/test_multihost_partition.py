"""Faults that close no connection, on simulated hosts: a group's host cut off (benchmarks/
partition.py runs the scenarios; the lighthouse's own host cut off, alone and with the job in each
state, is in the fault matrix, tests/test_ftcore_fault_matrix.py). Four network namespaces on one
switch: the lighthouse on host a, three single-rank replica groups of the toy trainer on b, c, d."""

import sys
from pathlib import Path

import netns
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
pytestmark = pytest.mark.integ


def test_a_group_cut_off_rejoins_by_one_heal_and_the_survivors_lose_no_step(tmp_path):
    """Group 2's host cut off for 8 s: declared failed once (the survivors' stalled exchange asks
    the lighthouse, which does not hear group 2 within the failure probe), it rejoins by one
    heal. Its first request after the link returns is answered with a quorum it must heal into,
    which its re-run of the failed exchange cannot use: it asks for that same answer again
    (`again`), so the survivors, who already count it, never wait out a store timeout."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"simulated hosts unavailable: {why}")
    import partition

    row = partition.run_once("group", 8.0, tmp_path)
    assert row["exit_codes"] == [0, 0, 0] and row["final_states_equal"], row
    assert row["failures"] == 1 and row["heals"] == 1, row  # failed once, not again when out of the quorum
    assert row["stall_reports"] + row["round_probes"] >= 1, row  # a probe, not the heartbeat timeout
    for g in (0, 1):  # every step attempt of the survivors committed: none waited on group 2 and failed
        assert row[f"g{g}_failed_attempts"] == 0, row


def test_a_heal_source_killed_while_it_serves_costs_the_other_survivor_nothing(tmp_path):
    """Group 2 returns from a cut and heals from group 0, which is killed (SIGKILL) as it serves
    and started again. The healing group and its source stand aside from the step's exchange, so
    group 1 never waits on either: none of its exchanges fails or re-runs, and all three end with
    the same state, every batch trained once (the toy checks its ledger)."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"simulated hosts unavailable: {why}")
    import partition

    row = partition.run_once("source", 8.0, tmp_path)
    assert row["exit_codes"] == [-9, 0, 0, 0] and row["final_states_equal"], row
    assert row["failures"] >= 2 and row["heals"] >= 2, row  # the cut group, then the dead source
    assert row["g1_failed_after"] == 0 and row["g1_reran_after"] == 0, row  # (the cut itself cost a re-run)
