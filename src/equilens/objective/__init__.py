"""Objectives: weighted sums of terms over a model pytree, and the choice of free parameters
and their bounds (a reparametrisation resolved at the top of the objective)."""

from ._objective import Objective as Objective
from ._params import (
    ObjectiveFunctions as ObjectiveFunctions,
    Parametrisation as Parametrisation,
    functions as functions,
    select as select,
)
