"""ftrec_train_k8s: ftrec_train with the training off the Airflow worker, on Kubernetes:
interaction data -> shards -> one pod per replica group (torchrun, K GPUs each) against the
standing lighthouse -> evaluation -> MLflow model registry, behind the same quality gate.

`train_group` is one mapped task, map index = replica group: retrying one of its task
instances restarts that group's pod only, while the other groups keep committing and the
new pod heals from them. Shards and checkpoints pass through FTREC_WORK, a volume the
workers and the pods mount at the same path. Set-up (image, namespace, volume, lighthouse
Deployment and Service, token Secret): README, "The DAG on Kubernetes"; the decisions live
in `ftrec_airflow.kubernetes`.
"""

from datetime import datetime, timedelta

from airflow.sdk import Asset, dag, task
from airflow.sdk.exceptions import AirflowFailException

from ftrec_airflow import kubernetes, pipeline
from ftrec_airflow.decorators import build_shards_task

UNAVAILABLE = kubernetes.unavailable()   # "" when the provider and FTREC_K8S_IMAGE are there
SHARDS = Asset(name="ftrec_train_k8s_shards", uri="ftrec://shards/ftrec_train_k8s")
RETRY = {"retries": 2, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": 2.0}


@dag(dag_id="ftrec_train_k8s", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
     params=pipeline.params(), tags=["ftrec", "kubernetes"], max_active_runs=4,
     description=f"unavailable: {UNAVAILABLE}" if UNAVAILABLE else "replica groups as Kubernetes pods",
     doc_md=__doc__ + (f"\n\n**Not available here:** {UNAVAILABLE}." if UNAVAILABLE else ""))
def ftrec_train_k8s():
    if UNAVAILABLE:   # still a DAG, so the UI says why instead of showing an import error
        @task
        def kubernetes_unavailable():
            raise AirflowFailException(f"ftrec_train_k8s: {UNAVAILABLE}")
        kubernetes_unavailable()
        return

    @task(retries=1, retry_delay=timedelta(seconds=5))
    def ingest_validate(params=None) -> dict:
        return pipeline.ingest_validate(params)

    @build_shards_task(outlets=[SHARDS], **RETRY)
    def build_shards(data: dict, params=None):
        return pipeline.shard_spec(params, data)

    @task
    def verify_shards(shards: dict) -> dict:
        return pipeline.verify_shards(shards)

    @task(**RETRY)
    def open_run(shards: dict, params=None) -> dict:
        return kubernetes.open_run(params, shards)

    @task
    def group_pods(run: dict) -> list[dict]:
        return kubernetes.group_pods(run)

    @task(**RETRY)
    def trained(run: dict) -> dict:
        return kubernetes.collect(run)

    @task(**RETRY)
    def evaluate(result: dict) -> dict:
        return pipeline.evaluate(result)

    @task(**RETRY, outlets=[pipeline.MODEL])
    def register_model(result: dict, evaluation: dict, params=None) -> dict:
        return pipeline.register_model(params, result, evaluation)

    run = open_run(verify_shards(build_shards(ingest_validate())))
    pods = kubernetes.group_pod_operator(task_id="train_group", **RETRY, execution_timeout=timedelta(hours=24)) \
        .expand_kwargs(group_pods(run))
    result = trained(run)
    pods >> result
    register_model(result, evaluate(result))


ftrec_train_k8s()
