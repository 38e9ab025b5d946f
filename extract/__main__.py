"""`python -m extract model=... data=...`: compose the config, run one extraction (or print its plan: dry_run=true)."""
from toolkit.entry import entry_main
from toolkit.schema import ExtractSchema


def _summary(result, cfg) -> str:
    return "dry run: nothing written" if cfg.get("dry_run") else f"store ready: {result}"


main = entry_main("extract", ExtractSchema, "extract.run:extract", _summary)

if __name__ == "__main__":
    main()
