"""What each pod of ftrec_train_k8s mounts of the work volume (issue 41, item 7): only its run's
folders, each by its own subPath at the workers' path, read-write only its output; every spec
schema-checked as in tests/test_kubernetes.py; unsafe subPaths and run ids refused or encoded."""

from pathlib import Path

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes", reason="pip install -e '.[kubernetes]' (make setup does)")

import test_kubernetes as tk  # noqa: E402

from ftrec_airflow import kubernetes, kubernetes_volumes, pipeline_ops, settings  # noqa: E402

k8s_env, train_group, stage_tasks = tk.k8s_env, tk.train_group, tk.stage_tasks  # its fixtures, shared
_pods, _run, _schema_errors = tk._pods, tk._run, tk._schema_errors

RUN = "runs/ftrec_train_k8s/manual__1"


def _work_mounts(pod) -> dict[str, tuple[str, bool]]:
    """mount path -> (subPath, readOnly) of the work volume's mounts in `pod`."""
    (c,) = pod.spec.containers
    got = {m.mount_path: (m.sub_path, m.read_only) for m in c.volume_mounts if m.name == "work"}
    assert all(sub for sub, _ in got.values()), got  # never the whole volume
    return got


def test_each_group_pod_mounts_its_output_rw_and_the_shards_and_champion_ro(train_group, tmp_path):
    work = tmp_path / "work"
    champion = work / "runs" / "ftrec_retrain" / "scheduled__0" / "train" / "replica_0" / "checkpoints" / "step-9"
    run = _run(tmp_path, groups=2, ranks=1)
    run["spec"]["overrides"].append(f"train.init_checkpoint={champion}")
    pods = _pods(train_group, run)
    for g, pod in enumerate(pods):
        assert _work_mounts(pod) == {
            str(work / RUN / "shards"): (f"{RUN}/shards", True),
            str(work / RUN / "train" / f"replica_{g}"): (f"{RUN}/train/replica_{g}", False),
            str(work / RUN / "train" / "ledger"): (f"{RUN}/train/ledger", False),  # a file per rank
            str(champion): (str(champion.relative_to(work)), True),
        }
    assert _schema_errors(kubernetes.to_dicts(pods)) == []


def test_a_local_mlflow_store_on_the_volume_is_mounted_rw(k8s_env, tmp_path):
    run = {**_run(tmp_path, groups=1), "tracking_uri": f"sqlite:///{tmp_path / 'work' / 'mlflow' / 'mlflow.db'}"}
    mounts = kubernetes.group_pods(run)[0]["work_mounts"]
    assert {"path": str(tmp_path / "work" / "mlflow"), "sub_path": "mlflow", "read_only": False} in mounts


def test_stage_pods_mount_the_run_ro_and_the_staging_folder_rw(stage_tasks, tmp_path):
    run = tmp_path / "work" / RUN
    work = run / ".shards.stage-0" / "_work"
    pods = []
    for task in stage_tasks.values():
        pods.append(task.unmap({"arguments": [str(work), "0"]}).build_pod_request_obj(dry_run=True))
        assert _work_mounts(pods[-1]) == {
            str(run): (RUN, True),
            str(work.parent): (f"{RUN}/.shards.stage-0", False),
        }
    reused = stage_tasks["read"].unmap({"arguments": ["", "0"]}).build_pod_request_obj(dry_run=True)
    assert _work_mounts(reused) == {}  # the set was reused: nothing to read or write
    with pytest.raises(kubernetes_volumes.MountError, match="not a shard build's work folder"):
        stage_tasks["read"].unmap({"arguments": [str(run / "train"), "0"]})
    assert _schema_errors(kubernetes.to_dicts([*pods, reused])) == []


def test_the_calibrate_pod_writes_the_cost_model_cache_alone(k8s_env, tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(tk.ROOT / "dags" / "ftrec_train_k8s.py")).dags["ftrec_train_k8s"]
    spec = pipeline_ops.ShardSpec(input="x", fmt="sasrec", out=str(tmp_path / "work" / RUN / "shards"), world_size=1)
    pod = (
        dag.get_task("build_shards.calibrate").unmap(kubernetes.calibrate_pod(spec)).build_pod_request_obj(dry_run=True)
    )
    assert _work_mounts(pod) == {str(tmp_path / "work" / "cost-models"): ("cost-models", False)}
    assert _schema_errors(kubernetes.to_dicts([pod])) == []


@pytest.mark.parametrize("sub", ["", "/runs/d/r", "runs//r", "runs/./r", "runs/../x", "..", "runs/d/r/", "a\\b"])
def test_unsafe_subpaths_are_refused(sub):
    with pytest.raises(kubernetes_volumes.MountError, match="subPath"):
        kubernetes_volumes.check_subpath(sub)


def test_paths_off_the_runs_or_with_dotdot_are_refused(k8s_env, tmp_path):
    work = tmp_path / "work"
    assert kubernetes_volumes.check_subpath(f"{RUN}/train") == f"{RUN}/train"
    for path, why in [
        (work / RUN / ".." / ".." / "other", "without '..'"),
        (tmp_path / "elsewhere", "not on the work volume"),
        (work, "subPath '.'"),  # the whole volume
        (work / "runs" / "ftrec_train_k8s", "not inside a run's folder"),
        (work / "mlflow", "not inside a run's folder"),
        (Path("runs/d/r"), "absolute"),
    ]:
        with pytest.raises(kubernetes_volumes.MountError, match=why):
            kubernetes_volumes.mount(path, True)
    run = _run(tmp_path, groups=1)
    run["spec"]["out"] = str(work / RUN / ".." / "other" / "train")
    with pytest.raises(kubernetes_volumes.MountError):
        kubernetes.group_pods(run)


@pytest.mark.parametrize("run_id", ["../../../etc", "a/../../b", "/abs", "..", "x/./y", "./"])
def test_tricky_run_ids_stay_inside_their_runs_folder(k8s_env, tmp_path, run_id):
    """The run folder is the run id slugged (settings.slug): '/' and '.' are encoded, so each
    subPath is one run's folder under runs/<dag>/, whatever the run id."""
    folder = settings.run_folder("ftrec_train_k8s", run_id)
    spec = pipeline_ops.TrainSpec(shards=str(folder / "shards"), out=str(folder / "train"))
    for m in kubernetes_volumes.group_mounts(spec, 0, "http://mlflow.internal:5000"):
        parts = m["sub_path"].split("/")
        assert parts[:3] == ["runs", settings.slug("ftrec_train_k8s"), settings.slug(run_id)]
        assert ".." not in parts and "." not in parts and len(parts) in (4, 5)


def test_a_forged_mount_from_xcom_is_refused_by_the_operator(k8s_env, tmp_path):
    from ftrec_airflow.kubernetes_operator import GroupPodOperator

    forged = [{"path": "/", "sub_path": "runs/../..", "read_only": False}]
    with pytest.raises(kubernetes_volumes.MountError, match="subPath"):
        GroupPodOperator(task_id="t", **kubernetes.pod_defaults(), work_mounts=forged)
