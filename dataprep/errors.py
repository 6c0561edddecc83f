"""Errors a user can cause in dataprep: one class, one clear line each.

The CLI prints `error: <message>` and exits non-zero without a traceback; the
Python API raises the exception for the caller (the Airflow tasks, tests).
"""


class DataprepError(Exception):
    """A problem with the input, the settings or a shard set.

    The message names the file, line, column or setting and says what to do.
    """


class DifferentShardSet(DataprepError):
    """The output folder holds another shard set (other input or settings): the one case where
    replacing it (`overwrite`) is the fix, so callers may retry with it."""
