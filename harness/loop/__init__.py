"""The loop: one step's batch, the update, the evaluation, the native loop, the TRL backend, the run setup."""
