"""The world DeviceMesh and the views of it each concern needs.

Mesh dims, outermost first: ("pp", "dp_replicate", "dp_shard", "cp", "tp"); a dim of degree 1 is left
out, so a name is present exactly when that parallelism is on. TP is innermost (its peers are
neighbouring ranks, on one node), then CP (ring attention exchanges K/V every block), PP outermost. A
world of one gets a 1-sized "dp_shard" dim so the code path stays uniform.

Expert parallel borrows its ranks from "dp_shard": a second view of the same world unflattens
"dp_shard" into ("dp_shard_mod_ep", "ep") (inner ep: EP peers are neighbours). Routed experts are
sharded over "ep" and FSDP-sharded over the shard ranks left ("dp_shard_mod_ep", with "dp_replicate"
for HSDP); everything else keeps FSDP over the whole "dp_shard".
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtlaunch.config.layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
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


def _flattened(mesh: DeviceMesh, names: tuple[str, ...], name: str) -> DeviceMesh:
    """`names` of `mesh` as one dim called `name` (flattened once; later calls reuse it)."""
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return mesh[names]._flatten(name)


def dp_mesh(mesh: DeviceMesh, flatten: bool = False) -> Optional[DeviceMesh]:
    """The ranks that average gradients and share parameter shards: ("dp_replicate", "dp_shard") as a
    2-D mesh (HSDP), or one flat "dp" dim (DDP, ZeRO-1); None when there are none. Context-parallel
    ranks belong here too (they hold the same parameters and each computes the gradient of its share
    of the tokens): "dp_shard" and "cp" are flattened into "dp_shard_cp"."""
    present = tuple(n for n in ("dp_replicate", "dp_shard", "cp") if has_dim(mesh, n) and mesh[n].size() > 1)
    if not present:
        return None
    if len(present) == 1:
        return mesh[present[0]]
    if flatten:
        return _flattened(mesh, present, "dp_cp" if "cp" in present else "dp")
    if "dp_replicate" not in present:  # dp_shard x cp: one shard dim
        return _flattened(mesh, present, "dp_shard_cp")
    if "cp" in present and "dp_shard" in present:
        _flattened(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh[present]


def dp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number (for the data loader; CP peers
    read the same samples)."""
    rank, size = 0, 1
    for name in DP_DIMS:
        if has_dim(mesh, name):
            rank = rank * mesh[name].size() + mesh[name].get_local_rank()
            size *= mesh[name].size()
    return rank, size


def cp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index in its context-parallel group and the group's size (1 without CP)."""
    cp = sub_mesh(mesh, "cp")
    return (cp.get_local_rank(), cp.size()) if cp is not None else (0, 1)


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
