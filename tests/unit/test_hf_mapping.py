"""Name mapping and RoPE row permutation between our Llama and Hugging Face's (no transformers needed)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dtlaunch.convert.hf import from_hf_state, hf_config, to_hf_state
from dtlaunch.errors import InputError
from dtlaunch.models.dense.config import DenseModelConfig
from dtlaunch.models.dense.hf import from_hf_name, halves_to_interleaved, interleaved_to_halves, to_hf_name
from dtlaunch.models.dense.model import apply_rope, build_model, rope_cache


def tiny() -> DenseModelConfig:
    return OmegaConf.structured(DenseModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128))


def test_every_parameter_maps_both_ways() -> None:
    names = [n for n, _ in build_model(tiny(), device="meta").named_parameters()]
    hf = [to_hf_name(n) for n in names]
    assert len(set(hf)) == len(names)
    assert [from_hf_name(h) for h in hf] == names
    assert to_hf_name("layers.1.feed_forward.w1.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert to_hf_name("layers.0.feed_forward.w3.weight") == "model.layers.0.mlp.up_proj.weight"
    assert to_hf_name("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight"
    assert to_hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(InputError):
        from_hf_name("model.layers.0.self_attn.rotary_emb.weird")


def test_permutation_is_inverse_and_moves_rows() -> None:
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)
    p = interleaved_to_halves(w, n_heads=4)
    assert torch.equal(halves_to_interleaved(p, n_heads=4), w)
    # Head 0 (rows 0..7): ours pairs (0,1),(2,3),.. -> HF halves: rows 0,2,4,6 then 1,3,5,7.
    assert [int(r) for r in p[:8, 0] // 3] == [0, 2, 4, 6, 1, 3, 5, 7]


def _rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's convention: cos/sin repeated over both halves, rotate_half pairs dims i and i + d/2."""
    c = torch.cat([cos, cos], dim=-1)[None, : x.shape[1], None, :]
    s = torch.cat([sin, sin], dim=-1)[None, : x.shape[1], None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat([-x2, x1], dim=-1) * s


def test_permuted_projection_gives_hf_rope_the_same_scores() -> None:
    m = tiny()
    torch.manual_seed(0)
    heads, hd, seq = 4, 16, 5
    wq = torch.randn(heads * hd, 64)
    wk = torch.randn(heads * hd, 64)
    x = torch.randn(1, seq, 64)
    cos, sin = rope_cache(m, seq)
    ours_q = apply_rope((x @ wq.T).view(1, seq, heads, hd), cos, sin)
    ours_k = apply_rope((x @ wk.T).view(1, seq, heads, hd), cos, sin)
    hf_q = _rotate_half_rope((x @ interleaved_to_halves(wq, heads).T).view(1, seq, heads, hd), cos, sin)
    hf_k = _rotate_half_rope((x @ interleaved_to_halves(wk, heads).T).view(1, seq, heads, hd), cos, sin)
    # Attention scores q.k are invariant to a common permutation of the head dims.
    ours = torch.einsum("bqhd,bkhd->bhqk", ours_q, ours_k)
    theirs = torch.einsum("bqhd,bkhd->bhqk", hf_q, hf_k)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
    # Without the permutation HF's rotation pairs the wrong dims: the scores differ.
    raw_q = _rotate_half_rope((x @ wq.T).view(1, seq, heads, hd), cos, sin)
    raw_k = _rotate_half_rope((x @ wk.T).view(1, seq, heads, hd), cos, sin)
    assert not torch.allclose(ours, torch.einsum("bqhd,bkhd->bhqk", raw_q, raw_k), atol=1e-2)


def test_state_round_trip_and_config() -> None:
    m = tiny()
    model = build_model(m, device="cpu")
    model.init_weights(seed=3)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    back = from_hf_state(to_hf_state(state, m), m)
    assert sorted(back) == sorted(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    cfg = hf_config(m)
    assert cfg["num_key_value_heads"] == 2 and cfg["intermediate_size"] == 192 and cfg["rope_scaling"] is None
    assert cfg["tie_word_embeddings"] is False
    m31 = OmegaConf.merge(m, {"rope_scaling": {"factor": 8.0}, "rope_theta": 500000.0})
    rs = hf_config(m31)["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["original_max_position_embeddings"] == 8192
