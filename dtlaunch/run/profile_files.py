"""Names the profiler's output shares between the worker that writes it (dtlaunch.train.observe.profiling)
and the launcher and `dtlaunch report` that read it (dtlaunch.report.breakdown): RUN/profile/step-<n>/
rank<r>.json.gz (+ .timing.json, .memory.pickle), RUN/profile/summary.json, and the trace annotations that
mark a step and its data loading."""

PROFILE_DIR = "profile"
SUMMARY_NAME = "summary.json"
STEP_ANNOTATION = "dtlaunch.step"
DATA_ANNOTATION = "dtlaunch.data"
