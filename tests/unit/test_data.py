"""The data loader: one global sample order sliced by dp rank, epochs, state, kinds and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dtlaunch.data.shards import ShardWriter
from dtlaunch.errors import ConfigError, DtlaunchError, InputError
from dtlaunch.job.model_schema import typed_job
from dtlaunch.launch.run_data import prepare_run_data
from dtlaunch.train.data import build_loader

SEQ = 8


def make_cfg(**over: object) -> object:
    cfg = typed_job({})
    cfg.model.vocab_size = 512
    cfg.training.seq_len = SEQ
    cfg.training.micro_batch = 2
    for key, value in over.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


def write_corpus(d: Path, tokens: np.ndarray, shard_tokens: int = 1000, vocab: int = 500) -> Path:
    w = ShardWriter(d, np.dtype(np.uint16), shard_tokens)
    w.add(tokens)
    w.close({"vocab_size": vocab, "tokenizer": "test", "eos_id": None})
    return d


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """48 samples of SEQ+1 tokens over 3 shards (windows cross shard boundaries)."""
    n_tokens = 48 * SEQ + 1
    return write_corpus(tmp_path / "tok", (np.arange(n_tokens) % 499).astype(np.uint16), shard_tokens=150)


def loaders(cfg: object, run_dir: Path, dp: int) -> list:
    return [build_loader(cfg, run_dir, r, dp) for r in range(dp)]


def step_indices(ls: list, accum: int) -> list[int]:
    """The sample indices of one optimizer step, in global order (micro-step major, then rank)."""
    out: list[int] = []
    for _ in range(accum):
        for ld in ls:
            out += ld.next_indices()
    return out


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("accum", [1, 2, 3])
def test_every_sample_once_per_epoch(corpus: Path, tmp_path: Path, dp: int, accum: int) -> None:
    mb = 2
    cfg = make_cfg(
        data__kind="tokens", data__path=str(corpus), training__micro_batch=mb, training__global_batch=mb * dp * accum
    )
    ls = loaders(cfg, tmp_path, dp)
    n = ls[0].source.num_samples
    assert n == 48
    seen: list[int] = []
    while len(seen) < 2 * n:  # two epochs; 48 is not a multiple of every global batch (12, 18, 24)
        seen += step_indices(ls, accum)
    first, second = seen[:n], seen[n : 2 * n]
    assert sorted(first) == list(range(n)), "epoch 0 must see every sample exactly once"
    assert sorted(second) == list(range(n)), "epoch 1 must see every sample exactly once"
    assert first != second, "a new epoch must bring a new order"
    # Within one micro-step the ranks' slices are disjoint.
    ls = loaders(cfg, tmp_path, dp)
    per_rank = [set(ld.next_indices()) for ld in ls]
    assert sum(len(s) for s in per_rank) == len(set().union(*per_rank)) == mb * dp


def test_tp_pp_peers_get_identical_batches(corpus: Path, tmp_path: Path) -> None:
    cfg = make_cfg(data__kind="tokens", data__path=str(corpus))
    peers = [build_loader(cfg, tmp_path, 1, 2) for _ in range(3)]  # e.g. tp ranks of dp rank 1
    for _ in range(5):
        batches = [p.next_batch() for p in peers]
        for b in batches[1:]:
            assert torch.equal(b.inputs, batches[0].inputs) and torch.equal(b.targets, batches[0].targets)


@pytest.mark.parametrize("kind", ["tokens", "synthetic"])
def test_dp2_concat_equals_one_process_and_accumulation(corpus: Path, tmp_path: Path, kind: str) -> None:
    one = build_loader(make_cfg(data__kind=kind, data__path=str(corpus), training__micro_batch=8), tmp_path, 0, 1)
    dp2 = loaders(make_cfg(data__kind=kind, data__path=str(corpus), training__micro_batch=4), tmp_path, 2)
    acc = build_loader(
        make_cfg(data__kind=kind, data__path=str(corpus), training__micro_batch=4, training__global_batch=8),
        tmp_path,
        0,
        1,
    )
    dp2acc = loaders(
        make_cfg(data__kind=kind, data__path=str(corpus), training__micro_batch=2, training__global_batch=8),
        tmp_path,
        2,
    )
    for _ in range(8):  # crosses into the second epoch for tokens (48 samples, 8 per step)
        first = one.next_batch()
        x, y = first.inputs, first.targets
        halves = [ld.next_batch() for ld in dp2]
        x2, y2 = torch.cat([b.inputs for b in halves]), torch.cat([b.targets for b in halves])
        assert torch.equal(x, x2) and torch.equal(y, y2)
        xa = torch.cat([acc.next_batch().inputs for _ in range(2)])
        assert torch.equal(x, xa)
        xda = torch.cat([ld.next_batch().inputs for _ in range(2) for ld in dp2acc])
        assert torch.equal(x, xda)


def test_targets_are_inputs_shifted(corpus: Path, tmp_path: Path) -> None:
    ld = build_loader(make_cfg(data__kind="tokens", data__path=str(corpus)), tmp_path, 0, 1)
    idx = ld.sample_index(0), ld.sample_index(1)
    batch = ld.next_batch()
    x, y = batch.inputs, batch.targets
    assert x.shape == y.shape == (2, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, i in enumerate(idx):  # sample i = tokens [i*SEQ, i*SEQ+SEQ], across shard boundaries
        expected = torch.arange(i * SEQ, i * SEQ + SEQ + 1) % 499
        assert torch.equal(torch.cat([x[row], y[row, -1:]]), expected)


def test_seed_changes_order_and_synthetic_content(corpus: Path, tmp_path: Path) -> None:
    a = build_loader(make_cfg(data__kind="tokens", data__path=str(corpus)), tmp_path, 0, 1)
    b = build_loader(make_cfg(data__kind="tokens", data__path=str(corpus), training__seed=7), tmp_path, 0, 1)
    assert [a.sample_index(i) for i in range(48)] != [b.sample_index(i) for i in range(48)]
    sa = build_loader(make_cfg(), tmp_path, 0, 1)
    sb = build_loader(make_cfg(training__seed=7), tmp_path, 0, 1)
    xa, xb = sa.next_batch().inputs, sb.next_batch().inputs
    assert not torch.equal(xa, xb)
    assert int(xa.min()) >= 0 and int(xa.max()) < 512


@pytest.mark.parametrize("kind", ["tokens", "synthetic"])
@pytest.mark.parametrize("new_dp,new_mb", [(2, 2), (4, 1), (1, 4)])
def test_state_restore_continues_also_on_other_dp(
    corpus: Path, tmp_path: Path, kind: str, new_dp: int, new_mb: int
) -> None:
    cfg = make_cfg(data__kind=kind, data__path=str(corpus), training__micro_batch=2)  # dp 2: gb 4
    ref = loaders(cfg, tmp_path, 2)
    for _ in range(13):  # 52 samples: past the first epoch of 48
        for ld in ref:
            ld.next_batch()
    state = ref[0].state_dict()
    assert state == ref[1].state_dict(), "the state is global: identical on every rank"
    assert state["consumed_samples"] == 52 and (kind == "synthetic" or state["epoch"] == 1)
    new_cfg = make_cfg(data__kind=kind, data__path=str(corpus), training__micro_batch=new_mb)
    restored = loaders(new_cfg, tmp_path, new_dp)
    for ld in restored:
        ld.load_state_dict(state)
    for _ in range(6):
        want = torch.cat([ld.next_batch().inputs for ld in ref])
        got = torch.cat([ld.next_batch().inputs for ld in restored])
        assert torch.equal(want, got)


def test_text_kind_prepares_once_and_reads(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("print('hello')\n" * 20)
    (src / "pkg" / "b.py").write_text("x = 1\n" * 30)
    (src / "notes.txt").write_text("not python\n" * 50)
    for skipped in ("site-packages/third_party.py", "__pycache__/a.py"):  # not part of the corpus
        (src / skipped).parent.mkdir()
        (src / skipped).write_text("import this\n" * 99)
    run = tmp_path / "run"
    cfg = make_cfg(data__kind="text", data__path=str(src), data__pattern="**/*.py")
    summary = prepare_run_data(cfg, run)
    assert summary.files == 2 and summary.tokens == 15 * 20 + 6 * 30 + 2  # bytes + one EOS per file
    assert prepare_run_data(cfg, run) is None, "same source: not tokenized again"
    x = build_loader(cfg, run, 0, 1).next_batch().inputs
    assert x.shape == (2, SEQ)
    cfg.data.max_bytes = 100
    assert prepare_run_data(cfg, run).tokens == 100 + 1, "a changed source re-tokenizes, capped"


def test_errors_are_one_line(corpus: Path, tmp_path: Path) -> None:
    def msg(exc_type: type, cfg: object, fn: str = "build") -> str:
        with pytest.raises(exc_type) as ei:
            (build_loader(cfg, tmp_path, 0, 1) if fn == "build" else prepare_run_data(cfg, tmp_path / "r"))
        text = str(ei.value)
        assert "\n" not in text
        return text

    assert "data.path" in msg(InputError, make_cfg(data__kind="tokens", data__path=str(tmp_path / "nope")))
    assert "data.path" in msg(ConfigError, make_cfg(data__kind="tokens"))
    with pytest.raises(Exception, match="data.kind"):  # a schema choice: refused when composed
        make_cfg(data__kind="csv")
    small = make_cfg(data__kind="tokens", data__path=str(corpus), training__global_batch=64, training__micro_batch=2)
    text = msg(DtlaunchError, small)
    assert str(corpus) in text and "global batch" in text
    assert "model.vocab_size" in msg(
        ConfigError, make_cfg(data__kind="tokens", data__path=str(corpus), model__vocab_size=256)
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.py").write_text("")
    assert "empty" in msg(InputError, make_cfg(data__kind="text", data__path=str(empty)), fn="prepare")
    with (corpus / "shard-00001.bin").open("r+b") as f:
        f.truncate(7)
    assert "corrupt" in msg(InputError, make_cfg(data__kind="tokens", data__path=str(corpus)))
    assert "corrupt" in msg(InputError, make_cfg(data__kind="tokens", data__path=str(corpus)), fn="prepare")


def test_token_id_beyond_model_vocab_is_caught(tmp_path: Path) -> None:
    bad = write_corpus(tmp_path / "bad", np.full(100, 600, dtype=np.uint16), vocab=500)  # meta lies
    ld = build_loader(make_cfg(data__kind="tokens", data__path=str(bad)), tmp_path, 0, 1)
    with pytest.raises(InputError, match="model.vocab_size"):
        ld.next_batch()
