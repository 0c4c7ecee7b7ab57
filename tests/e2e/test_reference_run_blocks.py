"""objective.reference=RUN_DIR's block reads (dtlaunch.convert.run_weights) against the whole-model reads
they replace (`ckpt export`'s: load_checkpoint_model, merged_run_state), on the checkpoints of tiny real
SFT runs written by ZeRO-3 on 2 workers (each tensor saved as two row chunks): every block equal bit for
bit, and no read of the whole model (the whole-model loaders are made to fail; the bytes DCP loads are
counted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SFT = ["data=synthetic", "training.seq_len=16", "training.micro_batch=2", "training.steps=2", "optim.lr=5e-2"]
# QLoRA on 2 row shards of a 32-row k/v projection: NF4 blocks of 64 x 16 elements divide each shard.
RUNS = {"full": ["peft=none"], "lora": ["peft=lora"], "qlora": ["peft=qlora", "peft.nf4_scaler_block_size=16"]}


@pytest.fixture(scope="module")
def runs(trainer, tiny_hf_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft_runs")
    out = {}
    for kind, extra in RUNS.items():
        trainer.run(
            root / kind,
            *SFT,
            f"model.init_from=hf:{tiny_hf_dirs['llama_tied']}",
            "strategy=zero3",
            "launch.nproc_per_node=2",
            "checkpoint.enabled=true",
            "checkpoint.every_steps=2",
            *extra,
        )
        out[kind] = root / kind
    return out


def whole_state(run: Path) -> dict:
    """The whole-model read the block reads replace (what `ckpt export RUN --format hf` writes)."""
    from dtlaunch.convert.adapters import merged_run_state
    from dtlaunch.convert.hf import load_checkpoint_model
    from dtlaunch.run.checkpoints import resolve_load_path

    info, _ = resolve_load_path(run)
    return (merged_run_state if info.marker.get("peft") else load_checkpoint_model)(run)[0]


def run_model(run: Path):
    from dtlaunch.convert.hf import model_config_from_marker
    from dtlaunch.run.checkpoints import resolve_load_path

    return model_config_from_marker(resolve_load_path(run)[0].marker)


def blocks(shape: tuple) -> list[tuple[tuple, tuple]]:
    """(shape, offset) of the blocks FSDP / TP hand out (row and column shards, even and uneven, empty),
    and odd ones: one row, one column, one element, an interior block."""

    def along(dim: int, start: int, size: int) -> tuple[tuple, tuple]:
        zeros = (0,) * len(shape)
        return shape[:dim] + (size,) + shape[dim + 1 :], zeros[:dim] + (start,) + zeros[dim + 1 :]

    out = [along(0, 0, shape[0])] if shape else [((), ())]
    for dim, n in enumerate(shape):
        for parts in (2, 3, 4):
            step = -(-n // parts)
            # torch.chunk's cut; the last part is empty when `step` divides n.
            out += [along(dim, start, min(step, n - start)) for start in range(0, n + 1, step)]
        out.append(along(dim, n - 1, 1))
    if len(shape) == 2 and min(shape) > 4:
        out += [((1, 1), (shape[0] - 1, 3)), ((shape[0] - 3, shape[1] - 4), (1, 2)), ((5, 3), (shape[0] // 2 - 2, 1))]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RUNS))
def test_every_block_equals_the_whole_reads(kind: str, runs) -> None:
    from dtlaunch.convert.run_weights import run_weights

    run = runs[kind]
    want = whole_state(run)
    got = run_weights(str(run / "checkpoints" / "step-00000002" if kind == "lora" else run), run_model(run))
    compared = 0
    for name, full in want.items():
        for shape, offset in blocks(tuple(full.shape)):
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
            block = got.read(name, shape, offset)
            assert block.dtype == torch.float32 and tuple(block.shape) == shape, (name, shape, offset)
            assert torch.equal(block, full[index].float()), (kind, name, shape, offset)
            compared += 1
        assert torch.equal(got.read(name), full.float()), (kind, name)
    assert compared > 20 * len(want)
    if kind != "full":
        # The adapters moved the adapted weights away from the base: the merge is in what was compared.
        from dtlaunch.convert.hf import load_hf_weights

        base = load_hf_weights(got.base.path, run_model(run))
        assert any(not torch.equal(base[n], want[n]) for n in want if n.endswith("attention.wq.weight"))


def row_halves(w, run_shapes: dict) -> dict:
    """Rank 0's block of every tensor on 2 row shards (FSDP's first half)."""
    return {n: w.read(n, ((s[0] + 1) // 2, *s[1:]), (0,) * len(s)) for n, s in run_shapes.items()}


@pytest.mark.slow
def test_a_full_run_loads_only_the_saved_chunks_its_blocks_touch(runs, monkeypatch) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    import dtlaunch.convert.hf as hf
    from dtlaunch.convert.dcp_blocks import DcpBlocks
    from dtlaunch.convert.run_weights import run_weights

    run = runs["full"]
    shapes = {n: tuple(t.shape) for n, t in whole_state(run).items()}
    loaded: list[int] = []
    slice_file = FileSystemReader._slice_file

    def counting(self, file, sinfo):
        loaded.append(sinfo.length)
        return slice_file(self, file, sinfo)

    def whole(*_a, **_k):
        raise AssertionError("the whole checkpoint was loaded")

    monkeypatch.setattr(FileSystemReader, "_slice_file", counting)
    monkeypatch.setattr(hf, "load_checkpoint_model", whole)
    w = run_weights(str(run), run_model(run))
    row_halves(w, shapes)
    # Exactly rank 0's saved chunks (the ones starting at row 0), each once: none of rank 1's.
    ckpt = DcpBlocks(run / "checkpoints" / "step-00000002")
    storage = ckpt.metadata.storage_data
    model = [(i, s.length) for i, s in storage.items() if i.fqn.startswith("model.")]
    rank0 = [n for i, n in model if i.offset[0] == 0]
    assert len(rank0) == len(shapes) and sorted(loaded) == sorted(rank0)
    assert sum(loaded) < 0.6 * sum(n for _, n in model)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_a_lora_run_reads_base_blocks_not_the_base(kind: str, runs, monkeypatch) -> None:
    import dtlaunch.convert.adapters as adapters
    import dtlaunch.convert.hf as hf
    from dtlaunch.convert.run_weights import run_weights

    run = runs[kind]
    shapes = {n: tuple(t.shape) for n, t in whole_state(run).items()}

    def whole(*_a, **_k):
        raise AssertionError("the whole model was loaded")

    for mod, fn in ((hf, "load_checkpoint_model"), (hf, "load_hf_weights"), (adapters, "merged_run_state")):
        monkeypatch.setattr(mod, fn, whole)
    reads: list[tuple[str, tuple]] = []
    read = hf.HFWeights.read

    def spying(self, name, shape=None, offset=None):
        t = read(self, name, shape, offset)
        reads.append((name, tuple(t.shape)))
        return t

    monkeypatch.setattr(hf.HFWeights, "read", spying)
    w = run_weights(str(run), run_model(run))
    row_halves(w, shapes)
    whole_reads = {n for n, s in reads if s == shapes[n]}
    if kind == "lora":
        assert not whole_reads, whole_reads
    else:  # QLoRA: the block linears' bases, whole one at a time for their NF4 rounding, and nothing else
        assert whole_reads == w.nf4_rounded and all("layers." in n for n in whole_reads), whole_reads
    assert len(reads) == len(shapes)


@pytest.mark.slow
def test_a_name_the_run_has_not_is_refused(runs) -> None:
    from dtlaunch.convert.run_weights import run_weights
    from dtlaunch.errors import InputError

    for kind in ("full", "lora"):
        w = run_weights(str(runs[kind]), run_model(runs[kind]))
        with pytest.raises(InputError, match="holds no layers.9.attention.wq.weight"):
            w.read("layers.9.attention.wq.weight", (1, 1), (0, 0))
