"""kernels.launch: several kernels' parts in one pallas_call (interpreter, against numpy)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax.kernels.launch import LaunchPart, _unravel, launch


def _grid_ids_part(n_i: int, n_j: int) -> LaunchPart:
    """Writes 10 * i + j + x[i] at [i, j] from program (i, j): every program once."""
    def body(pids, x_ref, o_ref):
        i, j = pids
        o_ref[i, j] = 10 * i + j + x_ref[i]
    x = jnp.arange(n_i, dtype=jnp.int32) * 100
    return LaunchPart(body, (n_i, n_j), (x,), (jax.ShapeDtypeStruct((n_i, n_j), jnp.int32),),
                      name="ids")


def _add_in_place_part(y: jax.Array, value: float) -> LaunchPart:
    """Adds `value` to y[p] in place (output aliased to the input)."""
    def body(pids, y_ref, o_ref):
        p = pids[0]
        o_ref[p] = y_ref[p] + value
    return LaunchPart(body, (y.shape[0],), (y,), (jax.ShapeDtypeStruct(y.shape, y.dtype),),
                      aliases={0: 0}, name="add")


def _add_to_even_entries_part(y: jax.Array, value: float) -> LaunchPart:
    """Adds `value` to y[2p] in place; the odd entries are never written (so they keep the
    input's values only if the output really is the aliased input)."""
    def body(pids, y_ref, o_ref):
        p = 2 * pids[0]
        o_ref[p] = y_ref[p] + value
    return LaunchPart(body, ((y.shape[0] + 1) // 2,), (y,),
                      (jax.ShapeDtypeStruct(y.shape, y.dtype),), aliases={0: 0}, name="even")


def _want_ids(n_i, n_j):
    i, j = np.meshgrid(np.arange(n_i), np.arange(n_j), indexing="ij")
    return 10 * i + j + 100 * i


def test_parts_in_one_launch_equal_their_own_launches():
    y = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0])
    (ids,), (added,) = launch([_grid_ids_part(3, 4), _add_in_place_part(y, 0.5)],
                              interpret=True)
    np.testing.assert_array_equal(np.asarray(ids), _want_ids(3, 4))
    np.testing.assert_array_equal(np.asarray(added), np.asarray(y) + 0.5)
    (alone,), = launch([_grid_ids_part(3, 4)], interpret=True)
    np.testing.assert_array_equal(np.asarray(alone), _want_ids(3, 4))


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_three_parts_in_any_order(order):
    y = jnp.arange(6, dtype=jnp.float32)
    z = jnp.arange(5, dtype=jnp.float32) * 10
    parts = [_add_in_place_part(y, 1.0), _grid_ids_part(2, 5), _add_to_even_entries_part(z, 3.0)]
    outs = launch([parts[k] for k in order], interpret=True)
    by_part = {k: out for k, out in zip(order, outs)}
    np.testing.assert_array_equal(np.asarray(by_part[0][0]), np.arange(6) + 1.0)
    np.testing.assert_array_equal(np.asarray(by_part[1][0]), _want_ids(2, 5))
    # the even entries got +3; the odd ones, never written, are the aliased input's
    np.testing.assert_array_equal(np.asarray(by_part[2][0]), [3.0, 10.0, 23.0, 30.0, 43.0])


def test_no_parts_is_an_error():
    with pytest.raises(ValueError, match="at least one part"):
        launch([])


def test_program_ids_unravel_axis_zero_fastest():
    """A part's flat program ids map to grid ids with axis 0 fastest, as a GPU grid runs."""
    got = [tuple(int(v) for v in _unravel(p, (3, 2))) for p in range(6)]
    assert got == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [tuple(int(v) for v in _unravel(p, (2, 1, 3))) for p in (0, 1, 2, 5)] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 2)]
