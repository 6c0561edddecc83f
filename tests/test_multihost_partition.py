"""Faults that close no connection, on simulated hosts: the lighthouse's host, or a group's, cut off.

Four network namespaces on one switch (benchmarks/partition.py runs the scenario): the lighthouse
on host a, three single-rank replica groups of the toy trainer on b, c and d. Mid-run, a's port
on the switch goes down for four heartbeat timeouts (packets vanish, no socket closes), then
comes back. The lighthouse must take the silence as its own isolation: nobody declared failed,
nobody healed, the groups go on under their lease, every group ends with the same state, and
every batch is trained once."""

import sys
from pathlib import Path

import netns
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
pytestmark = pytest.mark.integ


def test_a_lighthouse_cut_off_the_network_fails_nobody_and_heals_nobody(tmp_path):
    why = netns.unavailable()
    if why:
        pytest.skip(f"simulated hosts unavailable: {why}")
    import partition

    row = partition.run_once("lighthouse", 8.0, tmp_path)  # four heartbeat timeouts, within the lease
    assert row["exit_codes"] == [0, 0, 0], row
    assert row["isolations"] >= 1, row  # it noticed that it heard nobody ...
    assert row["failures"] == 0 and row["heals"] == 0, row  # ... and blamed nobody
    assert row["final_states_equal"], row
    for g in range(3):
        assert row[f"g{g}_committed"] == partition.STEPS, row  # every batch once, none twice
        assert row[f"g{g}_leased"] > 0, row  # it went on without the lighthouse


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
