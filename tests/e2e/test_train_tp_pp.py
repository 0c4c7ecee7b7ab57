"""Loss and grad-norm parity of tensor / pipeline / 3-D layouts with one process, through `dtlaunch train`.

Every layout trains for 5 steps on the same global batch of 4 synthetic samples (fp32); its logged loss
and grad norm must equal those of one process on the same model within 1e-4. grad_clip is set below the
observed norms (~0.73) so that the global norm is not only logged but also used to clip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOL = 1e-4
CLIP = ["training.grad_clip=0.5"]
# One process, micro_batch 4 = the global batch of every layout below.
REFERENCES = {
    "tiny": ["recipe=tiny_tp", "launch.nproc_per_node=1", "training.micro_batch=4"],
    "tiny_deep": ["recipe=tiny_pp", "model=tiny_deep", "launch.nproc_per_node=1", "training.micro_batch=4"],
}

LAYOUTS = {
    "tp_sp_2": ("tiny", ["recipe=tiny_tp", "training.micro_batch=4"]),
    "tp_no_sp_2": ("tiny", ["recipe=tiny_tp", "training.micro_batch=4", "strategy.sequence_parallel=false"]),
    "pp_gpipe_2": ("tiny", ["recipe=tiny_pp", "training.micro_batch=4", "strategy.pp_schedule=gpipe"]),
    "pp_1f1b_2": ("tiny", ["recipe=tiny_pp", "training.micro_batch=4", "strategy.pp_schedule=1f1b"]),
    # Two micro-steps of 2 samples (each split into 2 pipeline micro-batches) = the batch of 4.
    "pp_1f1b_accum": ("tiny", ["recipe=tiny_pp", "training.micro_batch=2", "training.global_batch=4"]),
    "fsdp_tp_2x2": (
        "tiny",
        ["recipe=tiny_tp", "strategy=fsdp_tp", "launch.nproc_per_node=4", "training.micro_batch=2"],
    ),
    "pp_interleaved_2x2": (
        "tiny_deep",
        [
            "recipe=tiny_pp",
            "model=tiny_deep",
            "training.micro_batch=4",
            "strategy.pp_schedule=interleaved_1f1b",
            "strategy.pp_stages_per_rank=2",
        ],
    ),
    "pp_uneven_3_5": (
        "tiny_deep",
        ["recipe=tiny_pp", "model=tiny_deep", "training.micro_batch=4", "strategy.pp_layers_per_stage=[3,5]"],
    ),
    "fsdp_tp_pp_2x2x2": ("tiny_deep", ["recipe=tiny_3d", "training.micro_batch=2"]),
    # FSDP x PP reduce-scattering after every pipeline micro-batch (the 3-D layout above keeps the
    # gradients unsharded across micro-batches, the default).
    "fsdp_pp_reshard_2x2": (
        "tiny_deep",
        [
            "recipe=tiny_pp",
            "model=tiny_deep",
            "launch.nproc_per_node=4",
            "strategy.pp=2",
            "strategy.dp_shard=2",
            "strategy.zero_stage=3",
            "strategy.pp_reshard_grads=true",
            "training.micro_batch=2",
        ],
    ),
}


@pytest.fixture(scope="module")
def references(trainer, reference_run) -> dict[str, list[dict]]:
    out = {}
    for model, overrides in REFERENCES.items():
        # Session-cached: the context-parallel parity tests compare with the same one-process run.
        rows = trainer.metrics(reference_run(*trainer.FAST, *overrides, *CLIP))
        assert len(rows) == 5 and rows[-1]["loss"] < rows[0]["loss"], rows
        # The clipping threshold is below the norm: clipping is exercised, not only logging.
        assert min(r["grad_norm"] for r in rows) > 0.5, rows
        out[model] = rows
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp32_parity(name: str, trainer, references, tmp_path: Path) -> None:
    model, overrides = LAYOUTS[name]
    trainer.run(tmp_path / "run", *overrides, *CLIP)
    got, want = trainer.metrics(tmp_path / "run"), references[model]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(got, want, strict=True))
        assert diff <= TOL, (
            f"{key}: max abs diff {diff:.3g} > {TOL}: {[r[key] for r in got]} vs {[r[key] for r in want]}"
        )


def test_v_schedule_needs_two_stages_per_rank(trainer, tmp_path: Path) -> None:
    proc = trainer.run(
        tmp_path / "run",
        "recipe=tiny_pp",
        "model=tiny_deep",
        "strategy.pp_schedule=zbv",
        "strategy.pp_stages_per_rank=3",
        "training.micro_batch=4",
        expect_ok=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pp_stages_per_rank=2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
