"""Context parallel pieces in one process: the load-balanced chunks, the ring attention's numerics
(forward and backward) against torch's SDPA on the whole sequence, the loader's chunks, and the layout
rules. The collectives themselves run in tests/e2e/test_train_cp.py (gloo, loss parity)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from dtlaunch.data.sources import SyntheticSource
from dtlaunch.errors import ConfigError
from dtlaunch.job.model_schema import typed_job
from dtlaunch.job.validate import validate
from dtlaunch.train.data import TokenLoader
from dtlaunch.train.parallel.context_parallel import _RingAttentionFn, local_positions


def test_chunks_are_load_balanced_and_cover_the_sequence() -> None:
    cp, s = 4, 64
    parts = [local_positions(s, r, cp) for r in range(cp)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(s))
    assert parts[1].tolist() == [*range(8, 16), *range(48, 56)]  # chunks 1 and 6 of 8
    # Causal work (keys each query sees) is equal on every rank.
    assert len({int((p + 1).sum()) for p in parts}) == 1


class _SimulatedExchange:
    """All ranks' K/V handed in directly; the reduce-scatter keeps every rank's share for the test to add
    up (what the collectives do across processes)."""

    def __init__(self, kv: dict[str, list[torch.Tensor]], cp: int, rank: int) -> None:
        self.kv, self.cp, self.rank, self.sent = kv, cp, rank, []
        self._next = "k"

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        name, self._next = self._next, "v" if self._next == "k" else "k"  # called for k, then v
        return torch.stack([x.detach() for x in self.kv[name]])

    def reduce_scatter(self, per_rank: torch.Tensor) -> torch.Tensor:
        self.sent.append(per_rank)
        return per_rank[self.rank]


@pytest.mark.parametrize(("cp", "kv_heads"), [(1, 4), (2, 2), (4, 1)])
def test_ring_attention_equals_full_causal_attention(cp: int, kv_heads: int) -> None:
    b, heads, s, d = 2, 4, 32, 16
    g = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (heads, kv_heads, kv_heads))
    weight = torch.randn(b, heads, s, d, generator=g)
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=True, enable_gqa=kv_heads != heads)
    (ref * weight).sum().backward()

    pos = [torch.from_numpy(local_positions(s, r, cp)) for r in range(cp)]
    kv = {"k": [k[:, :, p] for p in pos], "v": [v[:, :, p] for p in pos]}
    out, dq, dk, dv = torch.zeros_like(ref), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp):
        exchange = _SimulatedExchange(kv, cp, r)
        q_r, k_r, v_r = (t[:, :, pos[r]].clone().requires_grad_() for t in (q, k, v))
        o = _RingAttentionFn.apply(q_r, k_r, v_r, exchange, r, d**-0.5)
        out[:, :, pos[r]] = o.detach()
        (o * weight[:, :, pos[r]]).sum().backward()
        dq[:, :, pos[r]] = q_r.grad
        sent_k, sent_v = exchange.sent
        for owner in range(cp):
            dk[:, :, pos[owner]] += sent_k[owner]
            dv[:, :, pos[owner]] += sent_v[owner]
    torch.testing.assert_close(out, ref.detach(), atol=2e-6, rtol=1e-5)
    for got, want in zip((dq, dk, dv), ref_inputs, strict=True):
        torch.testing.assert_close(got, want.grad, atol=5e-6, rtol=1e-5)


def test_loader_hands_each_cp_rank_its_chunks_and_positions() -> None:
    src = SyntheticSource(vocab_size=100, seq_len=16, seed=3)
    whole = TokenLoader(src, 2, 16, 3, 0, 1, 100)
    full = whole.next_batch()
    for r in range(2):
        part = TokenLoader(src, 2, 16, 3, 0, 1, 100, cp_rank=r, cp_size=2)
        batch = part.next_batch()
        pos = batch.model_args["positions"]
        assert pos.tolist() == local_positions(16, r, 2).tolist()
        assert torch.equal(batch.inputs, full.inputs[:, pos]) and torch.equal(batch.targets, full.targets[:, pos])


class _MaskedSource:
    """Chat-like samples: ids and a target mask (only every third token is learnt)."""

    num_samples = 8

    def sample(self, index: int) -> np.ndarray:
        ids = (np.arange(17) * (index + 3)) % 50
        return np.stack([ids, (np.arange(17) % 3 == 0).astype(np.int64)])


def test_masked_loss_weight_counts_the_cp_ranks() -> None:
    """Each CP rank sums its chunk's target losses and gradients are averaged over the CP ranks too: the
    weight carries the cp factor, so the mean over ranks of (chunk sums x weight) is the batch mean."""
    whole = TokenLoader(_MaskedSource(), 2, 16, 3, 0, 1, 100)
    full = whole.next_batch()
    targets = full.targets
    chunks = []
    for r in range(2):
        part = TokenLoader(_MaskedSource(), 2, 16, 3, 0, 1, 100, cp_rank=r, cp_size=2)
        batch = part.next_batch()
        chunks.append(batch.targets)
        assert batch.loss_weight == pytest.approx(2 * full.loss_weight)
    # The ranks' targets (ignored ones included) are exactly the whole batch's, cut into the chunks.
    assert sorted(torch.cat(chunks, 1).flatten().tolist()) == sorted(targets.flatten().tolist())


def _cfg(*overrides: str):
    return typed_job(OmegaConf.from_dotlist(list(overrides)))


def test_layout_counts_cp_in_the_world() -> None:
    v = validate(_cfg("strategy.cp=2", "strategy.dp_shard=-1", "launch.nproc_per_node=8", "strategy.zero_stage=3"))
    assert (v.layout.cp, v.layout.dp_shard, v.layout.dp, v.layout.shard) == (2, 4, 4, 8)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["training.seq_len=100", "strategy.cp=4", "launch.nproc_per_node=4"], "2 x strategy.cp = 8 equal chunks"),
        (["strategy.cp=2", "strategy.pp=2", "launch.nproc_per_node=4"], "use strategy.pp=1"),
        (["strategy.cp=2", "model.arch=mistral", "model.sliding_window=16"], "model.sliding_window=null"),
        (["strategy.cp=2", "training.compile=true"], "training.compile=false"),
        (["strategy.cp=2", "strategy.tp=4", "launch.nproc_per_node=8", "training.seq_len=20"], "sequence_parallel"),
        (["strategy.cp=3"], "launch.nproc_per_node"),
        (["strategy.cp=0"], "strategy.cp=0 is out of range"),
    ],
)
def test_cp_layout_rules_name_the_fix(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(_cfg("strategy.dp_shard=-1", "strategy.zero_stage=3", *overrides))
    assert needle in str(err.value) and "\n" not in str(err.value), err.value
