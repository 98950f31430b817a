"""The coordinator role: owns the run (dataset, loop, advantages, logs) and holds no GPU."""
