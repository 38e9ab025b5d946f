"""sAwMIL, split along its seams (data flow order):

bags.py       padding-free bag layout, per-bag max, stage-2 candidate tokens
smoothing.py  Newton on the smoothed hinge (the solver's first step)
exact.py      active-set polish and interior point (the solver's exact steps)
solver.py     fit_linear_svm: the primal linear SVM with a certified duality gap
estimator.py  SAwMIL: the three-stage estimator (sklearn-style)
probe.py      SAwMILProbe: the estimator behind the shared Probe interface
synthetic.py  planted bags for tests and benchmarks
"""
from probes.samil.bags import last_k_candidates, segment_max
from probes.samil.estimator import SAwMIL
from probes.samil.probe import SAwMILProbe
from probes.samil.solver import fit_linear_svm, hinge_objective
from probes.samil.synthetic import make_planted_bags

__all__ = ["SAwMIL", "SAwMILProbe", "fit_linear_svm", "hinge_objective", "last_k_candidates", "make_planted_bags",
           "segment_max"]
