"""Zero-shot baseline: ask the model the paper's multiple-choice question about each statement and
read the next-token probability of each option's label (`python -m zero_shot`).

- :mod:`zero_shot.prompts`: the question (four enumerations), its rendering for base and chat
  models, and the token ids of each option label;
- :mod:`zero_shot.run`: the resumable scoring loop (an ``N x 7`` probability file per
  datapack and enumeration) and the evaluation of any such file into result cells next to the
  probes' (argmax and split-conformal modes, MCC / W-MCC / acceptance).
"""
