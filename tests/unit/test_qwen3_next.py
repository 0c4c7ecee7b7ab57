"""Qwen3-Next (model.arch=qwen3_next) against transformers' Qwen3NextForCausalLM on a tiny random directory
(tests/conftest.py: a Gated DeltaNet block then a gated full-attention block, 4 experts and a gated shared
expert): logits within 1e-5 in fp32, packed documents (data.document_mask) each equal to itself alone (ours and
transformers', logits and gradients), a bit-identical round trip, the planner's exact count, every
Qwen3-Next part mattering, and the layouts it cannot take refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from hf_loaded import QWEN3_NEXT_80B_A3B, ours, round_trip, theirs

from dtlaunch.errors import ConfigError
from dtlaunch.job.compose import compose
from dtlaunch.job.validate import validate

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))


def test_logits_match_transformers_and_every_part_matters(tiny_moe_hf_dirs) -> None:
    path = tiny_moe_hf_dirs["qwen3_next"]
    model, m = ours(path)
    assert m.arch == "qwen3_next" and list(m.layer_types) == ["linear_attention", "full_attention"]
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.partial_rotary_factor) == (2, 4, 0.25)
    assert (m.moe.num_shared_experts, m.moe.shared_expert_dim) == (1, 48)
    with torch.no_grad():
        full = model(TOKENS)
        diff = (full - theirs(path)(TOKENS).logits).abs().max().item()
        assert diff < 1e-5, f"max |logit diff| {diff}"
        attention, moe = model.layers["1"].attention, model.layers["0"].feed_forward
        gate_rows = attention.wq.weight[16:32].clone()  # head 0's rows of q_proj: 16 of query, then 16 of gate
        attention.wq.weight[16:32] = 0.0  # sigmoid(0) = 1/2 on every output of head 0
        assert (model(TOKENS) - full).abs().max().item() > 1e-4, "the attention output gate"
        attention.wq.weight[16:32] = gate_rows
        shared_gate, moe.shared_gate = moe.shared_gate, None
        assert (model(TOKENS) - full).abs().max().item() > 1e-4, "the shared expert's gate"
        moe.shared_gate = shared_gate
        assert torch.equal(model(TOKENS), full)


# One packed row: the first document crosses the Gated DeltaNet's 64-token chunk, the next two start mid-chunk.
DOCUMENTS = (70, 20, 30)


def packed_documents_are_each_alone(path, lengths=DOCUMENTS) -> None:
    """data.document_mask's inputs (doc_ids, restarted positions) on one packed row of `lengths`: each
    document's logits equal ours and transformers' on that document alone (1e-5), and the packed loss's
    gradient the sum of each alone's (1e-5 relative); without doc_ids the later documents differ (so the
    comparison can fail). Also test_qwen3_5's."""
    model, _ = ours(path, seq=sum(lengths))
    tokens = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    spans = [(sum(lengths[:i]), sum(lengths[: i + 1])) for i in range(len(lengths))]
    base = theirs(path)
    with torch.no_grad():
        packed, plain = model(tokens, positions=positions, doc_ids=doc_ids), model(tokens)
        for a, e in spans:
            torch.testing.assert_close(packed[:, a:e], model(tokens[:, a:e]), rtol=0, atol=1e-5)
            torch.testing.assert_close(packed[:, a:e], base(tokens[:, a:e]).logits, rtol=0, atol=1e-5)
    for a, e in spans[1:]:
        assert (plain[:, a:e] - packed[:, a:e]).abs().max() > 1e-3, "without doc_ids the documents mix"

    # A random projection of the logits as the loss: every logit's gradient differs.
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    (model(tokens, positions=positions, doc_ids=doc_ids) * weights).sum().backward()
    together = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for a, e in spans:
        (model(tokens[:, a:e]) * weights[:, a:e]).sum().backward()
    assert together.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in together.items():
        want = dict(model.named_parameters())[name].grad
        assert (grad - want).norm() <= 1e-5 * want.norm(), name


def test_packed_documents_are_each_alone(tiny_moe_hf_dirs) -> None:
    packed_documents_are_each_alone(tiny_moe_hf_dirs["qwen3_next"])


def test_round_trip_is_bit_identical_and_counted_exactly(tiny_moe_hf_dirs, tmp_path) -> None:
    cfg = round_trip(tiny_moe_hf_dirs["qwen3_next"], tmp_path, TOKENS)
    assert cfg["layer_types"] == ["linear_attention", "full_attention"] and cfg["shared_expert_intermediate_size"] == 48


def test_published_shape_is_counted_exactly() -> None:
    """Qwen3-Next-80B-A3B's config.json shape (meta device: no memory), its count equal to transformers'."""
    config = transformers.Qwen3NextConfig(**QWEN3_NEXT_80B_A3B)
    with torch.device("meta"):
        want = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    from dtlaunch.models.qwen3_next.hf import Qwen3NextHF
    from dtlaunch.models.registry import model_spec

    fields = Qwen3NextHF("Qwen3NextForCausalLM", "qwen3_next", qk_norm=True).config_from_hf(config.to_dict(), "x")
    overrides = ["model=tiny", "model.arch=qwen3_next", *_flat("model", fields)]
    m = compose(overrides).cfg.model
    assert model_spec(m).param_count(m) == want


def _flat(prefix: str, d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        if k == "arch":
            continue
        if isinstance(v, dict):
            out += _flat(f"{prefix}.{k}", v)
        else:
            out.append(f"{prefix}.{k}={json.dumps(v) if not isinstance(v, str) else v}")
    return out


# A model section of the family's own (no directory: config.json would contradict the override).
_OWN = [
    "model=tiny",
    "model.arch=qwen3_next",
    "model.qk_norm=true",
    "model.moe.num_experts=4",
    "model.linear_num_value_heads=4",
]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["strategy=tp", "launch.nproc_per_node=3"],
            r"^strategy.tp=3 does not divide model.linear_num_key_heads=2 \(model.arch=qwen3_next\)",
        ),
        (
            ["strategy.cp=2", "launch.nproc_per_node=2"],
            r"^strategy.cp_style=ring with strategy.cp=2: model.arch=qwen3_next's .*set strategy.cp_style=ulysses$",
        ),
        (
            _OWN
            + ["model.linear_num_key_heads=1", "strategy.cp=2", "strategy.cp_style=ulysses"]
            + ["launch.nproc_per_node=2"],
            r"^strategy.cp=2 does not divide model.linear_num_key_heads=1: .*use a cp that divides 1$",
        ),
        (
            ["objective=grpo", "data.kind=synthetic", "objective.max_completion_length=4", "strategy=tp"]
            + ["launch.nproc_per_node=2", "strategy.sequence_parallel=true"],
            r"^strategy.sequence_parallel=true with objective=grpo \(strategy.tp=2\): .*recurrent state",
        ),
        (_OWN + ["model.linear_num_key_heads=3"], r"linear_num_value_heads=4 is not a multiple of .*=3"),
        (_OWN + ["model.layer_types=[full_attention]"], r"^model.layer_types=\['full_attention'\]: give one of"),
    ],
)
def test_what_it_cannot_do_is_one_line(tiny_moe_hf_dirs, extra, message) -> None:
    source = [] if extra[: len(_OWN)] == _OWN else [f"model.init_from=hf:{tiny_moe_hf_dirs['qwen3_next']}"]
    job = compose([*source, "training.seq_len=16", *extra])
    with pytest.raises(ConfigError, match=message) as err:
        validate(job.cfg)
    assert "\n" not in str(err.value)


def documents_data(tmp_path, tokenizer) -> list[str]:
    """data.document_mask=true on a jsonl of documents (synthetic data has none). Also test_qwen3_5's."""
    (tmp_path / "d.jsonl").write_text('{"text": "one document"}\n{"text": "and another"}\n')
    data = [f"data.path={tmp_path / 'd.jsonl'}", f"data.tokenizer={tokenizer / 'tokenizer.json'}"]
    return ["data.kind=jsonl", *data, "data.document_mask=true"]


def test_document_mask_is_taken(tiny_moe_hf_dirs, tiny_tokenizer, tmp_path) -> None:
    """Packed documents reset the Gated DeltaNet blocks (test_packed_documents_are_each_alone)."""
    data = documents_data(tmp_path, tiny_tokenizer)
    validate(compose([f"model.init_from=hf:{tiny_moe_hf_dirs['qwen3_next']}", "training.seq_len=16", *data]).cfg)


def test_context_parallel_as_ulysses_is_accepted(tiny_moe_hf_dirs) -> None:
    """cp=2 with strategy.cp_style=ulysses divides the 2 key heads (and the 4 attention heads): validate takes it."""
    source = f"model.init_from=hf:{tiny_moe_hf_dirs['qwen3_next']}"
    cp = ["strategy.cp=2", "strategy.cp_style=ulysses", "launch.nproc_per_node=2"]
    validate(compose([source, "training.seq_len=16", *cp]).cfg)


def test_tensor_parallel_over_the_key_heads_is_accepted(tiny_moe_hf_dirs) -> None:
    """tp=2 divides the 2 key heads (and the rest): validate takes it, with sequence parallel too."""
    source = f"model.init_from=hf:{tiny_moe_hf_dirs['qwen3_next']}"
    for sp in ("false", "true"):
        validate(
            compose(
                [
                    source,
                    "training.seq_len=16",
                    "strategy=tp",
                    "launch.nproc_per_node=2",
                    f"strategy.sequence_parallel={sp}",
                ]
            ).cfg
        )


def test_a_published_size_plans_in_closed_form_without_a_trace(monkeypatch) -> None:
    """The published 80B plans from its closed-form activation terms (activations.py), in well under a second:
    no step is traced (the trace would have run on real tensors, a MoE router's, and was refused on a host that
    cannot hold them). `plan --trace` still refuses to trace it there, now with the analytic figure."""
    import time

    import dtlaunch.plan.memory as memory
    import dtlaunch.plan.trace as trace
    from dtlaunch.config.layout import Layout

    published = ["model.dim=2048", "model.n_layers=48", "model.n_heads=16", "model.n_kv_heads=2", "model.head_dim=256"]
    published += ["model.vocab_size=151936", "model.ffn_dim=5120", "model.moe.num_experts=512", "model.moe.top_k=10"]
    published += ["model.moe.expert_dim=512", "model.moe.num_shared_experts=1", "model.moe.shared_expert_dim=512"]
    published += ["model.linear_num_key_heads=16", "model.linear_num_value_heads=32"]
    cfg = compose([*_OWN, *published, "strategy=fsdp", "launch.nproc_per_node=8", "hardware=h100_80gb"]).cfg
    layout = Layout.resolve(cfg.strategy, 8)

    def no_trace(*_):
        raise AssertionError("traced")

    monkeypatch.setattr(memory, "_traced_stage", no_trace)
    monkeypatch.setattr(memory, "_untraced_stage", no_trace)
    start = time.perf_counter()
    plan = memory.plan_memory(cfg, layout)
    assert time.perf_counter() - start < 10
    assert not any("trace" in note for note in plan.notes), plan.notes
    # 48 blocks' activations (36 Gated DeltaNet, 12 full attention) at the default row: tens of GB, not zero.
    assert plan.worst.lines[memory.Line.ACTIVATIONS] > 1e9
    monkeypatch.setattr(trace, "free_host_bytes", lambda: 16 * 1024**3)
    reason = trace.skip_reason(cfg, layout)
    assert reason and "traces on real tensors (a MoE router's" in reason and "at least" not in reason, reason
