"""`model.arch=hf_auto`'s rules: weights and architecture from a HF directory; tensor parallel only from the
architecture's own plan, no pipeline split; context parallel as Ulysses, over plain causal attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlaunch.config.weight_source import WeightSource
from dtlaunch.errors import ConfigError
from dtlaunch.hub.model_source import hf_source_dir, read_hf_config

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def check(cfg: JobConfig) -> None:
    s = cfg.strategy
    if not WeightSource.parse(cfg.model.init_from).is_hf:
        raise ConfigError("model.arch=hf_auto needs model.init_from=hf:DIR: the architecture and weights come from DIR")
    if s.pp != 1:
        raise ConfigError(f"strategy.pp={s.pp}: model.arch=hf_auto has no pipeline split: use strategy.pp=1")
    if s.tp != 1:
        from dtlaunch.models.hf_auto.tp_plan import check as check_tp

        problem = check_tp(cfg.model, int(s.tp), bool(s.sequence_parallel))
        if problem:
            raise ConfigError(problem)
    if int(s.cp) > 1:
        check_ulysses_attention(cfg)


# config.json keys whose attention Ulysses' plain causal kernel would not compute: (key, what it is).
_NOT_PLAIN_CAUSAL = (
    ("attn_logit_softcapping", "attention logit soft-capping"),
    ("attention_dropout", "attention dropout"),
)


def check_ulysses_attention(cfg: JobConfig) -> None:
    """Ulysses (the context parallel transformers' models run) computes plain causal attention over the
    whole sequence: a sliding window shorter than the sequence, soft-capping or dropout are refused here,
    before any worker starts (the attention function refuses them again if a model passes them anyway)."""
    c = read_hf_config(hf_source_dir(cfg.model.init_from))
    seq = int(cfg.training.seq_len)
    window = c.get("sliding_window")
    if isinstance(window, (int, float)) and window and c.get("use_sliding_window", True) and window < seq:
        raise ConfigError(
            f"strategy.cp={cfg.strategy.cp}: this model's sliding_window={window} is shorter than training.seq_len="
            f"{seq}, and context parallel attention is plain causal: use training.seq_len<={window} or strategy.cp=1"
        )
    for key, what in _NOT_PLAIN_CAUSAL:
        if c.get(key):
            raise ConfigError(
                f"strategy.cp={cfg.strategy.cp}: this model uses {what} ({key}={c[key]} in config.json), and context "
                f"parallel attention is plain causal: use strategy.cp=1"
            )
