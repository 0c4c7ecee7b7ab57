"""The dense decoder's own rules on a model section (run by `validate` before anything starts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlaunch.errors import ConfigError

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check_attention(m: Any) -> None:
    """Head widths RoPE and grouped-query attention can use, and a sensible attention window."""
    if m.head_dim is None and m.dim % m.n_heads:
        raise ConfigError(
            f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}: pick a head count that divides it"
        )
    hd = m.head_dim or m.dim // m.n_heads
    if hd % 2:
        raise ConfigError(
            f"model head dim {hd} is odd: RoPE needs an even head dim; change model.dim, n_heads or head_dim"
        )
    if m.sliding_window is not None and m.sliding_window < 1:
        raise ConfigError(f"model.sliding_window={m.sliding_window} must be >= 1, or null for full causal attention")
    kv = m.n_kv_heads or m.n_heads
    if kv <= 0 or m.n_heads % kv:
        raise ConfigError(f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads} (grouped-query attention)")


def check_window(cfg: JobConfig) -> None:
    """Context parallel's attention (ring or Ulysses) is plain causal: no window shorter than the sequence."""
    m, cp = cfg.model, int(cfg.strategy.cp)
    if cp > 1 and m.sliding_window is not None and m.sliding_window < int(cfg.training.seq_len):
        raise ConfigError(
            f"model.sliding_window={m.sliding_window} is not supported with strategy.cp={cp} (context parallel "
            f"attention is plain causal): set model.sliding_window=null, training.seq_len<={m.sliding_window} or strategy.cp=1"
        )


def check(cfg: JobConfig) -> None:
    check_attention(cfg.model)
    check_window(cfg)
