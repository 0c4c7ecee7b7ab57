"""The routed experts' two CPU kernels: torch._grouped_mm against the per-expert loop, forward + backward.

  python bench/moe_experts_kernel.py            # tiny_moe and planner_moe shapes, fp32 and bf16

Per row: the median wall time of one forward + backward of each kernel (interleaved repeats, one
thread), the ratio grouped / loop (below 1: grouped is faster) and the largest difference between the
kernels' outputs and gradients relative to the largest value (0: bit for bit). Tokens are routed at
random (top-2 copies of micro_batch 4 x seq_len tokens).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from dtlaunch.models.moe.experts import _grouped, _looped, cpu_grouped_mm_dtypes

SHAPES = {  # name: (experts, dim, expert width, routed copies)
    "tiny_moe": (8, 64, 32, 2 * 4 * 64),
    "planner_moe": (8, 256, 256, 2 * 4 * 128),
}


def _run(kernel, x0, ws0, counts, g):  # noqa: ANN001, ANN202
    x = x0.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in ws0]
    start = time.perf_counter()
    out = kernel(x, *ws, counts)
    out.backward(g)
    return time.perf_counter() - start, [out.detach(), x.grad, *(w.grad for w in ws)]


def main(repeats: int = 15) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}; CPU grouped GEMM dtypes: {sorted(str(d) for d in cpu_grouped_mm_dtypes())}")
    for name, (n_exp, dim, hidden, copies) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            if dtype not in cpu_grouped_mm_dtypes():
                print(f"{name:12s} {str(dtype):15s} no CPU grouped GEMM in this torch")
                continue
            counts = torch.bincount(torch.randint(0, n_exp, (copies,)), minlength=n_exp)
            x0, g = torch.randn(copies, dim, dtype=dtype), torch.randn(copies, dim, dtype=dtype)
            ws0 = [0.05 * torch.randn(n_exp, *s, dtype=dtype) for s in ((hidden, dim), (dim, hidden), (hidden, dim))]
            times: dict = {"loop": [], "grouped": []}
            for _ in range(repeats):
                for key, kernel in (("loop", _looped), ("grouped", _grouped)):
                    times[key].append(_run(kernel, x0, ws0, counts, g)[0])
            (_, a), (_, b) = _run(_looped, x0, ws0, counts, g), _run(_grouped, x0, ws0, counts, g)
            diff = max(
                float((p.float() - q.float()).abs().max() / q.float().abs().max()) for p, q in zip(a, b, strict=True)
            )
            loop, grouped = statistics.median(times["loop"]), statistics.median(times["grouped"])
            print(
                f"{name:12s} {str(dtype):15s} loop {loop * 1e3:8.3f} ms  grouped {grouped * 1e3:8.3f} ms  "
                f"grouped/loop {grouped / loop:5.2f}  max rel diff (out, dx, dw1-3) {diff:.1e}"
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
