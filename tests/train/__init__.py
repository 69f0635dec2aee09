"""Training jobs (train/): data, checkpoints and formats, the loop, evaluation, reports and errors."""
