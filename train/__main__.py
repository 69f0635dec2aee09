"""``python -m train [overrides]``: the training job (see ``train/run/app.py``).

Launchers speak argparse, Hydra does not: the ``deepspeed`` launcher appends ``--local_rank=N`` (older torch
launchers pass ``--local-rank N``), which Hydra would reject as an override. The rank moves into the
``LOCAL_RANK`` environment variable, where ``torchrun`` puts it anyway, before Hydra parses the rest.

The overrides are checked before Hydra starts (``model.cli.job_config``): a key the config does not have,
``+key=`` ones included, is refused with the nearest valid names, and a value of another type or out of its
range with what to give. Errors and interrupts end as one line on stderr with an exit status
(``train/processes/errors.py``).

Only rank 0 writes the run directory's Hydra files and logs: the other ranks log errors only, to stdout, and the
job itself writes into rank 0's directory (Hydra's timestamped default may differ by a second across ranks).
"""
import os
import re
import sys
import warnings

_LOCAL_RANK = re.compile(r"--local[-_]rank(?:=(\d+))?")


def strip_launcher_args(argv: list[str]) -> list[str]:
    """``argv`` without ``--local_rank`` flags; their value is exported as ``LOCAL_RANK``."""
    kept, i = [], 0
    while i < len(argv):
        flag = argv[i]
        match = _LOCAL_RANK.fullmatch(flag)
        if match is None:
            kept.append(flag)
            i += 1
            continue
        value = match.group(1)
        if value is None:  # "--local_rank N"
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 1
        if not value.isdigit():
            sys.exit(f"error: {flag} needs an integer value, got {value!r} — pass --local_rank=<N>")
        os.environ["LOCAL_RANK"] = value
        i += 1
    return kept


def rank_overrides() -> list[str]:
    """Hydra overrides that keep ranks > 0 from writing their own copy of the run directory's files, and from
    repeating rank 0's log lines."""
    if int(os.environ.get("RANK", "0")) == 0:
        return []
    warnings.simplefilter("ignore")
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.job_logging.root.level=ERROR"]


def config_overrides(argv: list[str]) -> list[str]:
    """The config overrides among Hydra's command-line arguments (not its flags such as ``-m`` or ``--cfg job``)."""
    from hydra._internal.utils import get_args_parser

    known, _ = get_args_parser().parse_known_args(argv)
    return known.overrides


def announce_start() -> None:
    """Rank 0's first line, a second into the run, once the overrides are known to be valid (bad input prints its
    one line alone): torch, DeepSpeed and datasets take seconds to import, several on a loaded CPU, and a new user
    should not wonder whether anything runs (issue 57)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print("starting: the overrides are valid; loading torch, DeepSpeed and datasets, then the plan", flush=True)


if __name__ == "__main__":
    argv = strip_launcher_args(sys.argv[1:])
    from train.observe.quiet import name_the_accelerator
    from train.processes.errors import reported

    with reported():
        from model.cli import job_config

        name_the_accelerator(job_config(config_overrides(argv)).train.device)
        announce_start()
        sys.argv[1:] = argv + rank_overrides()
        from train.run.app import main

        main()
