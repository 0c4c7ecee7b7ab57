"""Building on the meta device skips random fills (meta tensors hold no values) and so never imports
torch._dynamo, which torch's Python reference for `normal_` on meta would (about a second per start)."""

from __future__ import annotations

import subprocess
import sys

import torch

from dtlaunch.models.meta_init import SkipRandomInitOnMeta


def test_meta_fills_are_skipped_and_real_ones_are_not() -> None:
    with SkipRandomInitOnMeta():
        meta = torch.empty(4, 4, device="meta")
        assert torch.nn.init.normal_(meta) is meta and meta.normal_() is meta
        real = torch.zeros(2000)
        torch.nn.init.normal_(real)
        assert 0.9 < float(real.std()) < 1.1
        assert torch.arange(3).tolist() == [0, 1, 2]


def test_the_workers_imports_and_a_meta_build_do_not_import_dynamo() -> None:
    code = (
        "import sys\n"
        "import dtlaunch.train.main\n"  # everything a worker imports before it builds
        "from dtlaunch.job.compose import compose\n"
        "from dtlaunch.models.registry import model_spec\n"
        "for model in ('tiny', 'tiny_moe', 'qwen3_0.6b'):\n"
        "    m = compose(['model=' + model]).cfg.model\n"
        "    built = model_spec(m).build(m, rope_len=64, device='meta')\n"
        "    assert built.rope_cos.shape == (64, built.rope_cos.shape[1]) and built.rope_cos.is_meta\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
