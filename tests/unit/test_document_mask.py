"""Packed documents with data.document_mask: each document's logits equal those of running it alone."""

from __future__ import annotations

import numpy as np
import torch
from omegaconf import OmegaConf

from dtlaunch.config.schema import ModelConfig
from dtlaunch.models.llama import build_model
from dtlaunch.train.data import document_inputs

EOS = 1


def test_document_mask_matches_documents_run_alone() -> None:
    m = OmegaConf.structured(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64))
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
