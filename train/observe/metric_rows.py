"""Reading ``metrics.jsonl`` back: its rows, and one key's series of them. Below both the logger that writes the
file (``train/observe/metrics.py``) and the health plots that read it (``train/observe/health.py``)."""
import json
import math
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series_of(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have ``key``; null (a skipped step) becomes NaN, a gap in a line."""
    return [r["step"] for r in rows if key in r], [math.nan if r[key] is None else r[key] for r in rows if key in r]
