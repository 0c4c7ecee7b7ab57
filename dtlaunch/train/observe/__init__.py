"""What a run shows of itself: metrics, trackers, measured memory, collective-timeout guards."""
