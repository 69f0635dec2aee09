"""Random draws that depend on a tensor's name, not on what else a process builds: the model's initial values
(``model/transformer.py``) and the LoRA adapters' (``model/lora.py``) both draw from these generators."""
import zlib

import torch


def seeded_generator(seed: int, key: str, device: torch.device) -> torch.Generator:
    """The generator of the tensor named ``key``: seeded by (seed, name) alone, whatever else a process builds."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
