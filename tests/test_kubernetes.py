"""ftrec_train_k8s without a cluster: the pods its mapped `train_group` task renders (the
operator the DAG file builds, unmapped per group as Airflow does at run time, asked for its
pod with the provider's own `build_pod_request_obj(dry_run=True)`: no API call), checked
against the launcher's `torchrun_command` for the same job, their GPUs, volumes and Secrets,
and round-tripped through the Kubernetes client's models; the lighthouse Deployment and
Service likewise; the tasks around the pods on a real MLflow store. Whether a cluster runs
them is not tested here (docs/kubernetes.md: not run).

The DAG file parsing with and without the provider, and unconfigured, is in
tests/test_dags_parse.py."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("AIRFLOW_HOME", str(ROOT / "work" / "test-airflow-home"))
pytest.importorskip("airflow.providers.cncf.kubernetes", reason="pip install -e '.[kubernetes]' (make setup does)")

from ftcore import ledger  # noqa: E402
from ftrec_airflow import kubernetes, pipeline_ops  # noqa: E402

IMAGE = "registry.example/ftrec:0.1.0"
WORKER_TOKEN = "the-workers-own-token-value"  # must never reach a spec


@pytest.fixture
def k8s_env(tmp_path, monkeypatch):
    for k, v in {
        "FTREC_K8S_IMAGE": IMAGE,
        "FTREC_K8S_NAMESPACE": "recs",
        "FTREC_K8S_MLFLOW_SECRET": "mlflow-creds",
        "FTREC_WORK": str(tmp_path / "work"),
        "FTCORE_TOKEN": WORKER_TOKEN,
    }.items():
        monkeypatch.setenv(k, v)
    for k in ("FTREC_LIGHTHOUSE_URL", "FTREC_K8S_GPU_RESOURCE", "FTREC_K8S_POD_TEMPLATE", "FTCORE_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.fixture
def train_group(k8s_env):
    """The DAG file's mapped pod task, parsed as the DAG processor does."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags" / "ftrec_train_k8s.py"))
    assert bag.import_errors == {}
    return bag.dags["ftrec_train_k8s"].get_task("train_group")


def _run(tmp_path, groups=3, ranks=2) -> dict:
    out = tmp_path / "work" / "runs" / "ftrec_train_k8s" / "manual__1" / "train"
    spec = pipeline_ops.TrainSpec(
        shards=str(out.parent / "shards"),
        out=str(out),
        replica_groups=groups,
        ranks_per_group=ranks,
        max_steps=20,
        overrides=["model.dim=16", "train.seed=0", "ft.lease=12"],  # [ft] reaches the pods as the launcher's ranks
    )
    return {
        "spec": spec.to_dict(),
        "mlflow_run_id": "0123abcd",
        "tracking_uri": "http://mlflow.internal:5000",
        "job_id": kubernetes.job_id("ftrec_train_k8s", "manual__1"),
    }


def _pods(train_group, run) -> list:
    return [train_group.unmap(kw).build_pod_request_obj(dry_run=True) for kw in kubernetes.group_pods(run)]


def test_each_group_pod_runs_the_launchers_torchrun_command(train_group, tmp_path, monkeypatch):
    from training.launch import TrainerLaunchConfig, TrainerLauncher

    run = _run(tmp_path)
    spec = pipeline_ops.TrainSpec(**run["spec"])
    pods = _pods(train_group, run)
    assert len(pods) == 3
    # the launcher of the same job against the same standing lighthouse, its token a file there
    monkeypatch.setenv("FTCORE_TOKEN_FILE", kubernetes.TOKEN_FILE)
    sets = pipeline_ops.trainer_settings(spec, run["mlflow_run_id"], run["tracking_uri"])
    launcher = TrainerLauncher(
        TrainerLaunchConfig(
            shards=spec.shards,
            replica_groups=3,
            ranks_per_group=2,
            lighthouse=kubernetes.config().lighthouse,
            job_id=run["job_id"],
            out=spec.out,
            max_restarts=kubernetes.TORCHRUN_MAX_RESTARTS,
            extra=[w for s in sets for w in ("--set", s)],
        )
    )
    for g, pod in enumerate(pods):
        words = shlex.split(launcher.torchrun_command(g))
        i = words.index("torchrun")
        want_env = dict(w.split("=", 1) for w in words[:i])
        want_args = [kubernetes.RDZV_ENDPOINT if w == "HOST:PORT" else w for w in words[i + 1 :]]
        (c,) = pod.spec.containers
        assert c.command == ["torchrun"] and c.args == want_args
        env = {e.name: e.value for e in c.env}
        # the same environment, but the token: the launcher's job-token file there, the job's Secret here
        assert want_env.pop("FTCORE_TOKEN_FILE") == str(Path(spec.out) / "job-token")
        assert env.pop("FTCORE_TOKEN_FILE") == kubernetes.TOKEN_FILE
        assert env.pop("FTREC_CHECKPOINT_KEY_FILE") == kubernetes.KEY_FILE  # the deployment's key, beside it
        assert {k: env.get(k) for k in want_env} == want_env
        assert set(env) - set(want_env) == {"MLFLOW_TRACKING_URI", "PYTHONUNBUFFERED"}
        assert env["FTREC_REPLICA_GROUP"] == str(g) and env["FTCORE_LIGHTHOUSE"] == "ftcore-lighthouse.recs.svc:29510"
        assert env["FTCORE_LEASE"] == "12.0"  # the run's ft.lease, as the launcher gives its ranks
        assert pod.metadata.labels["ftrec/replica-group"] == str(g)
        assert pod.metadata.name.startswith(f"ftrec-train-g{g}-")


def test_group_pods_get_their_gpus_volumes_and_secrets_never_a_token(train_group, tmp_path):
    import yaml

    run = _run(tmp_path, groups=2, ranks=4)
    for pod in _pods(train_group, run):
        assert pod.metadata.namespace == "recs" and pod.spec.restart_policy == "Never"
        (c,) = pod.spec.containers
        assert c.image == IMAGE
        assert c.resources.limits == {"nvidia.com/gpu": "4"}  # GPUs per pod = ranks per group
        mounts = {m.mount_path: m for m in c.volume_mounts}
        vols = {v.name: v for v in pod.spec.volumes}
        token = vols[mounts[kubernetes.TOKEN_DIR].name].secret
        # its job's own token, never the lighthouse's admin secret
        assert token.secret_name == kubernetes.job_secret_name(run["job_id"]) != "ftcore-lighthouse-token"
        assert [i.key for i in token.items] == ["token", "checkpoint.key"]  # and the checkpoint key beside it
        assert mounts[kubernetes.TOKEN_DIR].read_only
        assert {e.name: e.value for e in c.env}["FTCORE_TOKEN_FILE"] == kubernetes.TOKEN_FILE
        assert [e.secret_ref.name for e in c.env_from] == ["mlflow-creds"]
        spec = pipeline_ops.TrainSpec(**run["spec"])
        work = vols[mounts[spec.shards].name]  # its run's shard set, at the workers' path
        assert work.persistent_volume_claim.claim_name == "ftrec-work"
        assert str(tmp_path / "work") not in mounts  # never the whole work volume
        assert vols[mounts["/dev/shm"].name].empty_dir.medium == "Memory"
        text = yaml.safe_dump(kubernetes.to_dicts([pod]))
        assert WORKER_TOKEN not in text and "name: FTCORE_TOKEN\n" not in text
    op = train_group.unmap(kubernetes.group_pods(_run(tmp_path))[0])
    assert op.retries == 2 and op.on_finish_action.value == "delete_succeeded_pod" and op.get_logs
    assert train_group.expand_input.value.operator.task_id == "group_pods"  # map index = group


def test_cpu_only_pods_have_no_gpu_limit(k8s_env, tmp_path):
    from ftrec_airflow.kubernetes_operator import GroupPodOperator

    k8s_env.setenv("FTREC_K8S_GPU_RESOURCE", "")
    kw = kubernetes.group_pods(_run(tmp_path, groups=1))[0]
    pod = GroupPodOperator(task_id="train_group", **kubernetes.pod_defaults(), **kw).build_pod_request_obj(dry_run=True)
    assert pod.spec.containers[0].resources is None


def test_specs_round_trip_through_the_kubernetes_models(train_group, tmp_path):
    """Serialized as the API gets them and read back by the provider's and the client's own
    deserializers: a misspelt or mistyped field would not survive the round trip."""
    from airflow.providers.cncf.kubernetes.pod_generator import PodGenerator
    from kubernetes.client import ApiClient

    for pod in _pods(train_group, _run(tmp_path)):
        (d,) = kubernetes.to_dicts([pod])
        assert kubernetes.to_dicts([PodGenerator.deserialize_model_dict(d)]) == [d]
    api = ApiClient()
    for obj in kubernetes.lighthouse_manifests():
        (d,) = kubernetes.to_dicts([obj])
        back = api.deserialize(SimpleNamespace(data=json.dumps(d)), type(obj).__name__)
        assert kubernetes.to_dicts([back]) == [d]


def test_the_standing_lighthouse_deployment_and_service(k8s_env):
    deployment, service = kubernetes.to_dicts(kubernetes.lighthouse_manifests())
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    (c,) = spec["template"]["spec"]["containers"]
    assert c["command"] == ["ftcore-lighthouse"] and c["image"] == IMAGE
    assert c["args"][:2] == ["--bind", "$(POD_IP):29510"] and "--token-file" in c["args"]
    assert c["args"][c["args"].index("--token-file") + 1] == kubernetes.TOKEN_FILE
    assert c["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    (vol,) = spec["template"]["spec"]["volumes"]
    assert vol["secret"]["secretName"] == "ftcore-lighthouse-token"
    assert c["volumeMounts"][0]["mountPath"] == kubernetes.TOKEN_DIR
    (port,) = service["spec"]["ports"]
    assert port["port"] == 29510 and port["targetPort"] == c["ports"][0]["name"] == "lighthouse"
    # the group pods' FTCORE_LIGHTHOUSE is this Service's cluster DNS name
    meta = service["metadata"]
    assert kubernetes.config().lighthouse == f"{meta['name']}.{meta['namespace']}.svc:29510"
    assert WORKER_TOKEN not in json.dumps([deployment, service])


def test_lighthouse_manifests_from_the_command_line(k8s_env):
    import yaml

    r = subprocess.run(
        [sys.executable, "-m", "ftrec_airflow.kubernetes", "lighthouse"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert [d["kind"] for d in yaml.safe_load_all(r.stdout)] == ["Deployment", "Service"]
    r = subprocess.run(
        [sys.executable, "-m", "ftrec_airflow.kubernetes", "lighthouse"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FTREC_K8S_IMAGE": ""},
    )
    assert r.returncode == 2 and "FTREC_K8S_IMAGE" in r.stderr


def test_open_run_then_collect_group_zeros_result(k8s_env, tmp_path):
    """open_run: the MLflow run before any pod (a retry finds it again), the job id, and the
    Lighthouse tab pointed at the standing lighthouse; collect: group 0's result.json as the
    local train task returns it."""
    from airflow.sdk.exceptions import AirflowFailException

    from ftrec_airflow import lighthouse_status, pipeline, settings, tasks

    k8s_env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    k8s_env.setenv("FTREC_LIGHTHOUSE_URL", "http://ftcore-lighthouse.recs.svc:29510")
    k8s_env.delenv("AIRFLOW_CONN_FTREC_MLFLOW", raising=False)
    ctx = {"ti": SimpleNamespace(dag_id="ftrec_train_k8s", run_id="manual__1"), "run_id": "manual__1"}
    k8s_env.setattr(tasks, "get_current_context", lambda: ctx)
    k8s_env.setattr(kubernetes, "get_current_context", lambda: ctx)
    params = {**{k: p.value for k, p in pipeline.params().items()}, "replica_groups": 2, "ranks_per_group": 2}
    shards = {"path": str(settings.run_folder("ftrec_train_k8s", "manual__1") / "shards")}  # on the volume
    run = kubernetes.open_run(params, shards)
    assert kubernetes.open_run(params, shards)["mlflow_run_id"] == run["mlflow_run_id"]
    assert run["job_id"] == "ftrec_train_k8s/manual__1/train_group"
    snap = lighthouse_status.read_snapshot(settings.run_folder("ftrec_train_k8s", "manual__1"))
    assert snap["url"] == "http://ftcore-lighthouse.recs.svc:29510" and snap["job"] == run["job_id"]
    assert [kw["env_vars"]["FTCORE_LIGHTHOUSE"] for kw in kubernetes.group_pods(run)] == [
        "ftcore-lighthouse.recs.svc:29510"
    ] * 2
    with pytest.raises(RuntimeError, match="result.json is missing"):
        kubernetes.collect(run)
    res = Path(run["spec"]["out"]) / "replica_0" / "result.json"
    res.parent.mkdir(parents=True)
    res.write_text(
        json.dumps(
            {
                "mlflow_run_id": run["mlflow_run_id"],
                "checkpoint": "/ckpt",
                "steps": 3,
                "epochs_completed": 1,
                "metrics": {"test/sampled/ndcg_at_10": 0.25},
            }
        )
    )
    with pytest.raises(pipeline_ops.ExactlyOnceBroken, match="ledger check failed"):
        kubernetes.collect(run)  # the pods' ledger is missing: not collected, never registered
    spec = pipeline_ops.TrainSpec(**run["spec"])
    Path(spec.shards).mkdir(parents=True)
    (Path(spec.shards) / "manifest.json").write_text(json.dumps({"steps": 3}))
    writers = [ledger.Ledger(str(Path(spec.out) / "ledger"), g, k) for g in range(2) for k in range(2)]
    for step, rg in enumerate((0, 1, 1)):  # a planted double: row group 1 trained twice, 2 never
        for w in writers:
            w.record(step, 0, rg, "regular", {0, 1}, 1)
    with pytest.raises(pipeline_ops.ExactlyOnceBroken, match="twice"):
        kubernetes.collect(run)
    for w in writers:
        w.close()
    shutil.rmtree(Path(spec.out) / "ledger")
    writers = [ledger.Ledger(str(Path(spec.out) / "ledger"), g, k) for g in range(2) for k in range(2)]
    for rg in range(3):
        for w in writers:
            w.record(rg, 0, rg, "regular", {0, 1}, 1)
    got = kubernetes.collect(run)
    assert got["checkpoint"] == "/ckpt" and got["mlflow_run_id"] == run["mlflow_run_id"]
    assert got["replica_groups"] == 2 and got["tracking_uri"] == run["tracking_uri"]
    with pytest.raises(AirflowFailException, match="fault plans need the local launcher"):
        kubernetes.open_run({**params, "fault_plan": '{"faults": []}'}, shards)


# Kubernetes versions whose OpenAPI schema every rendered object must satisfy (kubernetes-validate
# bundles them: an offline check, no cluster); strict: a field Kubernetes does not know fails too
K8S_VERSIONS = ("1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")


def _schema_errors(objs: list[dict]) -> list[str]:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
    errors = []
    for version in K8S_VERSIONS:
        for d in objs:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{version} {d['kind']} {d['metadata'].get('name')}: {e.message} at {list(e.path)}")
    return errors


def test_every_rendered_object_satisfies_the_kubernetes_schema(train_group, k8s_env, tmp_path):
    """Each group pod (GPU and CPU-only), the lighthouse Deployment and Service, as the API
    server would receive them, against each version's OpenAPI schema, unknown fields refused."""
    from ftrec_airflow.kubernetes_operator import GroupPodOperator

    objs = kubernetes.to_dicts(_pods(train_group, _run(tmp_path, groups=3, ranks=2)))
    assert {d["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for d in objs} == {"2"}
    k8s_env.setenv("FTREC_K8S_GPU_RESOURCE", "")
    kw = kubernetes.group_pods(_run(tmp_path, groups=1))[0]
    cpu = GroupPodOperator(task_id="train_group", **kubernetes.pod_defaults(), **kw).build_pod_request_obj(dry_run=True)
    secret = kubernetes.job_secret(kubernetes.config(), kw["env_vars"]["FTCORE_JOB_ID"], "ftjob1.x.y", "k" * 43)
    objs += kubernetes.to_dicts([cpu, *kubernetes.lighthouse_manifests(), secret])
    assert [d["kind"] for d in objs] == ["Pod"] * 4 + ["Deployment", "Service", "Secret"]
    assert all(d.get("apiVersion") for d in objs)
    assert _schema_errors(objs) == []


def test_the_schema_check_catches_a_misspelt_or_mistyped_field(k8s_env):
    """The check above can fail: a field Kubernetes does not know, a string for an integer."""
    deployment, service = kubernetes.to_dicts(kubernetes.lighthouse_manifests())
    deployment["spec"]["replica"] = 1
    service["spec"]["ports"][0]["port"] = "29510"
    errors = _schema_errors([deployment, service])
    assert any("replica" in e for e in errors) and any("port" in e for e in errors), errors


def test_a_runs_pods_get_a_token_that_opens_their_job_alone(k8s_env, tmp_path):
    """The Secret open_run writes: the job's token, derived from the worker's admin secret;
    the lighthouse takes it for this job and refuses it for any other."""
    from ftcore import auth

    job = _run(tmp_path)["job_id"]
    token = auth.job_token("admin-secret", job)
    secret = kubernetes.job_secret(kubernetes.config(), job, token, "the-deployments-checkpoint-key")
    assert secret.metadata.name == kubernetes.job_secret_name(job)
    assert secret.string_data == {"token": token, "checkpoint.key": "the-deployments-checkpoint-key"}
    assert secret.metadata.namespace == "recs" and len(secret.metadata.name) <= 63
    assert auth.scope("admin-secret", f"Bearer {token}") == job
    assert kubernetes.job_secret_name(job) != kubernetes.job_secret_name(job + "x")


STAGE_TASKS = {"read": "scan", "partition": "split", "bucket": "bucket", "route": "route", "write": "write"}


@pytest.fixture
def stage_tasks(k8s_env):
    """build_shards' mapped stage tasks of the DAG file, parsed as the DAG processor does."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags" / "ftrec_train_k8s.py"))
    assert bag.import_errors == {}
    return {t: bag.dags["ftrec_train_k8s"].get_task(f"build_shards.{t}") for t in STAGE_TASKS}


def test_shard_stage_pods_run_dataprep_stage_on_the_work_volume(stage_tasks, tmp_path):
    work = str(tmp_path / "work" / "runs" / "x" / "r" / ".shards.stage-0" / "_work")
    for task_id, stage in STAGE_TASKS.items():
        pod = stage_tasks[task_id].unmap({"arguments": [work, "1"]}).build_pod_request_obj(dry_run=True)
        (c,) = pod.spec.containers
        assert c.command == ["python", "-m", "dataprep", "stage", stage] and c.args == [work, "1"]
        assert not (c.resources and c.resources.limits)  # no GPU
        assert str(Path(work).parent) in [m.mount_path for m in c.volume_mounts]
        assert pod.metadata.labels["ftrec/stage"] == stage and pod.metadata.namespace == "recs"


def test_shard_stage_pod_commands_build_the_one_process_set(stage_tasks, tmp_path):
    """The pods' commands, run here in the fanned-out order around the worker's own tasks
    (prepare, ids, plan, seal), build the set `dataprep shards` builds in one process."""
    from test_dataprep_bucketed import _assert_same

    from dataprep.build import build_shards
    from dataprep.synth import write_synthetic
    from ftrec_airflow import shard_tasks

    data = tmp_path / "ev.txt"
    write_synthetic(str(data), users=300, items=150, seed=3, fmt="sasrec")
    out = tmp_path / "work" / "runs" / "ftrec_train_k8s" / "manual__1" / "shards"  # a run's set: what pods mount
    spec = pipeline_ops.ShardSpec(input=str(data), fmt="sasrec", out=str(out), world_size=2, batch_size=8)
    stage = shard_tasks.prepare(spec, buckets=3, memory_budget=None, log=lambda line: None)["stage"]

    def pods(task_id: str, n: int) -> None:
        for kw in shard_tasks._args(stage, range(n)):
            (c,) = stage_tasks[task_id].unmap(kw).build_pod_request_obj(dry_run=True).spec.containers
            r = subprocess.run([sys.executable, *c.command[1:], *c.args], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr

    pods("read", 1)
    buckets = shard_tasks.run_stage("ids", stage)["buckets"]
    pods("partition", 1)
    pods("bucket", buckets)
    shard_tasks.plan(stage, log=lambda line: None)
    pods("route", buckets)
    pods("write", 2)
    summary = shard_tasks.seal(stage, spec.out, log=lambda line: None)
    assert buckets == 3 and summary["reused"] is False
    build_shards(str(data), "sasrec", str(tmp_path / "ref"), world_size=2, batch_size=8)
    _assert_same(tmp_path / "ref", out)


def test_the_cost_model_is_timed_by_a_pod_on_the_training_pool_and_read_by_the_shard_build(k8s_env, tmp_path):
    """FreeScale calibrates where it trains: build_shards.calibrate is a one-GPU pod running
    `python -m training calibrate --pool`, before prepare; prepare balances by what it published
    (its command run here, on this CPU: the manifest head names the device it timed)."""
    from airflow.dag_processing.dagbag import DagBag

    from dataprep.synth import write_synthetic
    from ftrec_airflow import shard_tasks
    from training import calibrate

    bag = DagBag(dag_folder=str(ROOT / "dags" / "ftrec_train_k8s.py"))
    assert bag.import_errors == {}
    dag = bag.dags["ftrec_train_k8s"]
    pod_task = dag.get_task("build_shards.calibrate")
    assert "build_shards.prepare" in pod_task.downstream_task_ids
    data = tmp_path / "ev.txt"
    write_synthetic(str(data), users=300, items=150, seed=3, fmt="sasrec")
    spec = pipeline_ops.ShardSpec(
        input=str(data), fmt="sasrec", out=str(tmp_path / "set"), world_size=2, batch_size=8, max_len=32,
        model_overrides=["model.dim=32", "train.seed=1"],
    )  # fmt: skip
    with pytest.raises(Exception, match="training pool 'k8s-gpu'"):  # before its pod ran
        shard_tasks.prepare(spec, buckets=2, memory_budget=None, log=lambda line: None, pool=kubernetes.CALIBRATE_POOL)
    pod = pod_task.unmap(kubernetes.calibrate_pod(spec)).build_pod_request_obj(dry_run=True)
    (c,) = pod.spec.containers
    assert c.command == ["python", "-m", "training", "calibrate"] and c.resources.limits == {"nvidia.com/gpu": "1"}
    assert ["--set", "model.dim=32"] == c.args[-2:] and "train.seed=1" not in c.args
    assert pod.metadata.labels["app.kubernetes.io/component"] == "calibrate"
    r = subprocess.run([sys.executable, *c.command[1:], *c.args], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    stage = shard_tasks.prepare(
        spec, buckets=2, memory_budget=None, log=lambda line: None, pool=kubernetes.CALIBRATE_POOL
    )["stage"]
    head = json.loads((Path(stage) / "_work" / shard_tasks.JOB).read_text())["head"]
    cm = head["config"]["cost_model"]
    assert cm["source"] == "calibrated:training" and cm["device"] == calibrate.device_name("cpu")
