"""The world DeviceMesh and the views of it each concern needs.

Mesh dims, outermost first: ("pp", "dp_replicate", "dp_shard", "tp"); a dim of degree 1 is left out, so
a name is present exactly when that parallelism is on. TP is innermost (its peers are neighbouring ranks,
on one node), PP outermost. A world of one gets a 1-sized "dp_shard" dim so the code path stays uniform.

Expert parallel borrows its ranks from "dp_shard": a second view of the same world unflattens
"dp_shard" into ("dp_shard_mod_ep", "ep") (inner ep: EP peers are neighbours). Routed experts are
sharded over "ep" and FSDP-sharded over the shard ranks left ("dp_shard_mod_ep", with "dp_replicate"
for HSDP); everything else keeps FSDP over the whole "dp_shard".
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtlaunch.config.layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    dims = [(name, getattr(layout, name)) for name in MESH_DIMS if getattr(layout, name) > 1]
    if not dims:
        dims = [("dp_shard", 1)]
    return init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))


def has_dim(mesh: DeviceMesh, name: str) -> bool:
    return name in (mesh.mesh_dim_names or ())


def sub_mesh(mesh: DeviceMesh, name: str) -> Optional[DeviceMesh]:
    return mesh[name] if has_dim(mesh, name) and mesh[name].size() > 1 else None


def dp_mesh(mesh: DeviceMesh, flatten: bool = False) -> Optional[DeviceMesh]:
    """The data-parallel ranks: ("dp_replicate", "dp_shard") as a 2-D mesh (HSDP), or one flat "dp" dim
    (DDP, ZeRO-1, the loss average); None when there is no data parallelism."""
    names = tuple(n for n in DP_DIMS if has_dim(mesh, n) and mesh[n].size() > 1)
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    sub = mesh[names]
    return sub._flatten("dp") if flatten else sub


def dp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number (for the data loader)."""
    rank, size = 0, 1
    for name in DP_DIMS:
        if has_dim(mesh, name):
            rank = rank * mesh[name].size() + mesh[name].get_local_rank()
            size *= mesh[name].size()
    return rank, size


class ExpertMeshes(NamedTuple):
    ep: DeviceMesh  # ranks holding different experts (the all-to-all group)
    fsdp: DeviceMesh  # ranks holding the same experts: FSDP (or HSDP, 2-D) over them


_EXPERT_MESHES: dict[int, ExpertMeshes] = {}


def expert_meshes(mesh: DeviceMesh, ep: int) -> Optional[ExpertMeshes]:
    """The EP and expert-FSDP views of the world mesh (None without expert parallel). Built once per
    world mesh: unflattening creates process groups, and every pipeline stage of a rank shares them."""
    if ep <= 1:
        return None
    key = id(mesh)
    if key not in _EXPERT_MESHES:
        shard = mesh["dp_shard"].size()
        sparse = mesh._unflatten("dp_shard", (shard // ep, ep), ("dp_shard_mod_ep", "ep"))
        fsdp_dims = tuple(n for n in ("dp_replicate", "dp_shard_mod_ep") if n in (sparse.mesh_dim_names or ()))
        _EXPERT_MESHES[key] = ExpertMeshes(ep=sparse["ep"], fsdp=sparse[fsdp_dims])
    return _EXPERT_MESHES[key]
