"""Bad data rows as one line: the file and line (or the row number), and what is wrong with it.

Two moments find them. Reading: ``datasets`` fails on a file it cannot parse (a malformed JSON line, bytes that
are not UTF-8, a CSV quote left open) with an error that names neither the line nor, for JSON, the file;
``unreadable`` re-reads the local files to find the first bad line (only then: a good file costs nothing).
Checking: a row that parses but cannot be a document (a missing or null text, a number where text belongs, a
conversation that is not a list of ``{"role": str, "content": str}`` messages) is found before the split by
``check_rows``, on every row of a map-style dataset (an Arrow check for a plain string column, Python for the
rest), or as it streams by (``row_problem``).

``Rows`` maps a row number of the dataset to where it came from: the line of a JSON Lines or CSV file, the row of
a Parquet or JSON-array file, or the row of a named dataset.
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import datasets

FETCH = 1024  # rows per read when checking in Python


class Rows:
    """Where row ``i`` of a dataset read from ``files`` with ``builder`` (None: a named dataset) came from."""

    def __init__(self, description: str, builder: str | None = None, files: list[str] | None = None):
        self.description, self.builder, self.files = description, builder, files or []
        self._counts: list[int] | None = None

    def __call__(self, row: int) -> str:
        if self.builder not in ("json", "csv", "parquet") or not self.files:
            return f"row {row + 1} of {self.description}"
        if self._counts is None:
            self._counts = [_row_count(self.builder, f) for f in self.files]
        for file, count in zip(self.files, self._counts):
            if row < count:
                return f"{file}, {_place(self.builder, file, row)}"
            row -= count
        return f"row {row + 1} of {self.description}"


def _is_json_array(file: str) -> bool:
    with open(file, "rb") as handle:
        return handle.read(1 << 16).lstrip().startswith(b"[")


def _row_count(builder: str, file: str) -> int:
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    if builder == "csv":
        with open(file, newline="", encoding="utf-8", errors="replace") as handle:
            return max(0, sum(1 for _ in csv.reader(handle)) - 1)
    if _is_json_array(file):
        return len(json.loads(Path(file).read_bytes()))
    with open(file, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def _place(builder: str, file: str, row: int) -> str:
    """Row ``row`` (0-based) of ``file``: its line where lines are rows, else its row number."""
    if builder == "json" and not _is_json_array(file):
        with open(file, "rb") as handle:
            seen = -1
            for number, line in enumerate(handle, 1):
                seen += bool(line.strip())
                if seen == row:
                    return f"line {number}"
    if builder == "csv":
        with open(file, newline="", encoding="utf-8", errors="replace") as handle:
            reader = csv.reader(handle)
            next(reader, None)  # the header
            for index, _ in enumerate(reader):
                if index == row:
                    return f"line {reader.line_num}"
    return f"row {row + 1}"


def unreadable(builder: str, files: list[str], error: Exception) -> str:
    """The line for a local data file ``datasets`` could not read: the first bad line found, else the error's
    own words with the files."""
    for file in files:
        problem = _first_bad_line(builder, file)
        if problem:
            return f"{file}, {problem}"
    cause = error.__cause__ or error
    what = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    where = files[0] if len(files) == 1 else f"one of {len(files)} files under {Path(files[0]).parent}"
    return f"cannot read {where} as {builder}: {what} — fix the file, or set data.path to readable files"


NOT_JSON = "fix or remove that line"


def _first_bad_line(builder: str, file: str) -> str | None:
    """``line N: <what is wrong> — <fix>`` for the first line of a JSON or CSV file that is not UTF-8, or (JSON) not
    one JSON object; None when every line reads."""
    if builder not in ("json", "csv"):
        return None
    if builder == "json" and _is_json_array(file):
        data = Path(file).read_bytes()
        try:
            json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as error:
            line = data[:error.start].count(b"\n") + 1
            return f"line {line}: {_not_utf8(data[error.start])}"
        except json.JSONDecodeError as error:
            return f"line {error.lineno}: {_not_json(error)}"
        return None
    first_type: dict[str, tuple[str, int]] = {}  # a field's type, and the line that set it
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"line {number}, column {error.start + 1}: {_not_utf8(raw[error.start])}"
            if builder != "json" or not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                return f"line {number}: {_not_json(error)}"
            if not isinstance(value, dict):
                return f"line {number}: a JSON {type(value).__name__} where a row (a JSON object) belongs — {NOT_JSON}"
            for key, item in value.items():
                if item is None:
                    continue
                kind, since = first_type.setdefault(key, (type(item).__name__, number))
                if kind != type(item).__name__:  # Arrow needs one type per column
                    return (f"line {number}: {key!r} is {_kind(item)}, where line {since} has a {kind} — give a field "
                            f"one type in every row: {NOT_JSON}")
    return None


def _not_json(error: json.JSONDecodeError) -> str:
    what = re.sub(r"( starting)? at$", "", error.msg)  # "Unterminated string starting at" (a position follows)
    return f"not valid JSON at column {error.colno} ({what[:1].lower() + what[1:]}) — {NOT_JSON}"


def _not_utf8(byte: int) -> str:
    return f"byte {byte:#04x} is not UTF-8 — save the file as UTF-8, or fix that line"


def row_problem(value, kind: str, field: str) -> str | None:
    """What is wrong with one row's ``field`` for a document of ``kind`` (``text`` or ``chat``); None: nothing."""
    if value is None:
        return f"no {field!r} (missing or null)"
    if kind == "text":
        return None if isinstance(value, str) else f"{field!r} is {_kind(value)}, not a string"
    if not isinstance(value, list):
        return f"{field!r} is {_kind(value)}, not a list of {{'role': str, 'content': str}} messages"
    for i, message in enumerate(value, 1):
        if not isinstance(message, dict):
            return f"message {i} of {field!r} is {_kind(message)}, not a {{'role': str, 'content': str}} object"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return (f"message {i} of {field!r} has no {key!r}" if message.get(key) is None else
                        f"message {i} of {field!r}: {key!r} is {_kind(message[key])}, not a string")
    return None


def _kind(value) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def check_rows(dataset: datasets.Dataset, fields: dict[str, str], rows: Rows) -> None:
    """Every row of ``dataset`` has a usable value in each of ``fields`` (column -> ``text`` | ``chat``); the first
    that does not is a ValueError naming where it is (``rows``) and what is wrong."""
    for field, kind in fields.items():
        if kind == "text" and _valid_strings(dataset, field):
            continue
        for start in range(0, len(dataset), FETCH):
            for offset, value in enumerate(_values(dataset, field, start)):
                if isinstance(value, _Undecodable):
                    raise ValueError(f"{rows(start + offset)}: {field!r} is not UTF-8 ({value}) — save the file as "
                                     "UTF-8, or fix that row")
                problem = row_problem(value, kind, field)
                if problem:
                    raise ValueError(f"{rows(start + offset)}: {problem} — fix or remove that row")


def _valid_strings(dataset: datasets.Dataset, field: str) -> bool:
    """Whether ``field`` is an Arrow string column with no null and only valid UTF-8: the check without Python."""
    import pyarrow as pa

    if dataset._indices is not None or not isinstance(dataset.features.get(field), datasets.Value):
        return False
    column = dataset.data.column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)) or column.null_count:
        return False
    try:
        column.validate(full=True)  # checks that every string is UTF-8
    except pa.ArrowInvalid:
        return False
    return True


class _Undecodable(str):
    """A row whose text Arrow holds as bytes that are not UTF-8 (the JSON reader keeps them)."""


def _values(dataset: datasets.Dataset, field: str, start: int) -> list:
    """``field`` of rows ``start..start + FETCH``; a row that cannot be decoded stands as ``_Undecodable``."""
    try:
        return dataset[start:start + FETCH][field]
    except UnicodeDecodeError:
        values = []
        for row in range(start, min(start + FETCH, len(dataset))):
            try:
                values.append(dataset[row][field])
            except UnicodeDecodeError as error:
                values.append(_Undecodable(f"byte {error.object[error.start]:#04x}"))
        return values
