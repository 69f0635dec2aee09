"""What a run writes and reads back: its checkpoints (atomic, with manifests), the reference and released weight
formats, warm starts (``train.init_from``) and LoRA adapters."""
