"""What a run shows: metrics.jsonl and wandb, dashboards, health and routing plots, slow ranks, the console."""
