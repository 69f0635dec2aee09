"""The commands of the README and docs/ run as written, and the pictures of docs/ come from their commands.

Each fenced ``bash`` block carries a mark after its language (docs/README.md, "For contributors"):
- ``cpu``: every command runs here, in this process (``runpy``, as ``python -m`` would run it), in a scratch
  directory per page, with a step limit: one training step (two where the command stops a run to resume it) of
  one row a microbatch, one evaluation batch, no probes, no wandb, no pictures, ``--max-new-tokens`` at most 8,
  and of a sweep (``-m``) the first job only, after every job's config is checked. ``outputs/<date>/<time>`` and
  ``multirun/<date>/<time>`` stand for the page's latest run and sweep. A job whose limited overrides already ran
  in the session is not run again;
- ``gpu``, ``long`` and ``launch``: the command must parse: a training job's config composes and passes the checks
  made before any engine (every job of a sweep), its batch is planned for the world size the command starts (and
  the stage split made when it has stages); a script exists, parses (``bash -n``), and has every flag, environment
  variable and mode the command gives it;
- ``fails``: the command stops with one ``error:`` line and exit status 2.
A CPU command that the page says fails, or a GPU command whose config no longer composes, is a doc that lies.

The result files: every link to a file under bench/results/ resolves, and every file there is linked from a page
(the figures' sources are not lost when the pages change); bench/results/ holds results, not scripts.
"""
import contextlib
import fnmatch
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)[ \t]*(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKS = ("cpu", "gpu", "long", "launch", "fails")
# One row a microbatch: a step of the default job's four rows took 1.2 s of CPU, of one row 0.3 s.
LIMITS = ["data.micro_batch_size=1", "train.eval.batches=1", "train.eval.probe_examples=0", "train.progress=false",
          "logger.mode=disabled", "logger.plots=false"]
# and of the synthetic tasks 8 held-out examples (an evaluation scores each, one row at a time: 256 took 12 s).
SYNTHETIC_LIMITS = ["data.synthetic.eval_examples=8"]
DEFAULT_CHOICES = {f"{group}={choice}" for entry in OmegaConf.to_container(OmegaConf.load(ROOT / "conf/config.yaml"))
                   ["defaults"] if isinstance(entry, dict) for group, choice in entry.items()}  # a no-op override
MAX_STEPS, MAX_NEW_TOKENS = 2, 8  # steps: 1, and 2 where a run stops at step 1 to be resumed
MODULES_RUN_HERE = {"model.layout", "model.accounting", "parallel.plan", "train.report", "train.export",
                    "train.generate", "train.health"}
GPUS_PER_NODE = 8  # launch/slurm.sbatch's default


def blocks(page: Path) -> list[tuple[str, list[str], int]]:
    """(mark, commands, line) of every marked ``bash`` block: its lines with continuations joined."""
    found = []
    text = page.read_text()
    for match in FENCE.finditer(text):
        language, mark, body = match.groups()
        if language != "bash" or not mark:
            continue
        line = text.count("\n", 0, match.start()) + 1
        assert mark in MARKS, f"{page.name}:{line}: ```bash {mark}: the mark is one of {', '.join(MARKS)}"
        found.append((mark, [c for c in body.replace("\\\n", " ").splitlines() if c.split("#")[0].strip()], line))
    return found


def words_of(line: str) -> list[list[str]]:
    """A command line's commands as words: comments dropped, ``a && b`` two commands."""
    words, commands = shlex.split(line, comments=True), []
    while words:
        cut = words.index("&&") if "&&" in words else len(words)
        commands.append(words[:cut])
        words = words[cut + 1:]
    return commands


def test_every_bash_block_is_marked():
    """A ``bash`` block without a mark would be skipped silently."""
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            assert match.group(1) != "bash" or match.group(2), f"{page.name}: a ```bash block without a mark"


RUNS: dict[str, Path] = {}  # a training job's limited overrides -> the directory of its run in this session


class Page:
    """One page's commands in order, in one scratch directory, with the page's latest run and sweep.

    A training job whose overrides (with the step limit, in any order) already ran in this session is not run
    again: its run directory stands for this one (a sweep's job is copied into the sweep's directory)."""

    def __init__(self, page: Path, scratch: Path, monkeypatch):
        self.page, self.scratch, self.runs, self.sweeps = page, scratch, 0, 0
        self.last_run = self.last_sweep = None
        monkeypatch.chdir(scratch)
        for name in ("README.md", "examples"):  # what the pages' commands read by a relative path
            (scratch / name).symlink_to(ROOT / name)

    def substitute(self, line: str) -> str:
        """The placeholders: the latest run and sweep, and stand-ins for what a reader fills in."""
        line = line.replace("outputs/<date>/<time>", str(self.last_run or "outputs/run0"))
        line = line.replace("multirun/<date>/<time>", str(self.last_sweep or "multirun/2000-01-01/00-00-00"))
        line = line.replace("<your text>", str(ROOT / "README.md"))
        return re.sub(r"<[^<>]+>", "placeholder", line)

    def run(self, mark: str, line: str, where: str) -> None:
        for words in words_of(self.substitute(line)):
            self.run_words(mark, words, f"{where}: {shlex.join(words)}")

    def run_words(self, mark: str, words: list[str], where: str) -> None:
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        program, args = words[0], words[1:]
        if program == "pip":
            return check_pip(args, where)
        if program == "python" and args[:2] == ["-m", "pytest"]:
            assert (ROOT / "tests").is_dir(), where  # the suite is never run from inside itself
            return
        if mark == "fails":
            assert program == "python" and args[:2] == ["-m", "train"], f"{where}: a `fails` command is python -m train"
            return expect_failure(args[2:], where)
        if mark != "cpu":
            return check_command(program, args, env, where)
        assert program == "python" and args[0] == "-m", f"{where}: only `python -m ...` runs here; mark it gpu"
        module, args = args[1], args[2:]
        if module == "train":
            return self.train(args, env, where)
        assert module in MODULES_RUN_HERE, f"{where}: python -m {module} is not one the doc test runs"
        args = [str(min(int(a), MAX_NEW_TOKENS)) if prev == "--max-new-tokens" else a
                for prev, a in zip([None, *args], args)]
        if "--plot" in args:
            (self.scratch / args[args.index("--plot") + 1]).parent.mkdir(parents=True, exist_ok=True)
        in_process(module, args, env, where)

    def train(self, args: list[str], env: dict, where: str) -> None:
        """``python -m train args`` with the step limit; of a sweep, every job's config is checked and the first job
        runs, into this page's sweep directory."""
        sweep = "-m" in args or "--multirun" in args
        overrides = [a for a in args if a not in ("-m", "--multirun")]
        if "--cfg" in overrides:
            return in_process("train", args, env, where)
        if sweep:
            jobs = sweep_jobs(overrides)
            for job in configs_to_check(jobs):
                checked_job(job, first=job is jobs[0])
            overrides = jobs[0]
        stops = any(o.startswith("train.stop_at=") for o in overrides)
        steps = MAX_STEPS if stops else 1  # a run that stops early needs a step after the stop
        limited = [f"train.max_steps={min(int(o.split('=')[1]), steps)}" if o.startswith("train.max_steps=") else
                   "train.stop_at=1" if o.startswith("train.stop_at=") else o
                   for o in overrides if not o.startswith("data.micro_batch_size=")]
        limited += [f"train.max_steps={steps}"] * (not any(o.startswith("train.max_steps=") for o in limited))
        limited += LIMITS + SYNTHETIC_LIMITS * ("data=synthetic" in limited)
        own_dir = any(o.startswith(("hydra.run.dir=", "train.resume=", "train.init_from=")) for o in limited)
        key = None if own_dir else " ".join(sorted(set(limited) - DEFAULT_CHOICES))  # composing costs a second
        if sweep:
            self.sweeps += 1
            self.last_sweep = self.scratch / f"multirun/2000-01-01/00-00-{self.sweeps:02d}"
            if key in RUNS:
                shutil.copytree(RUNS[key], self.last_sweep / "0", symlinks=True)
                return
            in_process("train", ["-m", *limited, f"hydra.sweep.dir={self.last_sweep}"], env, where)
            if key is not None:
                RUNS[key] = self.last_sweep / "0"
            return
        if key in RUNS:
            self.last_run = RUNS[key]
            return
        if not any(o.startswith("hydra.run.dir=") for o in limited):
            self.runs += 1
            self.last_run = self.scratch / f"outputs/run{self.runs}"
            limited.append(f"hydra.run.dir={self.last_run}")
        in_process("train", limited, env, where)
        if key is not None:
            RUNS[key] = self.last_run


def in_process(module: str, args: list[str], env: dict, where: str) -> None:
    """``python -m module args`` in this process; its output is shown only if it fails."""
    from hydra.core.global_hydra import GlobalHydra

    out = io.StringIO()
    saved_argv, saved_env = sys.argv, dict(os.environ)  # a run sets RANK, WORLD_SIZE, ...: a fresh process would not
    os.environ.update(env)
    sys.argv = [module, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        assert stop.code in (None, 0), f"{where}: python -m {module} {shlex.join(args)} exited {stop.code}:\n" + \
            out.getvalue()[-3000:]
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()


def expect_failure(args: list[str], where: str) -> None:
    """``python -m train args`` must stop before any work with one ``error:`` line and status 2."""
    out = io.StringIO()
    sys.argv, saved, saved_env = ["train", *args, "hydra.run.dir=failed"], sys.argv, dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), pytest.raises(SystemExit) as stop:
            runpy.run_module("train", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved
        os.environ.clear()
        os.environ.update(saved_env)
    errors = [line for line in out.getvalue().splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(errors) == 1, f"{where}: {shlex.join(args)}:\n{out.getvalue()[-2000:]}"
    assert not Path("failed").exists(), f"{where}: a failed run left its run directory"


def check_pip(args: list[str], where: str) -> None:
    assert args[0] == "install", where
    extras = re.fullmatch(r"\.\[(\w+)\]", args[-1]) if "-e" in args else None
    if extras:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        assert extras.group(1) in project["optional-dependencies"], f"{where}: no extra {extras.group(1)}"


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The per-job overrides Hydra's basic sweeper makes of ``overrides``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), max_batch_size=None)
    return jobs


def configs_to_check(jobs: list[list[str]]) -> list[list[str]]:
    """The jobs of a sweep that may differ in more than their seed (``compose_checked`` checks every seed's type):
    one job per setting of a seed sweep."""
    seen, kept = set(), []
    for job in jobs:
        setting = tuple(o for o in job if not o.startswith("train.seed="))
        if setting not in seen:
            seen.add(setting)
            kept.append(job)
    return kept


def checked_job(overrides: list[str], first: bool = True, world: int | None = 1, device: str = "cpu"):
    """One job planned on ``world`` processes (the stage count when None) of ``device`` and checked as the preflight
    does before any engine (``compose_checked`` checks every value of a sweep, so the other jobs need only
    compose)."""
    from model.cli import compose, compose_checked, resolved
    from parallel.job import plan
    from train.run.preflight import check_config

    config = resolved(compose_checked(overrides) if first else compose(overrides))
    job = plan(config, world or config.parallel.pipeline_stages, torch.device(device))
    check_config(job)
    return job


def check_training(overrides: list[str], world: int | None, where: str) -> None:
    """A training job that does not run here: every job's config, its batch on ``world`` processes (the stage
    count when unknown) and its stage split, planned for GPUs."""
    overrides = [o for o in overrides if o not in ("-m", "--multirun")]
    jobs = sweep_jobs(overrides)
    for job in configs_to_check(jobs):
        try:
            checked_job(job, first=job is jobs[0], world=world, device="cuda")
        except ValueError as error:
            raise AssertionError(f"{where}: {shlex.join(job)}: {error}") from None


def check_script(path: Path, args: list[str], env: dict, where: str) -> str:
    """A script the command runs: it exists and parses, and knows every flag, variable and mode it is given."""
    assert path.is_file(), f"{where}: {path.relative_to(ROOT)} does not exist"
    text = path.read_text()
    if path.suffix in (".sh", ".sbatch"):
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"{where}: {path.name}: {done.stderr}"
    for word in args:
        if word.startswith("--"):
            assert word.split("=")[0] in text, f"{where}: {path.name} has no {word.split('=')[0]}"
    for name, value in env.items():
        assert re.search(rf"\b{name}\b", text), f"{where}: {path.name} does not read {name}"
        if name == "ONLY":
            for stage in value.split():
                assert re.search(rf"\bstage {stage}\b", text), f"{where}: {path.name} has no stage {stage}"
    return text


def check_command(program: str, args: list[str], env: dict, where: str) -> None:
    """A ``gpu`` or ``launch`` command: what it would start, checked without starting it."""
    if program == "python" and args[:2] == ["-m", "train"]:
        return check_training(args[2:], 1, where)
    if program == "python" and args[0] == "-m":
        import importlib.util

        assert importlib.util.find_spec(args[1]) is not None, f"{where}: no module {args[1]}"
        return
    if program in ("python", "bash"):
        path, rest = ROOT / args[0], args[1:]
        check_script(path, rest, env, where)
        if program == "bash":  # a mode word (gpu_health.sh moe) is one of the script's cases
            for word in rest:
                if not word.startswith("-") and "=" not in word:
                    assert re.search(rf"^\s*{word}\)", path.read_text(), re.M), f"{where}: {path.name}: no {word}"
        return
    if program == "torchrun":
        split = args.index("-m")
        flag = next(a for a in args[:split] if a in ("--nproc-per-node", "--nproc_per_node"))
        return check_training(args[split + 2:], int(args[args.index(flag) + 1]), where)
    if program == "deepspeed":
        split = args.index("--module")
        world = int(args[args.index("--num_gpus") + 1]) if "--num_gpus" in args else None
        return check_training(args[split + 2:], world, where)
    if program == "sbatch":
        nodes = next(int(a.split("=")[1]) for a in args if a.startswith("--nodes="))
        script = next(a for a in args if a.endswith(".sbatch"))
        check_script(ROOT / script, [], {}, where)
        return check_training(args[args.index(script) + 1:], nodes * GPUS_PER_NODE, where)
    if program.startswith("launch/"):
        check_script(ROOT / program, [], env, where)
        world = {"launch/torchrun.sh": int(env.get("NPROC", 2)), "launch/deepspeed.sh": env.get("NUM_GPUS"),
                 "launch/cpu_pipeline.sh": int(env.get("NPROC", env.get("STAGES", 2)))}.get(program)
        if program == "launch/cpu_pipeline.sh":  # what the script adds before the user's overrides
            stages = int(env.get("STAGES", 2))
            args = ["train.device=cpu", f"parallel.pipeline_stages={stages}", f"train.grad_accum_steps={2 * stages}",
                    *args]
        return check_training(args, int(world) if world else None, where)
    raise AssertionError(f"{where}: no check for {program}: add one to tests/meta/test_docs.py")


@pytest.fixture
def quiet_runs(monkeypatch):
    """One thread (the CPU is shared) and no pictures at the end of every run (the pictures have tests of their own;
    drawing them took half of a two-step run)."""
    import train.observe.dashboards
    import train.observe.health
    import train.observe.metrics
    import train.observe.routing

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for module, name in ((train.observe.metrics, "plot_losses"), (train.observe.health, "plot_health"),
                         (train.observe.dashboards, "draw_and_log"), (train.observe.routing, "plot_experts")):
        monkeypatch.setattr(module, name, lambda *args, **kwargs: None)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_the_commands_run_as_written(page, tmp_path, monkeypatch, quiet_runs):
    here = Page(page, tmp_path, monkeypatch)
    for mark, commands, line in blocks(page):
        for command in commands:
            here.run(mark, command, f"{page.relative_to(ROOT)}:{line}")


def pictures() -> list[tuple[str, str]]:
    """(picture, command) of docs/README.md's table of pictures that live under docs/images/."""
    rows = re.findall(r"^\| `(docs/images/[^`]+\.png)` \| `([^`]+)` \|$", (ROOT / "docs/README.md").read_text(), re.M)
    return rows


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_every_picture_is_listed_with_its_command():
    listed = {picture for picture, _ in pictures()}
    assert listed == {str(p.relative_to(ROOT)) for p in (ROOT / "docs/images").glob("*.png")}
    for page in PAGES:  # and every picture a page shows exists
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name}: {target} does not exist"


@pytest.mark.parametrize("picture, command", pictures(), ids=[p for p, _ in pictures()])
def test_the_pictures_are_drawn_by_their_commands(picture, command, tmp_path, monkeypatch):
    """The committed picture has the size of the one its command draws now (the drawing is the project's code:
    another layout, plan or figure code changes it)."""
    words = shlex.split(command)
    assert words[:2] == ["python", "-m"] and "--plot" in words
    monkeypatch.chdir(tmp_path)
    (tmp_path / picture).parent.mkdir(parents=True)
    in_process(words[2], words[3:], {}, picture)
    assert png_size(tmp_path / picture) == png_size(ROOT / picture)


RESULTS = ROOT / "bench" / "results"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def result_links() -> dict[Path, list[str]]:
    """Every result file a page links to (``[...](../bench/results/...)``) -> the pages that do."""
    linked: dict[Path, list[str]] = {}
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            path = (page.parent / target).resolve()
            if path.is_relative_to(RESULTS):
                linked.setdefault(path, []).append(page.name)
    return linked


def test_every_linked_result_file_exists():
    missing = {str(p.relative_to(ROOT)): pages for p, pages in result_links().items() if not p.is_file()}
    assert not missing, f"links to result files that do not exist: {missing}"


# Files of the kind results are that a run or an export writes (named on the pages, never under bench/results/).
RUN_OUTPUTS = {"config.json", "init_from.json", "layers.png", "manifest.json", "model.safetensors.index.json",
               "synthetic.png", "tokenizer_config.json"}


def test_every_named_result_file_exists():
    """A result file named as code (`bench/results/train/x.json`, `train/x.json` under a table's
    `bench/results/...` header, `x_{a,b}.json`, `round13_local*.json`) is one that exists under bench/results/."""
    results = [str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file()]
    for page in PAGES:
        for named in re.findall(r"`([\w/{},*.-]+\.(?:json|jsonl|txt|log|png))`", page.read_text()):
            for name in expand_braces(named):
                name = name.removeprefix("bench/results/")
                found = (ROOT / name).exists() or any(fnmatch.fnmatch(r, "*" + name) for r in results)
                assert found or name in RUN_OUTPUTS, f"{page.name}: `{named}`: no result file {name}"


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [name for part in match.group(1).split(",")
            for name in expand_braces(path[:match.start()] + part + path[match.end():])]


def test_every_result_file_is_linked_from_a_page():
    files = {p.resolve() for p in RESULTS.rglob("*") if p.is_file()}
    unlinked = sorted(str(p.relative_to(ROOT)) for p in files - set(result_links()))
    assert not unlinked, f"result files no page links to (docs/history.md lists them all): {unlinked}"


def test_results_hold_no_scripts():
    """An experiment's script lives in bench/ (or in the commit that ran it), its results in bench/results/."""
    scripts = sorted(str(p.relative_to(ROOT)) for p in RESULTS.rglob("*") if p.suffix in (".py", ".sh", ".patch"))
    assert not scripts, f"scripts under bench/results/: {scripts}"
