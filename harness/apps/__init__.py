"""What a user runs: the command line's commands, sweeps, the gradient lab, claims, bench, docs, soak."""
