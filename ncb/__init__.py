"""Neighbour-Consistency Belief read from a probe or the zero-shot prompt, and contextual stress tests."""
