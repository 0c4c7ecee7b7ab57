"""Reading DCP checkpoints safely: the load planner the workers' resume and the converters share."""

from __future__ import annotations

import io
from typing import Any


def safe_load_planner() -> Any:
    """DCP's default load planner, but non-tensor values are unpickled with weights_only=True."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
