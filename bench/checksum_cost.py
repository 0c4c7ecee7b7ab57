"""Cost of checkpoint checksums: a DCP save through dtlaunch's hashing writer vs the same save through
torch's plain FileSystemWriter, alternating, one process, a ~110M-parameter fp32 state plus AdamW-sized
state (3 x the parameters), written to --out. Prints the median save times and the overhead in %.

    python bench/checksum_cost.py [--params 110e6] [--repeats 5] [--out /tmp/ckpt-checksum-bench]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
import warnings
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=110e6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="/tmp/ckpt-checksum-bench")
    ap.add_argument("--algorithm", default="", help="crc32 or xxh3_128 (default: the one dtlaunch picks)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    from dtlaunch.run import checksums
    from dtlaunch.train.checkpoint.manager import _SlowWriter

    if args.algorithm:
        checksums.default_algorithm = lambda: args.algorithm  # type: ignore[assignment]
    n = int(args.params) // 16
    # 16 tensors per kind: weights, two Adam moments, one more fp32 copy (like master weights): 4 x params.
    state = {f"{kind}.{i}": torch.randn(n) for kind in ("model", "exp_avg", "exp_avg_sq", "extra") for i in range(16)}
    total = sum(t.numel() * t.element_size() for t in state.values())
    out = Path(args.out)
    times: dict[str, list[float]] = {"plain": [], "checksummed": []}
    for r in range(args.repeats + 1):  # the first round warms the page cache and allocator
        for mode in ("plain", "checksummed"):
            d = out / mode
            shutil.rmtree(d, ignore_errors=True)
            writer = dcp.FileSystemWriter(str(d)) if mode == "plain" else _SlowWriter(str(d), 0.0)
            t = time.perf_counter()
            dcp.save(state, storage_writer=writer, no_dist=True)
            if r:
                times[mode].append(time.perf_counter() - t)
    plain, summed = statistics.median(times["plain"]), statistics.median(times["checksummed"])
    algo = checksums.default_algorithm()
    print(
        f"save of {total / 2**20:.0f} MiB: plain {plain:.3f} s, checksummed ({algo}) {summed:.3f} s "
        f"-> checksum overhead {100 * (summed - plain) / plain:+.1f} % (median of {args.repeats})"
    )
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
