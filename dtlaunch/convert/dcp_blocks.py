"""One block of a tensor of a DCP checkpoint, read on this process alone: no process group is needed and
none is used (no collective), so every rank of a job reads its own block independently.

DCP's own resharding does the work: `create_read_items_for_chunk_list` (what DefaultLoadPlanner runs for a
DTensor's shard) turns the block into read items against the chunks the saving ranks wrote, and
FileSystemReader copies each overlap into the block. FileSystemReader loads a saved chunk whole (it was
written with torch.save, which has no partial reads) and drops it after the copy: a read holds the block
plus one saved chunk at a time (a shard of the tensor when a sharded layout wrote it, the whole tensor when
one process did), never the checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class _BlockPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with a plain tensor as the destination of a block that need not start at the
    origin: the read items name the block by its offset (as a DTensor's shard is named), which only a
    sharded tensor could be looked up by."""

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class DcpBlocks:
    """A DCP checkpoint directory opened once (its metadata), its tensors read block by block."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = FileSystemReader(str(self.path))
        self.metadata = self.reader.read_metadata()
        # rank=None, use_collectives=False: this process reads for itself (FileSystemReader keeps both only
        # to name files and to decide on collectives, which read_data never runs).
        self.reader.set_up_storage_reader(self.metadata, True, rank=None, use_collectives=False)
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: md for k, md in self.metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
        }

    def read(self, key: str, shape: Optional[tuple] = None, offset: Optional[tuple] = None) -> torch.Tensor:
        """Tensor `key`'s block [offset : offset + shape] (the whole tensor by default) in its saved dtype."""
        md = self.tensors[key]
        size = tuple(md.size)
        shape = size if shape is None else tuple(shape)
        offset = (0,) * len(size) if offset is None else tuple(offset)
        if (
            len(shape) != len(size)
            or len(offset) != len(size)
            or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offset, shape, size, strict=True))
        ):
            raise ValueError(f"{self.path}: block {shape} at {offset} is not inside {key} of shape {size}")
        out = torch.empty(shape, dtype=md.properties.dtype)
        if math.prod(shape) == 0:
            return out  # an empty shard (uneven sharding): nothing to read
        block = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
        items = create_read_items_for_chunk_list(key, md, [block])
        planner = _BlockPlanner()
        planner.set_up_planner({key: out}, self.metadata, is_coordinator=True)
        self.reader.read_data(LoadPlan(items), planner).wait()
        return out
