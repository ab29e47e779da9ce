"""eval.topk_overlap: the local top-k's share of the exact set, and its JSON."""
import json

from dejavu_jax.eval import topk_overlap


def test_one_chunk_is_the_exact_set_and_more_chunks_lose_a_little():
    one = topk_overlap.overlap_row(1536, 154, trials=2, chunk=2048, seed=0)
    assert one["chunks"] == 1 and one["overlap_exact_min"] == 1.0
    many = topk_overlap.overlap_row(8192, 819, trials=2, chunk=1024, seed=0)
    assert many["chunks"] == 8 and 0.9 < many["overlap_exact_mean"] < 1.0


def test_cli_writes_rows_and_meta(tmp_path):
    out = tmp_path / "o.json"
    assert topk_overlap.main(["--models", "smollm2-135m", "--fractions", "0.1",
                              "--trials", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows"][0]["k"] == 154 and res["meta"]["command"].startswith("python -m")
