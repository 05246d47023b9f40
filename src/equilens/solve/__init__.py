"""Fitting: `fit` (one start), `fit_batch` and `multi_start` (vmapped batches of starts or
objectives), `FitResult` and its `RESULTS` codes, saving and loading."""

from ._fit import SOLVER_NAMES as SOLVER_NAMES, fit as fit, fit_batch as fit_batch, pick as pick
from ._result import RESULTS as RESULTS, FitResult as FitResult
