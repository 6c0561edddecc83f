"""ftrec_train_k8s: ftrec_train with the training off the Airflow worker, on Kubernetes:
interaction data -> shards -> one pod per replica group (torchrun, K GPUs each) against the
standing lighthouse -> evaluation -> MLflow model registry, behind the same quality gate.

The long form: docs/airflow.md, "dags/ftrec_train_k8s"."""

from datetime import timedelta

from airflow.sdk import dag, task
from airflow.sdk.exceptions import AirflowFailException

from ftrec_airflow import kubernetes, pipeline

UNAVAILABLE = kubernetes.unavailable()  # "" when the provider and FTREC_K8S_IMAGE are there
# build_shards' mapped stages are pods too (python -m dataprep stage ...), on the work volume; its
# cost model is timed first by a pod on the training pool (one GPU), as FreeScale calibrates
K8S_TRAIN = pipeline.TrainingDag(
    "ftrec_train_k8s",
    shard_fanout={
        "pods": kubernetes.stage_pod_operator,
        **({} if UNAVAILABLE else {"calibrate": kubernetes.calibration()}),
    },
)


@dag(
    **K8S_TRAIN.dag_args(
        __doc__ + (f"\n\n**Not available here:** {UNAVAILABLE}." if UNAVAILABLE else ""),
        tags=("kubernetes",),
        max_active_runs=4,
        description=f"unavailable: {UNAVAILABLE}" if UNAVAILABLE else "replica groups as Kubernetes pods",
    )
)
def ftrec_train_k8s():
    if UNAVAILABLE:  # still a DAG, so the UI says why instead of showing an import error

        @task(retries=0)
        def kubernetes_unavailable():
            raise AirflowFailException(f"ftrec_train_k8s: {UNAVAILABLE}")

        kubernetes_unavailable()
        return

    @task
    def open_run(shards: dict, params=None) -> dict:
        return kubernetes.open_run(params, shards)

    @task(retries=0)
    def group_pods(run: dict) -> list[dict]:
        return kubernetes.group_pods(run)

    @task
    def job_token(run: dict) -> None:
        kubernetes.put_job_secret(kubernetes.config(), run["job_id"])

    @task(trigger_rule="all_done")
    def drop_job_token(run: dict) -> None:
        kubernetes.drop_job_secret(kubernetes.config(), run["job_id"])

    @task
    def trained(run: dict) -> dict:
        return kubernetes.collect(run)

    run = open_run(K8S_TRAIN.shards())
    pods = kubernetes.group_pod_operator(task_id="train_group", execution_timeout=timedelta(hours=24)).expand_kwargs(
        group_pods(run)
    )
    job_token(run) >> pods
    pods >> drop_job_token(run)
    result = trained(run)
    pods >> result
    K8S_TRAIN.gate(result)


ftrec_train_k8s()
