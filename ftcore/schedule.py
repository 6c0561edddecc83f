"""Exactly-once data across failures: the replicated data schedule with make-up steps. Every
group holds the same copy and applies the same commit(), so all agree on what each step
trains; a row group a group missed is queued and made up at the end of the window, spread
over every live group (one missed batch each per step). The rules: docs/ftcore.md, "schedule"."""

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftcore import timeouts


@dataclass(frozen=True)
class Position:
    kind: str  # "regular" or "makeup"
    epoch: int  # the epoch the row group belongs to (makeup: the first piece's)
    row_group: int  # row group (step of the shard files) (makeup: the first piece's)
    index: int  # regular: index in the epoch order; makeup: -1
    # makeup: (helper, owner, epoch, row group) per live group with work: the helper trains the
    # row group of the owner's shards (the owner missed it), sorted by helper
    pieces: tuple[tuple[int, int, int, int], ...] = ()

    def piece(self, group: int) -> tuple[int, int, int] | None:
        """(owner, epoch, row group) that `group` trains at this position, None when it has none."""
        if self.kind == "regular":
            return (group, self.epoch, self.row_group)
        return next(((o, e, rg) for h, o, e, rg in self.pieces if h == group), None)


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
        self._done_at = 0.0  # when `finished` first found the data done without every group
        self._ended_live: frozenset[int] = frozenset()  # the groups live in a round since the data was done

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

    def finished(self, spent: bool = False) -> bool:
        """The run may end: the data is done (or `spent`: a step budget that ends mid-epoch is
        used up) and every group of the job was live in a round formed since (`position` saw
        it), or it has waited END_WAIT for that. The round in which the last batch was trained
        does not count: a group may have failed that step's vote, and the next round heals it
        (not live) before all end with one state. Waiting, the steps have no work: a group held
        out as slow is readmitted in such a round, a restarted one heals in."""
        if not (self.done or spent):
            return False
        if len(self._ended_live) >= self.num_groups:
            return True
        self._done_at = self._done_at or time.monotonic()
        return time.monotonic() - self._done_at > timeouts.END_WAIT

    def position(self, live: set[int], spent: bool = False) -> Position | None:
        """What the next step trains, given the groups that can contribute to it.

        None: nothing to train now (the data is done or the step budget `spent`, or nobody is
        live): wait.
        """
        if self.done or spent:
            self._ended_live = frozenset(live)  # a round formed after the data was done
            return None
        if self.in_makeup:
            pieces = self._spread(sorted(live))
            if pieces:
                return Position("makeup", pieces[0][2], pieces[0][3], -1, tuple(sorted(pieces)))
            return None
        return Position("regular", self.epoch, self.order(self.epoch)[self.index], self.index)

    def _spread(self, free: list[int]) -> list[tuple[int, int, int, int]]:
        """One missed batch for each live group, in queue order: the owner trains its own
        when it is free, else the lowest free group does (it reads the owner's shards). So a
        group that is away, slow or gone never holds the others up, nor leaves them idle."""
        pieces: list[tuple[int, int, int, int]] = []
        for e, rg, owners in self.makeup:
            for o in owners:
                if not free:
                    return pieces
                h = o if o in free else free[0]
                free.remove(h)
                pieces.append((h, o, e, rg))
        return pieces

    def works(self, pos: Position, group: int) -> bool:
        """Does `group` train a batch at `pos` (else it joins with zero gradients)?"""
        return pos.piece(group) is not None

    def commit(self, pos: Position, contributors: set[int]) -> None:
        """Apply a committed step at `pos` to which `contributors` sent real gradients."""
        if pos.kind == "makeup":
            done = {(o, e, rg) for h, o, e, rg in pos.pieces if h in contributors}
            for entry in self.makeup:
                entry[2] = [o for o in entry[2] if (o, entry[0], entry[1]) not in done]
            self.makeup = [entry for entry in self.makeup if entry[2]]
            if not self.makeup:
                self._end_makeup()
            return
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
        self._ended_live = frozenset()  # a healed or resumed group has seen no round since
