"""The toy family's module: embedding -> blocks (norm, MLP, residual) -> norm -> head, following the
runtime's protocol (a `layers` ModuleDict keyed by block index, `init_param`, `buffer_values`)."""

import zlib

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, ratio * dim, bias=False)
        self.down = nn.Linear(ratio * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    def __init__(self, m) -> None:
        super().__init__()
        self.cfg = m
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleDict({str(i): Block(m.dim, m.mlp_ratio) for i in range(m.n_layers)})
        self.norm = nn.RMSNorm(m.dim)
        self.output = nn.Linear(m.dim, m.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, head: bool = True) -> torch.Tensor:
        # head=False: the final norm's output, for the runtime's chunked loss (training.loss_chunks).
        x = self.tok_embeddings(tokens)
        for block in self.layers.values():
            x = block(x)
        h = self.norm(x)
        return self.output(h) if head else h

    def init_param(self, name: str, shape: tuple, seed: int) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g).mul_(0.02)

    def buffer_values(self, device=None) -> dict:
        return {}


def build_model(m, rope_len=None, device="meta") -> ToyLM:
    with torch.device(device):
        model = ToyLM(m)
    model.rope_len = rope_len
    return model
