"""Packed documents with data.document_mask: each document's logits equal those of running it alone."""

from __future__ import annotations

import numpy as np
import torch
from omegaconf import OmegaConf

from dtlaunch.models.dense.config import DenseModelConfig
from dtlaunch.models.dense.model import build_model
from dtlaunch.train.data import document_inputs

EOS = 1


def test_document_mask_matches_documents_run_alone() -> None:
    m = OmegaConf.structured(DenseModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64))
    model = build_model(m, rope_len=32, device="cpu")
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, 64, (n,), generator=g) for n in (4, 6, 5)]
    docs = [torch.cat([d, torch.tensor([EOS])]) for d in docs]
    packed = torch.cat(docs)[None]
    extra = document_inputs(packed.numpy(), EOS)
    assert extra["positions"][0].tolist() == [*range(5), *range(7), *range(6)]
    with torch.no_grad():
        masked = model(packed, **extra)
        plain = model(packed)
        start = 0
        for d in docs:
            alone = model(d[None])
            torch.testing.assert_close(masked[0, start : start + len(d)], alone[0], rtol=1e-5, atol=1e-5)
            start += len(d)
    # Without the mask, the later documents see the earlier ones: the check above can fail.
    assert not torch.allclose(plain[0, 5:12], masked[0, 5:12], atol=1e-3)
    assert np.array_equal(extra["doc_ids"][0].numpy(), np.repeat([0, 1, 2], [5, 7, 6]))


def test_unpacked_samples_are_single_documents_padded_and_masked(tmp_path, tiny_tokenizer, tiny_docs) -> None:
    import json

    from dtlaunch.config.model_schema import typed_job
    from dtlaunch.data.run_data import prepare_run_data
    from dtlaunch.data.tokenizer import load_tokenizer
    from dtlaunch.train.data import build_loaders

    docs = tiny_docs(30, seed=5, words=(3, 40))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = typed_job({})
    for key, value in {
        "data.kind": "jsonl",
        "data.path": str(path),
        "data.tokenizer": str(tiny_tokenizer / "tokenizer.json"),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.pack": False,
        "model.vocab_size": 512,
        "training.seq_len": 24,
        "training.micro_batch": 30,
        "launch.nproc_per_node": 1,
    }.items():
        OmegaConf.update(cfg, key, value)
    prepare_run_data(cfg, tmp_path)
    loader, _ = build_loaders(cfg, tmp_path, 0, 1)
    assert loader.source.num_samples == 30
    tok = load_tokenizer(str(tiny_tokenizer / "tokenizer.json"))
    inputs, targets = loader.next_batch()
    for i, k in enumerate(loader._order(0)[:30]):  # the shuffled order of epoch 0
        ids = [*tok.encode(docs[int(k)].encode()).tolist(), tok.eos_id][:25]
        n = len(ids)
        assert inputs[i, : n - 1].tolist() == ids[:-1]
        assert targets[i, : n - 1].tolist() == ids[1:]
        assert (targets[i, n - 1 :] == -100).all(), "padding is no target"
