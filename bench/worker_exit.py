"""How long a failed worker takes to exit after its exception: the interpreter's own exit (before) vs
dtlaunch.train.main.exit_failed (after), alternated, on the real worker module with every worker import
loaded. The failure: `main()` without $DTLAUNCH_RUN_DIR (a KeyError before any run directory is touched).

    python bench/worker_exit.py [rounds]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

PRE = "import sys, time\nimport dtlaunch.train.main as m\nsys.stderr.write(f'RAISED {time.time()}\\n')\n"
CODE = {
    "before (interpreter exit)": PRE + "m.main()\n",
    "after (exit_failed)": PRE + "try:\n    m.main()\nexcept BaseException:\n    m.exit_failed()\n",
}


def exit_seconds(code: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "DTLAUNCH_RUN_DIR"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    ended = time.time()
    assert proc.returncode == 1 and "KeyError" in proc.stderr, (proc.returncode, proc.stderr[-500:])
    raised = next(float(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("RAISED "))
    return ended - raised


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    times: dict[str, list[float]] = {name: [] for name in CODE}
    for _ in range(rounds):
        for name, code in CODE.items():
            times[name].append(exit_seconds(code))
    for name, xs in times.items():
        print(f"{name}: median {statistics.median(xs):.2f} s after the raise ({', '.join(f'{x:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
