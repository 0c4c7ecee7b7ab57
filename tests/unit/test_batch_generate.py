"""Batched generation (dtlaunch.infer.batch_generate) against transformers' `generate` on the same HF
directory: a left-padded batch of prompts of different lengths, greedy, with per-row stops."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from dtlaunch.infer.batch_generate import Sampling, generate_batch, sample_next
from dtlaunch.infer.generate import load_source, set_positions

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 17, 42, 3, 99, 8, 11], [7], [60, 2, 33, 90], [14, 14, 14, 200, 31]]
NEW = 12


def hf_greedy(path, prompts, stops: list[int]) -> tuple[list[list[int]], float]:
    """transformers' greedy completions, and the mean entropy of its logits over the completion tokens."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = ref.generate(
            ids,
            attention_mask=attn,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=stops,
            output_logits=True,
            return_dict_in_generate=True,
        )
    rows, entropy = [], 0.0
    for i, row in enumerate(out.sequences[:, longest:].tolist()):
        end = next((j + 1 for j, t in enumerate(row) if t in stops), None)
        rows.append(row[:end] if end is not None else row)
        for j in range(len(rows[-1])):
            lp = torch.log_softmax(out.logits[j][i].float(), dim=-1)
            entropy += float(-(lp.exp() * lp).sum())
    return rows, entropy / sum(len(r) for r in rows)


@pytest.mark.parametrize("family", ["qwen2", "llama_tied"])
def test_greedy_batch_matches_transformers(tiny_hf_dirs, family: str) -> None:
    path = tiny_hf_dirs[family]
    loaded = load_source(f"hf:{path}", torch.device("cpu"))
    set_positions(loaded.model, max(len(p) for p in PROMPTS) + NEW)
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    free = generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1])
    # A second stop id that some rows emit part-way: those rows stop there, the others run on.
    stop = free.completions[0][NEW // 2]
    ours = generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1, stop])
    assert any(len(c) < NEW for c in ours.completions) and any(t for t in ours.truncated)
    hf_rows, hf_entropy = hf_greedy(path, PROMPTS, [1, stop])
    assert ours.completions == hf_rows
    assert ours.entropy == pytest.approx(hf_entropy, rel=1e-5) and ours.entropy > 0  # the rollout's "entropy"
    # Each row alone (no padding) gives the same tokens as in the batch.
    for prompt, batched in zip(PROMPTS, ours.completions, strict=True):
        assert generate_batch(loaded.model, [prompt], greedy, stop_ids=[1, stop]).completions[0] == batched


def test_a_model_training_with_a_chunked_loss_still_decodes_logits(tiny_hf_dirs) -> None:
    """GRPO's rollout runs the model the step trains, whose head training.loss_chunks > 1 leaves to the loss:
    the loss's callers ask for the hidden states per call (`head=False`), so the model holds no switch that
    a rollout between two training forwards could find set (the bug of f949d8c)."""
    from dtlaunch.train.loss import head_loss

    loaded = load_source(f"hf:{tiny_hf_dirs['llama_tied']}", torch.device("cpu"))
    set_positions(loaded.model, max(len(p) for p in PROMPTS) + NEW)
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    plain = generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1]).completions
    loss = head_loss(8, [loaded.model])  # what the trainer builds for training.loss_chunks=8
    assert not loss.logits
    state = dict(vars(loaded.model))
    hidden = loss.model_output(loaded.model, torch.tensor([PROMPTS[0]]))
    assert hidden.shape[-1] == loaded.model.cfg.dim  # training: hidden states
    assert generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1]).completions == plain
    assert dict(vars(loaded.model)).keys() == state.keys()  # building the loss set nothing on the model


def test_seeded_sampling_repeats(tiny_hf_dirs) -> None:
    loaded = load_source(f"hf:{tiny_hf_dirs['qwen2']}", torch.device("cpu"))
    set_positions(loaded.model, max(len(p) for p in PROMPTS) + NEW)
    s = Sampling(max_new_tokens=NEW, temperature=1.0, top_p=0.9, top_k=50)

    def draw(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return generate_batch(loaded.model, PROMPTS, s, [1], generator=g).completions

    assert draw(3) == draw(3) and draw(3) != draw(4)


@pytest.mark.slow_reason("torch.compile of the decode step (inductor on CPU), the only test that compiles it")
def test_compiled_decode_matches_transformers_and_compiles_once(tiny_hf_dirs) -> None:
    """objective.generation_compile: the decode steps compiled against static caches give transformers'
    greedy completions (per-row stops included) and eager's seeded samples; a second batch of the same
    shape reuses the compiled step (the caches are new objects, the weights the same)."""
    from torch._dynamo.utils import counters

    path = tiny_hf_dirs["qwen2"]
    loaded = load_source(f"hf:{path}", torch.device("cpu"))
    set_positions(loaded.model, max(len(p) for p in PROMPTS) + NEW)
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    stop = generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1]).completions[0][NEW // 2]
    compiled = generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1, stop], compiled=True)
    assert compiled.completions == hf_greedy(path, PROMPTS, [1, stop])[0]
    graphs = counters["stats"]["unique_graphs"]
    s = Sampling(max_new_tokens=NEW, temperature=1.0, top_p=0.9)

    def draw(**kw) -> list[list[int]]:
        return generate_batch(
            loaded.model, PROMPTS, s, [1], generator=torch.Generator().manual_seed(3), **kw
        ).completions

    assert draw(compiled=True) == draw()
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled


def test_per_row_limits(tiny_hf_dirs) -> None:
    """`limits` (a tool-calling continuation's room left in max_completion_length): each row is its unlimited
    greedy completion cut at its own limit (truncated), and a row never takes a position past its prompt +
    its limit, so the RoPE table need only cover those."""
    loaded = load_source(f"hf:{tiny_hf_dirs['qwen2']}", torch.device("cpu"))
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    set_positions(loaded.model, max(len(p) for p in PROMPTS) + NEW)
    free = generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1]).completions
    limits = [2, NEW, 5, 1]  # the longest prompt gets the smallest room but one
    set_positions(loaded.model, max(len(p) + n for p, n in zip(PROMPTS, limits, strict=True)))
    cut = generate_batch(loaded.model, PROMPTS, greedy, stop_ids=[1], limits=limits)
    assert cut.completions == [row[:n] for row, n in zip(free, limits, strict=True)]
    assert cut.truncated == [len(row) > n or row[-1] != 1 for row, n in zip(free, limits, strict=True)]


def test_shared_prefill_and_dropped_rows_match_plain_path(tiny_hf_dirs) -> None:
    """GRPO's batch, each prompt's G rows side by side: one prefill per distinct prompt (its keys and values
    copied to its rows) and the finished rows dropped from the decode batch give the plain path's tokens
    (every row prefilled and decoded to the end) row for row, greedy and sampled from the same seed."""
    loaded = load_source(f"hf:{tiny_hf_dirs['qwen2']}", torch.device("cpu"))
    set_positions(loaded.model, max(len(p) for p in PROMPTS) + NEW)
    rows = [p for p in PROMPTS for _ in range(4)]
    limits = [NEW - (i % 5) * 2 for i in range(len(rows))]  # rows end at different steps: several drops
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    stop = generate_batch(loaded.model, PROMPTS[:1], greedy, stop_ids=[1]).completions[0][3]  # ends a group early
    batch_rows: list[int] = []
    hook = loaded.model.register_forward_pre_hook(lambda _, args: batch_rows.append(args[0].shape[0]))
    try:
        for s, seed in ((greedy, 0), (Sampling(max_new_tokens=NEW, temperature=1.0, top_p=0.9, top_k=50), 7)):
            batch_rows.clear()
            g = torch.Generator().manual_seed(seed)
            fast = generate_batch(loaded.model, rows, s, [1, stop], 0, g, limits=limits)
            assert batch_rows[0] == len(PROMPTS) and min(batch_rows[1:]) < len(rows), batch_rows
            assert sorted(batch_rows[1:], reverse=True) == batch_rows[1:]  # rows leave, none come back
            batch_rows.clear()
            g = torch.Generator().manual_seed(seed)
            plain = generate_batch(loaded.model, rows, s, [1, stop], 0, g, limits=limits, plain=True)
            assert set(batch_rows) == {len(rows)}, batch_rows  # every row in every forward
            assert fast.completions == plain.completions and fast.truncated == plain.truncated
            assert fast.entropy == pytest.approx(plain.entropy, rel=1e-6) and fast.entropy > 0
            assert len({len(c) for c in fast.completions}) > 2  # rows of many lengths
    finally:
        hook.remove()


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "qwen3_5"])
def test_shared_prefix_prefill_matches_whole_rows(tiny_hf_dirs, family: str) -> None:
    """A multi-turn continuation's rows (`shared`: each row's prompt, the prefix its group shares, before its
    own turns): each prefix prefilled once, then only each row's own tokens, gives the tokens of every row
    prefilled whole, greedy and sampled from the same seed; a sliding-window family (gemma3, window 8 <
    the rows) keeps the distances between real tokens. A recurrent-state family (qwen3_5) prefills whole."""
    loaded = load_source(f"hf:{tiny_hf_dirs[family]}", torch.device("cpu"))
    suffixes = [[9], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [50, 51, 52], [70, 71, 72, 73, 74, 75]]
    rows = [p + x for p in PROMPTS[:3] for x in suffixes]  # 3 prompts x 4 rows, suffixes of 1 to 11 tokens
    shared = [len(p) for p in PROMPTS[:3] for _ in suffixes]
    set_positions(loaded.model, max(len(r) for r in rows) + NEW)
    shapes: list[tuple[int, int]] = []
    hook = loaded.model.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    try:
        for s, seed in ((Sampling(max_new_tokens=NEW, temperature=0.0), 0), (Sampling(NEW, 1.0, 0.9, 50), 7)):
            shapes.clear()
            split = generate_batch(loaded.model, rows, s, [1], 0, torch.Generator().manual_seed(seed), shared=shared)
            prefills = shapes[:2]
            whole = generate_batch(loaded.model, rows, s, [1], 0, torch.Generator().manual_seed(seed))
            assert split.completions == whole.completions and split.truncated == whole.truncated
            assert split.entropy == pytest.approx(whole.entropy, rel=1e-5) and split.entropy > 0
            if family == "qwen3_5":
                assert prefills[0] == (len(rows), max(len(r) for r in rows))
            else:  # the 3 prompts once (7 positions), then the 12 rows' last 11 positions
                assert prefills == [(3, 7), (len(rows), 11)], prefills
    finally:
        hook.remove()


def test_draws_follow_the_distribution() -> None:
    """sample_next's draw (inverse CDF, one uniform per row): each id's frequency is its probability after
    temperature and top-k, within 5 standard errors, and an id top-k removed is never drawn."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(0)) * 2
    s = Sampling(max_new_tokens=1, temperature=0.7, top_k=30)
    g, n = torch.Generator().manual_seed(1), 200_000
    ids = torch.cat([sample_next(logits.expand(1000, -1), s, g) for _ in range(n // 1000)])
    freq = torch.bincount(ids, minlength=40).double() / n
    scaled = logits[0] / 0.7
    p = scaled.masked_fill(scaled < scaled.topk(30).values[-1], float("-inf")).softmax(-1).double()
    assert (p == 0).sum() == 10 and freq[p == 0].sum() == 0
    assert torch.all((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt()), (freq - p).abs().max()


@contextlib.contextmanager
def per_head_cache(model: torch.nn.Module) -> Iterator[None]:
    """DeepSeek-V3's attention decodes with the full per-head keys and values (the dense decoder's cache)
    instead of its latent cache, inside the block."""
    from dtlaunch.models.deepseek_v3.mla import MLAttention

    attention = [mod for mod in model.modules() if isinstance(mod, MLAttention)]
    assert attention
    for mod in attention:
        mod.latent_cache = False
    try:
        yield
    finally:
        for mod in attention:
            mod.latent_cache = True


def deepseek_v3(tiny_moe_hf_dirs, tmp_path, q_rank: str) -> tuple[torch.nn.Module, object]:
    """The tiny DeepSeek-V3 directory (a low-rank query) or one with a plain q projection, and our model of it."""
    from hf_loaded import variant

    src = tiny_moe_hf_dirs["deepseek_v3"]
    path = src if q_rank == "low_rank_q" else variant(src, tmp_path, q_lora_rank=None)
    model = load_source(f"hf:{path}", torch.device("cpu")).model
    assert bool(model.cfg.q_lora_rank) == (q_rank == "low_rank_q")
    return model, path


@pytest.mark.parametrize("q_rank", ["low_rank_q", "plain_q"])
def test_deepseek_v3_latent_cache_generates_as_the_per_head_cache_and_transformers(
    tiny_moe_hf_dirs, tmp_path, q_rank: str
) -> None:
    """DeepSeek-V3 decodes from its latent cache (mla.py: the normalised kv latent and the shared rotated key
    per position, attention absorbed into the latent space): transformers' greedy completions (per-row stops
    included), and the per-head cache's greedy and seeded-sampled completions row for row, GRPO's G rows
    sharing each prompt's prefill and the finished rows dropped; each decode step's logits within 1e-5 (fp32)
    of the per-head cache's and of the whole sequence's forward."""
    from dtlaunch.models.dense.model import KVCache

    model, path = deepseek_v3(tiny_moe_hf_dirs, tmp_path, q_rank)
    set_positions(model, max(len(p) for p in PROMPTS) + NEW)
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    stop = generate_batch(model, PROMPTS, greedy, stop_ids=[1]).completions[0][NEW // 2]
    rows = [p for p in PROMPTS for _ in range(3)]
    limits = [NEW - (i % 4) * 3 for i in range(len(rows))]  # rows end at different steps: rows dropped

    def runs() -> list:
        sampled = Sampling(max_new_tokens=NEW, temperature=1.0, top_p=0.9, top_k=50)
        g = torch.Generator().manual_seed(7)
        return [
            generate_batch(model, PROMPTS, greedy, stop_ids=[1, stop]),
            generate_batch(model, rows, greedy, [1, stop], limits=limits),
            generate_batch(model, rows, sampled, [1, stop], 0, g, limits=limits),
        ]

    latent = runs()
    assert any(len(c) < NEW for c in latent[0].completions) and any(latent[0].truncated)
    assert latent[0].completions == hf_greedy(path, PROMPTS, [1, stop])[0]
    with per_head_cache(model):
        per_head = runs()
    for a, b in zip(latent, per_head, strict=True):
        assert a.completions == b.completions and a.truncated == b.truncated
        assert a.entropy == pytest.approx(b.entropy, rel=1e-5) and a.entropy > 0
    assert latent[2].completions != latent[1].completions  # the sampled run is not the greedy one

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def stepped() -> torch.Tensor:
        caches = [KVCache() for _ in model.layers]
        with torch.no_grad():
            steps = [model(tokens[:, :9], caches=caches)]
            steps += [model(tokens[:, i : i + 1], caches=caches) for i in range(9, tokens.shape[1])]
        return torch.cat(steps, dim=1)

    with torch.no_grad():
        full = model(tokens)
    latent_logits = stepped()
    with per_head_cache(model):
        per_head_logits = stepped()
    assert (latent_logits - per_head_logits).abs().max().item() < 1e-5
    assert (latent_logits - full).abs().max().item() < 1e-5


def test_deepseek_v3_shared_prefix_prefill_with_the_latent_cache(tiny_moe_hf_dirs, tmp_path) -> None:
    """A multi-turn continuation (`shared`) on DeepSeek-V3: each prefix's latent cache prefilled once and moved
    to its rows gives the tokens of every row prefilled whole, and of the per-head cache's shared prefill,
    greedy and sampled from the same seed."""
    model, _ = deepseek_v3(tiny_moe_hf_dirs, tmp_path, "low_rank_q")
    suffixes = [[9], [30, 31, 32, 33, 34, 35, 36], [50, 51, 52]]
    rows = [p + x for p in PROMPTS[:3] for x in suffixes]
    shared = [len(p) for p in PROMPTS[:3] for _ in suffixes]
    set_positions(model, max(len(r) for r in rows) + NEW)

    def run(s: Sampling, seed: int, **kw) -> object:
        return generate_batch(model, rows, s, [1], 0, torch.Generator().manual_seed(seed), **kw)

    for s, seed in ((Sampling(max_new_tokens=NEW, temperature=0.0), 0), (Sampling(NEW, 1.0, 0.9, 50), 7)):
        split, whole = run(s, seed, shared=shared), run(s, seed)
        with per_head_cache(model):
            per_head = run(s, seed, shared=shared)
        assert split.completions == whole.completions == per_head.completions
        assert split.entropy == pytest.approx(whole.entropy, rel=1e-5) and split.entropy > 0


def test_deepseek_v3_caches_its_latent_as_the_plan_counts(tiny_moe_hf_dirs, tmp_path, monkeypatch) -> None:
    """Every block's cache holds kv_lora_rank + qk_rope_head_dim values per position and row (the latent and
    the shared rotated key, no per-head keys or values), and the planner's KV cache line
    (dtlaunch.plan.generation.kv_cache_bytes) is the bytes those tensors allocate, the same under tensor
    parallel (the latent is whole on every rank), with each block's absorbed wkv_b matrix (KVCache.derived:
    this rank's heads, halved under TP(2))."""
    from types import SimpleNamespace

    from dtlaunch.plan.generation import kv_cache_bytes

    model, _ = deepseek_v3(tiny_moe_hf_dirs, tmp_path, "low_rank_q")
    m = model.cfg
    set_positions(model, max(len(p) for p in PROMPTS) + NEW)
    caches: list = []
    own = model.decoding_cache
    monkeypatch.setattr(model, "decoding_cache", lambda key, kv: caches.append(own(key, kv)) or caches[-1])
    out = generate_batch(model, PROMPTS, Sampling(max_new_tokens=NEW, temperature=0.0), stop_ids=[], plain=True)
    assert all(len(c) == NEW for c in out.completions)
    assert len(caches) == int(m.n_layers)
    width = int(m.kv_lora_rank) + int(m.qk_rope_head_dim)  # 16 + 8; the per-head cache: 4 x (20 + 10)
    longest = max(len(p) for p in PROMPTS)
    for cache in caches:
        assert tuple(cache.k.shape) == (len(PROMPTS), longest + NEW, 1, width) and cache.v.numel() == 0
    allocated = sum(c.k.untyped_storage().nbytes() + c.v.untyped_storage().nbytes() for c in caches)
    # Each block's absorbed wkv_b matrix, kept on its cache for the generation (mla.py): this rank's heads.
    derived = sum(w.untyped_storage().nbytes() for c in caches for w in c.derived.values())
    absorbed = int(m.kv_lora_rank) * int(m.n_heads) * (int(m.qk_nope_head_dim) + int(m.v_head_dim)) * 4
    assert derived == int(m.n_layers) * absorbed

    def planned(tp: int) -> float:
        c = SimpleNamespace(
            model=m,
            tp=tp,
            layers=int(m.n_layers),
            compute_bytes=4,
            accum_steps=1,
            training=SimpleNamespace(micro_batch=len(PROMPTS), seq_len=longest + NEW),
            cfg=SimpleNamespace(objective=SimpleNamespace(max_completion_length=NEW)),
            decisions=SimpleNamespace(decode_positions_multiple=1),
        )
        return kv_cache_bytes(c)

    assert allocated == int(m.n_layers) * width * len(PROMPTS) * (longest + NEW) * 4
    assert planned(1) == allocated + derived and planned(2) == allocated + derived / 2


@pytest.mark.slow_reason("torch.compile of DeepSeek-V3's decode step (inductor on CPU: ~1 min, its MoE included)")
def test_deepseek_v3_compiled_decode_with_the_latent_cache(tiny_moe_hf_dirs, tmp_path) -> None:
    """objective.generation_compile on DeepSeek-V3: the compiled steps against static latent caches give the
    eager per-head cache's greedy and seeded-sampled completions."""
    model, _ = deepseek_v3(tiny_moe_hf_dirs, tmp_path, "low_rank_q")
    set_positions(model, max(len(p) for p in PROMPTS) + NEW)
    greedy, sampled = Sampling(max_new_tokens=NEW, temperature=0.0), Sampling(NEW, 1.0, 0.9, 50)

    def run(s: Sampling, **kw) -> list[list[int]]:
        return generate_batch(model, PROMPTS, s, [1], 0, torch.Generator().manual_seed(3), **kw).completions

    compiled = [run(greedy, compiled=True), run(sampled, compiled=True)]
    with per_head_cache(model):
        assert compiled == [run(greedy), run(sampled)]
