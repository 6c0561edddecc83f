"""The pod of one replica group: KubernetesPodOperator with its GPUs given as a count, so
that the mapped task can take them per DAG run (ranks per group is a DAG param) where the
operator wants a V1ResourceRequirements. Imports the provider: only ftrec_train_k8s, when
the Kubernetes path is configured, imports this (ftrec_airflow.kubernetes)."""

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from kubernetes.client import models as k8s

from ftrec_airflow.kubernetes import KEY_ITEM
from ftrec_airflow.kubernetes_volumes import stage_mounts, volume_mounts


class GroupPodOperator(KubernetesPodOperator):
    """One replica group as one pod: `gpus` of `gpu_resource` (GPUs per pod = ranks per group;
    an empty resource name: a CPU-only pod), and its job's token Secret `token_secret` (the
    job's token and the deployment's checkpoint key) mounted at `token_dir` (names only: the
    mapped task's arguments travel as JSON); `work_mounts`: the parts of the work volume it sees
    (kubernetes_volumes: each by its own subPath); `stage_pod`: those of the shard-build stage
    its arguments name."""

    def __init__(
        self,
        *,
        gpus: int = 0,
        gpu_resource: str = "nvidia.com/gpu",
        token_secret: str = "",
        token_dir: str = "/etc/ftcore",
        work_mounts: list[dict] | None = None,
        stage_pod: bool = False,
        **kwargs,
    ):
        if stage_pod and work_mounts is None:  # a shard-build stage: arguments [work, index]
            work_mounts = stage_mounts((kwargs.get("arguments") or [""])[0])
        if work_mounts:
            kwargs["volume_mounts"] = [*(kwargs.get("volume_mounts") or []), *volume_mounts(work_mounts)]
        if gpus and gpu_resource and "container_resources" not in kwargs:
            # limits alone: Kubernetes sets an extended resource's request to its limit
            kwargs["container_resources"] = k8s.V1ResourceRequirements(limits={gpu_resource: str(gpus)})
        if token_secret:
            from airflow.providers.cncf.kubernetes.secret import Secret

            items = [k8s.V1KeyToPath(key=k, path=k) for k in ("token", KEY_ITEM)]
            token = Secret("volume", token_dir, token_secret, items=items)
            kwargs["secrets"] = [token, *(kwargs.get("secrets") or [])]
        super().__init__(**kwargs)
        self.gpus = gpus
        self.gpu_resource = gpu_resource
