"""Config composition and error reporting for the command-line tools (same `conf/` tree and override syntax as
training): ``compose`` builds the config an override list gives, ``compose_checked`` also refuses keys the
config does not have (with the nearest valid names), and ``error_line`` turns a bad-input exception into the one
line every tool prints: ``error: <what> — <what to do>``, exit status ``USAGE_ERROR``.
"""
import difflib
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
USAGE_ERROR = 2  # exit status of a bad config, override or input (the shell convention for misuse)


class UnknownKeyError(ValueError):
    """An override names a key the config does not have."""

    def __init__(self, key: str, known: list[str]):
        scores = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in known), reverse=True)
        close = [k for score, k in scores[:3] if score >= max(0.6, scores[0][0] - 0.1)] if scores else []
        hint = f"did you mean {' or '.join(close)}?" if close else "`python -m train --cfg job` lists every key"
        super().__init__(f"unknown config key {key} — {hint}")


def compose(overrides: list[str]) -> DictConfig:
    """The config that ``python -m train <overrides>`` would see, without starting a run."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def compose_checked(overrides: list[str]) -> DictConfig:
    """``compose``, refusing unknown keys: the ones Hydra cannot override, and the ones ``+key=``/``++key=`` would
    add (accepted by Hydra and then read by nothing). ``hydra.*`` overrides are left to Hydra; of a sweep
    (``key=a,b``) the first value is composed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException

    parsed = [o for o in OverridesParser.create().parse_overrides(list(overrides))
              if not o.key_or_group.startswith("hydra.") and o.key_or_group != "hydra"]
    single = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
              else o.input_line for o in parsed]
    adds = [o.key_or_group for o in parsed if o.is_add() or o.is_force_add()]
    base = [line for o, line in zip(parsed, single) if not (o.is_add() or o.is_force_add())]
    try:
        cfg = compose(base)
    except ConfigCompositionException as error:
        key = re.match(r"Could not override '([^']+)'", str(error))
        if key is None:
            raise
        choices = [line for o, line in zip(parsed, single) if "." not in o.key_or_group  # group selections
                   and not (o.is_add() or o.is_force_add())]
        raise UnknownKeyError(key.group(1), config_keys(_compose_or_default(choices))) from None
    known = config_keys(cfg)
    for key in adds:
        if key not in known:
            raise UnknownKeyError(key, known)
    return compose(single)


def _compose_or_default(overrides: list[str]) -> DictConfig:
    try:
        return compose(overrides)
    except Exception:  # a bad group choice as well: suggest from the defaults
        return compose([])


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
