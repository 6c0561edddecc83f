"""FreeScale's communication on by default where it applies (training/comm/config.py): the
"auto" transport and item-table placement as pure decisions from tables of layouts, each with
the reason the trainer logs; one bubble definition for comm/, train/ and result.json; and no
always-zero straggler metric where one rank a group cannot show one."""

import pytest
import torch

from training import memory
from training.comm.bubbles import StepAccount, fraction, metrics
from training.comm.config import LARGE_TABLE_BYTES, CommConfig, choose_embedding, choose_transport
from training.metrics import COLUMNS, COMPUTE, STEP_TIME, History, Window, run_summary, summarize


def test_the_defaults_are_auto():
    assert CommConfig().transport == "auto" and CommConfig().embedding == "auto"
    assert CommConfig().policy == "prioritized"
    assert all(ok for ok, _ in CommConfig().checks())
    assert not all(ok for ok, _ in CommConfig(transport="nccl").checks())


@pytest.mark.parametrize(
    "transport, device, ranks, want, why",
    [
        ("auto", "cuda", 2, "smfree", "smfree on CUDA"),
        ("auto", "cuda", 1, "collective", "1 rank per group"),
        ("auto", "cpu", 4, "collective", "no copy engines"),
        ("collective", "cuda", 8, "collective", "(set)"),
        ("smfree", "cpu", 2, "smfree", "(set)"),
    ],
)
def test_transport_choice(transport, device, ranks, want, why):
    got, line = choose_transport(transport, device, ranks)
    assert got == want and why in line and line.startswith("comm.transport=")


BIG = LARGE_TABLE_BYTES // (64 * 4)  # items of a dim-64 table at the "large" size


@pytest.mark.parametrize(
    "embedding, ranks, items, rows, dense, want, why",
    [
        ("auto", 1, BIG * 2, 1e4, True, "replicated", "1 rank per group"),
        ("auto", 2, BIG, 1e9, False, "sharded", "large table"),
        ("auto", 4, 1_000_000, 20_000, True, "sharded", "fewer bytes"),  # lookups 7 MB < gradient 244 MB
        ("auto", 4, 1_000_000, 20_000, False, "replicated", "row-wise gradient"),  # sparse anyway
        ("auto", 2, 3_000, 20_000, True, "replicated", "lookups"),  # a small table: its gradient is less
        ("auto", 2, 1_000_000, 0, True, "replicated", "lookups 0.0 MB"),  # no token count: only "large" decides
        ("replicated", 8, BIG * 4, 10, True, "replicated", "(set)"),
        ("sharded", 2, 10, 1e6, False, "sharded", "(set)"),
    ],
)
def test_embedding_choice(embedding, ranks, items, rows, dense, want, why):
    got, line = choose_embedding(embedding, ranks, items, 64, rows, dense)
    assert got == want and why in line, line


def test_auto_leads_the_memory_check_and_a_table_that_does_not_fit_is_still_sharded():
    got, line = memory.choose_embedding("auto", 3_000, 64, "adam", 2, budget=10 * memory.GB, rows_per_step=20_000)
    assert got == "replicated" and line.startswith("comm.embedding=auto: replicated") and "per rank" in line
    need = memory.table_bytes(3_000, 64, "adam")
    got, line = memory.choose_embedding("auto", 3_000, 64, "adam", 2, budget=need - 1, rows_per_step=20_000)
    assert got == "sharded" and "chosen automatically" in line


def test_one_bubble_definition_for_comm_train_and_result_json():
    # 2 ranks x 3 steps: rank 1 computes half of rank 0, every step lasts 4 s on both
    per_rank = torch.zeros(2, 3, COLUMNS, dtype=torch.float64)
    per_rank[:, :, STEP_TIME] = 4.0
    per_rank[0, :, COMPUTE], per_rank[1, :, COMPUTE] = 4.0, 2.0
    want = fraction(18.0, 24.0)
    assert want == pytest.approx(0.25)  # = 1 - mean/max for this pure straggler
    w = Window()
    w.steps, w.lr = [1, 2, 3], [1e-3]
    assert summarize(w, per_rank)["train/bubble_fraction"] == pytest.approx(want)
    h = History()
    h.add(w, per_rank)
    assert run_summary(h)["bubble_fraction"] == pytest.approx(want)
    accounts = [StepAccount(r, s, 4.0, 4.0 if r == 0 else 2.0, 0.0, 0.0, 2.0 * r) for r in (0, 1) for s in range(3)]
    assert metrics(accounts)["comm/bubble_fraction"] == pytest.approx(want)
    # one rank a group, idle half the step: not 0 (a K=1 run still has a bubble)
    one = torch.zeros(1, 2, COLUMNS, dtype=torch.float64)
    one[:, :, STEP_TIME], one[:, :, COMPUTE] = 2.0, 1.0
    assert summarize(w, one)["train/bubble_fraction"] == pytest.approx(0.5)


def test_a_layout_that_cannot_show_stragglers_does_not_log_them_as_zero():
    a = [StepAccount(0, 1, 2.0, 1.5, 0.2, 0.0, 0.3)]
    assert "comm/straggler_s" in metrics(a) and "comm/straggler_s" not in metrics(a, straggler=False)
    assert metrics(a, straggler=False)["comm/compute_s"] == 1.5
