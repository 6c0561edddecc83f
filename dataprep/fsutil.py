"""Moved: atomic writes and file hashes to ftcore.util.files, the fingerprint to dataprep.fingerprint."""

from dataprep.fingerprint import fingerprint  # noqa: F401
from ftcore.util.files import (  # noqa: F401
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    atomic_writer,
    sha256_file,
)
