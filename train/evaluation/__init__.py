"""Evaluation: held-out loss, the synthetic tasks' accuracies and the long-context probes."""
