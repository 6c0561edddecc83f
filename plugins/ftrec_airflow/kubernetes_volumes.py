"""Which parts of the work volume each pod sees (issue 41, item 7): a pod mounts only its run's
folders, each by its own `subPath` at the path the workers use (so no command changes),
read-write only where it writes. A mount is a JSON-able dict {"path", "sub_path", "read_only"}
(mapped kwargs travel as XCom); GroupPodOperator turns it into a V1VolumeMount, checking the
subPath again. Pure functions of paths and the work root: no provider import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftrec_airflow import pipeline_ops, settings

WORK_VOLUME = "work"  # the pod volume of the work PVC (pod_defaults)
COST_MODELS = "cost-models"  # the calibrate pod's cache, read by the shard build on the worker


class MountError(ValueError):
    """A path a pod would mount is outside the run folders, or its subPath is unsafe."""


def check_subpath(sub: str) -> str:
    """`sub` if it is a safe subPath of the work volume: relative, '/'-separated, no empty,
    '.' or '..' component (the whole volume, or a way out of the folder, is never mounted)."""
    parts = sub.split("/")
    if not sub or sub.startswith("/") or "\\" in sub or "\0" in sub or any(p in ("", ".", "..") for p in parts):
        raise MountError(
            f"work volume subPath {sub!r}: must be a relative path inside the volume, with no empty, "
            "'.' or '..' component"
        )
    return sub


def mount(path: str | Path, read_only: bool, *, runs_only: bool = True) -> dict[str, Any]:
    """`path` (a path on the work volume, as the workers see it) mounted at the same path by its
    own subPath. `runs_only`: it must lie in a run's folder, runs/<dag>/<run>[/...]."""
    root = settings.work_root()
    p = Path(path)
    if not p.is_absolute() or ".." in p.parts:
        raise MountError(f"{path}: a pod mounts absolute paths without '..' only")
    try:
        sub = p.relative_to(root).as_posix()
    except ValueError:
        raise MountError(
            f"{path} is not on the work volume (FTREC_WORK={root}): a pod sees only its run's folders there"
        ) from None
    check_subpath(sub)
    if runs_only and (sub.split("/")[0] != "runs" or sub.count("/") < 2):
        raise MountError(f"{path}: not inside a run's folder ({root}/runs/<dag>/<run>)")
    return {"path": str(p), "sub_path": sub, "read_only": bool(read_only)}


def _local_store(tracking_uri: str) -> Path | None:
    """The folder of a local MLflow store on the work volume (sqlite:///..., file:...), else None."""
    for scheme in ("sqlite:///", "file://", "file:"):
        if tracking_uri.startswith(scheme):
            path = Path(tracking_uri[len(scheme) :])
            path = path.parent if scheme == "sqlite:///" else path
            return path if path.is_absolute() and path.is_relative_to(settings.work_root()) else None
    return None


def group_mounts(spec: pipeline_ops.TrainSpec, group: int, tracking_uri: str) -> list[dict[str, Any]]:
    """A replica group's pod: its own output folder read-write (<run>/train/replica_<g>), the
    job's ledger (<run>/train/ledger, a file per rank: training/replica.py writes it beside the output
    folder, the train task's ledger check reads it) read-write, the shard set read-only, a warm
    start's checkpoint (train.init_checkpoint) read-only at its own path; a local MLflow store
    on the work volume read-write (a tracking server needs none)."""
    out = Path(spec.out)
    mounts = [mount(spec.shards, True), mount(out / f"replica_{group}", False), mount(out / "ledger", False)]
    for s in spec.overrides:
        key, _, value = s.partition("=")
        if key.strip() == "train.init_checkpoint" and value.strip():
            mounts.append(mount(value.strip(), True))
    store = _local_store(tracking_uri)
    if store is not None:
        mounts.append(mount(store, False, runs_only=False))
    return mounts


def stage_mounts(work: str) -> list[dict[str, Any]]:
    """A shard-build stage pod, from its work folder (<run>/.shards.stage-<key>/_work): the run's
    folder read-only (its input: the ingested data) and the staging folder read-write. A reused
    set (work ""): nothing."""
    if not work:
        return []
    stage = Path(work).parent
    if not stage.name.startswith(".shards.stage-"):
        raise MountError(f"{work}: not a shard build's work folder (<run>/.shards.stage-<key>/_work)")
    return [mount(stage.parent, True), mount(stage, False)]


def calibrate_mounts() -> list[dict[str, Any]]:
    """The calibrate pod writes the shared cost-model cache (<work>/cost-models), which the shard
    build reads: a timing, never a checkpoint or a shard."""
    return [mount(settings.work_root() / COST_MODELS, False, runs_only=False)]


def volume_mounts(mounts: list[dict[str, Any]]) -> list:
    """The mounts as V1VolumeMounts of the work volume, each subPath checked again (the mapped
    kwargs came through XCom)."""
    from kubernetes.client import models as k8s

    return [
        k8s.V1VolumeMount(
            name=WORK_VOLUME,
            mount_path=str(m["path"]),
            sub_path=check_subpath(str(m["sub_path"])),
            read_only=bool(m["read_only"]),
        )
        for m in mounts
    ]
