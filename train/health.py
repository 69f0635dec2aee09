"""``python -m train.health``: the command of ``train/observe/health.py``, kept at the top of train/
where users type it."""
import sys

from train.observe.health import main


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
