"""dtlaunch.convert.dcp_blocks: a block of a DCP checkpoint's tensor, in its saved dtype, equal to the same
block of the whole tensor; blocks outside the tensor refused. (Checkpoints saved as several chunks by a
sharded run: tests/e2e/test_reference_run_blocks.py.)"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch


def saved(tmp_path: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    return tmp_path / "ckpt"


def test_blocks_keep_the_saved_dtype_and_values(tmp_path: Path) -> None:
    from dtlaunch.convert.dcp_blocks import DcpBlocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 5, generator=g).to(torch.bfloat16)
    v = torch.randn(6, generator=g)
    b = DcpBlocks(saved(tmp_path, {"w": w, "v": v}))
    assert torch.equal(b.read("w"), w) and b.read("w").dtype == torch.bfloat16
    for shape, offset in (((3, 5), (4, 0)), ((7, 2), (0, 3)), ((1, 1), (6, 4)), ((0, 5), (7, 0)), ((2, 3), (2, 1))):
        got = b.read("w", shape, offset)
        assert torch.equal(got, w[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]), (shape, offset)
    assert torch.equal(b.read("v", (2,), (3,)), v[3:5])


def test_a_block_outside_the_tensor_is_refused(tmp_path: Path) -> None:
    from dtlaunch.convert.dcp_blocks import DcpBlocks

    b = DcpBlocks(saved(tmp_path, {"w": torch.zeros(4, 4)}))
    for shape, offset in (((2, 4), (3, 0)), ((4,), (0,)), ((1, 1), (-1, 0))):
        with pytest.raises(ValueError, match="is not inside w of shape"):
            b.read("w", shape, offset)
