"""`python -m truthfulqa model=... [format=lm_eval|chat|plain] [limit=N] [results_dir=...]`: score every
TruthfulQA choice, write the MC1 / MC2 result JSON and print both with their intervals."""
from toolkit.entry import entry_main
from truthfulqa.schema import TruthfulQASchema

main = entry_main("truthfulqa", TruthfulQASchema, "truthfulqa.run:run")

if __name__ == "__main__":
    main()
