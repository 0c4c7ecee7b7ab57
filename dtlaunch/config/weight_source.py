"""Where a model's weights come from, as every command writes it: `random`, `hf:DIR` or `hf:ORG/NAME[@REV]`
(a Hugging Face directory or hub model), or a path (a run directory or one of its checkpoints).

The one parser of that text (model.init_from, objective.reference, a peft record's base, the SOURCE of
`generate` and `eval`): no I/O here; what a source resolves to (a hub snapshot, a checkpoint) is its
readers' business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HF_PREFIX = "hf:"
RANDOM = "random"


@dataclass(frozen=True)
class WeightSource:
    kind: str  # "random", "hf" or "path"
    name: str  # hf: what follows "hf:" (DIR or ORG/NAME[@REV], possibly empty); path: the path; random: ""

    @classmethod
    def parse(cls, value: Any) -> WeightSource:
        """The source a value names; None and "" are random initialisation."""
        text = str(value or RANDOM)
        if text == RANDOM:
            return cls("random", "")
        if text.startswith(HF_PREFIX):
            return cls("hf", text[len(HF_PREFIX) :])
        return cls("path", text)

    @property
    def is_hf(self) -> bool:
        return self.kind == "hf"

    @property
    def is_random(self) -> bool:
        return self.kind == "random"

    def __str__(self) -> str:
        return {"random": RANDOM, "hf": HF_PREFIX + self.name, "path": self.name}[self.kind]


def hf_name(value: Any) -> str | None:
    """What follows `hf:` in a source (DIR or ORG/NAME[@REV]; "" for a bare `hf:`); None for any other source."""
    source = WeightSource.parse(value)
    return source.name if source.is_hf else None
