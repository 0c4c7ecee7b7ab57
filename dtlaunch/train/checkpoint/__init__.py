"""Sharded DCP checkpoints of the worker: the manager, the Stateful containers, write-time checksums."""
