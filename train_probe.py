"""`python -m train_probe probe=... task=... layer=...`: compose the config, train, write result cells."""
from toolkit.entry import entry_main
from probes.schema import TrainProbeSchema


def summary(paths, cfg) -> str:
    """The run's last log lines: its cells' folder, then the best layer per probe and task (by calibration MCC)."""
    from experiments.tables import results_table

    return f"{len(paths)} result cells under {cfg.results_dir}; the best layer of each task:\n{results_table(paths)}"


main = entry_main("train_probe", TrainProbeSchema, "probes.pipeline:train_probes", summary)

if __name__ == "__main__":
    main()
