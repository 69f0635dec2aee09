"""What every benchmark result file carries besides its numbers: the command, the machine and the date."""
import sys
import time


def result_meta() -> dict:
    import torch

    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"command": "python " + " ".join(sys.argv), "machine": machine, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
