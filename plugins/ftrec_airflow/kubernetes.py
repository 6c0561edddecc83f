"""Training off the Airflow worker: `ftrec_train_k8s` runs each replica group as one Kubernetes
pod (the cncf.kubernetes provider's KubernetesPodOperator) against a standing lighthouse, a
Deployment behind a Service.

The long form: docs/airflow.md, "plugins/ftrec_airflow/kubernetes"."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow.sdk import get_current_context
from airflow.sdk.exceptions import AirflowFailException

from ftrec_airflow import kubernetes_volumes, pipeline_ops, settings

PROVIDER = "apache-airflow-providers-cncf-kubernetes"
LIGHTHOUSE = "ftcore-lighthouse"  # Deployment, Service and its pods' app label
LIGHTHOUSE_PORT = 29510
TOKEN_DIR = "/etc/ftcore"  # the token Secret, mounted in the lighthouse and every group pod
TOKEN_FILE = f"{TOKEN_DIR}/token"
KEY_ITEM = "checkpoint.key"  # the deployment's checkpoint key: an item of the same Secret
KEY_FILE = f"{TOKEN_DIR}/{KEY_ITEM}"
RDZV_ENDPOINT = "127.0.0.1:29400"  # torchrun's rendezvous inside the pod (one node per group)
TORCHRUN_MAX_RESTARTS = 3  # crashed ranks restarted in place before the pod fails
STARTUP_TIMEOUT_S = 900  # a GPU node may have to be scaled up first
MIN_REPLICAS, LR_POLICY = 1, "sqrt"  # the launcher's defaults (training/launch.py)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodConfig:
    image: str
    namespace: str = "default"
    work_pvc: str = "ftrec-work"
    token_secret: str = "ftcore-lighthouse-token"
    mlflow_secret: str = ""
    gpu_resource: str = "nvidia.com/gpu"
    pod_template: str = ""
    lighthouse: str = ""  # host:port the ranks reach the lighthouse on

    @property
    def work(self) -> str:
        """Where the work volume is mounted: FTREC_WORK, the same path as on the workers."""
        return str(settings.work_root())


def _get(key: str, default: str = "") -> str:
    value = os.environ.get(f"FTREC_K8S_{key.upper()}")
    if value is None:
        from airflow.configuration import conf

        value = conf.get("ftrec", f"k8s_{key}", fallback=None)
    return default if value is None else value.strip()


def config() -> PodConfig:
    ns = _get("namespace", "default") or "default"
    lighthouse = settings.lighthouse_url().split("://", 1)[-1] or f"{LIGHTHOUSE}.{ns}.svc:{LIGHTHOUSE_PORT}"
    return PodConfig(
        image=_get("image"),
        namespace=ns,
        work_pvc=_get("work_pvc", "ftrec-work"),
        token_secret=_get("token_secret", "ftcore-lighthouse-token"),
        mlflow_secret=_get("mlflow_secret"),
        gpu_resource=_get("gpu_resource", "nvidia.com/gpu"),
        pod_template=_get("pod_template"),
        lighthouse=lighthouse,
    )


def unavailable() -> str:
    """Why ftrec_train_k8s cannot run here, or "" when it can. Imports the provider only
    when an image is configured: elsewhere parsing the DAG file stays cheap."""
    if not config().image:
        return (
            "set FTREC_K8S_IMAGE (or k8s_image in airflow.cfg's [ftrec] section) to an image with ftrec "
            "installed; docs/kubernetes.md"
        )
    try:
        import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401
    except ImportError as e:
        return f"the cncf.kubernetes provider does not import ({e}): pip install 'ftrec[kubernetes]' ({PROVIDER})"
    return ""


# ---------------------------------------------------------------- what each group runs


def job_id(dag_id: str, run_id: str) -> str:
    """The DAG run's job on the standing lighthouse (the Lighthouse tab's too)."""
    return settings.lighthouse_job_id(f"{dag_id}/{run_id}/train_group")


def group_env(cfg: PodConfig, job: str, groups: int, group: int, tracking_uri: str) -> dict[str, str]:
    """A group pod's environment: the launcher's job_env() with this group's id (the token as
    a file from the Secret, never its value), the checkpoint key (a file from the same Secret),
    the tracking URI, unbuffered output (the pod's log streams into the task log)."""
    from ftcore.environment import RankEnv  # not at parse time: the DAG file imports no ftcore or training
    from training.checkpoint_key import KEY_ENV

    told = RankEnv(
        lighthouse=cfg.lighthouse,
        job=job,
        num_groups=groups,
        min_replicas=MIN_REPLICAS,
        lr_policy=LR_POLICY,
        token_file=TOKEN_FILE,
    )
    return {
        **told.to_env(),
        KEY_ENV: KEY_FILE,
        **RankEnv(group=group).to_env(),
        "MLFLOW_TRACKING_URI": tracking_uri,
        "PYTHONUNBUFFERED": "1",
    }


def group_args(spec: pipeline_ops.TrainSpec, job: str, group: int, trainer_sets: list[str]) -> list[str]:
    """torchrun's arguments for one group: training/launch.py's torchrun_command on one node."""
    args = [
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(spec.ranks_per_group),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        RDZV_ENDPOINT,
        "--rdzv-id",
        f"{job}-g{group}",
        "--max-restarts",
        str(TORCHRUN_MAX_RESTARTS),
        "-m",
        "training",
        "train",
        "--shards",
        spec.shards,
        "--out",
        str(Path(spec.out) / f"replica_{group}"),
    ]
    for s in trainer_sets:
        args += ["--set", s]
    return args


def group_pods(run: dict[str, Any], cfg: PodConfig | None = None) -> list[dict[str, Any]]:
    """The mapped pod task's kwargs, one dict per replica group (map index = group)."""
    cfg = cfg or config()
    spec = pipeline_ops.TrainSpec(**run["spec"])
    sets = pipeline_ops.trainer_settings(spec, run["mlflow_run_id"], run["tracking_uri"])
    from training.launch import trainer_ft  # not at parse time: the DAG file imports no training

    ft = trainer_ft([w for s in sets for w in ("--set", s)])  # the trainer's [ft], as the launcher gives it
    return [
        {
            "name": f"ftrec-train-g{g}",
            "gpus": spec.ranks_per_group,
            "labels": {
                "app.kubernetes.io/name": "ftrec",
                "app.kubernetes.io/component": "replica-group",
                "ftrec/replica-group": str(g),
            },
            "env_vars": {**group_env(cfg, run["job_id"], spec.replica_groups, g, run["tracking_uri"]), **ft},
            "arguments": group_args(spec, run["job_id"], g, sets),
            "token_secret": job_secret_name(run["job_id"]),
            "token_dir": TOKEN_DIR,
            "work_mounts": kubernetes_volumes.group_mounts(spec, g, run["tracking_uri"]),
        }
        for g in range(spec.replica_groups)
    ]


def pod_defaults(cfg: PodConfig | None = None) -> dict[str, Any]:
    """What every group pod shares: the operator's partial() arguments. The work volume is there
    but mounted by no one here: each pod mounts its run's folders (its `work_mounts`)."""
    from airflow.providers.cncf.kubernetes.secret import Secret
    from kubernetes.client import models as k8s

    cfg = cfg or config()
    secrets = []  # the job's token Secret is per run: GroupPodOperator(token_secret=...)
    if cfg.mlflow_secret:  # its keys (MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN) become the pod's env
        secrets.append(Secret("env", None, cfg.mlflow_secret))
    return {
        "namespace": cfg.namespace,
        "image": cfg.image,
        "cmds": ["torchrun"],
        "secrets": secrets,
        "volumes": [
            k8s.V1Volume(
                name=kubernetes_volumes.WORK_VOLUME,
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=cfg.work_pvc),
            ),
            # torch's worker processes share tensors through /dev/shm (64 MiB by default)
            k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory")),
        ],
        "volume_mounts": [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")],
        "gpu_resource": cfg.gpu_resource,
        "pod_template_file": cfg.pod_template or None,
        "get_logs": True,  # the group's output in the task log
        "on_finish_action": "delete_succeeded_pod",  # a failed group's pod stays for kubectl logs
        "startup_timeout_seconds": STARTUP_TIMEOUT_S,
    }


def group_pod_operator(**task_args):
    """The mapped pod task: `.expand_kwargs(group_pods(run))` gives one pod per group."""
    from ftrec_airflow.kubernetes_operator import GroupPodOperator

    return GroupPodOperator.partial(**pod_defaults(), **task_args)


def stage_pod_operator(*, task_id: str, stage: str, **task_args):
    """A mapped stage of the fanned-out shard build as pods (shard_tasks.fanout's `pods`): each
    runs `python -m dataprep stage STAGE WORK INDEX` on the work volume, without a GPU, and
    mounts its run's folder read-only and the staging folder read-write (`stage_pod`)."""
    from ftrec_airflow.kubernetes_operator import GroupPodOperator

    labels = {"app.kubernetes.io/name": "ftrec", "app.kubernetes.io/component": "shard-build", "ftrec/stage": stage}
    defaults = {**pod_defaults(), "cmds": ["python", "-m", "dataprep", "stage", stage], "gpu_resource": ""}
    return GroupPodOperator.partial(task_id=task_id, labels=labels, stage_pod=True, **defaults, **task_args)


CALIBRATE_POOL = "k8s-gpu"  # the name the calibrate pod publishes its cost model under


def calibrate_pod(spec: pipeline_ops.ShardSpec) -> dict[str, Any]:
    """The calibrate pod's kwargs: the trained model's cost model timed on one GPU of the training
    pool (training/calibrate.py), cached on the work volume by device, model config and torch
    version, and published for this DAG's shard build (shard_tasks.PoolCalibration)."""
    args = ["--max-len", str(spec.max_len), "--cache-dir", str(settings.work_root() / "cost-models")]
    args += ["--pool", CALIBRATE_POOL]
    for s in spec.model_overrides or []:
        if s.startswith("model."):
            args += ["--set", s]
    labels = {"app.kubernetes.io/name": "ftrec", "app.kubernetes.io/component": "calibrate"}
    mounts = kubernetes_volumes.calibrate_mounts()
    return {"name": "ftrec-calibrate", "gpus": 1, "arguments": args, "labels": labels, "work_mounts": mounts}


def calibrate_pod_operator(*, task_id: str, **task_args):
    """The calibrate task as a pod on the training pool (one GPU): `python -m training calibrate`."""
    from ftrec_airflow.kubernetes_operator import GroupPodOperator

    defaults = {**pod_defaults(), "cmds": ["python", "-m", "training", "calibrate"]}
    return GroupPodOperator.partial(task_id=task_id, **defaults, **task_args)


def calibration():
    """build_shards' PoolCalibration on Kubernetes (the DAG's shard_fanout `calibrate`)."""
    from ftrec_airflow.shard_tasks import PoolCalibration

    return PoolCalibration(calibrate_pod_operator, calibrate_pod, CALIBRATE_POOL)


# ---------------------------------------------------------------- the job's own credential


def job_secret_name(job: str) -> str:
    """The Secret holding one job's token (a DNS-1123 name: the job id is hashed)."""
    return "ftcore-job-" + hashlib.sha256(job.encode()).hexdigest()[:20]


def job_secret(cfg: PodConfig, job: str, token: str, key: str):
    """The job's token (item `token`) and the deployment's checkpoint key (item `checkpoint.key`:
    a warm start reads the champion's checkpoint, another run's) as a Secret, labelled as ftrec's."""
    from kubernetes.client import models as k8s

    labels = {"app.kubernetes.io/name": "ftrec", "app.kubernetes.io/component": "job-token"}
    meta = k8s.V1ObjectMeta(name=job_secret_name(job), namespace=cfg.namespace, labels=labels)
    return k8s.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=meta,
        type="Opaque",
        string_data={"token": token, KEY_ITEM: key},
    )


def put_job_secret(cfg: PodConfig, job: str) -> None:
    """Create (or, on a retry, replace) the job's token Secret, derived on this worker from the
    lighthouse's admin secret (FTCORE_TOKEN_FILE / FTCORE_TOKEN): the pods never see that one;
    with it the worker's checkpoint key (FTREC_CHECKPOINT_KEY_FILE)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes.client.exceptions import ApiException

    from ftcore import auth
    from training import checkpoint_key

    secret = auth.token_from_env()
    if secret is None:
        raise AirflowFailException(
            "no lighthouse token on this worker: set FTCORE_TOKEN_FILE to the lighthouse's admin secret "
            "(each run's pods get only their job's token, derived from it)"
        )
    try:
        key = checkpoint_key.key().secret.decode()
    except checkpoint_key.CheckpointError as e:
        raise AirflowFailException(f"the pods need the deployment's checkpoint key: {e}") from None
    api = KubernetesHook().core_v1_client
    body = job_secret(cfg, job, auth.job_token(secret, job), key)
    try:
        api.create_namespaced_secret(cfg.namespace, body)
    except ApiException as e:
        if e.status != 409:
            raise
        api.replace_namespaced_secret(body.metadata.name, cfg.namespace, body)


def drop_job_secret(cfg: PodConfig, job: str) -> None:
    """Delete the job's token Secret once its pods are done (gone already: fine)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes.client.exceptions import ApiException

    try:
        KubernetesHook().core_v1_client.delete_namespaced_secret(job_secret_name(job), cfg.namespace)
    except ApiException as e:
        if e.status != 404:
            raise


# ---------------------------------------------------------------- the tasks around the pods


def open_run(p: dict, shards: dict) -> dict[str, Any]:
    """Before any pod starts: the TrainSpec, the MLflow run (a retry finds the same one),
    the job id; everything the pods and `collect` need, JSON-able."""
    from ftrec_airflow import lighthouse_status, mlflow_registry, tasks

    spec = tasks.train_spec(shards, params=p)
    if spec.fault_plan:
        raise AirflowFailException(
            "param fault_plan: fault plans need the local launcher (ftrec_train, "
            "ftrec_chaos_drill); on Kubernetes, delete a group's pod to see a recovery"
        )
    ctx = get_current_context()
    ti = ctx["ti"]
    uri, creds = mlflow_registry.connect()
    if creds and not config().mlflow_secret:
        log.warning(
            "the %s connection has credentials, which never go into a pod spec: give the "
            "pods a Secret with them (FTREC_K8S_MLFLOW_SECRET)",
            settings.MLFLOW_CONN_ID,
        )
    exp_id, run_id = mlflow_registry.ensure_run(
        spec.experiment,
        f"{ti.dag_id}/{ti.run_id}/train",
        run_name=f"{ti.dag_id} {ti.run_id}",
        tags={"airflow.dag_id": ti.dag_id, "airflow.run_id": ti.run_id, "ftrec.runs_on": "kubernetes"},
        tracking_uri=uri,
    )
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    job = job_id(ti.dag_id, ti.run_id)
    if settings.lighthouse_url():  # the Lighthouse tab asks the standing lighthouse for this job
        lighthouse_status.write_snapshot(
            settings.run_folder(ti.dag_id, ti.run_id), settings.lighthouse_url(), None, job=job
        )
    return {
        "spec": spec.to_dict(),
        "mlflow_run_id": run_id,
        "experiment_id": exp_id,
        "run_url": mlflow_registry.run_url(exp_id, run_id),
        "tracking_uri": uri,
        "job_id": job,
    }


def collect(run: dict[str, Any]) -> dict[str, Any]:
    """After the pods: group 0's result, as the local train task returns it (evaluate and
    register_model take either), once the job's ledger shows every batch trained once (else
    ExactlyOnceBroken: a run that broke exactly-once never ends green nor registers a model)."""
    import json

    spec = pipeline_ops.TrainSpec(**run["spec"])
    path = Path(spec.out) / "replica_0" / "result.json"
    if not path.exists():
        raise RuntimeError(
            f"every group pod succeeded but {path} is missing: is FTREC_WORK ({settings.work_root()}) "
            "the same volume on the workers and in the pods?"
        )
    result = json.loads(path.read_text())
    if result.get("mlflow_run_id") != run["mlflow_run_id"]:
        raise RuntimeError(f"{path} is from MLflow run {result.get('mlflow_run_id')}, not {run['mlflow_run_id']}")
    pipeline_ops.check_exactly_once(spec, result)
    ids = ("mlflow_run_id", "experiment_id", "run_url", "tracking_uri")
    return pipeline_ops.TrainedRun.of(spec, result, **{k: run[k] for k in ids}).to_dict()


# ---------------------------------------------------------------- the standing lighthouse


def _lighthouse_container(cfg: PodConfig):
    """The lighthouse's one container: it binds the pod's own address (never a wildcard, as
    everywhere in ftcore) and reads its admin token from the mounted Secret."""
    from kubernetes.client import models as k8s

    return k8s.V1Container(
        name="lighthouse",
        image=cfg.image,
        command=["ftcore-lighthouse"],
        args=[
            "--bind",
            f"$(POD_IP):{LIGHTHOUSE_PORT}",
            "--token-file",
            TOKEN_FILE,
            "--min-replicas",
            str(MIN_REPLICAS),
        ],
        env=[
            k8s.V1EnvVar(
                name="POD_IP",
                value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP")),
            )
        ],
        ports=[k8s.V1ContainerPort(name="lighthouse", container_port=LIGHTHOUSE_PORT, protocol="TCP")],
        readiness_probe=k8s.V1Probe(tcp_socket=k8s.V1TCPSocketAction(port="lighthouse"), period_seconds=5),
        liveness_probe=k8s.V1Probe(
            tcp_socket=k8s.V1TCPSocketAction(port="lighthouse"), period_seconds=10, failure_threshold=6
        ),
        resources=k8s.V1ResourceRequirements(requests={"cpu": "500m", "memory": "256Mi"}),
        volume_mounts=[k8s.V1VolumeMount(name="token", mount_path=TOKEN_DIR, read_only=True)],
    )


def lighthouse_manifests(cfg: PodConfig | None = None) -> list:
    """The lighthouse's Deployment and Service (kubernetes client models). One replica,
    recreated rather than rolled: two lighthouses must never answer for one job at once."""
    from kubernetes.client import models as k8s

    cfg = cfg or config()
    labels = {"app.kubernetes.io/name": LIGHTHOUSE, "app.kubernetes.io/part-of": "ftrec"}
    meta = k8s.V1ObjectMeta(name=LIGHTHOUSE, namespace=cfg.namespace, labels=labels)
    deployment = k8s.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=meta,
        spec=k8s.V1DeploymentSpec(
            replicas=1,
            strategy=k8s.V1DeploymentStrategy(type="Recreate"),
            selector=k8s.V1LabelSelector(match_labels=labels),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=k8s.V1PodSpec(
                    containers=[_lighthouse_container(cfg)],
                    volumes=[
                        k8s.V1Volume(
                            name="token",
                            secret=k8s.V1SecretVolumeSource(
                                secret_name=cfg.token_secret, items=[k8s.V1KeyToPath(key="token", path="token")]
                            ),
                        )
                    ],
                ),
            ),
        ),
    )
    service = k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=meta,
        spec=k8s.V1ServiceSpec(
            selector=labels,
            ports=[
                k8s.V1ServicePort(name="lighthouse", port=LIGHTHOUSE_PORT, target_port="lighthouse", protocol="TCP")
            ],
        ),
    )
    return [deployment, service]


def to_dicts(objs: list) -> list[dict]:
    """Kubernetes client models as the API's JSON (camelCase, no nulls)."""
    from kubernetes.client import ApiClient

    return [ApiClient().sanitize_for_serialization(o) for o in objs]


def main(argv: list[str] | None = None) -> int:
    import argparse

    import yaml

    p = argparse.ArgumentParser(
        prog="python -m ftrec_airflow.kubernetes",
        description="print Kubernetes manifests for ftrec (FTREC_K8S_* settings apply)",
    )
    p.add_argument("what", choices=["lighthouse"], help="the standing lighthouse's Deployment and Service")
    p.parse_args(argv)
    cfg = config()
    if not cfg.image:
        print("error: set FTREC_K8S_IMAGE to an image with ftrec installed", file=sys.stderr)
        return 2
    print(yaml.safe_dump_all(to_dicts(lighthouse_manifests(cfg)), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
