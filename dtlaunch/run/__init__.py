"""What the launcher and the workers share about a run, without torch: environment names, the
checkpoint catalog and its checksums, the preemption marker and signals, the metrics file, phase lines.

The launcher side (commands/, launch/, convert/, plan/) imports these and never `dtlaunch.train`, which
only the workers load (and the planner's trace, through `dtlaunch.train.runtime`).
"""
