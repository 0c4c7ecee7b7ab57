"""Kubernetes: a Kubeflow Trainer TrainJob (or a Training Operator PyTorchJob) and the ConfigMap carrying
the job's resolved config; applied and read back with the `kubernetes` client.

Each node (pod) runs `dtlaunch train` on the shipped config (see remote.py) with the rank and rendezvous
Kubeflow gives torchrun (`PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT`); the run directory and
its checkpoints live on a PersistentVolumeClaim mounted by every pod. Preemption: Kubernetes sends SIGTERM
and waits `cluster.signal_before_s` (terminationGracePeriodSeconds); the workers checkpoint at the next
step and exit 75; the job's restart policy (a PyTorchJob's `OnFailure` replicas, a TrainJob runtime's
JobSet failurePolicy) starts the pod group again, and it resumes from the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from dtlaunch.errors import ConfigError, DtlaunchError, InputError
from dtlaunch.launch import hub_env, remote

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

TRAINJOB = ("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs")
PYTORCHJOB = ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs")
RECORD_NAME = "kubernetes.json"
MANIFEST_NAME = "kubernetes.yaml"
CONFIG_MOUNT = "/etc/dtlaunch"
# The names the torch-distributed runtime gives its ReplicatedJob and training container.
NODE = "node"
PATCH_MANAGER = "dtlaunch"
MANAGED_BY = {"app.kubernetes.io/managed-by": "dtlaunch"}


def _api(cfg: JobConfig) -> tuple[str, str, str, str]:
    return PYTORCHJOB if str(cfg.cluster.k8s.api) == "pytorchjob" else TRAINJOB


def _check(cfg: JobConfig) -> None:
    k = cfg.cluster.k8s
    if cfg.cluster.nodes < 1:
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} must be >= 1")
    if not k.image:
        raise ConfigError("cluster.k8s.image is empty: set the container image the pods run (with dtlaunch installed)")
    if not k.pvc:
        raise ConfigError(
            "cluster.k8s.pvc is empty: name a PersistentVolumeClaim for the run directory "
            "(checkpoints on a pod's own disk are lost with the pod)"
        )
    if any(c.isspace() for c in k.image):
        raise ConfigError(f"cluster.k8s.image={k.image!r} contains white space: give an image reference")
    remote.check_dns_label("cluster.k8s.namespace", k.namespace)
    remote.check_dns_subdomain("cluster.k8s.pvc", k.pvc)
    if str(cfg.cluster.k8s.api) == "trainjob":
        remote.check_dns_subdomain("cluster.k8s.runtime", k.runtime)
    if k.service_account:
        remote.check_dns_subdomain("cluster.k8s.service_account", k.service_account)
    remote.check_mount_path("cluster.k8s.mount_path", k.mount_path)
    if cfg.cluster.signal_before_s < 0:
        raise ConfigError(f"cluster.signal_before_s={cfg.cluster.signal_before_s} must be >= 0")


def _env(cfg: JobConfig, environ: Mapping[str, str]) -> list[dict[str, Any]]:
    """PYTHONUNBUFFERED, the launcher's hub cache variables (hub_env.py), HF_TOKEN from the Secret
    cluster.k8s.hf_token_secret names (a reference: the value never enters the manifest), then
    cluster.k8s.env, which wins."""
    k = cfg.cluster.k8s
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": n, "value": v} for n, v in hub_env.forwarded_env(cfg, k.env, environ).items()]
    if k.hf_token_secret and hub_env.TOKEN_VAR not in k.env:
        name, key = hub_env.k8s_token_ref(str(k.hf_token_secret))
        env.append({"name": hub_env.TOKEN_VAR, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    for name, value in k.env.items():
        env.append({"name": str(name), "value": str(value)})
    return env


def _resources(cfg: JobConfig, gpus: int) -> dict[str, Any]:
    k = cfg.cluster.k8s
    amounts = {}
    if k.cpu:
        amounts["cpu"] = str(k.cpu)
    if k.memory:
        amounts["memory"] = str(k.memory)
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"limits": dict(amounts), "requests": dict(amounts)} if amounts else {}


def _volumes(cfg: JobConfig, config_map: str) -> tuple[list[dict], list[dict]]:
    k = cfg.cluster.k8s
    volumes = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": k.pvc}},
        {"name": "job-config", "configMap": {"name": config_map}},
        # The 64 MiB /dev/shm of a pod is too small for NCCL and data-loader workers.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "runs", "mountPath": remote.check_mount_path("cluster.k8s.mount_path", k.mount_path)},
        {"name": "job-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


def _pod_fields(cfg: JobConfig) -> dict[str, Any]:
    k = cfg.cluster.k8s
    fields: dict[str, Any] = {"terminationGracePeriodSeconds": int(cfg.cluster.signal_before_s)}
    if k.service_account:
        fields["serviceAccountName"] = k.service_account
    if k.node_selector:
        fields["nodeSelector"] = {str(a): str(b) for a, b in k.node_selector.items()}
    if k.tolerations:
        from omegaconf import OmegaConf

        fields["tolerations"] = [
            OmegaConf.to_container(t) if not isinstance(t, dict) else dict(t) for t in k.tolerations
        ]
    return fields


def node_script(cfg: JobConfig, config_file: str, nodes: int) -> str:
    """The shell each pod runs. TrainJob: Kubeflow Trainer's torch variables. PyTorchJob: the Training
    Operator sets MASTER_ADDR/MASTER_PORT and the node's index as PET_NODE_RANK (RANK in older versions)."""
    if str(cfg.cluster.k8s.api) == "pytorchjob":
        check = []
        rank, endpoint = "${PET_NODE_RANK:-$RANK}", "$MASTER_ADDR:$MASTER_PORT"
    else:
        check = [remote.nodes_check("PET_NNODES", nodes, "Kubeflow Trainer")]
        rank, endpoint = "$PET_NODE_RANK", "$PET_MASTER_ADDR:$PET_MASTER_PORT"
    return "\n".join(["set -eu", *check, remote.train_command(shlex.quote(config_file), rank, endpoint)]) + "\n"


def render(cfg: JobConfig, run_name: str, environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """[ConfigMap, TrainJob | PyTorchJob] as plain dicts (what the API server receives); `environ`: the
    launcher's environment (default os.environ), read for the hub variables the pods get."""
    _check(cfg)
    environ = os.environ if environ is None else environ
    k = cfg.cluster.k8s
    name = remote.job_name(run_name, k.job_name)
    config_map = f"{name}-config"
    gpus = remote.gpus_per_node(cfg)
    nproc = remote.workers_per_node(cfg)
    nodes = int(cfg.cluster.nodes)
    run_dir = remote.node_run_dir(k.mount_path, run_name)
    file_name = remote.recipe_file_name(str(cfg.recipe or ""))
    meta = {"name": name, "namespace": k.namespace, "labels": dict(MANAGED_BY)}
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": config_map},
        "data": {file_name: remote.shipped_config(cfg, run_dir, name, nodes, nproc)},
    }
    command = ["sh", "-c", node_script(cfg, f"{CONFIG_MOUNT}/{file_name}", nodes)]
    volumes, mounts = _volumes(cfg, config_map)
    group, version, kind, _ = _api(cfg)
    if kind == "TrainJob":
        trainer: dict[str, Any] = {
            "image": k.image,
            "command": command,
            "numNodes": nodes,
            "numProcPerNode": nproc,
            "env": _env(cfg, environ),
        }
        resources = _resources(cfg, gpus)
        if resources:
            trainer["resourcesPerNode"] = resources
        pod_spec = {**_pod_fields(cfg), "volumes": volumes, "containers": [{"name": NODE, "volumeMounts": mounts}]}
        job_pod = {"template": {"spec": {"template": {"spec": pod_spec}}}}
        spec = {
            "runtimeRef": {"name": k.runtime},
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": PATCH_MANAGER,
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{"name": NODE, **job_pod}]}}},
                }
            ],
        }
    else:
        container = {
            "name": "pytorch",  # the Training Operator finds the training container by this name
            "image": k.image,
            "command": command,
            "env": _env(cfg, environ),
            "volumeMounts": mounts,
        }
        resources = _resources(cfg, gpus)
        if resources:
            container["resources"] = resources
        template = {"spec": {**_pod_fields(cfg), "volumes": volumes, "containers": [container]}}
        # OnFailure: any non-zero exit (75 after a checkpoint, a collective broken by a lost peer) restarts
        # the pod, which resumes from the newest checkpoint. ExitCode would treat 75 as permanent.
        replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
        if nodes > 1:
            replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "OnFailure", "template": template}
        spec = {"nprocPerNode": str(nproc), "pytorchReplicaSpecs": replicas}
        if cfg.launch.max_restarts > 0:
            spec["elasticPolicy"] = {
                "rdzvBackend": "c10d",
                "minReplicas": nodes,
                "maxReplicas": nodes,
                "maxRestarts": int(cfg.launch.max_restarts),
            }
    job = {"apiVersion": f"{group}/{version}", "kind": kind, "metadata": meta, "spec": spec}
    return [cm, job]


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    return remote.to_yaml(manifests)


def api_client(context: str = "") -> Any:
    """A client from the kubeconfig (its current context, or `context`), else the in-cluster config."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise DtlaunchError(
            "cluster=kubernetes needs the kubernetes client: pip install 'dtlaunch[kubernetes]' "
            "(or print the manifests with --dry-run and `kubectl apply -f -`)"
        ) from None
    try:
        # $KUBECONFIG read now: the client reads it once at import, which may be before it was set.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, context=context or None)
    except Exception as kube_exc:  # no kubeconfig: try the pod's service account
        try:
            config.load_incluster_config()
        except Exception:
            raise DtlaunchError(f"no Kubernetes cluster configured: {str(kube_exc).splitlines()[0]}") from None
    return client.ApiClient()


def _api_error(exc: Any, what: str) -> DtlaunchError:
    try:
        message = json.loads(exc.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        message = ""
    return DtlaunchError(f"{what}: {exc.status} {exc.reason}: {message or 'no message'}")


def apply(manifests: list[dict[str, Any]], client: Any) -> str:
    """Create the ConfigMap (replaced when a previous submission left one) and then the job; the job's name."""
    from kubernetes.client import CoreV1Api, CustomObjectsApi
    from kubernetes.client.rest import ApiException

    cm, job = manifests
    ns = cm["metadata"]["namespace"]
    core = CoreV1Api(client)
    try:
        core.create_namespaced_config_map(ns, cm)
    except ApiException as exc:
        if exc.status != 409:
            raise _api_error(exc, f"creating ConfigMap {cm['metadata']['name']}") from None
        try:
            core.replace_namespaced_config_map(cm["metadata"]["name"], ns, cm)
        except ApiException as exc2:
            raise _api_error(exc2, f"replacing ConfigMap {cm['metadata']['name']}") from None
    group, version = job["apiVersion"].split("/")
    plural = PYTORCHJOB[3] if job["kind"] == "PyTorchJob" else TRAINJOB[3]
    name = job["metadata"]["name"]
    try:
        CustomObjectsApi(client).create_namespaced_custom_object(group, version, ns, plural, job)
    except ApiException as exc:
        if exc.status == 409:
            raise InputError(
                f"{job['kind']} {name} already exists in namespace {ns}: delete it first "
                f"(kubectl delete {plural} {name} -n {ns}); the new one resumes from the run's checkpoints"
            ) from None
        raise _api_error(exc, f"creating {job['kind']} {name}") from None
    return name


def record(run_dir: Path, manifests: list[dict[str, Any]], context: str) -> None:
    job = manifests[1]
    data = {
        "apiVersion": job["apiVersion"],
        "kind": job["kind"],
        "name": job["metadata"]["name"],
        "namespace": job["metadata"]["namespace"],
        "context": context,
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (run_dir / MANIFEST_NAME).write_text(to_yaml(manifests))
    tmp = run_dir / f".{RECORD_NAME}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(run_dir / RECORD_NAME)


def read_record(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / RECORD_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {Path(run_dir) / RECORD_NAME}: {exc}") from None


def job_state(obj: dict[str, Any]) -> tuple[str, str]:
    """(state, reason) from a TrainJob's or PyTorchJob's status conditions: the newest true condition."""
    conditions = [c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    if not conditions:
        return "Pending", ""
    last = max(conditions, key=lambda c: c.get("lastTransitionTime") or "")
    return str(last.get("type", "Unknown")), str(last.get("reason") or last.get("message") or "")


def query_status(rec: dict[str, Any], client: Any) -> dict[str, Any]:
    from kubernetes.client import CustomObjectsApi
    from kubernetes.client.rest import ApiException

    group, version = rec["apiVersion"].split("/")
    plural = PYTORCHJOB[3] if rec["kind"] == "PyTorchJob" else TRAINJOB[3]
    try:
        obj = CustomObjectsApi(client).get_namespaced_custom_object(
            group, version, rec["namespace"], plural, rec["name"]
        )
    except ApiException as exc:
        if exc.status == 404:
            return {"job": rec["name"], "kind": rec["kind"], "state": "NotFound", "reason": "deleted or never created"}
        raise _api_error(exc, f"reading {rec['kind']} {rec['name']}") from None
    state, reason = job_state(obj)
    return {"job": rec["name"], "kind": rec["kind"], "namespace": rec["namespace"], "state": state, "reason": reason}
