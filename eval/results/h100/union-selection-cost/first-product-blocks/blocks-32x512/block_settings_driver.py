"""bench_decode with the batch predictor's first product at block settings FP=rows,block_d,d_chunks."""
import os
import dejavu_jax  # noqa: F401
import dejavu_jax.sparse as sp
import dejavu_jax.kernels.batch_predictor_select as bps
from dejavu_jax.kernels.gather_matvec import gather_matvec_part
from dejavu_jax.kernels._common import next_pow2

rows, bd, chunks = map(int, os.environ["FP"].split(","))


def first_product_part(segment):
    return gather_matvec_part(segment.x, [segment], block_rows=rows,
                              block_d=min(bd, next_pow2(segment.x.shape[1])), d_chunks=chunks)


bps.first_product_part = first_product_part
sp.first_product_part = first_product_part
import importlib  # noqa: E402
raise SystemExit(importlib.import_module("dejavu_jax.eval." + os.environ.get("FP_MODULE", "bench_decode")).main())
