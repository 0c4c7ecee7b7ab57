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

    from dtlaunch.data.tokenizer import load_tokenizer
    from dtlaunch.job.model_schema import typed_job
    from dtlaunch.launch.run_data import prepare_run_data
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
    batch = loader.next_batch()
    inputs, targets = batch.inputs, batch.targets
    for i, k in enumerate(loader._order(0)[:30]):  # the shuffled order of epoch 0
        ids = [*tok.encode(docs[int(k)].encode()).tolist(), tok.eos_id][:25]
        n = len(ids)
        assert inputs[i, : n - 1].tolist() == ids[:-1]
        assert targets[i, : n - 1].tolist() == ids[1:]
        assert (targets[i, n - 1 :] == -100).all(), "padding is no target"


def _packed(lengths: list[list[int]], seed: int = 0) -> torch.Tensor:
    """(B, S) token rows made of documents of these lengths, each ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        torch.cat([torch.cat([torch.randint(2, 64, (n - 1,), generator=g), torch.tensor([EOS])]) for n in r])
        for r in lengths
    ]
    return torch.stack(rows)


def test_document_attention_equals_sdpa_under_the_dense_mask() -> None:
    """Each document's causal kernel on its own slice gives the outputs and gradients of one SDPA call under
    the dense "causal and same document" mask (grouped-query heads, rows cut differently)."""
    from dtlaunch.models.dense.documents import Documents, attend, dense_mask

    doc_ids = document_inputs(_packed([[7, 1, 24], [32]]).numpy(), EOS)["doc_ids"]
    docs = Documents.of(doc_ids)
    assert docs.lengths == ((7, 1, 24), (32,))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 32, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 8, generator=g, requires_grad=True) for _ in range(2))
    out = attend(q, k, v, docs)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(doc_ids), enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_packed_documents_hold_no_sequence_squared_mask() -> None:
    """At S = 1024 a dense mask is B * S^2 = 2 MiB, kept for backward (several times that while built). The
    document path's measured peak over forward + backward is the plain causal path's, which is what the
    plan counts (it has no mask line)."""
    from dtlaunch.train.observe.memtrack import StorageCounter

    m = OmegaConf.structured(DenseModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64))
    model = build_model(m, rope_len=1024, device="cpu")
    model.init_weights(seed=0)
    tokens = _packed([[300, 500, 224], [1024]])
    extra = document_inputs(tokens.numpy(), EOS)

    def peak(**kw: torch.Tensor) -> int:
        counter = StorageCounter()
        with counter:
            model(tokens, **kw).float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return counter.peak

    causal, documents = peak(), peak(**extra)
    assert abs(documents - causal) < 0.01 * causal, (documents, causal)
    assert 2 * 1024**2 > 0.1 * causal  # the mask the test rules out would show


def test_hf_auto_keeps_packed_documents_apart(tiny_hf_dirs) -> None:
    """model.arch=hf_auto: the restarted positions alone make transformers' mask keep each document to
    itself (its packed-sequence detection); each document's logits equal those of running it alone."""
    from dtlaunch.job.compose import compose
    from dtlaunch.models.hf_auto.build import build_model as build_hf_auto

    m = compose(["model=tiny", "model.arch=hf_auto", f"model.init_from=hf:{tiny_hf_dirs['llama_tied']}"]).cfg.model
    torch.manual_seed(0)
    model = build_hf_auto(m, device="cpu")
    packed = _packed([[5, 7, 6]])
    extra = document_inputs(packed.numpy(), EOS)
    with torch.no_grad():
        masked = model(packed, **extra)
        start = 0
        for n in (5, 7, 6):
            torch.testing.assert_close(
                masked[0, start : start + n], model(packed[:, start : start + n])[0], rtol=1e-5, atol=1e-5
            )
            start += n


def test_compiled_blocks_run_document_attention_eagerly_without_recompiling() -> None:
    """training.compile with data.document_mask: attention runs between the compiled halves of each block
    (parallelize.apply_compile), so batches with other document lengths reuse the compiled code; the
    losses and gradients are eager's."""
    import copy

    import torch._dynamo

    from dtlaunch.train.parallel.parallelize import apply_compile

    m = OmegaConf.structured(DenseModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64))
    eager = build_model(m, rope_len=64, device="cpu")
    eager.init_weights(seed=0)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, documents=True)
    torch._dynamo.reset()
    for i, lengths in enumerate([[[10, 22, 32]], [[40, 3, 21]], [[64]]]):
        extra = document_inputs(_packed(lengths, seed=i).numpy(), EOS)
        tokens = _packed(lengths, seed=i)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(tokens, **extra).square().mean()
        want = eager(tokens, **extra).square().mean()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
        compiled.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
