"""SciPy's BLAS and LAPACK routines as C function pointers, and the Numba functions that
call them (Fortran calling convention: every argument a pointer): what the kernels of the
sparse route (`_sparse_kernels`) and of the host linear algebra (`_envelope_kernels`) use
for their dense blocks. The pointers are passed to the kernels as arguments, so that Numba
can still cache them. The functions are private and marked `no_type_check` (the test
suite's jaxtyping import hook would otherwise wrap them, which Numba cannot compile or
cache)."""

import ctypes
from typing import no_type_check

import numba
import numpy as np

from ._compile_lock import serialise_compilation


def _blas(name: str, n_args: int, module: str = "blas"):
    """A BLAS (or LAPACK) routine of SciPy's (Fortran calling convention: every argument a
    pointer), passed to the kernels as an argument (so that Numba can still cache them)."""
    from numba.extending import get_cython_function_address

    ptr = ctypes.c_void_p
    return ctypes.CFUNCTYPE(None, *([ptr] * n_args))(
        get_cython_function_address(f"scipy.linalg.cython_{module}", name)
    )


_SYRK = _blas("dsyrk", 10)


_TRSM = _blas("dtrsm", 11)


_SYMM = _blas("dsymm", 12)


_GEMM = _blas("dgemm", 13)


_POTRF = _blas("dpotrf", 5, "lapack")


_TRTRI = _blas("dtrtri", 6, "lapack")


_LAUUM = _blas("dlauum", 5, "lapack")


# Reassociated sums (vectorised dot products) and fused multiply-adds; no assumptions
# about NaN or infinity.
_REASSOC = {"reassoc", "contract"}


@numba.njit(cache=True, nogil=True)
@no_type_check
def _trsm(trsm, side, uplo, trans, diag, m, n, alpha, a, lda, b, ldb):
    # BLAS dtrsm, b <- alpha op(a)^-1 b (side ord("L")) or alpha b op(a)^-1 (ord("R")), `a`
    # triangular (its `uplo` triangle), on Fortran-order views starting at the given
    # arrays' first elements
    dims = np.array([m, n, lda, ldb], np.int32)
    chars = np.array([side, uplo, trans, diag], np.uint8)
    coef = np.array([alpha])
    trsm(
        chars[0:].ctypes,
        chars[1:].ctypes,
        chars[2:].ctypes,
        chars[3:].ctypes,
        dims[0:].ctypes,
        dims[1:].ctypes,
        coef.ctypes,
        a.ctypes,
        dims[2:].ctypes,
        b.ctypes,
        dims[3:].ctypes,
    )


@numba.njit(cache=True, nogil=True)
@no_type_check
def _syrk(syrk, uplo, trans, n, k, alpha, a, lda, beta, c, ldc):
    # BLAS dsyrk, c <- alpha op(a) op(a)^T + beta c on c's `uplo` triangle (trans ord("N"):
    # op(a) = a, n x k), on Fortran-order views starting at the given arrays' first elements
    dims = np.array([n, k, lda, ldc], np.int32)
    chars = np.array([uplo, trans], np.uint8)
    coef = np.array([alpha, beta])
    syrk(
        chars[0:].ctypes,
        chars[1:].ctypes,
        dims[0:].ctypes,
        dims[1:].ctypes,
        coef[0:].ctypes,
        a.ctypes,
        dims[2:].ctypes,
        coef[1:].ctypes,
        c.ctypes,
        dims[3:].ctypes,
    )


@numba.njit(cache=True, nogil=True)
@no_type_check
def _gemm(gemm, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    # BLAS dgemm, c <- alpha op(a) op(b) + beta c, on Fortran-order views starting at the
    # given arrays' first elements (trans: ord("N") or ord("T"))
    dims = np.array([m, n, k, lda, ldb, ldc], np.int32)
    chars = np.array([trans_a, trans_b], np.uint8)
    coef = np.array([alpha, beta])
    gemm(
        chars[0:].ctypes,
        chars[1:].ctypes,
        dims[0:].ctypes,
        dims[1:].ctypes,
        dims[2:].ctypes,
        coef[0:].ctypes,
        a.ctypes,
        dims[3:].ctypes,
        b.ctypes,
        dims[4:].ctypes,
        coef[1:].ctypes,
        c.ctypes,
        dims[5:].ctypes,
    )


@numba.njit(cache=True, nogil=True)
@no_type_check
def _symm(symm, side, uplo, m, n, alpha, a, lda, b, ldb, beta, c, ldc):
    # BLAS dsymm, c <- alpha a b + beta c (side ord("L")) or alpha b a + beta c (ord("R")),
    # `a` symmetric with its `uplo` triangle read, on Fortran-order views starting at the
    # given arrays' first elements
    dims = np.array([m, n, lda, ldb, ldc], np.int32)
    chars = np.array([side, uplo], np.uint8)
    coef = np.array([alpha, beta])
    symm(
        chars[0:].ctypes,
        chars[1:].ctypes,
        dims[0:].ctypes,
        dims[1:].ctypes,
        coef[0:].ctypes,
        a.ctypes,
        dims[2:].ctypes,
        b.ctypes,
        dims[3:].ctypes,
        coef[1:].ctypes,
        c.ctypes,
        dims[4:].ctypes,
    )


serialise_compilation(globals())
