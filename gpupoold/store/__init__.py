"""gpupoold's records in SQLite: tokens, lease history, audit log, drained and quarantined GPUs."""
