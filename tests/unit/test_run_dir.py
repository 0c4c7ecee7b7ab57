"""RunDir.of_checkpoint: the one walk from a checkpoint up to its run, which ckpt export, generate, eval and
objective.reference all take; and tokenizer_file, the one reading of 'a directory means its tokenizer.json'."""

from __future__ import annotations

from pathlib import Path

from dtlaunch.run.run_dir import CONFIG_NAME, RunDir, tokenizer_file


def test_a_checkpoint_finds_its_run_at_any_depth_and_not_beyond(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "a"
    step = run / "ckpt" / "nested" / "step-00000004"  # checkpoint.dir=ckpt/nested
    step.mkdir(parents=True)
    (tmp_path / CONFIG_NAME).write_text("an unrelated config higher up\n")
    (run / CONFIG_NAME).write_text("run: {}\n")
    assert RunDir.of_checkpoint(step) == RunDir(run)
    assert RunDir.of_checkpoint(step).config == run / "config.yaml"
    (run / CONFIG_NAME).unlink()
    assert RunDir.of_checkpoint(step) == RunDir(tmp_path)  # the nearest one, whatever it is
    (tmp_path / CONFIG_NAME).unlink()
    assert RunDir.of_checkpoint(step) is None


def test_a_run_with_only_its_kept_tokenizer_is_still_the_run(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.tokenizer.parent.mkdir(parents=True)
    run.tokenizer.write_text("{}")
    found = RunDir.of_checkpoint(run.path / "checkpoints" / "step-00000001")
    assert found == run and found.tokenizer == tmp_path / "run" / "tokenizer" / "tokenizer.json"
    assert not found.config.is_file()


def test_tokenizer_file_of_a_directory_or_a_file(tmp_path: Path) -> None:
    assert tokenizer_file(tmp_path) == tmp_path / "tokenizer.json"
    file = tmp_path / "my.json"
    assert tokenizer_file(file) == file  # a file (or a path that is not there) names itself
