"""The per-lease worker processes: starting, following, adopting and stopping them (supervisor.py),
their processes (process.py) and what they leave under state_dir/workers (state_dir.py)."""
