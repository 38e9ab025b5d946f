"""`python -m train_probe probe=... task=... layer=...`: compose the config, train, write result cells."""
import logging
import sys

import hydra
from omegaconf import DictConfig

from extract.store import StoreError
from probes.data import TaskError
from probes.pipeline import train_probes

log = logging.getLogger("train_probe")


@hydra.main(version_base="1.3", config_path="conf", config_name="train_probe")
def main(cfg: DictConfig) -> None:
    try:
        paths = train_probes(cfg)
    except (StoreError, TaskError, ValueError) as err:
        log.error("%s", err)
        sys.exit(1)
    log.info("%d result cells under %s", len(paths), cfg.results_dir)


if __name__ == "__main__":
    main()
