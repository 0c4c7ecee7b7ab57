"""Wrong endings the fuzz suite found in spoiled files that need its built inputs (a run with
checkpoints), kept as plain cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fuzz_harness import run_cli, wrong_endings


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_marker_describing_another_model_is_refused(
    command: str, fuzz_inputs: dict[str, Path], tmp_path: Path
) -> None:
    """COMPLETE.json's model section says ffn_dim 256, the tensors hold 192: was torch's size-mismatch
    RuntimeError (exit 1, four lines)."""
    run = tmp_path / "run"
    shutil.copytree(fuzz_inputs["run"], run)
    step = run / "checkpoints" / "step-00000001"
    marker = json.loads((step / "COMPLETE.json").read_text())
    marker["model"]["ffn_dim"] = 256
    (step / "COMPLETE.json").write_text(json.dumps(marker))
    argv = {
        "generate": ["generate", str(step), "--prompt", "hello", "--max-new-tokens", "1"],
        "export": ["ckpt", "export", str(step), "--format", "torch", "--out", str(tmp_path / "out")],
    }[command]
    code, err = run_cli(argv)
    assert not wrong_endings(code, err), err
    if code == 2:  # an export whose checksums catch the edit first is refused as corrupt: also right
        assert "restore the marker" in err or "corrupt" in err or "checksum" in err, err


def test_a_marker_whose_checksums_are_not_a_table_is_corrupt(fuzz_inputs: dict[str, Path], tmp_path: Path) -> None:
    """COMPLETE.json's checksums.files set to a number: was AttributeError (exit 1) in ckpt export."""
    run = tmp_path / "run"
    shutil.copytree(fuzz_inputs["run"], run)
    step = run / "checkpoints" / "step-00000002"
    marker = json.loads((step / "COMPLETE.json").read_text())
    marker["checksums"]["files"] = 5
    (step / "COMPLETE.json").write_text(json.dumps(marker))
    code, err = run_cli(["ckpt", "export", str(step), "--format", "torch", "--out", str(tmp_path / "out")])
    assert code == 2 and not wrong_endings(code, err) and "checksums are not a table of files" in err, err


@pytest.mark.parametrize(("key", "value"), [("max_position_embeddings", None), ("rms_norm_eps", None)])
def test_a_config_json_value_of_the_wrong_type_is_refused(
    key: str, value: object, fuzz_inputs: dict[str, Path], tmp_path: Path
) -> None:
    """null where config.json's reader takes a number: was int(None) / float(None), exit 1."""
    d = tmp_path / "model"
    shutil.copytree(fuzz_inputs["hf"], d)
    c = json.loads((d / "config.json").read_text())
    c[key] = value
    (d / "config.json").write_text(json.dumps(c))
    code, err = run_cli(["validate", f"model.init_from=hf:{d}"])
    assert code == 2 and not wrong_endings(code, err) and "config.json holds a value of the wrong type" in err, err
