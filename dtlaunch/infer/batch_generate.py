"""Batched generation with dtlaunch's own model modules: the rollout phase of objective=grpo, and the
batched path `dtlaunch generate` can share.

Prompts of different lengths are left-padded into one (rows, prompt) block; each row's RoPE positions
start at its first real token and attention ignores the padding (KVCache.key_mask), so every row sees
exactly what it would see alone. The KV cache is allocated once for prompt + max_new_tokens positions and
written in place. A row stops at its first stop id (EOS, end of turn), which it keeps; the batch stops
when every row has, or after max_new_tokens. Sampling follows transformers' order: temperature, top-k,
top-p; temperature 0 is greedy. Draws come from the caller's torch.Generator (seeded per rank and step
by the rollout, so a resumed run draws the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from dtlaunch.models.dense.model import KVCache


class PreallocatedKVCache(KVCache):
    """A block's keys and values for `capacity` positions, allocated at the first append (its head count
    is the module's: under tensor parallel, this rank's heads) and filled in place."""

    def __init__(self, capacity: int, key_mask: torch.Tensor) -> None:
        super().__init__()
        self.capacity, self.filled = capacity, 0
        self.key_mask = key_mask  # (rows, capacity), shared by every block's cache, updated by the decoder

    @property
    def length(self) -> int:
        return self.filled

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            shape = (k.shape[0], self.capacity, *k.shape[2:])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        assert self.v is not None
        end = self.filled + k.shape[1]
        self.k[:, self.filled : end] = k
        self.v[:, self.filled : end] = v
        self.filled = end
        return self.k[:, :end], self.v[:, :end]


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass
class Generated:
    completions: list[list[int]]  # each row's new ids, its stop id included when it stopped
    truncated: list[bool]  # no stop id within max_new_tokens
    # Mean entropy (nats) of the distribution each new token was sampled from, before top-k / top-p, at the
    # temperature (TRL's GRPO "entropy": logits / temperature over the completion tokens).
    entropy: float = 0.0


def sample_next(logits: torch.Tensor, s: Sampling, generator: Optional[torch.Generator]) -> torch.Tensor:
    """(rows, vocab) fp32 logits -> (rows,) next ids."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - s.top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    s: Sampling,
    stop_ids: Iterable[int],
    pad_id: int = 0,
    generator: Optional[torch.Generator] = None,
    all_done: Optional[Callable[[torch.Tensor], bool]] = None,
) -> Generated:
    """Completions of `prompts` (token ids) from `model` (a dtlaunch decoder whose RoPE tables cover the
    longest prompt + max_new_tokens: dtlaunch.infer.generate.set_positions). `all_done(done)`: whether
    decoding may stop, given this batch's finished rows; a sharded model's ranks must run the same number
    of decode steps (each forward gathers weights collectively), so they agree on it there."""
    device = next(model.parameters()).device
    rows, longest = len(prompts), max(len(p) for p in prompts)
    capacity = longest + s.max_new_tokens
    tokens = torch.full((rows, longest), pad_id, dtype=torch.long, device=device)
    key_mask = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        key_mask[i, longest - len(p) : longest] = True
    lengths = key_mask[:, :longest].sum(dim=1)
    positions = (key_mask[:, :longest].long().cumsum(dim=1) - 1).clamp(min=0)
    caches = [PreallocatedKVCache(capacity, key_mask) for _ in model.layers]
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    out = torch.full((rows, s.max_new_tokens), pad_id, dtype=torch.long, device=device)
    n = 0
    entropy = torch.zeros((), device=device)
    logits = model(tokens, positions=positions, caches=caches)[:, -1].float()
    for n in range(s.max_new_tokens):
        lp = torch.log_softmax(logits / s.temperature if s.temperature > 0 else logits, dim=-1)
        entropy += (-(lp.exp() * lp).sum(-1) * ~done).sum()  # the rows still generating
        nxt = sample_next(logits, s, generator)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out[:, n] = nxt
        done = done | torch.isin(nxt, stops)
        finished = all_done(done) if all_done is not None else bool(done.all())
        if finished or n == s.max_new_tokens - 1:
            break
        key_mask[:, longest + n] = True  # a finished row's later tokens are never read back
        logits = model(nxt[:, None], positions=(lengths + n)[:, None], caches=caches)[:, -1].float()
    stop_set = set(stops.tolist())
    completions, truncated = [], []
    for row in out[:, : n + 1].tolist():
        end = next((j + 1 for j, t in enumerate(row) if t in stop_set), None)
        completions.append(row[:end] if end is not None else row)
        truncated.append(end is None)
    tokens_out = sum(len(c) for c in completions)
    return Generated(completions=completions, truncated=truncated, entropy=float(entropy) / max(tokens_out, 1))
