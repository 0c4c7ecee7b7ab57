"""Training objectives beside next-token cross-entropy, one file each: the DPO family (objective=dpo / orpo /
simpo: dpo.py), KTO (kto.py), the reward model (reward.py), GRPO (rollout.py, its formulas in grpo.py).
What they share: the completion log-probs (logps.py), the reference's (reference.py), the step data
(step_data.py).
"""

from __future__ import annotations

from dtlaunch.train.objectives.dpo import STATS_LEN, PreferenceObjective, summarize

__all__ = ["STATS_LEN", "PreferenceObjective", "summarize"]
