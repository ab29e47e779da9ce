"""Checks of the token ids and masks that the model's entry points receive.

An id outside [0, vocab_size) is no error on the device: the embedding lookup
(`jnp.take`) fills its row with NaN, and NaN logits follow. So every public entry point
(`model.logits`, `prefill`, `decode_step`, the engines' prefill and step, the scorers,
`generate_tokens`) calls these checks first.

Shapes and dtypes are static, so they are checked always, at trace time too. Values can
only be checked on concrete arrays: under `jax.jit` the ids are traced, and inside a jitted
function the contract (ids in [0, vocab_size)) is the caller's. The jitted entry points
therefore check their concrete arguments before they enter the jit (`checked`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np


def is_traced(x) -> bool:
    """Whether `x` is a tracer (inside jit, vmap or grad), whose values are unknown."""
    return isinstance(x, jax.core.Tracer)


def _host_blocks(x) -> list[np.ndarray]:
    """The values of a concrete array on the host: the whole array, or for an array that
    spans several processes, this process's shards."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return [np.asarray(s.data) for s in x.addressable_shards]
    return [np.asarray(x)]


def _shape_and_dtype(x) -> tuple[tuple[int, ...], np.dtype]:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), np.dtype(x.dtype)
    arr = np.asarray(x)
    if arr.size == 0 and arr.dtype == np.float64:  # an empty list
        return arr.shape, np.dtype(np.int64)
    return arr.shape, arr.dtype


def check_token_ids(ids, vocab_size: int, name: str = "input_ids",
                    shape: str = "[batch, time]") -> None:
    """Raise ValueError unless `ids` is an integer array with the axes of `shape`
    ("[batch, time]", or "[batch]" for one token per row) whose values, when concrete, all
    lie in [0, vocab_size). The message names `name`, the first bad id, its position and
    the vocabulary size."""
    ndim = shape.count(",") + 1
    got, dtype = _shape_and_dtype(ids)
    if len(got) != ndim:
        raise ValueError(f"{name} must be {shape}, got shape {got}")
    if dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {dtype}")
    if 0 in got:
        raise ValueError(f"{name} is empty (shape {got}): every row needs a token")
    if is_traced(ids):
        return
    sharded = isinstance(ids, jax.Array) and not ids.is_fully_addressable
    for block in _host_blocks(ids):
        bad = np.flatnonzero((block < 0) | (block >= vocab_size))
        if bad.size:
            where = [int(i) for i in np.unravel_index(bad[0], block.shape)]
            raise ValueError(
                f"{name}: token id {int(block[tuple(where)])} at {where}"
                f"{' of a local shard' if sharded else ''} is outside the vocabulary: ids "
                f"must be in [0, {vocab_size}) for this model (vocab_size {vocab_size})")


def check_mask(mask, ids_shape: tuple[int, ...], name: str = "attention_mask") -> None:
    """Raise ValueError unless `mask` has the shape of the ids and a bool or integer dtype."""
    got, dtype = _shape_and_dtype(mask)
    if got != tuple(ids_shape):
        raise ValueError(f"{name} shape {got} != input_ids shape {tuple(ids_shape)}")
    if dtype.kind not in "biu":
        raise ValueError(f"{name} must be bool or integer (1 = real token), got dtype {dtype}")


def check_prompt(input_ids, attention_mask, vocab_size: int, state=None) -> None:
    """Checks for a prefill: ids [B, T] in the vocabulary, a mask of their shape, and, with
    a decode state (`.valid` [B, S]), its batch of B rows and room for the T tokens."""
    check_token_ids(input_ids, vocab_size)
    check_mask(attention_mask, np.shape(input_ids))
    check_left_padded(attention_mask)
    valid = getattr(state, "valid", None)
    if valid is not None:
        (B, T), (Bs, S) = np.shape(input_ids), valid.shape
        if B != Bs or T > S:
            raise ValueError(f"prompts [{B}, {T}] do not fit a decode state of {Bs} rows and "
                             f"{S} cache slots")


def check_left_padded(attention_mask) -> None:
    """Raise ValueError unless a concrete prompt mask [B, T] holds only 0 and 1 and every
    row ends with a real token: a prefill returns the last column's logits, which for a
    right-padded or empty row would be a padding position's. Traced masks are not checked."""
    if is_traced(attention_mask):
        return
    for block in _host_blocks(attention_mask):
        block = block.astype(np.int64)
        if ((block != 0) & (block != 1)).any():
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only, got "
                             f"{sorted(set(np.unique(block).tolist()) - {0, 1})[:3]}")
        rows = np.flatnonzero(block[:, -1] == 0)
        if rows.size:
            raise ValueError(f"attention_mask row {int(rows[0])} ends with padding: prompts "
                             "must be left-padded, with a token in the last column")


def check_step_tokens(tokens, vocab_size: int, state=None) -> None:
    """Checks for a decode step: tokens [B] in the vocabulary, one per row of the state,
    and, when the state's next slot is concrete, a free cache slot to write."""
    check_token_ids(tokens, vocab_size, "tokens", "[batch]")
    valid = getattr(state, "valid", None)
    if valid is not None and np.shape(tokens)[0] != valid.shape[0]:
        raise ValueError(f"tokens has {np.shape(tokens)[0]} rows; the decode state has "
                         f"{valid.shape[0]}")
    slot = getattr(state, "slot", None)
    if valid is not None and slot is not None and not is_traced(slot) \
            and int(_host_blocks(slot)[0]) >= valid.shape[1]:
        raise ValueError(f"the decode state's cache is full ({valid.shape[1]} slots): "
                         "make the state with a larger max_len")


def largest_position(positions) -> int | None:
    """The largest of concrete position ids (this process's shards of an array spanning
    several), or None for traced ones."""
    if is_traced(positions):
        return None
    return max(int(b.max()) for b in _host_blocks(positions))


def check_next_positions(positions, limit: int, what: str = "positions") -> None:
    """Raise ValueError when concrete position ids [B] of the next tokens reach `limit`
    (an OPT model's learned positions end there); traced ones are not checked."""
    largest = largest_position(positions)
    if largest is not None and largest >= limit:
        raise ValueError(f"the next token would pass the model's {limit} {what}")


def checked(jitted, check):
    """`jitted` (a jax.jit function) behind `check(*args, **kwargs)`, which runs first on
    the concrete arguments of every call; `.lower` and `.trace` stay the jitted ones."""

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        check(*args, **kwargs)
        return jitted(*args, **kwargs)

    call.lower, call.trace = jitted.lower, jitted.trace
    return call
