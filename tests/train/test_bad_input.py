"""Bad data rows and config values of the wrong type are one line naming where and what (``train/data/bad_rows.py``,
``model.cli.check_types``): a malformed JSON line, bytes that are not UTF-8, a missing field, a value of the wrong
type, in JSON Lines, JSON, CSV and Parquet files, map-style or streaming; and a config value of the wrong type,
inside lists and mappings and in every value of a sweep. The line numbers expected are those of the lines each
test writes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.cli import ConfigTypeError, compose_checked
from train.data.loader import DataConfig, build_documents

REPO = Path(__file__).resolve().parents[2]
GOOD = [{"text": f"document {i} " * 8} for i in range(12)]


def jsonl(path: Path, rows: list, bad_line: int | None = None, bad: bytes = b"", blank: bool = True) -> Path:
    """``rows`` as JSON Lines, with a blank line after the third (``blank``) and ``bad`` as line ``bad_line``
    (1-based)."""
    lines = [json.dumps(r).encode() for r in rows]
    if blank:
        lines.insert(3, b"")
    if bad_line is not None:
        lines.insert(bad_line - 1, bad)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def documents(path, **settings):
    return build_documents(DataConfig(**{"source": "hf", "path": str(path), "heldout_fraction": 0.2, **settings}))


@pytest.mark.parametrize("bad, message", [
    (b'{"text": "cut off', "not valid JSON at column 10 (unterminated string) — fix or remove that line"),
    (b'{"text": "caf\xe9"}', "'text' is not UTF-8 (byte 0xe9) — save the file as UTF-8, or fix that row"),
    (b'{"body": "no text"}', "no 'text' (missing or null) — fix or remove that row"),
    (b'{"text": 5}', "'text' is int 5, where line 1 has a str — give a field one type in every row: fix or remove "
                     "that line"),  # Arrow cannot read the file
    (b'["a", "list"]', "a JSON list where a row (a JSON object) belongs — fix or remove that line"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, bad, message):
    path = jsonl(tmp_path / "notes.jsonl", GOOD, bad_line=9, bad=bad)
    with pytest.raises(ValueError) as refused:
        documents(path)
    assert str(refused.value) == f"{path}, line 9: {message}"


def test_rows_of_several_files_and_of_conversations(tmp_path):
    """The second file's row is named by its own line; a conversation's message by its number."""
    jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "yo"}]}] * 5)
    second = jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "yo"}]}] * 5, bad_line=3,
                   bad=json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}).encode())
    with pytest.raises(ValueError) as refused:
        documents(tmp_path)
    assert str(refused.value) == f"{second}, line 3: message 2 of 'messages' has no 'content' — fix or remove that row"


def test_csv_parquet_and_json_array_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "table.csv"
    table.write_text("text,n\n" + "".join(f"row {i},{i}\n" for i in range(6)) + ",7\n")  # an empty text on line 8
    with pytest.raises(ValueError, match=rf"^{table}, line 8: no 'text' \(missing or null\)"):
        documents(table)
    parquet = tmp_path / "p" / "rows.parquet"
    parquet.parent.mkdir()
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), parquet)
    with pytest.raises(ValueError, match=rf"^{parquet}, row 3: no 'text'"):
        documents(parquet.parent)
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(GOOD[:4] + [{"text": ["not", "text"]}], indent=1))
    with pytest.raises(ValueError, match=rf"^{array}, row 5: 'text' is list \['not', 'text'\], not a string"):
        documents(array)


def test_streaming_rows_are_checked_as_they_stream(tmp_path):
    path = jsonl(tmp_path / "notes.jsonl", GOOD + [{"text": None}])  # Arrow reads a null; the check refuses it
    texts = documents(path, streaming=True, heldout_fraction=0.0).texts(0, 0)
    with pytest.raises(ValueError, match=r"^a row of dataset .* stream\): no 'text' \(missing or null\) — fix or"):
        list(texts)


def test_good_files_pass(tmp_path):
    docs = documents(jsonl(tmp_path / "notes.jsonl", GOOD))
    assert sorted(docs.texts(0, 0)) and docs.format == "text"


@pytest.mark.parametrize("overrides, message", [
    (["train.betas=[0.9,x]"], "train.betas=[0.9,'x'] has element 2 'x', text — give a list of numbers"),
    (["train.eval.probe_lens=5"], "train.eval.probe_lens=5 is a whole number — give a list of whole numbers, e.g. "
                                  "train.eval.probe_lens=[5]"),
    (["layout.kv_source_layer_ids=[2,a]"], "layout.kv_source_layer_ids=[2,'a'] has element 2 'a', text — give a "
                                           "list of whole numbers"),
    (["model.dim=12.5"], "model.dim=12.5 is a number — give a whole number"),
    (["train.progress=maybe"], "train.progress='maybe' is text — give true or false"),
    (["parallel.keep_attention_layers=[1,x]"], "parallel.keep_attention_layers=[1,'x'] has element 2 'x', text — "
                                               "give a whole number or a list of them"),
    (["data=synthetic", "data.synthetic.tasks={mqar:x}"], "data.synthetic.tasks={mqar: 'x'} has mqar: 'x', which is "
                                                          "text — give a number"),
    (["train.lr=0.1,fast"], "train.lr='fast' is text — give a number"),  # the second value of a sweep
])
def test_config_values_of_the_wrong_type(overrides, message):
    with pytest.raises(ConfigTypeError) as refused:
        compose_checked(overrides)
    assert str(refused.value) == message


def test_right_types_interpolations_and_nulls_pass():
    cfg = compose_checked(["train.eval.probe_lens=[${data.seq_len},512]", "parallel.keep_attention_layers=2",
                           "train.lr=1", "train.stop_at=null", "train.resume=auto", "train.seed=3"])
    assert cfg.train.eval.probe_lens == [256, 512] and cfg.train.lr == 1


def _train(tmp_path, *overrides):
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HYDRA_FULL_ERROR"}}
    return subprocess.run([sys.executable, "-m", "train", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


@pytest.mark.parametrize("case", ["malformed", "wrong type", "config"])
def test_train_refuses_with_one_line(tmp_path, case):
    path = tmp_path / "notes.jsonl"
    if case == "config":
        overrides = ["train.eval.probe_lens=[128,long]"]
        line = "error: train.eval.probe_lens=[128,'long'] has element 2 'long', text — give a list of whole numbers"
    else:
        bad = b'{"text": "cut off' if case == "malformed" else b'{"text": 5}'
        jsonl(path, GOOD, bad_line=9, bad=bad, blank=False)  # without a blank line Arrow reads the int
        overrides = ["data=hf", f"data.path={path}"]
        line = f"error: {path}, line 9: " + ("not valid JSON at column 10 (unterminated string) — fix or remove "
                                             "that line" if case == "malformed" else
                                             "'text' is int 5, not a string — fix or remove that row")
    done = _train(tmp_path, *overrides)
    assert done.returncode == 2 and done.stderr == line + "\n", done.stderr[-3000:]
    assert not (tmp_path / "run").exists()
