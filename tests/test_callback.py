"""The host callback of the sparse route's kernels: on the CPU it hands the host function
read-only views of XLA's buffers and writes its results back in their dtypes; it batches
like `jax.pure_callback`, and a sharded program calls it once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equilens._callback import host_callback


def _sum_and_scaled(x, y):
    # (float64 and int64 results: the callback casts them to the requested dtypes)
    x, y = np.asarray(x), np.asarray(y)
    return np.asarray([np.sum(x) + np.sum(y)], np.float64), np.asarray(y, np.int64) * 2


def _shapes(x, y):
    return (
        jax.ShapeDtypeStruct((1,), x.dtype),
        jax.ShapeDtypeStruct(y.shape, y.dtype),
    )


def test_host_callback_matches_pure_callback_and_sees_read_only_views():
    seen = []

    def fn(x, y):
        seen.append((type(x), x.flags.writeable, y.flags.writeable))
        return _sum_and_scaled(x, y)

    x = jnp.linspace(0.0, 1.0, 7)
    y = jnp.arange(5, dtype=jnp.int32)
    got = jax.jit(lambda a, b: host_callback(fn, _shapes(a, b), a * 2.0, b))(x, y)

    def cast(a, b):
        return tuple(
            np.asarray(r, s.dtype)
            for r, s in zip(_sum_and_scaled(a, b), _shapes(a, b), strict=True)
        )

    want = jax.jit(lambda a, b: jax.pure_callback(cast, _shapes(a, b), a * 2.0, b))(x, y)
    assert seen == [(np.ndarray, False, False)]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert float(got[0][0]) == pytest.approx(float(np.sum(x) * 2.0 + 10.0), rel=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1]), 2 * np.arange(5))


def test_host_callback_refuses_writes_into_operands_and_wrong_shapes():
    def writes(x):
        x[0] = 1.0
        return x

    x = jnp.zeros(3)
    shape = jax.ShapeDtypeStruct((3,), x.dtype)
    with pytest.raises(Exception, match="read-only"):
        jax.block_until_ready(jax.jit(lambda a: host_callback(writes, shape, a + 1.0))(x))
    wrong = jax.ShapeDtypeStruct((4,), x.dtype)
    with pytest.raises(Exception, match="expected"):
        jax.block_until_ready(
            jax.jit(lambda a: host_callback(lambda v: np.array(v), wrong, a + 1.0))(x)
        )


def test_host_callback_batches_sequentially():
    calls = []

    def fn(x, y):
        calls.append(x.shape)
        return _sum_and_scaled(x, y)

    xs = jnp.arange(12.0).reshape(3, 4)
    ys = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)
    got = jax.jit(jax.vmap(lambda a, b: host_callback(fn, _shapes(a, b), a, b)))(xs, ys)
    assert calls == [(4,)] * 3
    for i in range(3):
        one = _sum_and_scaled(np.asarray(xs[i]), np.asarray(ys[i]))
        np.testing.assert_allclose(np.asarray(got[0][i]), one[0])
        np.testing.assert_array_equal(np.asarray(got[1][i]), one[1])


@pytest.mark.skipif(jax.device_count() < 2, reason="needs several (host) devices")
def test_host_callback_runs_once_in_a_sharded_program():
    calls = []

    def fn(x):
        calls.append(x.shape)
        return np.full(3, np.sum(x))

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    x = jax.device_put(jnp.arange(4.0 * n), jax.NamedSharding(mesh, jax.P("d")))
    shape = jax.ShapeDtypeStruct((3,), x.dtype)
    got = jax.block_until_ready(jax.jit(lambda v: host_callback(fn, shape, jnp.sin(v)))(x))
    assert calls == [(4 * n,)]
    np.testing.assert_allclose(np.asarray(got), np.sum(np.sin(np.arange(4.0 * n))), rtol=1e-6)
