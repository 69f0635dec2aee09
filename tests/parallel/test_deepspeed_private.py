"""DeepSpeed's private names are touched in ``parallel/deepspeed_private.py`` only, that file lists every one it
touches, and the installed DeepSpeed is the version they were checked against.

DeepSpeed's private names are read from its own source: every ``_name`` its engine, pipeline and topology classes
and its ``groups`` module define or set on ``self``. Planted bugs each catches: ``module._topo`` put back into
``parallel/engine.py`` (or ``engine._INSTRUCTION_MAP`` into a benchmark), the first test; a private name used in
``deepspeed_private.py`` but missing from ``PRIVATE_NAMES``, or one that a public method covers put back (the
``_get_gradients_for_reduction`` override in place of ``buffered_allreduce_fallback(grads=...)``, listed), the second;
``pyproject.toml`` moved to another DeepSpeed without the file re-checked, the third."""
import pathlib
import re

import deepspeed

from parallel import deepspeed_private

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("runtime/engine.py", "runtime/pipe/engine.py", "runtime/pipe/module.py", "runtime/pipe/topology.py",
           "utils/groups.py")
PACKAGES = ("parallel", "train", "model", "kernels", "bench", "launch")
USE = re.compile(r"(?:\.|\bdef )(_[A-Za-z]\w*)\b")  # an attribute read or set, or a method defined (an override)


def deepspeed_private_names() -> set[str]:
    root = pathlib.Path(deepspeed.__file__).parent
    names = set()
    for source in SOURCES:
        text = (root / source).read_text()
        names |= set(re.findall(r"(?:\bself\.|\bcls\.|\bdef )(_[A-Za-z]\w*)", text))
        names |= set(re.findall(r"^(_[A-Za-z]\w*)\s*=", text, re.M))
    return names


def used(path: pathlib.Path, private: set[str]) -> set[str]:
    return set(USE.findall(path.read_text())) & private


def test_only_the_adapter_touches_deepspeed_private_names():
    private = deepspeed_private_names()
    assert "_INSTRUCTION_MAP" in private and "_topo" in private  # the scan sees DeepSpeed's names
    allowed = pathlib.Path(deepspeed_private.__file__).resolve()
    elsewhere = {str(path.relative_to(ROOT)): sorted(names) for package in PACKAGES
                 for path in sorted((ROOT / package).rglob("*.py"))
                 if path.resolve() != allowed and (names := used(path, private))}
    assert not elsewhere, f"DeepSpeed private names outside parallel/deepspeed_private.py: {elsewhere}"


def test_the_adapter_lists_every_private_name_it_uses():
    assert used(pathlib.Path(deepspeed_private.__file__), deepspeed_private_names()) == set(
        deepspeed_private.PRIVATE_NAMES)
    # What no public API of the checked DeepSpeed covers: the instruction table, the run of a schedule (wrapped and
    # drained around it), the start-up broadcast its constructor makes. A new name needs a reason here.
    assert set(deepspeed_private.PRIVATE_NAMES) == {"_INSTRUCTION_MAP", "_exec_schedule", "_broadcast_model"}


def test_the_installed_deepspeed_is_the_checked_one():
    pinned = re.search(r'"deepspeed==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert deepspeed.__version__ == pinned == deepspeed_private.CHECKED_VERSION
