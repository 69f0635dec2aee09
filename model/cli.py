"""Config composition for the model's command-line tools (same `conf/` tree and override syntax as training)."""
from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(overrides: list[str]) -> DictConfig:
    """The config that ``python -m train <overrides>`` would see, without starting a run."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_cli(action) -> None:
    """Run a CLI action; a bad config or override ends with its message instead of a traceback."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        action()
    except (ValueError, HydraException, OmegaConfBaseException) as err:
        raise SystemExit(f"error: {err}") from None
