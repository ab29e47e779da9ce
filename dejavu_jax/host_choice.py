"""Choosing each decoded token on the host from inside the device's decode loop.

A serving loop that picks tokens on the host (its own sampler, a grammar, a logits
processor) would otherwise synchronise every step: wait for the step, copy its logits,
choose, and dispatch the next step, which hands every weight array over again while the
device idles. Here the steps stay in one device loop and each ends in a host callback
(`jax.experimental.io_callback`) that receives the step's logits and returns the chosen
ids: only the logits and the ids cross per token.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

Chooser = Callable[[np.ndarray], np.ndarray]


def checked_ids(ids, batch: int, vocab: int) -> np.ndarray:
    """`ids` as int32 [batch], or ValueError unless they are `batch` integers in [0, vocab)."""
    arr = np.asarray(ids)
    if arr.shape != (batch,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"a host chooser must return {batch} integer ids (one per row), "
                         f"got {arr.dtype} {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise ValueError(f"a host chooser returned id {int(arr.min() if arr.min() < 0 else arr.max())}"
                         f" outside the vocabulary [0, {vocab})")
    return arr.astype(np.int32)


_failures: list[Exception] = []


def host_chosen(choose: Chooser, logits: jax.Array) -> jax.Array:
    """int32 [B]: `choose(logits)` run on the host, where logits is a float32 numpy array
    [B, V] of this step; callable inside jit and `lax.scan` (each call waits for its step's
    logits, and the next step for its ids). A chooser that raises or returns an invalid
    choice (wrong shape, not integers, an id outside [0, V)) does not stop the device
    program: the step gets ids 0 and the error waits for `raise_failed_choice`."""
    batch, vocab = logits.shape

    def call(host_logits):
        try:
            return checked_ids(choose(np.asarray(host_logits)), batch, vocab)
        except Exception as e:  # reported on the host by raise_failed_choice
            _failures.append(e)
            return np.zeros(batch, np.int32)

    return io_callback(call, jax.ShapeDtypeStruct((batch,), jnp.int32),
                       logits.astype(jnp.float32))


def raise_failed_choice(pending=None) -> None:
    """Raise ValueError for the first chooser failure since the last check (later ones are
    dropped); nothing when there was none. Call it once the device call's results are
    ready; `pending`: device values still being computed, waited for before raising so that
    their own failures are dropped with this one."""
    if _failures:
        if pending is not None:
            jax.block_until_ready(pending)
        first = _failures[0]
        _failures.clear()
        raise ValueError(f"host chooser failed: {first}") from first


def host_argmax(logits: np.ndarray) -> np.ndarray:
    """The greedy choice made on the host: each row's argmax (the benchmarks' chooser)."""
    return logits.argmax(-1)
