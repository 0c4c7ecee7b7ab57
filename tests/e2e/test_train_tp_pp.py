"""The 3-D recipe (FSDP 2 x TP 2 x PP 2 on 8 workers) through `dtlaunch train`: loss and grad-norm parity
with one process, as a user runs it (the launcher, the data loader sharded over the replicas, the metrics of
the last pipeline stage).

It trains for 5 steps on the same global batch of 4 synthetic samples (fp32); its logged loss and grad norm
must equal those of one process on the same model within 1e-4. grad_clip is set below the observed norms
(~0.73) so that the global norm is not only logged but also used to clip. The other tensor / pipeline layouts
are checked in-process against one process by tests/distributed/test_parallel_layouts.py (same steps, same
tolerance); tensor and pipeline parallel runs also go through the CLI in test_hf_families_train.py (TP+SP),
test_fault_tolerance.py, test_resume_cli.py (1F1B, ZBV) and test_train_cp.py (FSDP x TP x CP).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOL = 1e-4
CLIP = ["training.grad_clip=0.5"]
# One process, micro_batch 4 = the global batch of the 3-D layout.
REFERENCE = ["recipe=tiny_pp", "model=tiny_deep", "launch.nproc_per_node=1", "training.micro_batch=4"]
LAYOUT_3D = ["recipe=tiny_3d", "training.micro_batch=2"]


@pytest.fixture(scope="module")
def reference(trainer, reference_run) -> list[dict]:
    rows = trainer.metrics(reference_run(*trainer.FAST, *REFERENCE, *CLIP))
    assert len(rows) == 5 and rows[-1]["loss"] < rows[0]["loss"], rows
    # The clipping threshold is below the norm: clipping is exercised, not only logging.
    assert min(r["grad_norm"] for r in rows) > 0.5, rows
    return rows


def test_3d_recipe_fp32_parity(trainer, reference, tmp_path: Path) -> None:
    trainer.run(tmp_path / "run", *LAYOUT_3D, *CLIP)
    got = trainer.metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(got, reference, strict=True))
        assert diff <= TOL, (
            f"{key}: max abs diff {diff:.3g} > {TOL}: {[r[key] for r in got]} vs {[r[key] for r in reference]}"
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
