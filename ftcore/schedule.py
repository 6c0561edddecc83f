"""Exactly-once data across failures: the replicated data schedule with make-up steps. Every
group holds the same copy and applies the same commit(), so all agree on what each step
trains; a row group a group missed is queued and made up at the end of the window by the
groups that missed it. The rules: docs/ftcore.md, "schedule"."""

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    kind: str  # "regular" or "makeup"
    epoch: int  # the epoch the row group belongs to
    row_group: int  # row group (step of the shard files)
    index: int  # regular: index in the epoch order; makeup: index in the make-up queue


class MakeupSchedule:
    def __init__(
        self,
        steps_per_epoch: int,
        num_groups: int,
        epochs: int,
        seed: int = 0,
        window_steps: int | None = None,
        order: Callable[[int], list[int]] | None = None,
    ):
        if steps_per_epoch < 1 or num_groups < 1 or epochs < 1:
            raise ValueError("MakeupSchedule needs steps_per_epoch, num_groups and epochs >= 1")
        self.steps, self.num_groups, self.epochs, self.seed = steps_per_epoch, num_groups, epochs, seed
        self.window = window_steps or steps_per_epoch
        self._order = order  # a trainer's own epoch order (training.data.DataCursor.order)
        self.epoch, self.index, self.in_makeup = 0, 0, False
        self.makeup: list[list] = []  # [epoch, row_group, [groups that still owe it]]

    def order(self, epoch: int) -> list[int]:
        """Row-group order of an epoch: file order first (dataprep shuffled), then seeded."""
        if self._order is not None:
            return self._order(epoch)
        rg = list(range(self.steps))
        if epoch > 0:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(rg)
        return rg

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs and not self.makeup

    def position(self, live: set[int]) -> Position | None:
        """What the next step trains, given the groups that can contribute to it.

        None: nothing can run now (only make-up work of absent groups is left): wait.
        """
        if self.in_makeup:
            for j, (e, rg, groups) in enumerate(self.makeup):
                if set(groups) & live:
                    return Position("makeup", e, rg, j)
            if self.epoch + 1 >= self.epochs and self.index >= self.steps:
                return None  # the run's last make-up work belongs to absent groups
            e, i = (self.epoch + 1, 0) if self.index >= self.steps else (self.epoch, self.index)
            return Position("regular", e, self.order(e)[i], i)
        if self.epoch >= self.epochs:
            return None
        return Position("regular", self.epoch, self.order(self.epoch)[self.index], self.index)

    def works(self, pos: Position, group: int) -> bool:
        """Does `group` train a batch at `pos` (else it joins with zero gradients)?"""
        return pos.kind == "regular" or group in self.makeup[pos.index][2]

    def commit(self, pos: Position, contributors: set[int]) -> None:
        """Apply a committed step at `pos` to which `contributors` sent real gradients."""
        if pos.kind == "makeup":
            entry = self.makeup[pos.index]
            entry[2] = [g for g in entry[2] if g not in contributors]
            if not entry[2]:
                del self.makeup[pos.index]
            if not self.makeup:
                self._end_makeup()
            return
        if self.in_makeup:  # make-up work left only for absent groups: move on
            self._end_makeup()
        missed = sorted(set(range(self.num_groups)) - contributors)
        if missed:
            self.makeup.append([pos.epoch, pos.row_group, missed])
        self.index += 1
        if self.index % self.window == 0 or self.index >= self.steps:
            if self.makeup:
                self.in_makeup = True
            elif self.index >= self.steps:
                self.epoch, self.index = self.epoch + 1, 0

    def _end_makeup(self) -> None:
        self.in_makeup = False
        if self.index >= self.steps:
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "in_makeup": self.in_makeup,
            "makeup": [[e, rg, list(g)] for e, rg, g in self.makeup],
            "steps": self.steps,
            "num_groups": self.num_groups,
            "epochs": self.epochs,
            "seed": self.seed,
            "window": self.window,
        }

    def load_state_dict(self, st: dict) -> None:
        if int(st["steps"]) != self.steps or int(st["num_groups"]) != self.num_groups:
            raise ValueError(
                f"schedule state is for {st['steps']} steps x {st['num_groups']} groups, "
                f"this run has {self.steps} x {self.num_groups}"
            )
        self.epoch, self.index, self.in_makeup = int(st["epoch"]), int(st["index"]), bool(st["in_makeup"])
        self.makeup = [[int(e), int(rg), [int(x) for x in g]] for e, rg, g in st["makeup"]]
        self.epochs, self.seed, self.window = int(st["epochs"]), int(st["seed"]), int(st["window"])
