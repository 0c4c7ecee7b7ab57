"""Environment variables the launcher sets for its workers, and the module torchrun starts."""

WORKER_MODULE = "dtlaunch.train.main"
# The run directory whose config.yaml the workers read.
RUN_DIR_ENV = "DTLAUNCH_RUN_DIR"
# Start from step 0 even if the run directory holds checkpoints (`dtlaunch train --no-resume`).
NO_RESUME_ENV = "DTLAUNCH_NO_RESUME"
# The checkpoint the launcher verified ("<path>\n<marker mtime ns>"), so that rank 0 does not read every
# byte of it a second time.
VERIFIED_ENV = "DTLAUNCH_VERIFIED_CHECKPOINT"
