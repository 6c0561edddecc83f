"""The deployment's checkpoint key: an HMAC-SHA256 seals every checkpoint's meta.json.

One setting, FTREC_CHECKPOINT_KEY_FILE: a file holding a secret (make one with `python -m
training.checkpoint new-key FILE`), the same file for every process that writes or reads the
deployment's checkpoints: the ranks (save, resume), a warm start from the champion (another
run's checkpoint), the gate and `training eval`. Without it nothing is saved or loaded;
`make run` and `python -m training launch` make one once (0600) in their work folder
(`use_default`). meta.json lists every file's sha256, so its HMAC vouches for every byte of the
checkpoint. No torch here: the Airflow side imports this module.
"""

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ftcore.util.files import atomic_write_text, read_secret

KEY_ENV = "FTREC_CHECKPOINT_KEY_FILE"
KEY_NAME = "checkpoint.key"  # the default file's name in a work folder, and the Secret's item
SEAL = "integrity"  # meta.json's entry that holds the HMAC
ALG = "hmac-sha256"
MIN_KEY_CHARS = 16
_DOMAIN = b"ftrec-checkpoint-manifest-v1\0"
_HOW = (
    f"set {KEY_ENV} to the deployment's key file (make one with `python -m training.checkpoint new-key FILE`; "
    f"`make run` makes WORK/{KEY_NAME}: `source WORK/env.sh`); every process that writes or reads the "
    "deployment's checkpoints needs the same file (docs/security.md)"
)


class CheckpointError(ValueError):
    """A checkpoint the user pointed at cannot be read; the message names it."""


class CheckpointKeyError(CheckpointError):
    """The key is the problem, not the checkpoint's bytes: none or an unreadable one, or a
    checkpoint sealed under another key or under none. Resume stops on it rather than falling
    back to an older checkpoint (every checkpoint would be refused alike)."""


@dataclass(frozen=True)
class Key:
    secret: bytes
    path: str

    @property
    def id(self) -> str:
        """A public name of the key (an HMAC of a constant): says which key sealed a checkpoint."""
        return hmac.new(self.secret, b"ftrec-checkpoint-key-id", hashlib.sha256).hexdigest()[:16]

    def mac(self, body: dict) -> str:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hmac.new(self.secret, _DOMAIN + canonical.encode(), hashlib.sha256).hexdigest()


_read: dict[tuple, Key] = {}  # by (path, inode, mtime, size): a key file is read (and warned about) once


def key_from_file(path: str) -> Key:
    """The key in `path` (CheckpointKeyError when unreadable, or too short to be a secret)."""
    try:
        st = os.stat(path)
        stamp = (path, st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp not in _read:
            _read[stamp] = Key(read_secret(path, "ftrec: warning: checkpoint key file").encode(), path)
    except OSError as e:
        raise CheckpointKeyError(f"checkpoint key file {path} cannot be read ({e.strerror}); {_HOW}") from None
    k = _read[stamp]
    if len(k.secret) < MIN_KEY_CHARS:
        raise CheckpointKeyError(
            f"checkpoint key file {path} holds {len(k.secret)} characters, fewer than {MIN_KEY_CHARS}: "
            f"not a secret; {_HOW}"
        )
    return k


def key() -> Key:
    """This process's key: the file FTREC_CHECKPOINT_KEY_FILE names (CheckpointKeyError when unset)."""
    path = os.environ.get(KEY_ENV, "").strip()
    if not path:
        raise CheckpointKeyError(f"no checkpoint key: checkpoints are sealed and verified with one; {_HOW}")
    return key_from_file(path)


def ensure_key_file(path: "str | os.PathLike") -> Path:
    """`path`, made now with a new secret when it does not exist: private (0600) from its first
    byte, complete or absent, and never replacing a key another process made first."""
    path = Path(path)
    if path.exists():
        return path
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.new")
    atomic_write_text(tmp, secrets.token_urlsafe(32) + "\n", perm=0o600)
    try:
        os.link(tmp, path)  # fails when it exists: the first process's key stays
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path


def use_default(folder: "str | os.PathLike") -> str:
    """FTREC_CHECKPOINT_KEY_FILE when set; else FOLDER/checkpoint.key (made once), set for this
    process and its children. For a work folder's own runs (make run, the local launcher)."""
    if os.environ.get(KEY_ENV, "").strip():
        return os.environ[KEY_ENV]
    os.environ[KEY_ENV] = str(ensure_key_file(Path(folder).resolve() / KEY_NAME))
    return os.environ[KEY_ENV]


def seal(body: dict, k: Key) -> dict:
    """`body` as meta.json holds it (JSON types: what a reader parses), with its HMAC under `k`."""
    plain = {n: v for n, v in json.loads(json.dumps(body, default=str)).items() if n != SEAL}
    return {**plain, SEAL: {"alg": ALG, "key_id": k.id, "hmac": k.mac(plain)}}


def unseal(manifest: dict, folder: str, k: Key) -> dict:
    """The manifest without its seal, once its HMAC verifies under `k`; else CheckpointError
    naming the folder and meta.json."""
    where = f"checkpoint {folder}: meta.json"
    sealed = manifest.get(SEAL)
    if sealed is None:
        raise CheckpointKeyError(
            f"{where} carries no HMAC: the checkpoint predates keyed checkpoints (or its seal was "
            f"removed). If you trust its files, re-key it: python -m training.checkpoint rekey {folder}"
        )
    if not (isinstance(sealed, dict) and sealed.get("alg") == ALG and isinstance(sealed.get("hmac"), str)):
        raise CheckpointError(f"{where}: its seal ({SEAL!r}) is damaged: refusing the checkpoint")
    if str(sealed.get("key_id")) != k.id:
        raise CheckpointKeyError(
            f"{where} is sealed under another key (id {sealed.get('key_id')}) than {KEY_ENV} {k.path} "
            f"(id {k.id}): give every process of the deployment the same key file, or re-key a "
            "checkpoint you trust with `python -m training.checkpoint rekey FOLDER --from-key-file OLD`"
        )
    body = {n: v for n, v in manifest.items() if n != SEAL}
    if not hmac.compare_digest(k.mac(body), sealed["hmac"]):
        raise CheckpointError(
            f"{where}: its HMAC does not verify under {KEY_ENV} {k.path}: the manifest was rewritten "
            "after it was saved; refusing the checkpoint"
        )
    return body
