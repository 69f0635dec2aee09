"""Config composition and error reporting for the command-line tools (same `conf/` tree and override syntax as
training): ``compose`` builds the config an override list gives, ``compose_checked`` also refuses keys the
config does not have (with the nearest valid names), values of another type than the schema's
(``model/config.py``) and values out of their range, ``resolved`` turns a composed config into the schema's
objects, and ``error_line`` turns a bad-input exception into the one line every tool prints:
``error: <what> — <what to do>``, exit status ``USAGE_ERROR``.
"""
import difflib
import re
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

from omegaconf import DictConfig, OmegaConf

from model.config import JobConfig, SettingError, build, schema_field

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
USAGE_ERROR = 2  # exit status of a bad config, override or input (the shell convention for misuse)


class UnknownKeyError(ValueError):
    """An override names a key the config does not have."""

    def __init__(self, key: str, known: list[str]):
        scores = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in known), reverse=True)
        close = [k for score, k in scores[:3] if score >= max(0.6, scores[0][0] - 0.1)] if scores else []
        hint = f"did you mean {' or '.join(close)}?" if close else "`python -m train --cfg job` lists every key"
        super().__init__(f"unknown config key {key} — {hint}")


def register_schema() -> None:
    """``JobConfig`` as Hydra's ``schema`` config, the first entry of ``conf/config.yaml``'s defaults, so that
    OmegaConf checks every value's type, and refuses a key the schema does not have, while Hydra composes.

    The node is made group by group and left writable: a frozen dataclass (the args classes are frozen) makes
    read-only nodes, into which Hydra could not merge the presets."""
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.structured(JobConfig)
    for group in fields(JobConfig):
        node[group.name] = OmegaConf.structured(group.type)
    _writable(node)
    ConfigStore.instance().store(name="schema", node=node)


def _writable(node: DictConfig) -> None:
    OmegaConf.set_readonly(node, False)
    for key in node:
        if not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
            _writable(node[key])


register_schema()  # on import: every composition of conf/ (here, python -m train's, a test's) needs it


def compose(overrides: list[str]) -> DictConfig:
    """The config that ``python -m train <overrides>`` would see, without starting a run."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def compose_checked(overrides: list[str]) -> DictConfig:
    """``compose``, refusing unknown keys (the ones Hydra cannot override, and the ones ``+key=``/``++key=`` would
    add, accepted by Hydra and then read by nothing) and values of the wrong type (``check_types``), every value
    of a sweep included. ``hydra.*`` overrides are left to Hydra; of a sweep (``key=a,b``) the first value is
    composed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException

    parsed = [o for o in OverridesParser.create().parse_overrides(list(overrides))
              if not o.key_or_group.startswith("hydra.") and o.key_or_group != "hydra"]
    single = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
              else o.input_line for o in parsed]
    choices = [line for o, line in zip(parsed, single) if "." not in o.key_or_group  # group selections
               and not (o.is_add() or o.is_force_add())]
    defaults = compose(choices)
    known = config_keys(defaults)
    values = [o for o in parsed if "." in o.key_or_group or o.is_add() or o.is_force_add()]
    for o in values:
        if o.key_or_group not in known:
            raise UnknownKeyError(o.key_or_group, known)
    check_types(values, defaults)
    try:
        cfg = compose(single)
    except ConfigCompositionException as error:  # a key Hydra refuses although the defaults have it
        key = re.match(r"Could not override '([^']+)'", str(error))
        if key is None:
            raise
        raise UnknownKeyError(key.group(1), known) from None
    return cfg


def job_config(overrides: list[str]) -> JobConfig:
    """The schema's objects of the config ``overrides`` give (``compose_checked``, then ``resolved``): what the
    command-line tools read."""
    return resolved(compose_checked(overrides))


_NAMES = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "text",
          "list[int]": "a list of whole numbers", "list[float]": "a list of numbers", "list[str]": "a list of texts",
          "list[bool]": "a list of true/false", "list": "a list", "mapping": "a mapping"}


class ConfigTypeError(ValueError):
    """An override whose value has the wrong type for its key."""


def check_types(overrides, defaults: DictConfig) -> None:
    """Every value of every (parsed) override has the type the schema (``model/config.py``) declares for its key:
    a bool for a bool, a whole number for an int, a number for a float, text for a string, a list of such for a
    list (element by element), a mapping for a group (key by key), null only where the field is optional.
    ``defaults`` (the composed config) gives the examples in the messages. An interpolation (``${...}``) is
    resolved later and not checked here."""
    plain = OmegaConf.to_container(defaults, resolve=False)
    for override in overrides:
        if override.is_delete():
            continue
        key = override.key_or_group
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            problem = _type_problem(key, value, _default(plain, key))
            if problem:
                raise ConfigTypeError(f"{key}={_shown(value)} {problem}")


def resolved(cfg: DictConfig) -> JobConfig:
    """The composed config as the schema's objects (``JobConfig``), every value checked against its field's range
    and choices (``model.config.build``), before anything is built from it; a value still missing (``???``) is an
    error naming the setting."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        found = schema_field(missing[0])
        hint = f" ({found[0].metadata['doc']})" if found is not None else ""
        raise SettingError(f"{missing[0]} has no value — set {missing[0]}=<value>{hint}")
    return build(JobConfig, OmegaConf.to_container(cfg, resolve=True), "")


def _default(plain: dict, key: str):
    node = plain
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _kind(annotation) -> str | type | None:
    """What a value of ``annotation`` must be: a name of ``_NAMES``, a schema dataclass (a mapping of its fields),
    or None (anything)."""
    if get_origin(annotation) in (Union, UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return _kind(kinds[0]) if len(kinds) == 1 else None
    if get_origin(annotation) in (list, tuple):
        element = _kind(get_args(annotation)[0])
        return f"list[{element}]" if isinstance(element, str) and not element.startswith("list") else "list"
    if get_origin(annotation) is dict:
        return "mapping"
    if is_dataclass(annotation):
        return annotation
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(annotation)


def _optional(annotation) -> bool:
    return annotation is Any or type(None) in get_args(annotation)


def _type_problem(key: str, value, default, cls=JobConfig) -> str | None:
    """What is wrong with ``value`` for ``key`` (a dotted path under ``cls``), as ``is <what> — give <what>``;
    None when nothing is (or the schema does not know the key: the unknown-key check names it)."""
    found = schema_field(key, cls)
    if found is None or _interpolated(value):
        return None
    spec, annotation = found
    if value is None:
        return None if _optional(annotation) else f"is null — give {_wanted(annotation, spec)}"
    if spec.metadata.get("one_or_list"):
        fix = "give a whole number or a list of them"
        if isinstance(value, list):
            return _element_problem(value, "int", fix)
        return None if _is(value, "int") else f"is {_described(value)} — {fix}"
    kind = _kind(annotation)
    if kind is None:
        return None
    if is_dataclass(kind) or kind == "mapping":
        if not isinstance(value, dict):
            example = f", e.g. {key}={_shown(default)}" if isinstance(default, dict) else ""
            return f"is {_described(value)} — give a mapping{example}"
        if kind == "mapping":
            element = _kind(get_args(annotation)[1])
            wrong = [(name, item) for name, item in value.items() if not _interpolated(item) and not _is(item, element)]
            return f"has {wrong[0][0]}: {_shown(wrong[0][1])}, which is {_described(wrong[0][1])} — give " \
                   f"{_NAMES[element]}" if wrong else None
        for name, item in value.items():
            problem = _type_problem(name, item, (default or {}).get(name), kind)
            if problem:
                return f"has {name}: {_shown(item)}, which {problem}"
        return None
    if kind.startswith("list"):
        element = kind[5:-1] if kind != "list" else None
        if not isinstance(value, list):
            example = f"[{_shown(value)}]" if element and _is(value, element) else _shown(default or [1, 2])
            return f"is {_described(value)} — give {_NAMES[kind]}, e.g. {key}={example}"
        return _element_problem(value, element, f"give {_NAMES[kind]}") if element else None
    if _is(value, kind):
        return None
    hint = f" (quote a value that reads as a number: '{key}=\"{value}\"')" if kind == "str" and \
        isinstance(value, (int, float)) else ""
    return f"is {_described(value)} — give {_NAMES[kind]}{hint}"


def _wanted(annotation, spec) -> str:
    if spec.metadata.get("one_or_list"):
        return "a whole number or a list of them"
    kind = _kind(annotation)
    return "a mapping" if kind is None or not isinstance(kind, str) else _NAMES[kind]


def _element_problem(values: list, kind: str, fix: str) -> str | None:
    for i, item in enumerate(values):
        if not _interpolated(item) and not _is(item, kind):
            return f"has element {i + 1} {_shown(item)}, {_described(item)} — {fix}"
    return None


def _interpolated(value) -> bool:
    """An interpolation (``${...}``), which OmegaConf resolves later: not checked here."""
    return isinstance(value, str) and "${" in value


def _is(value, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    return True


def _described(value) -> str:
    return {bool: "true/false", int: "a whole number", float: "a number", str: "text", list: "a list",
            dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def config_keys(cfg: DictConfig) -> list[str]:
    """Every dotted key of ``cfg``, nodes and leaves (``train``, ``train.eval``, ``train.eval.every``, ...)."""
    keys = []

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            keys.append(name)
            if isinstance(value, dict):
                walk(value, f"{name}.")
    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return keys


def error_line(error: BaseException) -> str:
    """``error: <what> — <what to do>`` on one line, for an exception that reports bad input."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(error).strip()
    if isinstance(error, MissingConfigException):
        missing = re.search(r"Could not find '([^']+)'", text)
        options = re.search(r"Available options in '([^']+)':\s*(.*?)(?:\nConfig search path|$)", text, re.S)
        if missing and options:
            return (f"error: there is no {options.group(1)} config named {missing.group(1).split('/')[-1]!r} — use "
                    f"one of: {', '.join(options.group(2).split())}")
    if isinstance(error, OverrideParseException):
        lines = text.splitlines()
        what = lines[0].replace("Error parsing override", "cannot parse the override")
        if len(lines) > 1 and not lines[1].startswith("See "):
            what += f" ({lines[1]})"
        return f"error: {what} — write overrides as key=value (grammar: hydra.cc/docs/advanced/override_grammar/basic)"
    if isinstance(error, KeyError) and error.args:
        text = str(error.args[0])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = "; ".join(lines) if lines else type(error).__name__
    if " — " not in line:
        line += " — fix the setting or input named above and run again"
    return f"error: {line}"


def run_cli(action) -> None:
    """Run a CLI action; a bad config or override ends with one error line and exit status 2."""
    import sys

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        action()
    except (ValueError, OSError, HydraException, OmegaConfBaseException) as err:
        print(error_line(err), file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
