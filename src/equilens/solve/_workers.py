"""Worker processes that evaluate an objective's log-density at many points at once, one
share of the points per process: nested sampling's batches on every CPU core.

Processes rather than threads: each worker runs the Numba likelihood single-threaded with
its own interpreter, so the Python between the kernels (the amplitudes' solve, the model's
assembly) runs in parallel too, which Numba's threads inside one call cannot do (1.3-1.7x
from a second thread on a small image). The workers are fresh interpreters
(`python -c ...`), not forks (JAX's and OpenMP's threads do not survive a fork) and not
`multiprocessing`'s spawn (which re-runs the user's script unless it is guarded by
`if __name__ == "__main__"`); they talk to the parent over their standard input and output
with pickles.
"""

import os
import pickle
import signal
import subprocess
import sys
import traceback
from typing import Any

import numpy as np
from jaxtyping import Float

_SERVE = "from equilens.solve._workers import _serve; _serve()"


def _usable_cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


class DensityPool:
    """`n_workers` processes, each holding the log-density of `objective` over the free
    parameters `param` of `template` (`equilens.numba._terms.density` with `backend`),
    evaluated with `threads` Numba threads per worker. Calling the pool with an `(m, d)`
    array of parameter vectors returns the `m` log-densities, the rows split evenly
    between the workers, in order. Close it (or use it as a context manager): the workers
    are stopped, also on Ctrl-C in the parent (they ignore SIGINT themselves)."""

    def __init__(
        self,
        objective: Any,
        template: Any,
        param: Any,
        backend: str,
        n_workers: int,
        threads: int = 1,
    ):
        import jax

        if n_workers < 1 or threads < 1:
            raise ValueError(
                f"DensityPool: n_workers and threads must be >= 1, got {n_workers}, {threads}"
            )
        env = dict(os.environ)
        env.update(
            {
                # the parent's precision; the host only (a worker must not take a GPU)
                "JAX_ENABLE_X64": "1" if jax.config.read("jax_enable_x64") else "0",
                "JAX_PLATFORMS": "cpu",
                "NUMBA_NUM_THREADS": str(threads),
                "OMP_NUM_THREADS": str(threads),
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            }
        )
        spec = pickle.dumps((objective, template, param, backend), protocol=pickle.HIGHEST_PROTOCOL)
        self.workers: list[subprocess.Popen] = []
        try:
            for _ in range(n_workers):
                proc = subprocess.Popen(
                    [sys.executable, "-c", _SERVE],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    # (out of the terminal's process group: Ctrl-C reaches the parent
                    # alone, which ends the run between two batches)
                    start_new_session=True,
                )
                self.workers.append(proc)
                self._send(proc, ("init", (list(sys.path), spec)))
            for proc in self.workers:  # (the workers start up in parallel)
                self._receive(proc)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self.workers)

    @staticmethod
    def _send(proc: subprocess.Popen, message: Any) -> None:
        assert proc.stdin is not None
        pickle.dump(message, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()

    @staticmethod
    def _receive(proc: subprocess.Popen) -> Any:
        assert proc.stdout is not None
        try:
            status, payload = pickle.load(proc.stdout)
        except EOFError:
            code = proc.wait()
            raise RuntimeError(
                f"an equilens likelihood worker process ended (exit status {code}); its "
                "error is printed above"
            ) from None
        if status == "error":
            raise RuntimeError(f"an equilens likelihood worker failed:\n{payload}")
        return payload

    def __call__(self, points: Float[np.ndarray, "m d"]) -> Float[np.ndarray, " m"]:
        points = np.atleast_2d(np.asarray(points, np.float64))
        chunks = np.array_split(points, self.size)
        busy = []
        for proc, chunk in zip(self.workers, chunks, strict=True):
            if len(chunk):
                self._send(proc, ("eval", chunk))
                busy.append(proc)
        return np.concatenate([self._receive(proc) for proc in busy])

    def close(self) -> None:
        for proc in self.workers:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.close()  # (end of input: the worker returns)
            except OSError:
                pass
        for proc in self.workers:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.workers = []

    def __enter__(self) -> "DensityPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _serve() -> None:
    """A worker's loop: reads `(command, payload)` pickles from standard input and answers
    `("ok", result)` or `("error", traceback)` on the original standard output (which is
    pointed at standard error for everything else the worker prints)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    density = None
    while True:
        try:
            command, payload = pickle.load(inp)
        except EOFError:
            return
        try:
            if command == "init":
                from ..numba._terms import density as make_density

                path, spec = payload
                sys.path[:] = path  # (the parent's: its modules unpickle here too)
                objective, template, param, backend = pickle.loads(spec)
                density = make_density(objective, template, param, backend)
                result: Any = density.backend
            elif command == "eval":
                assert density is not None
                result = np.array([density.f(v) for v in payload], np.float64)
            else:
                raise ValueError(f"unknown command {command!r}")
            reply: tuple[str, Any] = ("ok", result)
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
