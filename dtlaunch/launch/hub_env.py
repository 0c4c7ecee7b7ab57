"""What a Kubernetes pod or a SkyPilot node needs to read a job's hub names offline: the launcher's hub
cache variables (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT), so the nodes resolve the commit
pinned in config.yaml in the cache `submit` checked, and the token by reference only.

Slurm needs none of this: a batch job inherits the submitting shell's environment. A token's value is
never written into a manifest or task: on Kubernetes it comes from a Secret (cluster.k8s.hf_token_secret),
on SkyPilot from a task secret whose value `sky` reads from the submitting environment (`--secret HF_TOKEN`).
Variables set explicitly in cluster.k8s.env / cluster.sky.env win over the forwarded ones.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT")
TOKEN_VAR = "HF_TOKEN"
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def uses_hub(cfg: JobConfig) -> bool:
    """The job names a hub model (model.init_from=hf:ORG/NAME) or a hub dataset (data.kind=hf)."""
    from dtlaunch.hub.dataset import hub_dataset_refs
    from dtlaunch.launch.job_inputs import is_hub_model

    return is_hub_model(cfg) or bool(hub_dataset_refs(cfg))


def forwarded_env(cfg: JobConfig, explicit: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's hub cache variables that are set, for a job that reads hub names; none otherwise
    (a local job's manifest does not change with the submitting shell)."""
    if not uses_hub(cfg):
        return {}
    return {k: environ[k] for k in CACHE_VARS if environ.get(k) and k not in explicit}


def token_to_forward(cfg: JobConfig, explicit: Mapping[str, Any], environ: Mapping[str, str]) -> bool:
    """The launcher holds HF_TOKEN for a job that reads hub names, and the nodes' env does not set it."""
    return bool(environ.get(TOKEN_VAR)) and TOKEN_VAR not in explicit and uses_hub(cfg)


def k8s_token_ref(value: str) -> tuple[str, str]:
    """cluster.k8s.hf_token_secret = NAME or NAME:KEY (KEY defaults to HF_TOKEN) -> (name, key)."""
    from dtlaunch.launch.remote import check_dns_subdomain

    name, _, key = value.partition(":")
    key = key or TOKEN_VAR
    check_dns_subdomain("cluster.k8s.hf_token_secret", name)
    if not _SECRET_KEY.fullmatch(key):
        raise ConfigError(
            f"cluster.k8s.hf_token_secret={value!r}: the key {key!r} is not a Secret key (letters, digits, '-', '_', "
            f"'.'): write NAME or NAME:KEY"
        )
    return name, key
