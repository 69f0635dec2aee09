"""What every benchmark result file carries besides its numbers: the command, the machine, the date and the code."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def code_version() -> str | None:
    """``CSA2_CODE`` if set, else the checkout's commit. Set it on the GPU machine: its copy of the tree may carry a
    stale .git (2026-12-01: files measured at a later commit said ``a76f82a-dirty``, the session's first)."""
    if os.environ.get("CSA2_CODE"):
        return os.environ["CSA2_CODE"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def result_meta() -> dict:
    """The command as typed (the value of $OUT written back as ``$OUT``, so that the file can be committed as it
    comes back), the device, torch and Triton versions, the date and the code version."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    command = "python " + " ".join(sys.argv)
    if os.environ.get("OUT"):
        command = command.replace(os.environ["OUT"].rstrip("/"), "$OUT")
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"command": command, "machine": machine, "torch": torch.__version__, "triton": triton_version,
            "date": time.strftime("%Y-%m-%d"), "code": code_version()}


def write_result(path: Path, result: dict) -> None:
    """``result`` as indented JSON at ``path``, atomically (a temporary file renamed over it): a call cut while a
    benchmark rewrites its file after each run keeps the previous whole file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)
