"""A tiny progress bar on stderr for long stages; silent when `quiet`.

Redraws at most ten times a second so that it never costs measurable time on
the hot path, and writes nothing at all when stderr is not wanted.
"""

import sys
import time


class Progress:
    """`with Progress("balance", total=n) as p: p.update(k)`."""

    def __init__(self, label: str, total: int | None = None, *, quiet: bool = True, unit: str = ""):
        self.label, self.total, self.quiet, self.unit = label, total, quiet, unit
        self.done = 0
        self._start = time.monotonic()
        self._last = 0.0

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self, force: bool = False, end: str = "") -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        elapsed = now - self._start
        if end and self.total is None:
            text = f"\r{self.label:>10} done {elapsed:5.1f}s"
        elif self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 24)
            text = f"\r{self.label:>10} [{bar:<24}] {self.done}/{self.total}{self.unit} {elapsed:5.1f}s"
        elif self.total is None:
            text = f"\r{self.label:>10} ... {elapsed:5.1f}s"
        else:
            text = f"\r{self.label:>10} {self.done}{self.unit} {elapsed:5.1f}s"
        sys.stderr.write(text + end)
        sys.stderr.flush()

    def __exit__(self, *exc) -> None:
        self._draw(force=True, end="\n")


def stage(label: str, *, quiet: bool) -> Progress:
    """A one-shot stage without a known total (shows elapsed time)."""
    return Progress(label, None, quiet=quiet)
