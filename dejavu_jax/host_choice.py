"""Choosing each decoded token on the host from inside the device's decode loop.

A serving loop that picks tokens on the host (its own sampler, a grammar, a logits
processor) would otherwise synchronise every step: wait for the step, copy its logits,
choose, and dispatch the next step, which hands every weight array over again while the
device idles. Here the steps stay in one device loop and each ends in a host callback
(`jax.experimental.io_callback`) that receives the step's logits and returns the chosen
ids: only the logits and the ids cross per token. A `CandidateChooser` receives only each
row's k highest logits and their ids (found on the device, `top_candidates`), so a
sampler that needs no more (greedy, top-k, top-p over the head of the distribution, a
grammar's allowed set among them) pays for k values a row instead of the vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

CandidatePick = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class CandidateChooser:
    """A host chooser that sees each row's `k` highest logits: `pick(values, ids)`, with
    values float32 [B, k] in descending order and ids int32 [B, k] their vocabulary ids,
    returns the chosen vocabulary ids [B]."""
    pick: CandidatePick
    k: int = 64

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"a candidate chooser needs k >= 1 candidates, got {self.k!r}")


Chooser = Callable[[np.ndarray], np.ndarray] | CandidateChooser


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


def top_candidates(logits: jax.Array, k: int, chunk: int = 1024):
    """(values float32 [B, k] descending, ids int32 [B, k]): each row's k largest logits,
    exactly (ties by the lower id). Two stages: the top k of every `chunk` ids, then the
    top k of those, instead of one top k over the whole vocabulary (a sort of it on GPUs)."""
    batch, vocab = logits.shape
    k = min(k, vocab)
    x = logits.astype(jnp.float32)
    if vocab <= 2 * chunk or k >= chunk:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    n = -(-vocab // chunk)
    x = jnp.pad(x, ((0, 0), (0, n * chunk - vocab)), constant_values=-jnp.inf)
    values, ids = jax.lax.top_k(x.reshape(batch, n, chunk), k)
    ids = ids + (jnp.arange(n, dtype=ids.dtype) * chunk)[:, None]
    values, at = jax.lax.top_k(values.reshape(batch, n * k), k)
    return values, jnp.take_along_axis(ids.reshape(batch, n * k), at, -1).astype(jnp.int32)


def host_chosen(choose: Chooser, logits: jax.Array) -> jax.Array:
    """int32 [B]: `choose(logits)` run on the host, where logits is a float32 numpy array
    [B, V] of this step (for a `CandidateChooser`, `choose.pick(values, ids)` on the step's
    top `choose.k` candidates); callable inside jit and `lax.scan` (each call waits for its
    step's logits, and the next step for its ids). A chooser that raises or returns an
    invalid choice (wrong shape, not integers, an id outside [0, V)) does not stop the
    device program: the step gets ids 0 and the error waits for `raise_failed_choice`."""
    batch, vocab = logits.shape
    if isinstance(choose, CandidateChooser):
        payload = top_candidates(logits, choose.k)
        fn = choose.pick
    else:
        payload, fn = (logits.astype(jnp.float32),), choose

    def call(*host):
        try:
            return checked_ids(fn(*(np.asarray(a) for a in host)), batch, vocab)
        except Exception as e:  # reported on the host by raise_failed_choice
            _failures.append(e)
            return np.zeros(batch, np.int32)

    return io_callback(call, jax.ShapeDtypeStruct((batch,), jnp.int32), *payload)


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


def _first_candidate(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return ids[:, 0]


HOST_ARGMAX_CANDIDATES = CandidateChooser(_first_candidate, k=64)
"""The greedy choice on the host from the top 64 candidates (the benchmarks' chooser)."""
