"""The kernels' input operands in the layout they are compiled for."""

import numpy as np


def kernel_operands(*arrays) -> list:
    """Read-only, C-contiguous input operands (views; a copy only of an operand that is not
    C-contiguous). Numba compiles a kernel once per combination of its arguments' types,
    read-only flags and layouts included: a JAX buffer's view is read-only, a NumPy array (a
    converted operand, a test's input) is not, and a column slice is not contiguous (the
    forward kernel was compiled twice in the fast suite, 12.6 s each, for the layout of its
    `values` alone). Passing every input read-only and C-contiguous keeps one compilation of
    each parallel kernel (tens of seconds each)."""
    out = []
    for a in arrays:
        if isinstance(a, np.ndarray):
            if not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            if a.flags.writeable:
                a = a.view()
                a.flags.writeable = False
        out.append(a)
    return out
