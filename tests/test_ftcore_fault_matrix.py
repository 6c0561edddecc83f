"""The fault matrix (benchmarks/fault_matrix.py): every fault class against one group, two of
three and three of five, and every control-plane fault with the job in each state, in real jobs
of the toy trainer (real processes, real signals; link cuts, the lighthouse's own among them,
on simulated hosts). Each cell asserts that the survivors commit again before a heartbeat
timeout (found by a probe, or carried by the lease: never waited out for as long as the fault
lasts), that nobody was failed, healed or excluded who was not faulty, and that no faulty group
committed in a quorum of its own; each job that its groups end bitwise equal with every batch
trained once."""

import sys
from pathlib import Path

import netns
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import fault_matrix  # noqa: E402

pytestmark = [pytest.mark.integ, pytest.mark.slow]


@pytest.mark.parametrize("job", sorted(fault_matrix.JOBS))
def test_fault_matrix(job, tmp_path):
    if fault_matrix.JOBS[job].on_hosts:
        why = netns.unavailable()
        if why:
            pytest.skip(f"simulated hosts unavailable: {why}")
    rows = fault_matrix.run(job, str(tmp_path))
    table = "\n".join(
        f"{r['case']:40} gap {r['gap_s']:6.3f} s  failed {r['failed']}  false: {r['false_failures']} "
        f"{r['false_heals']} {r['false_exclusions']}  alone {r['alone']}  equal {r['states_equal']}  {r['ledger']}"
        for r in rows
    )
    assert [r["case"] for r in rows] == [c.case for c in fault_matrix.JOBS[job].cells]
    assert all(r["ok"] for r in rows), table
    # crashed and hung groups are failed, not waited for
    assert all(r["failed"] for r in rows if r["case"].startswith(("crash", "hang"))), table
