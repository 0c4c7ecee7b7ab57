"""How long one compose of a job takes in-process, against Hydra's own `hydra.compose` in the same process.

dtlaunch composes a job once per command (the launcher; workers read the resolved file) and the test suite
composes thousands. `dtlaunch.job.compose.compose` runs Hydra 1.3's compose steps without the `hydra` node
(Hydra's own settings, which compose built and dtlaunch deleted) and without Hydra's deep copy of its config
repository. This times, alternating, round after round:

- `compose`: dtlaunch's whole compose (search directory, Hydra, typing into the schema, checks);
- `hydra.compose`: Hydra's public compose of the same job in the same search directory, with its node
  (what the Hydra step cost before), and the lean Hydra step alone (`_compose_without_hydra_node`).

    python bench/compose_time.py [--reps 20] [-- overrides...]   (default: recipe=tiny_ddp)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = args.overrides or ["recipe=tiny_ddp"]

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import dtlaunch.job.compose as c
    from dtlaunch.job.model_schema import register_schemas

    c.compose(overrides)  # imports, resolvers, the schema's node: paid once per process
    register_schemas()
    rest, recipe_file, recipe_name = c._split_recipe(list(overrides), c.list_recipes(()))
    if recipe_file is not None:
        rest.append(f"recipe={recipe_name}")
    times: dict[str, list[float]] = {"compose": [], "hydra.compose": [], "lean Hydra step": []}
    with tempfile.TemporaryDirectory() as tmp:
        c._build_search_dir(Path(tmp), recipe_file, recipe_name)
        for _ in range(args.reps):
            times["compose"] += _timed(lambda: c.compose(overrides), 1)
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=tmp, version_base="1.3", job_name="dtlaunch"):
                times["hydra.compose"] += _timed(
                    lambda: hydra_compose(config_name="job", overrides=rest, return_hydra_config=True), 1
                )
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=tmp, version_base="1.3", job_name="dtlaunch"):
                times["lean Hydra step"] += _timed(lambda: c._compose_without_hydra_node(rest), 1)
            GlobalHydra.instance().clear()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"`{' '.join(overrides)}`, {args.reps} rounds, medians (min-max) in ms")
    for k, v in times.items():
        print(f"  {k:16s} {med[k]:7.1f}  ({min(v) * 1000:.1f}-{max(v) * 1000:.1f})")
    print(f"  Hydra step: hydra.compose / lean = {med['hydra.compose'] / med['lean Hydra step']:.2f}x")


if __name__ == "__main__":
    main()
