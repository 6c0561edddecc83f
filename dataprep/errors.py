"""Errors a user can cause in dataprep: one class, one clear line each.

The CLI prints `error: <message>` and exits non-zero without a traceback; the
Python API raises the exception for the caller (the Airflow tasks, tests).
A message never quotes the input's content (the file may be a secret posted as data); it
names the file, line and column instead.
"""

import re


class DataprepError(Exception):
    """A problem with the input, the settings or a shard set.

    The message names the file, line, column or setting and says what to do.
    """


class DifferentShardSet(DataprepError):
    """The output folder holds another shard set (other input or settings): the one case where
    replacing it (`overwrite`) is the fix, so callers may retry with it."""


def cause(e: BaseException) -> str:
    """The first line of a reader's error (pyarrow's, the codec's) without the input it quotes:
    pyarrow appends the offending row ("got 1: <row>") and quotes bad values ('<value>')."""
    text = (str(e).splitlines() or [type(e).__name__])[0]
    text = re.sub(r"(got \d+( columns)?)\s*:.*", r"\1", text)
    return re.sub(r"'[^']*'|\"[^\"]*\"", "(value)", text)[:200]
