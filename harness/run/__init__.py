"""The run's description and its files: the config schema and its checks, names, records, locks, trackers, seeds,
threads. Nothing here imports a model, a task or the loop."""
