"""QLoRA's NF4 base linears against torchao's own quantisation: the value a meta-built, `to_empty`-ed and
loaded NF4 weight computes with equals torchao's dequantised weight, whole or as row shards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as torchao_to_nf4  # noqa: E402

from dtlaunch.errors import ConfigError  # noqa: E402
from dtlaunch.models.nf4 import (  # noqa: E402
    frozen_block_linears,
    is_nf4,
    load_nf4_rows,
    quantize_frozen_linears,
)

BLOCK, SCALER = 16, 8


class Blocks(nn.Module):
    """Two blocks of linears under `layers`, like the decoders, and a head outside them."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        with torch.device(device):
            self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)) for i in range(2)})
            self.output = nn.Linear(32, 64, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_meta_quantised_linear_computes_with_torchaos_dequantised_weight(dtype: torch.dtype) -> None:
    model = Blocks()
    names = quantize_frozen_linears(model, BLOCK, SCALER, dtype)
    assert names == ["layers.0.0.weight", "layers.0.1.weight", "layers.1.0.weight", "layers.1.1.weight"]
    assert not is_nf4(model.output.weight)  # the head is not a block linear
    model.to_empty(device="cpu")
    lin = model.layers["0"][0]
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    ref = torchao_to_nf4(w.to(dtype), BLOCK, SCALER)
    load_nf4_rows(lin.weight, ref, 0, 1)
    lin.bias.copy_(torch.linspace(-1, 1, 64))
    x = torch.randn(5, 32, dtype=dtype, requires_grad=True)
    y = lin(x)
    expected = x.detach() @ ref.get_original_weight().to(dtype).t() + lin.bias  # torchao adds the bias as it is
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    assert not lin.weight.requires_grad
    y.sum().backward()  # the input's gradient through the dequantised weight; none for the weight
    torch.testing.assert_close(x.grad, torch.ones(5, 64, dtype=dtype) @ ref.get_original_weight().to(dtype))
    assert lin.weight.grad is None
    # A weight quantised in another dtype than the input still computes in the input's dtype.
    assert lin(torch.randn(2, 32, dtype=torch.float32)).dtype == torch.float32


def test_row_shards_equal_rows_of_the_whole_quantised_weight() -> None:
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    full = torchao_to_nf4(w, BLOCK, SCALER)
    rows = []
    for index in range(2):
        shard = Blocks()
        quantize_frozen_linears(shard, BLOCK, SCALER, torch.float32, shards=2)
        local = torch.chunk(shard.layers["0"][0].weight, 2, dim=0)[index]  # FSDP's split of a meta weight
        local = torch.empty_like(local, device="cpu")
        load_nf4_rows(local, full, index, 2)
        rows.append(local.get_original_weight())
    torch.testing.assert_close(torch.cat(rows), full.get_original_weight(), rtol=0, atol=0)


def test_weights_without_whole_blocks_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"peft.nf4_block_size=64 x peft.nf4_scaler_block_size=256"):
        quantize_frozen_linears(Blocks(), 64, 256, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"3 row shard"):
        quantize_frozen_linears(Blocks(), BLOCK, SCALER, torch.bfloat16, shards=3)


def test_only_frozen_block_linears_are_quantised() -> None:
    model = Blocks()
    model.layers["1"][1].weight.requires_grad_(True)  # a trained linear stays as it is
    names = [n for n, _ in frozen_block_linears(model)]
    assert names == ["layers.0.0", "layers.0.1", "layers.1.0"]


def test_a_one_row_gate_stays_in_the_compute_dtype() -> None:
    """A linear with one output (Qwen3-Next's shared-expert gate) is not quantised: a single row cannot be
    cut into FSDP row shards of whole NF4 blocks, under any block sizes."""
    model = Blocks()
    with torch.device("meta"):
        model.layers["0"].append(nn.Linear(32, 1, bias=False).requires_grad_(False))
    names = quantize_frozen_linears(model, BLOCK, SCALER, torch.bfloat16, shards=2)
    assert "layers.0.2.weight" not in names and len(names) == 4
    assert not is_nf4(model.layers["0"][2].weight)
