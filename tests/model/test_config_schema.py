"""The schema of ``conf/`` (``model/config.py``, issue 52) and the range of every number in it (issue 57).

- Every key written in a ``conf/`` YAML file has a typed field, and every field has a value written in one: a setting
  added on one side only fails here, named.
- Every field is documented; every number (and list or mapping of numbers) declares its range.
- Every number given a value outside its range, one setting at a time (the cases are generated from the schema, so
  a new field is walked as soon as it exists), is refused by the preflight's resolution in one line that names the
  setting and what to set, before anything is built; ``python -m train`` prints that line alone and exits 2.
"""
import math
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from omegaconf import OmegaConf

from model.cli import CONF_DIR, USAGE_ERROR, compose, error_line
from model.config import JobConfig
from train.run.preflight import planned

REPO = Path(__file__).resolve().parents[2]
NUMBERS = (int, float)


def schema_settings(cls=JobConfig, prefix: str = "") -> dict[str, tuple[object, dict]]:
    """Every setting of the schema: its dotted key -> (annotation, field metadata), nested groups walked."""
    found = {}
    types = get_type_hints(cls)
    for spec in fields(cls):
        key, kind = f"{prefix}{spec.name}", types[spec.name]
        found.update(schema_settings(kind, f"{key}.") if is_dataclass(kind) else {key: (kind, spec.metadata)})
    return found


SETTINGS = schema_settings()


def yaml_settings() -> dict[str, set[str]]:
    """Every key set in a ``conf/`` group file (its defaults list left out) -> the files that set it. A file of group
    ``g`` sets ``g.<key>``; one marked ``# @package _global_`` (``data=synthetic``) sets the keys as written. A
    mapping is walked down to the schema's settings (a setting may itself be a mapping: ``data.synthetic.tasks``)."""
    found: dict[str, set[str]] = {}

    def walk(node, prefix: str, where: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and path not in SETTINGS:
                walk(value, f"{path}.", where)
            else:
                found.setdefault(path, set()).add(where)
    for path in sorted(CONF_DIR.glob("*/*.yaml")):
        text = path.read_text()
        node = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k != "defaults"}
        walk(node, "" if "# @package _global_" in text else f"{path.parent.name}.", str(path.relative_to(REPO)))
    return found


def test_every_key_in_conf_has_a_typed_field():
    untyped = {key: sorted(files) for key, files in yaml_settings().items() if key not in SETTINGS}
    assert not untyped, f"keys in conf/ without a field in model/config.py's schema: {untyped}"


def test_every_typed_field_has_a_value_in_conf():
    unset = sorted(set(SETTINGS) - set(yaml_settings()))
    assert not unset, f"fields of model/config.py's schema set in no conf/ file: {unset}"


def test_every_field_is_documented():
    def undocumented(cls, prefix=""):
        types = get_type_hints(cls)
        for spec in fields(cls):
            if not spec.metadata.get("doc"):
                yield f"{prefix}{spec.name}"
            if is_dataclass(types[spec.name]):
                yield from undocumented(types[spec.name], f"{prefix}{spec.name}.")
    assert not list(undocumented(JobConfig))


def numeric(kind, metadata: dict) -> bool:
    """A number, a list of numbers or a mapping to numbers (``None`` allowed or not)."""
    if metadata.get("one_or_list"):
        return True
    options = [a for a in get_args(kind) if a is not type(None)] if get_origin(kind) is not None and \
        get_origin(kind) not in (list, tuple, dict) else [kind]
    for option in options:
        inner = [a for a in get_args(option) if a is not Ellipsis][-1:] if get_origin(option) in (list, tuple, dict) \
            else (option,)
        if any(t in NUMBERS for t in inner):
            return True
    return False


NUMERIC = sorted(key for key, (kind, metadata) in SETTINGS.items() if numeric(kind, metadata) and
                 kind is not bool)


def test_every_number_declares_its_range():
    assert len(NUMERIC) > 90  # the walk below sees the schema
    assert [key for key in NUMERIC if "range" not in SETTINGS[key][1]] == []


def outside(key: str):
    """A value of ``key`` just outside its declared range, in the form its field takes."""
    kind, metadata = SETTINGS[key]
    allowed = metadata["range"]
    whole = metadata.get("one_or_list") or int in (get_args(kind) or (kind,)) or \
        any(int in get_args(a) for a in get_args(kind))
    step = 1 if whole else 0.5
    if allowed.low is not None:
        bad = allowed.low if allowed.low_open else allowed.low - step
    else:
        bad = allowed.high if allowed.high_open else allowed.high + step
    bad = int(bad) if whole else float(bad)
    origin = get_origin(kind) if get_origin(kind) in (list, tuple, dict) else \
        next((get_origin(a) for a in get_args(kind) if get_origin(a) in (list, tuple, dict)), None)
    if origin is dict:
        return {"mqar": bad}
    return [bad] if origin in (list, tuple) else bad


@pytest.fixture(scope="module")
def defaults():
    return compose(["model=v41_mini", "data=synthetic"])  # every part on: each group's settings are read


@pytest.mark.parametrize("key", NUMERIC)
def test_a_number_out_of_range_is_one_line_naming_it(key, defaults):
    """In process, as the preflight resolves the config: a ValueError whose line names the setting and the range to
    set; nothing after the resolution runs (planting a range-free field, or a check that skips list elements or
    mappings, fails here)."""
    kept = OmegaConf.select(defaults, key)
    kept = OmegaConf.to_container(kept) if OmegaConf.is_config(kept) else kept
    OmegaConf.update(defaults, key, outside(key), merge=False)
    try:
        with pytest.raises(ValueError) as refused:
            planned(defaults, world_size=1)
    finally:  # the next case starts from the defaults again (cheaper than a copy per case)
        OmegaConf.update(defaults, key, kept, merge=False)
    line = error_line(refused.value)
    assert line.startswith(f"error: {key}=") and " — set " in line and "\n" not in line, line
    assert str(SETTINGS[key][1]["range"]) in line, line


@pytest.mark.parametrize("overrides, line", [
    (["data.seq_len=0"], "error: data.seq_len=0 is out of range — set a whole number >= 1"),
    (["data.seq_len=-4"], "error: data.seq_len=-4 is out of range — set a whole number >= 1"),
    (["data.seq_len=1"], "error: data.seq_len=1 holds no compressed entry of the layout's ratio 2 — set "
                         "data.seq_len>=2"),
    (["train.warmup_steps=-1"], "error: train.warmup_steps=-1 is out of range — set a whole number >= 0"),
    (["train.lr=-1"], "error: train.lr=-1 is out of range — set a number >= 0"),
    (["train.betas=[0.9,1.5]"], "error: train.betas=[0.9,1.5] has element 2 = 1.5, out of range — set each to a "
                                "number in [0, 1)"),
])
def test_the_values_of_issue_57_are_refused_in_one_line(overrides, line):
    with pytest.raises(ValueError) as refused:
        planned(compose(overrides), world_size=1)
    assert error_line(refused.value) == line


def test_train_prints_the_line_alone_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "train", "train.betas=[0.9,1.5]", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == USAGE_ERROR and done.stdout == "", done.stdout + done.stderr
    assert done.stderr == "error: train.betas=[0.9,1.5] has element 2 = 1.5, out of range — set each to a number in " \
                          "[0, 1)\n", done.stderr
    assert not (tmp_path / "run").exists()


def test_a_nan_is_out_of_every_range():
    with pytest.raises(ValueError, match="train.lr=nan is out of range"):
        planned(compose(["train.lr=nan"]), world_size=1)


def test_any_is_only_a_number_or_a_list_of_them():
    """``Any`` is how a field says "a whole number or a list of them" (OmegaConf has no such union): no other use."""
    loose = [key for key, (kind, metadata) in SETTINGS.items() if kind is Any and not metadata.get("one_or_list")]
    assert loose == []
