"""The world DeviceMesh and the views of it each concern needs.

Mesh dims, outermost first: ("pp", "dp_replicate", "dp_shard", "tp"); a dim of degree 1 is left out, so
a name is present exactly when that parallelism is on. TP is innermost (its peers are neighbouring ranks,
on one node), PP outermost. A world of one gets a 1-sized "dp_shard" dim so the code path stays uniform.
"""

from __future__ import annotations

from typing import Optional

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
