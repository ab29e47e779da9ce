"""Pallas GPU kernels for contextually-sparse decoding, with pure-jnp references.

* :func:`sparse_mlp` -- MLP over a selected set of neurons (fused gather + GEMV).
* :func:`head_sparse_attention` -- one decode step over a selected set of heads (KV
  groups and, for GQA, a query-head mask from :func:`query_head_groups`), with optional
  missing-KV recomputation (:class:`KVWindow`); per batch row with a ``[B, Kh, G]`` mask.
* :func:`row_head_attention` -- each batch row's attention core over its own heads, for
  queries projected densely.
* :func:`top_k_indices` -- the top-k unit ids of a score vector in one launch.
* :func:`layer_norm` -- LayerNorm / RMSNorm of a few rows in one launch (optionally also
  the rows over their RMS, the predictors' input).

All take ``impl`` = None (auto: Pallas on GPU, reference elsewhere), "pallas",
"interpret" or "reference".
"""
from .head_attention import (AttnConfig, KVWindow, head_sparse_attention,
                             head_sparse_attention_reference, query_head_groups,
                             row_head_attention, row_head_attention_reference)
from .layer_norm import layer_norm, layer_norm_reference
from .sparse_mlp import MLPConfig, sparse_mlp, sparse_mlp_reference
from .threshold_matvec import ThresholdBlocks, ThresholdConfig
from .top_k import top_k_indices, top_k_indices_reference

__all__ = ["sparse_mlp", "sparse_mlp_reference", "MLPConfig", "ThresholdBlocks",
           "ThresholdConfig", "head_sparse_attention",
           "head_sparse_attention_reference", "AttnConfig", "KVWindow", "query_head_groups",
           "row_head_attention", "row_head_attention_reference", "top_k_indices",
           "top_k_indices_reference", "layer_norm", "layer_norm_reference"]
