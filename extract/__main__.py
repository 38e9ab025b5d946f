"""`python -m extract model=... data=...`: compose the config, run one extraction."""
import logging
import sys

import hydra
from omegaconf import DictConfig

from extract.models import ModelError
from extract.run import extract
from extract.statements import StatementsError
from extract.store import StoreError

log = logging.getLogger("extract")


@hydra.main(version_base="1.3", config_path="../conf", config_name="extract")
def main(cfg: DictConfig) -> None:
    try:
        path = extract(cfg)
    except (StatementsError, StoreError, ModelError) as err:
        log.error("%s", err)
        sys.exit(1)
    log.info("store ready: %s", path)


if __name__ == "__main__":
    main()
