"""Shared helpers for the sparse kernels: dispatch, validation, activations.

Every public kernel takes ``impl``:

* ``None``       -- auto: compiled Pallas on GPU, the jnp reference elsewhere;
* ``"pallas"``   -- compiled Pallas (Triton lowering; GPU only);
* ``"interpret"``-- the same Pallas kernels run by the Pallas interpreter
  (any backend; used by the CPU tests);
* ``"reference"``-- the pure-jnp reference.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

IMPLS = ("pallas", "interpret", "reference")


def resolve_impl(impl: str | None) -> str:
    """Map ``impl`` (None or one of :data:`IMPLS`) to a concrete implementation."""
    if impl is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
    return impl


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of the default device, which size the kernels' grids: a
    GPU's own count, else the H200's 132 (the grids then only matter to the interpreter)."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else 132


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_pow2(n: int) -> bool:
    """Whether n is a positive power of two."""
    return n >= 1 and not n & (n - 1)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def balanced_chunks(n_chunks: int, want: int) -> int:
    """Chunks per program when ``n_chunks`` column chunks split into as few equal-sized
    runs of at most ``max(1, want)`` chunks as possible (the last run no shorter)."""
    n_chunks = max(1, int(n_chunks))
    runs = cdiv(n_chunks, max(1, min(n_chunks, int(want))))
    return cdiv(n_chunks, runs)


def erf(x):
    """The error function from exp and a polynomial (Abramowitz and Stegun 7.1.26; absolute
    error below 1.5e-7), so that kernels can use it: Triton has no erf."""
    a = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    return jnp.sign(x) * (1.0 - poly * jnp.exp(-a * a))


def soft_cap(logits, cap: float | None):
    """``cap * tanh(logits / cap)`` (Gemma 2's attention and final logits), or the logits
    unchanged when ``cap`` is None. Plain jnp, so kernels call it on their tiles too."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def activation_fn(name: str):
    """Elementwise activation by name, usable both in jnp and inside kernels."""
    if name == "relu":
        return lambda h: jnp.maximum(h, 0.0)
    if name == "silu":
        return lambda h: h / (1.0 + jnp.exp(-h))
    if name == "gelu":  # the exact (erf) form, as OPT's "gelu"
        return lambda h: 0.5 * h * (1.0 + erf(h * float(np.sqrt(0.5))))
    if name == "gelu_tanh":  # the tanh approximation (Gemma's GeGLU; gelu_new)
        c = float(np.sqrt(2.0 / np.pi))
        return lambda h: 0.5 * h * (1.0 + jnp.tanh(c * (h + 0.044715 * h * h * h)))
    if name == "identity":
        return lambda h: h
    raise ValueError(
        f"activation must be one of 'relu', 'silu', 'gelu', 'gelu_tanh', 'identity'; got "
        f"{name!r}")


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------

def check_array(name: str, a, ndim: int | None = None, shape=None, floating: bool = False):
    """Raise TypeError/ValueError if ``a`` is not an array of the given rank/shape."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(a.shape)}")
    if shape is not None:
        want = tuple(shape)
        if tuple(a.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")
    if floating and not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")


def check_indices(name: str, idx, upper: int, *, distinct: bool = True):
    """Check an index vector: rank 1, integer dtype, and (when concrete) in range/distinct."""
    check_array(name, idx, ndim=1)
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer (int32) array, got dtype {idx.dtype}")
    if idx.shape[0] < 1:
        raise ValueError(f"{name} must select at least one entry, got length 0")
    if idx.shape[0] > upper:
        raise ValueError(f"{name} has {idx.shape[0]} entries but only {upper} exist")
    if isinstance(idx, jax.core.Tracer):
        return
    try:
        v = np.asarray(idx)
    except Exception:  # non-concrete array types: skip value checks
        return
    if v.min() < 0 or v.max() >= upper:
        raise ValueError(
            f"{name} values must lie in [0, {upper}); got min {v.min()}, max {v.max()}")
    if distinct and np.unique(v).size != v.size:
        raise ValueError(f"{name} must hold distinct values")


def check_bias(name: str, b, shape, dtype_like=None):
    """Bias may be None; otherwise it must have exactly ``shape``."""
    if b is None:
        return
    check_array(name, b, shape=shape, floating=True)
