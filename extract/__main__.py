"""`python -m extract model=... data=...`: compose the config, run one extraction."""
from extract.entry import entry_main
from extract.schema import ExtractSchema

main = entry_main("extract", ExtractSchema, "extract.run:extract", lambda path, cfg: f"store ready: {path}")

if __name__ == "__main__":
    main()
