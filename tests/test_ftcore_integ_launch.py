"""FT-HSDP end to end: the launcher, a real lighthouse, real gloo groups, real signals.

Each test launches replica groups of the toy trainer (ftcore/examples/toy.py) with a
fault plan, and checks what the papers promise: survivors keep training, a restarted
group heals and ends bitwise identical to the others (parameters AND optimizer state),
a failed step is discarded everywhere, and every sample is trained exactly once.
Every process is started in its own session and ended by its process group.
"""

import json
from pathlib import Path

import pytest
from conftest import TOY, run_launch

from ftcore import ledger, tensorfile
from ftcore.examples.toy import sample_ids

pytestmark = [pytest.mark.integ, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
STEPS = 30


def launch(
    out: Path,
    plan: list[dict] | None = None,
    groups: int = 3,
    ranks: int = 1,
    steps: int = STEPS,
    env: dict | None = None,
    timeout: float = 150.0,
) -> tuple[int, str]:
    toy_args = ["--steps", str(steps), "--step-sleep", "0.04"]
    r = run_launch(
        out,
        timeout,
        env,
        worker=TOY,
        groups=groups,
        ranks=ranks,
        faults=plan or None,
        timeout=timeout - 20,
        worker_args=toy_args,
    )
    return r.returncode, r.stdout


def states(out: Path, groups: int) -> list[bytes]:
    return [(out / f"replica_{g}" / "state.safetensors").read_bytes() for g in range(groups)]


def timeline(out: Path) -> dict:
    return json.loads((out / "timeline.json").read_text())


def check_ledger(out: Path, groups: int, ranks: int = 1, steps: int = STEPS) -> dict:
    return ledger.check(
        str(out / "ledger"),
        steps_per_epoch=steps,
        num_groups=groups,
        ranks_per_group=ranks,
        epochs=1,
        sample_ids=lambda s, rg: sample_ids(s, rg, steps, 16),
    )


def assert_identical(out: Path, groups: int) -> bytes:
    st = states(out, groups)
    assert all(s == st[0] for s in st), "replica groups ended with different parameters/optimizer state"
    tree = tensorfile.loads(st[0])
    assert tree["optimizer"]["state"], "optimizer state missing from the final state"
    return st[0]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> bytes:
    """A fault-free run: the reference for runs whose faults must not change the result."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    code, log = launch(out)
    assert code == 0, log[-3000:]
    return assert_identical(out, 3)


def test_a_relaunch_into_the_same_folder_reports_only_its_own_attempt(tmp_path):
    out = tmp_path / "run"
    firsts = []
    for _ in range(2):
        code, log = launch(out, groups=2, steps=10)
        assert code == 0, log[-3000:]
        tl = timeline(out)
        firsts.append(min(s["t"] for s in tl["steps"]))
        assert tl["summary"]["committed_steps"] == 10 and tl["summary"]["failed_attempts"] == 0
        # 2 groups x 10 steps, this launch's, and each group's round that found every group at the end
        assert tl["summary"]["idle_rounds"] >= 2, tl["summary"]
        assert tl["summary"]["step_attempts"] == 2 * 10 + tl["summary"]["idle_rounds"], tl["summary"]
        assert [e["kind"] for e in tl["lighthouse_events"]].count("quorum_formed") >= 1
    assert firsts[1] > firsts[0]
    assert_identical(out, 2)


def test_kill9_survivors_continue_restarted_group_heals_bitwise_identical(tmp_path):
    out = tmp_path / "run"
    plan = [
        {"kind": "kill", "group": 1, "at_step": 8},  # from outside
        {"kind": "kill", "group": 2, "at_step": 20, "phase": "during_allreduce"},  # mid all-reduce
        {"kind": "raise", "group": 0, "at_step": 0, "phase": "heal_serve"},  # first heal fails
        {"kind": "raise", "group": 0, "at_step": 14, "phase": "vote"},  # g0 falls behind
        {"kind": "slow", "group": 0, "at_step": 3, "until_step": 6, "delay_s": 0.2},
    ]
    code, log = launch(out, plan)
    assert code == 0, log[-4000:]
    assert_identical(out, 3)
    tl = timeline(out)
    assert tl["restarts"] == {"0": 0, "1": 1, "2": 1}
    healed = {e["group"] for e in tl["lighthouse_events"] if e["kind"] == "heal_finished"}
    assert {0, 1, 2} <= healed  # 0 healed after its failed vote left it one step behind
    # the first heal transfer broke (the source raised while serving): that step failed, the next healed
    assert any(s["group"] == 1 and s["error"].startswith("heal:") for s in tl["steps"])
    assert any(s["group"] == 0 and "raise in vote" in s["error"] for s in tl["steps"])
    # the survivors went on with fewer participants while the others were down
    g0 = [s for s in tl["steps"] if s["group"] == 0 and s["committed"]]
    assert any(s["participants"] == 2 for s in g0) and g0[-1]["participants"] == 3
    # group 2 died at the start of step 20's exchange: the survivors re-ran that exchange in their
    # own quorum, on the gradients they had, and committed step 20 without a failed attempt
    at20 = [s for s in tl["steps"] if s["group"] in (0, 1) and s["step"] == 21 and s["committed"]]
    assert at20 and all(s["requorum"] and s["participants"] == 2 for s in at20), at20
    summary = check_ledger(out, 3)
    assert summary["makeup_steps"] > 0  # the missed buckets were made up, not lost


def test_error_mid_allreduce_discards_the_step_on_every_group(tmp_path, baseline):
    out = tmp_path / "run"
    plan = [
        {"kind": "raise", "group": 0, "at_step": 6, "phase": "during_allreduce"},
        {"kind": "raise", "group": 2, "at_step": 12, "phase": "before_allreduce"},
    ]
    code, log = launch(out, plan)
    assert code == 0, log[-4000:]
    steps = timeline(out)["steps"]
    for bad in (6, 12):
        failed = {s["group"] for s in steps if not s["committed"] and s["step"] == bad}
        assert failed == {0, 1, 2}, f"step {bad} was not discarded everywhere: {failed}"
    # no replica applied a partial update: the result equals the fault-free run's, bit for bit
    assert assert_identical(out, 3) == baseline
    check_ledger(out, 3)


def test_two_ranks_per_group_kill_one_rank_restarts_the_group(tmp_path):
    out = tmp_path / "run"
    code, log = launch(out, [{"kind": "kill", "group": 0, "rank": 1, "at_step": 8}], groups=2, ranks=2, steps=20)
    assert code == 0, log[-4000:]
    assert timeline(out)["restarts"]["0"] == 1
    assert_identical(out, 2)
    check_ledger(out, 2, ranks=2, steps=20)


def test_groups_of_two_ranks_heal_aside_from_the_exchange_and_end_identical(tmp_path):
    """3 groups x 2 ranks (each group's rank 0 relays for it): group 2 is killed and heals while
    groups 0 and 1 go on; in the heal step the healing group and its source stand aside and
    each of their ranks takes the step's average from rank k of the exchange's first member."""
    out = tmp_path / "run"
    # 40 steps: the group's replacement (about a second here) rejoins while the others still train
    code, log = launch(out, [{"kind": "kill", "group": 2, "rank": 0, "at_step": 8}], groups=3, ranks=2, steps=40)
    assert code == 0, log[-4000:]
    events = timeline(out)["lighthouse_events"]
    healed = [e for e in events if e["kind"] == "heal_assigned" and e["group"] == 2]
    assert healed, [e["kind"] for e in events]
    steps = [s for s in timeline(out)["steps"] if s["quorum_id"] == healed[0]["quorum_id"] and s["committed"]]
    source = healed[0]["source"]  # it committed the heal step without contributing: aside
    assert any(s["group"] == source and s["contributors"] == 1 for s in steps), steps
    assert_identical(out, 3)
    check_ledger(out, 3, ranks=2, steps=40)


def test_a_group_that_fails_the_last_steps_vote_heals_before_the_job_ends(tmp_path):
    """Group 0 contributes to the last batch's exchange and then fails its vote: its peers
    commit the batch (with its gradient) and the data is done. The job does not end on that
    round: the next one heals group 0 (it is a step behind), and all end with one state."""
    out = tmp_path / "run"
    code, log = launch(out, [{"kind": "raise", "group": 0, "at_step": STEPS - 1, "phase": "vote"}])
    assert code == 0, log[-4000:]
    tl = timeline(out)
    assert any(s["group"] == 0 and not s["committed"] and "injected" in s["error"] for s in tl["steps"])
    healed = [e for e in tl["lighthouse_events"] if e["kind"] == "heal_assigned" and e["group"] == 0]
    assert healed and healed[0]["step"] == STEPS, healed
    assert_identical(out, 3)
    check_ledger(out, 3, steps=STEPS)
