"""Hub names resolved against a local hub (tests/e2e/hub_server.py), in process: what each call fetches
and the one-line error for each way the hub or the network refuses."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
from hub_server import GOOD_TOKEN, Hub, Repo, point_hub_lib_at

hub_lib = pytest.importorskip("huggingface_hub")

from dtlaunch.errors import InputError  # noqa: E402


@pytest.fixture(scope="module")
def model_files(tiny_hf_dirs) -> Path:
    return tiny_hf_dirs["llama_tied"]


@pytest.fixture(scope="module")
def dataset_files(tmp_path_factory) -> Path:
    """Two configurations (subsets) of JSONL files, declared in the README as hub datasets do."""
    import json

    path = tmp_path_factory.mktemp("docs")
    configs = "configs:\n"
    for subset, n in (("long", 5), ("short", 2)):
        (path / subset).mkdir()
        (path / subset / "train.jsonl").write_text(
            "".join(json.dumps({"text": f"{subset} {i}"}) + "\n" for i in range(n))
        )
        configs += f"- config_name: {subset}\n  data_files:\n  - split: train\n    path: {subset}/*.jsonl\n"
    (path / "README.md").write_text(f"---\n{configs}---\n")
    return path


@pytest.fixture
def hub(model_files: Path, dataset_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh local hub and an empty cache; huggingface_hub's import-time settings pointed at them."""
    from huggingface_hub import constants

    with Hub(lifetime=120) as h:
        h.repos[("models", "acme/tiny-llama")] = Repo.from_dir(model_files)
        h.repos[("models", "acme/gated-llama")] = Repo.from_dir(model_files, gated=True)
        h.repos[("models", "acme/private-llama")] = Repo.from_dir(model_files, private=True)
        h.repos[("datasets", "acme/docs")] = Repo.from_dir(dataset_files)
        point_hub_lib_at(monkeypatch, h.url, str(tmp_path / "cache"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield h


def resolve(name: str) -> Path:
    from dtlaunch.hub.model_source import hf_source_dir

    return hf_source_dir(f"hf:{name}")


def weights(name: str) -> Path:
    from dtlaunch.hub.model_source import hf_weights_dir

    return hf_weights_dir(f"hf:{name}")


def test_resolving_fetches_config_json_only_and_weights_once(hub: Hub) -> None:
    snapshot = resolve("acme/tiny-llama")
    assert snapshot.name == hub.repos[("models", "acme/tiny-llama")].sha
    assert (snapshot / "config.json").is_file() and hub.content_gets() == 1 == hub.gets("/config.json")
    assert not (snapshot / "model.safetensors").exists()
    assert weights("acme/tiny-llama") == snapshot
    assert hub.gets("/model.safetensors") == 1 and (snapshot / "model.safetensors").is_file()
    before = sum(hub.requests.values())
    assert weights(f"acme/tiny-llama@{snapshot.name}") == snapshot  # pinned and cached: not one request
    assert sum(hub.requests.values()) == before


def test_offline_mode_reads_the_cache_and_names_the_download_when_absent(hub: Hub, monkeypatch) -> None:
    from huggingface_hub import constants

    snapshot = weights("acme/tiny-llama")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("dtlaunch.hub.resolve._RESOLVED", {})
    before = sum(hub.requests.values())
    assert resolve("acme/tiny-llama") == snapshot and weights("acme/tiny-llama") == snapshot
    assert sum(hub.requests.values()) == before
    with pytest.raises(InputError, match=r"not in the cache and HF_HUB_OFFLINE=1: run `dtlaunch download hf:acme/x"):
        resolve("acme/x")


def test_unknown_name_relays_the_hubs_close_matches(hub: Hub) -> None:
    with pytest.raises(InputError) as e:
        resolve("acme/tiny-lama")
    assert "model.init_from=hf:acme/tiny-lama: no such model on the hub" in str(e.value)
    assert "Did you mean acme/tiny-llama" in str(e.value) and "\n" not in str(e.value)


def test_gated_model_without_a_token_then_with_one(hub: Hub, monkeypatch) -> None:
    with pytest.raises(InputError, match=r"is a gated model and no token was given: .* set HF_TOKEN"):
        resolve("acme/gated-llama")
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    assert weights("acme/gated-llama").joinpath("model.safetensors").is_file()


def test_private_model_401_without_and_403_with_a_wrong_token(hub: Hub, monkeypatch) -> None:
    with pytest.raises(InputError, match=r"answered 401 .*set HF_TOKEN to a token with read access"):
        resolve("acme/private-llama")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(InputError, match=r"answered 403 .*HF_TOKEN is refused"):
        resolve("acme/private-llama")


def test_revision_that_does_not_exist(hub: Hub) -> None:
    with pytest.raises(InputError, match=r"hf:acme/tiny-llama@v9: the hub has no such revision"):
        resolve("acme/tiny-llama@v9")


def test_no_network_outside_offline_mode(hub: Hub, monkeypatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    from huggingface_hub import constants

    point_hub_lib_at(monkeypatch, closed, constants.HF_HUB_CACHE)
    # huggingface_hub retries a refused connection 5 times with 1-8 s back-off (23 s): the same retries, unslept.
    import huggingface_hub.utils._http as hub_http

    monkeypatch.setattr(hub_http.time, "sleep", lambda seconds: None)
    with pytest.raises(InputError, match=r"cannot reach the hub at .* and it is not in the cache: check the network"):
        resolve("acme/tiny-llama")


def test_a_local_directory_wins_over_a_hub_name(hub: Hub, model_files: Path, tmp_path: Path, monkeypatch) -> None:
    local = tmp_path / "acme" / "tiny-llama"
    shutil.copytree(model_files, local)
    monkeypatch.chdir(tmp_path)
    assert resolve("acme/tiny-llama") == Path("acme/tiny-llama") and not hub.requests


def test_submit_needs_the_weights_in_the_cache(hub: Hub) -> None:
    from types import SimpleNamespace

    from dtlaunch.hub.download import check_cached

    sha = hub.repos[("models", "acme/tiny-llama")].sha
    cfg = SimpleNamespace(model=SimpleNamespace(init_from=f"hf:acme/tiny-llama@{sha}"))
    with pytest.raises(
        InputError, match=rf"not in the hub cache .*run `dtlaunch download hf:acme/tiny-llama@{sha}` first"
    ):
        check_cached(cfg)
    weights(f"acme/tiny-llama@{sha}")
    check_cached(cfg)


def test_generate_from_a_hub_name(hub: Hub) -> None:
    import torch

    from dtlaunch.infer.generate import load_source

    loaded = load_source("hf:acme/tiny-llama", torch.device("cpu"), max_len=8)
    assert hub.gets("/model.safetensors") == 1 and hub.gets("/tokenizer.json") == 1
    assert loaded.model is not None


def test_hub_dataset_subset_and_unknown_name(hub: Hub) -> None:
    pytest.importorskip("datasets")
    from types import SimpleNamespace

    from dtlaunch.data.records import iter_documents
    from dtlaunch.hub.dataset import local_source

    data = SimpleNamespace(kind="hf", subset="short", revision="")
    local, subset = local_source(SimpleNamespace(data=data), "acme/docs")
    assert Path(local).name == hub.repos[("datasets", "acme/docs")].sha and subset == "short"
    assert list(iter_documents("hf", local, "text", "train", "data.path", subset)) == ["short 0", "short 1"]
    data.subset = "medium"
    with pytest.raises(InputError, match=r"data.path: .*medium.*set data.subset / data.split to one it has"):
        list(iter_documents("hf", local, "text", "train", "data.path", "medium"))
    with pytest.raises(InputError, match=r"data.path=acme/dogs: no such dataset on the hub .*Did you mean acme/docs"):
        local_source(SimpleNamespace(data=data), "acme/dogs")


def test_without_the_hub_extra_one_line_names_it(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    monkeypatch.setattr("dtlaunch.hub.resolve._RESOLVED", {})
    with pytest.raises(InputError, match=r"need the 'huggingface_hub' package: pip install 'dtlaunch\[hub\]'"):
        resolve("acme/tiny-llama")


def test_a_hub_datasets_revision_belongs_in_data_revision() -> None:
    from dtlaunch.commands.common import load_job
    from dtlaunch.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.path=acme/docs@v1: .* data.path=acme/docs data.revision=v1"):
        load_job(["recipe=tiny_fsdp", "data.kind=hf", "data.path=acme/docs@v1"], [])
