"""Mesh arithmetic: the parallel degrees against the world, the pipeline's stage split, Ulysses' K/V heads.

Pure Python (no torch) so the planner, the validators and the workers all agree on the same numbers. What the
job decides from its layout (batch accounting, FSDP, loss chunks, ...) is config.decisions.Decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

DIMS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")


def nproc_per_node(cfg: JobConfig, detected_gpus: int | None = None) -> int:
    """Workers per node: the configured number, else one per GPU, else 2 on a CPU host."""
    if cfg.launch.nproc_per_node > 0:
        return int(cfg.launch.nproc_per_node)
    if detected_gpus:
        return detected_gpus
    if cfg.hardware.gpus_per_node > 0:
        return int(cfg.hardware.gpus_per_node)
    return 2


def world_size(cfg: JobConfig, detected_gpus: int | None = None) -> int:
    # A scheduler's node count (Slurm, Kubernetes, SkyPilot) says how many nodes the job gets.
    nodes = cfg.cluster.nodes if cfg.cluster.kind != "local" else cfg.launch.nnodes
    return int(nodes) * nproc_per_node(cfg, detected_gpus)


@dataclass(frozen=True)
class Layout:
    """Resolved parallel degrees; dp_replicate * dp_shard * cp * tp * pp == world. `ep` takes no ranks of
    its own: it splits dp_shard into dp_shard / ep (FSDP of routed experts) x ep (expert parallel)."""

    world: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    # Context parallel: ranks that share each sample's sequence. They see the same samples (not part of
    # `dp`), but hold parameter shards and average gradients like data-parallel ranks.
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks one FSDP / ZeRO shard group spans: dp_shard x cp (context-parallel peers hold the same
        parameters, so they share the shards, as torchtitan does)."""
        return self.dp_shard * self.cp

    @classmethod
    def resolve(cls, strategy: Any, world: int) -> Layout:
        """Fill the one `-1` degree with the rest of the world; check the product."""
        degrees = {d: int(getattr(strategy, d, 1)) for d in DIMS}
        bad = [d for d, v in degrees.items() if v == 0 or v < -1]
        if bad:
            d = bad[0]
            raise ConfigError(f"strategy.{d}={degrees[d]} is not a degree: use a positive integer or -1 (the rest)")
        free = [d for d, v in degrees.items() if v == -1]
        if len(free) > 1:
            raise ConfigError(
                f"strategy.{free[0]} and strategy.{free[1]} are both -1: only one degree can take 'the rest'; "
                f"set strategy.{free[1]}=<n>"
            )
        fixed = 1
        for v in degrees.values():
            if v != -1:
                fixed *= v
        if free:
            if world % fixed:
                raise ConfigError(
                    f"strategy.{free[0]}=-1 cannot fill the world of {world} ranks: the other degrees multiply to "
                    f"{fixed}, which does not divide {world}; change the degrees or launch.nproc_per_node"
                )
            degrees[free[0]] = world // fixed
        elif fixed != world:
            desc = " x ".join(f"strategy.{d}={v}" for d, v in degrees.items())
            raise ConfigError(
                f"layout {desc} = {fixed} ranks but the world has {world}: set one degree to -1 "
                f"or change launch.nproc_per_node/launch.nnodes"
            )
        return cls(world=world, **degrees, ep=int(getattr(strategy, "ep", 1)))


def expert_fsdp_degree(layout: Layout) -> int:
    """Shard ranks left to FSDP over routed experts once `ep` of them hold different experts."""
    return layout.dp_shard // layout.ep


def ulysses_kv_heads(kv_heads: int, cp: int) -> int:
    """K/V heads (of one tensor-parallel rank) that Ulysses' all-to-all carries: all of them when cp divides
    them, each rank then receiving kv_heads / cp whole groups of query heads; otherwise (grouped-query
    attention with fewer K/V heads than CP ranks, e.g. 8 over cp=16) each K/V head repeated until the count
    is lcm(kv_heads, cp), so that every rank receives the K/V heads its query heads read. The runtime
    (train/parallel/ulysses.py) and the planner (plan/ulysses_terms.py) both take the count from here."""
    return kv_heads if kv_heads % cp == 0 else math.lcm(kv_heads, cp)


def pp_stage_layers(n_layers: int, n_stages: int, explicit: list[int] | None = None) -> list[int]:
    """Transformer blocks per pipeline stage. Uneven splits give the extra blocks to the middle
    stages, because the first stage also holds the embedding and the last the output head."""
    if explicit:
        return list(explicit)
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    # Hand out the remainder from the middle outward so the end stages stay lighter.
    order = sorted(range(n_stages), key=lambda i: (abs(i - (n_stages - 1) / 2), i))
    for i in order[:extra]:
        counts[i] += 1
    return counts
