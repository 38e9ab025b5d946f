"""`python -m extract model=... data=...`: compose the config, run one extraction."""
from extract.config import answer_help
from extract.schema import ExtractSchema

answer_help(__name__, "extract", ExtractSchema)   # before the imports below: --help needs no torch

import logging

from omegaconf import DictConfig

from extract.errors import hydra_main, run_entry
from extract.run import extract

log = logging.getLogger("extract")


@hydra_main(config_path="../conf", config_name="extract")
def main(cfg: DictConfig) -> None:
    path = run_entry(extract, cfg, log=log)
    if path is not None:
        log.info("store ready: %s", path)


if __name__ == "__main__":
    main()
