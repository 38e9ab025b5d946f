"""TruthfulQA, behavioural half: MC1 / MC2 from per-choice log-likelihoods, exactly as
lm-evaluation-harness 0.4.x computes truthfulqa_mc1 / truthfulqa_mc2 (format=lm_eval), plus a
chat-template and a no-primer variant. `python -m truthfulqa model=... [format=...] [limit=N]`."""
