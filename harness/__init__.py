"""The shared RLVR loop: tasks, models, rollouts and training."""
