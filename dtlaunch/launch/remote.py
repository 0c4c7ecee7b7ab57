"""What Kubernetes and SkyPilot jobs share: the config that travels with the job, the command each node
runs, names a cluster accepts, and GPU counts that agree with the layout.

A remote node has no view of the submitting machine's files, so the job carries its resolved config as a
recipe file (`# @package _global_` + every key, already resolved). Each node runs
`dtlaunch train recipe=<that file> launch.node_rank=<its index> launch.rdzv_endpoint=<first node>`: the
same validation, plan, run directory, resume from the newest checkpoint and exit codes (75 = stopped at a
checkpoint, run it again) as a local or Slurm run. The run directory lives on storage every node mounts
(a PersistentVolumeClaim, a bucket), so a restarted job finds its checkpoints.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from dtlaunch.config.layout import nproc_per_node
from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

# RFC 1123 label (namespaces, most object names) and subdomain (ConfigMaps, PVCs), as Kubernetes checks them.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Kubeflow adds suffixes (`-node-0-0`, `-master-0`) to the job's name to name pods and services, which
# must stay within the 63 characters of a label: keep room for them.
JOB_NAME_MAX = 40
HEREDOC_END = "DTLAUNCH_CONFIG_END"


def check_dns_label(key: str, value: str, max_len: int = 63) -> str:
    if len(value) > max_len or not _DNS_LABEL.fullmatch(value):
        raise ConfigError(
            f"{key}={value!r} is not a name Kubernetes accepts: use at most {max_len} lowercase letters, digits "
            f"and '-', starting and ending with a letter or digit"
        )
    return value


def check_dns_subdomain(key: str, value: str) -> str:
    if len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ConfigError(
            f"{key}={value!r} is not a name Kubernetes accepts: use lowercase letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit"
        )
    return value


def job_name(run_name: str, explicit: str = "", key: str = "cluster.k8s.job_name") -> str:
    """The cluster-side name of the job: `explicit` (checked, refused when invalid), else the run name
    lowercased with every other character run turned into '-' (a run name like `tiny_ddp-20260101-120000`
    is not a DNS label). Starts with a letter: TrainJob and PyTorchJob names are RFC 1035 labels."""
    if explicit:
        name = check_dns_label(key, explicit, JOB_NAME_MAX)
        if not name[0].isalpha():
            raise ConfigError(f"{key}={explicit!r} must start with a letter (Kubernetes service names do)")
        return name
    name = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"dtl-{name}".rstrip("-")
    return name[:JOB_NAME_MAX].rstrip("-")


def gpus_per_node(cfg: JobConfig) -> int:
    """GPUs each node requests: cluster.gpus_per_node on a GPU profile, 0 on the CPU profile. One worker per
    GPU: a launch.nproc_per_node that says otherwise, or more GPUs than the profile's node has, is refused."""
    if cfg.hardware.name == "cpu" or cfg.hardware.gpus_per_node <= 0:
        return 0
    gpus = int(cfg.cluster.gpus_per_node)
    if gpus < 1:
        raise ConfigError(
            f"cluster.gpus_per_node={gpus} on hardware={cfg.hardware.name}: set the GPUs each node gets (>= 1)"
        )
    if gpus > cfg.hardware.gpus_per_node:
        raise ConfigError(
            f"cluster.gpus_per_node={gpus} but a {cfg.hardware.name} node has {cfg.hardware.gpus_per_node}: "
            f"set cluster.gpus_per_node<={cfg.hardware.gpus_per_node}"
        )
    nproc = int(cfg.launch.nproc_per_node)
    if nproc > 0 and nproc != gpus:
        raise ConfigError(
            f"launch.nproc_per_node={nproc} but cluster.gpus_per_node={gpus}: one worker per GPU; set both to the "
            f"same number (or launch.nproc_per_node=0)"
        )
    return gpus


def workers_per_node(cfg: JobConfig) -> int:
    return nproc_per_node(cfg, gpus_per_node(cfg) or None)


def check_mount_path(key: str, value: str) -> str:
    if not value.startswith("/") or any(c in value for c in "\n\r\x00") or ".." in value.split("/"):
        raise ConfigError(f"{key}={value!r} must be an absolute path without '..' (where the storage is mounted)")
    return value.rstrip("/") or "/"


def node_run_dir(mount_path: str, run_name: str) -> str:
    """The run directory as the nodes see it: <mount_path>/<run name> on the shared storage."""
    return str(PurePosixPath(mount_path) / run_name)


def recipe_file_name(recipe: str) -> str:
    """The shipped config's file name: the recipe's name when it is a plain one (it becomes the `recipe`
    key again on the node), else `job.yaml`."""
    return f"{recipe}.yaml" if re.fullmatch(r"[A-Za-z0-9][-_.A-Za-z0-9]*", recipe or "") else "job.yaml"


def shipped_config(cfg: JobConfig, run_dir: str, rdzv_id: str, nodes: int, nproc: int) -> str:
    """The resolved job as a recipe file, with what the nodes need fixed in it: the run directory on the
    shared storage, the node and worker counts the job was planned for, and one rendezvous id."""
    from omegaconf import OmegaConf

    shipped = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    shipped.run.dir = run_dir
    shipped.launch.nnodes = int(nodes)
    shipped.launch.nproc_per_node = int(nproc)
    shipped.launch.rdzv_id = rdzv_id
    text = "# @package _global_\n# Written by `dtlaunch submit`: the resolved job, run by every node.\n"
    text += OmegaConf.to_yaml(shipped)
    if any(line.strip() == HEREDOC_END for line in text.splitlines()):
        raise ConfigError(f"a config value is the line {HEREDOC_END!r}, which ends the job's embedded config")
    return text


def train_command(config_word: str, node_rank: str, endpoint: str) -> str:
    """`dtlaunch train` on one node. All three are shell text where variables expand: config_word an
    already quoted path, node_rank and endpoint go inside double quotes."""
    return f'exec dtlaunch train recipe={config_word} launch.node_rank="{node_rank}" launch.rdzv_endpoint="{endpoint}"'


def nodes_check(var: str, nodes: int, scheduler: str) -> str:
    """Shell: stop (exit 2) when the scheduler started another number of nodes than the job was planned for."""
    return (
        f'if [ "${{{var}:-}}" != "{int(nodes)}" ]; then echo "dtlaunch: {scheduler} started ${{{var}:-?}} node(s) '
        f'(\\${var}) but the job was planned for {int(nodes)}: submit it again" >&2; exit 2; fi'
    )


def to_yaml(docs: list[Any]) -> str:
    """YAML documents, multi-line strings (scripts, the shipped config) as readable `|` blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: Any, data: str) -> Any:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=1000)
