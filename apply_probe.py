"""`python -m apply_probe probe=<cell.json> data=<datapack> | text="..." | csv=<file>`: a saved probe on another
datapack's store (a transfer cell) or on your own statements; what it does: probes.apply."""
from toolkit.entry import entry_main
from probes.schema import APPLY_QUOTED, APPLY_RENAMED, ApplyProbeSchema

main = entry_main("apply_probe", ApplyProbeSchema, "probes.apply:apply", quote=APPLY_QUOTED, renames=APPLY_RENAMED)

if __name__ == "__main__":
    main()
