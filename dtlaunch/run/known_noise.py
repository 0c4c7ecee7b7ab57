"""Log lines third-party imports print on every start that mean nothing for a dtlaunch job, silenced one by
one: a filter on the logger that prints each, matching its message. Everything else those loggers say
still shows. Installed first thing by the CLI and by each worker, before torch or torchao is imported.
"""

from __future__ import annotations

import logging

# (logger, a fragment of the message), each with why it is harmless.
KNOWN_NOISE = (
    # torchao registers its enums with torch.utils._pytree.register_constant, which torch deprecates for
    # enums (torchao's call to change; the registration still works).
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile"),
    # torchao's optional compiled kernels built for another Python or GPU generation (mxfp8, CUTLASS sm90a):
    # dtlaunch uses none of them (float8 goes through torch._scaled_mm, NF4 is plain torch).
    ("torchao", "/torchao/_C"),
    # Without Triton (CPU machines) torchao's int8 matmul autotuner is off; dtlaunch does not use it.
    ("torchao.kernel.intmm", "Detected no triton"),
)


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def silence_known_noise() -> None:
    """Add the filters (once per process)."""
    for name, fragment in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(_DropMessage(fragment))
