"""Benchmark-only variants of sparse decoding: slower or inexact, kept for comparison.

Not part of the user-facing API. `generate`, `SparseConfig` and `sparse.predictor_selector`
offer only the measured-best choices (the top-k methods `sparse.SELECT_METHODS`: "exact",
the default, and "local", the fastest on the GPU). The benchmarks (eval/bench_decode.py,
eval/profile_decode.py, eval/kernel_parity.py) and the tests also run what those were
measured against (docs/kernels.md, "What was tried"):

  TOP_K_VARIANTS        top-k methods superseded by "local": "threshold" (sort-free jnp),
                        "radix" (`kernels.top_k_indices`, one Pallas launch, exact at
                        bfloat16 precision), "chunked" (the radix set in three launches),
                        "packed" (the radix set through one integer sort)
  APART                 a --select suffix: the split selector's score product and selection
                        in launches of their own instead of riding in the MLP's launches
  UNION_HEADS           a --select suffix: a batch selects the union of its rows' heads
                        (every row attends with all of them) instead of per-row heads
  XLA_BATCH             a --select suffix: a batch scores and selects through XLA (the
                        layer's predictors sliced out, small fusions) instead of
                        `kernels.batch_predictor_select`'s three launches
  HEADS_IN_FC1          a --select suffix: a batch's heads are selected in the fc1 launch
                        (beside the score product) instead of the fc2 launch, which then
                        holds the union's chunk programs alone
  without_kv_recompute  missing-KV recomputation off (inexact: isolates its cost)
"""

from __future__ import annotations

import dataclasses

from dejavu_jax import sparse

TOP_K_VARIANTS = ("threshold", "radix", "chunked", "packed")
APART = "-apart"
UNION_HEADS = "-union-heads"
XLA_BATCH = "-xla-batch"
HEADS_IN_FC1 = "-heads-in-fc1"
SUFFIXES = (APART, UNION_HEADS, XLA_BATCH, HEADS_IN_FC1)


def _split_name(name: str) -> tuple[str, set[str]]:
    """(method, suffixes) of a --select entry."""
    found = set()
    while True:
        for suffix in SUFFIXES:
            if name.endswith(suffix) and suffix not in found:
                found.add(suffix)
                name = name.removesuffix(suffix)
                break
        else:
            return name, found


def _method(name: str) -> str:
    return _split_name(name)[0]


def is_selector_name(name: str) -> bool:
    """Whether `name` is a benchmark --select entry: a method of `sparse.SELECT_METHODS` or
    `TOP_K_VARIANTS`, optionally with any of the suffixes `SUFFIXES`, each at most once."""
    return _method(name) in sparse.SELECT_METHODS + TOP_K_VARIANTS


def variant_top_k(method: str, scores, k: int, impl: str | None = None):
    """int32 ids [k] of one row of scores [n] by a `TOP_K_VARIANTS` method, or None where the
    method defers to the exact selection ("packed" beyond 2**16 scores)."""
    from dejavu_jax.kernels.top_k import top_k_indices, top_k_indices_chunked
    from dejavu_jax.topk import packed_top_k, threshold_top_k
    if method == "threshold":
        return threshold_top_k(scores, k)
    if method == "radix":
        return top_k_indices(scores, k, impl=impl)
    if method == "chunked":
        return top_k_indices_chunked(scores, k, impl=impl)
    if method == "packed":
        return packed_top_k(scores, k) if scores.shape[0] <= 1 << 16 else None
    raise ValueError(f"unknown top-k variant {method!r}; choose from {TOP_K_VARIANTS}")


def variant_selector(group_size: int, name: str, impl: str | None = None,
                     union_capacity=None) -> sparse.PredictorSelector:
    """The predictor selector of a benchmark --select entry (see `is_selector_name`).

    The method picks each row's top-k as `sparse.predictor_selector` does for the public
    ones; the suffix `APART` keeps a split selector out of the MLP's launches,
    `UNION_HEADS` gives a batch the union of its rows' heads, `XLA_BATCH` has a batch
    select through XLA, and `HEADS_IN_FC1` moves a batch's heads selection into fc1's
    launch.
    """
    if not is_selector_name(name):
        raise ValueError(f"unknown selection method {name!r}; choose from "
                         f"{sparse.SELECT_METHODS + TOP_K_VARIANTS} (optionally + any of "
                         f"{SUFFIXES})")
    method, suffixes = _split_name(name)
    return sparse.PredictorSelector(group_size, union_capacity, method, impl,
                                    ride_mlp_launches=APART not in suffixes,
                                    row_heads=UNION_HEADS not in suffixes,
                                    batch_kernels=XLA_BATCH not in suffixes,
                                    batch_heads_in_fc1=HEADS_IN_FC1 in suffixes)


def without_kv_recompute(scfg: sparse.SparseConfig) -> sparse.SparseConfig:
    """`scfg` with missing-KV recomputation off: selected heads see zeros for the entries they
    missed. Inexact; the benchmarks use it to isolate the recomputation's cost."""
    return dataclasses.replace(scfg, _kv_recompute=False)
