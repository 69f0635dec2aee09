"""Pipeline, data, expert and context parallelism (parallel/): multi-process runs equal one process."""
