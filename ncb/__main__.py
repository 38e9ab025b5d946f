"""`python -m ncb model=... data=... method=<cell.json|zero_shot>`: compose the config, compute the targets'
NCB and the stress tests of one method."""
import logging

import hydra
from omegaconf import DictConfig

from extract.errors import run_entry
from ncb.run import run

log = logging.getLogger("ncb")


@hydra.main(version_base="1.3", config_path="../conf", config_name="ncb")
def main(cfg: DictConfig) -> None:
    paths = run_entry(run, cfg, log=log)
    if paths is not None:
        log.info("written: %s", ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
