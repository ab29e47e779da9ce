"""The decode benchmark (eval/bench_decode.py) on CPU: its rows, their batches and timings,
the bytes-per-step formula against the parameter arrays, the HF config mapping, and the
HF modes skipped with a log line where torch is missing."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dejavu_jax import config as config_lib
from dejavu_jax import generation, model, sparse
from dejavu_jax.eval import bench_decode, bench_hf
from dejavu_jax.params import init_params

BF16 = jnp.bfloat16


def nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def counted_step_bytes(config, context: int, batch: int) -> int:
    """What a dense decode step reads, counted from the arrays the benchmark allocates:
    every weight once, except that the embedding (when the LM head is separate) and the
    position table are only gathered for the `batch` new tokens (the tied embedding is read
    whole as the LM head, plus those rows), plus the K/V cache of `context` tokens."""
    params = jax.eval_shape(lambda k: init_params(config, k, BF16), jax.random.key(0))
    total = sum(nbytes(x) for x in jax.tree.leaves(params.layers))
    for field in dataclasses.fields(params):
        x = getattr(params, field.name)
        if field.name == "layers" or x is None:
            continue
        if field.name == "pos_embed":
            total += batch * x.shape[1] * jnp.dtype(x.dtype).itemsize
        elif field.name == "embed":
            rows = batch * x.shape[1] * jnp.dtype(x.dtype).itemsize
            total += rows + (nbytes(x) if params.lm_head is None else 0)
        else:
            total += nbytes(x)
    cache = jax.eval_shape(lambda: model.init_state(config, batch, context, BF16))
    return total + nbytes(cache.k) + nbytes(cache.v)


@pytest.fixture
def no_bandwidth_probe(monkeypatch):
    """For the runs that check no bandwidth figure: the run's memory-bandwidth probe
    (`measure_best_bandwidth`, seconds of bf16 GEMVs and copies on the CPU) returns a
    constant; test_bench_decode_cli runs and checks the probe itself."""
    def probe(gb=4.0, detail=None):
        if detail is not None:
            detail.update({"W@x": 1.0, "x@W": 1.0, "chain": 1.0, "copy": 1.0})
        return 1.0
    monkeypatch.setattr(bench_decode, "measure_best_bandwidth", probe)


@pytest.mark.parametrize("name", ["opt-tiny", "opt-350m", "opt-6.7b", "llama-tiny",
                                  "smollm2-135m"])
def test_step_bytes_counts_every_weight(name):
    config = config_lib.preset(name)
    for context, batch in ((8, 1), (1024, 4)):
        dense = bench_decode.step_bytes(config, None, context, batch, 64, False)
        assert dense == counted_step_bytes(config, context, batch)
        # the sparse formula at full density, all layers sparse, is the dense one
        full = sparse.sparse_config(config, 1.0, 1.0, dense_layers=0)
        assert bench_decode.step_bytes(config, full, context, batch, 64, False) == dense
    # predictor rows add both predictors of every sparse layer, as the bench runs them
    from dejavu_jax.train.predictor_model import decode_predictors
    rank, dense_layers = 64, 1
    preds = jax.eval_shape(lambda k: decode_predictors(
        bench_decode.random_predictors(config, rank, k)), jax.random.key(1))
    per_layer = sum(nbytes(x) for x in jax.tree.leaves(preds)) // config.n_layers
    scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=dense_layers)
    with_preds = bench_decode.step_bytes(config, scfg, 8, 1, rank, True)
    without = bench_decode.step_bytes(config, scfg, 8, 1, rank, False)
    assert with_preds - without == per_layer * (config.n_layers - dense_layers)
    # fewer units read fewer bytes
    half = sparse.sparse_config(config, 0.5, 0.5, dense_layers=dense_layers)
    assert bench_decode.step_bytes(config, half, 8, 1, rank, False) < without
    # by default a batch runs every layer dense: dense bytes, no predictor, any sets
    for predictors in (True, False):
        assert (bench_decode.step_bytes(config, half, 8, 2, rank, predictors)
                == bench_decode.step_bytes(config, None, 8, 2, rank, False))
    # under the "union" policy a batch's predicted neurons are the union's capacity: 2 rows
    # at half density read every neuron; with the union of their heads, every head too:
    # the layer runs dense and reads no predictor. With per-row heads (the default) the
    # union's head weights are every head's, but each row reads only its own groups' K/V;
    # fixed sets read their k neurons at any batch
    def union(mlp, heads):
        return dataclasses.replace(sparse.sparse_config(config, mlp, heads,
                                                        dense_layers=dense_layers),
                                   batch_policy="union")
    dense2 = bench_decode.step_bytes(config, None, 8, 2, rank, False)
    assert bench_decode.step_bytes(config, union(0.5, 0.5), 8, 2, rank, True,
                                   row_heads=False) == dense2
    sparse_layers = config.n_layers - dense_layers
    kh = union(0.5, 0.5).head_k[-1]
    skipped_kv = 2 * (config.n_kv_heads - min(config.n_kv_heads, kh)) * 2 * 8 * config.head_dim
    assert (bench_decode.step_bytes(config, union(0.5, 0.5), 8, 2, rank, True)
            == dense2 - 2 * skipped_kv * sparse_layers + per_layer * sparse_layers)
    assert (bench_decode.step_bytes(config, union(0.25, 0.5), 8, 2, rank, False)
            < bench_decode.step_bytes(config, None, 8, 2, rank, False))
    quarter, half_mlp = union(0.25, 1.0), union(0.5, 1.0)
    assert (bench_decode.step_bytes(config, quarter, 8, 2, rank, True)
            == bench_decode.step_bytes(config, half_mlp, 8, 2, rank, False)
            + per_layer * (config.n_layers - dense_layers))
    # without the batch fallbacks the half-neuron union is read as gathered rows
    kernels_only = dataclasses.replace(quarter, batch_policy="kernels")
    assert (bench_decode.step_bytes(config, kernels_only, 8, 2, rank, True)
            < bench_decode.step_bytes(config, quarter, 8, 2, rank, True))
    # "shared": the batch-1 weights and predictors once, each further row its token's
    # embedding (and OPT position) row and the K/V of the shared heads' groups
    # (below `batch_dense_mlp`, so the MLP gathers its rows at any batch)
    quarter_mlp = sparse.sparse_config(config, 0.25, 0.5, dense_layers=dense_layers)
    shared = dataclasses.replace(quarter_mlp, batch_policy="shared")
    extra_row = config.embed_dim + (config.hidden if config.family == "opt" else 0)
    for layer in range(config.n_layers):
        kg = min(config.n_kv_heads, shared.head_k[layer])
        extra_row += kg * 2 * 8 * config.head_dim
    one = bench_decode.step_bytes(config, quarter_mlp, 8, 1, rank, True)
    assert (bench_decode.step_bytes(config, shared, 8, 3, rank, True)
            == one + 2 * 2 * extra_row)


@pytest.mark.parametrize("name", sorted(config_lib.PRESETS))
def test_hf_config_round_trips(name):
    """bench_hf builds the HF peers from our presets: reading the HF config back gives the
    preset (every field: sizes, norms, biases, tying, rope)."""
    pytest.importorskip("transformers")
    config = config_lib.preset(name)
    hf = bench_hf.hf_config(config).to_dict()
    assert config_lib.from_hf_config(hf, name=name) == config


@pytest.mark.parametrize("fixture", ["gemma", "gemma2", "gemma3", "phi3-longrope",
                                     "phi3-partial"])
def test_hf_config_round_trips_for_fixture_configs(fixture):
    """The same for configs read from the fixtures' HF checkpoints: Gemma 2's attention
    soft-cap, Phi-3's LongRoPE factors and partial rotary width survive the round trip."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from dejavu_jax.loading import read_config
    config = read_config(Path(__file__).parent / "fixtures" / "hf" / fixture)
    hf = bench_hf.hf_config(config).to_dict()
    assert config_lib.from_hf_config(hf, name=config.name) == config


def test_cache_len_holds_every_step():
    # prompt + synchronised warmup and steps + the two device-loop runs, with a margin
    assert bench_hf.cache_len(128, 3, 20) == 128 + 3 + 20 + 2 * 20 + 64


def test_bench_decode_cli(tmp_path, monkeypatch):
    # a torch that cannot be imported, for the HF child process (CI has none anyway)
    fake = tmp_path / "no_torch"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(fake)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = tmp_path / "bench"
    ctx = 8
    assert bench_decode.main([
        "--models", "opt-tiny", "--contexts", str(ctx), "--batch", "1,2", "--steps", "2",
        "--warmup", "1", "--prefill-reps", "1", "--mlp", "0.5", "--heads", "0.25",
        "--layouts", "stacked", "--modes", "dense,sparse,hf-eager,hf-compiled",
        "--out", str(out)]) == 0

    log = (out / "bench_decode.log").read_text()
    assert ("hf-eager, hf-compiled skipped: torch/transformers not importable in" in log
            and "No module named 'torch'" in log)
    result = json.loads((out / "bench_decode.json").read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["hf"]["skipped"] and meta["batches"] == [1, 2]
    assert set(meta["best_detail"]) == {"W@x", "x@W", "chain", "copy"}
    assert meta["best_gbs"] == max(meta["best_detail"].values())

    assert sorted((r["mode"], r["batch"]) for r in rows) == [
        ("dense", 1), ("dense", 2), ("sparse", 1), ("sparse", 2)]
    config = config_lib.preset("opt-tiny")
    weights = sum(nbytes(x) for x in jax.tree.leaves(
        jax.eval_shape(lambda k: init_params(config, k, BF16), jax.random.key(0))))
    by = {(r["mode"], r["batch"]): r for r in rows}
    for r in rows:
        assert r["model"] == "opt-tiny" and r["context"] == ctx and r["layout"] == "stacked"
        for key in ("ms", "p90_ms", "ms_loop", "prefill_ms", "compile_s", "compile_step_s",
                    "compile_loop_s", "compile_prefill_s"):
            # the dense engine's row reuses the dense row's compiled prefill
            reused = key == "compile_prefill_s" and r["indices"].endswith("(dense engine)")
            assert math.isfinite(r[key]) and (r[key] >= 0 if reused else r[key] > 0), (key, r)
        assert r["compile_s"] == pytest.approx(
            r["compile_prefill_s"] + r["compile_step_s"] + r["compile_loop_s"])
        assert r["peak_bytes"] is None  # CPU keeps no memory stats
        assert r["step_peak_bytes"] > 0
        assert r["cache_len"] == bench_hf.cache_len(ctx, 1, 2)
        assert r["gbs"] == pytest.approx(r["bytes"] / r["ms_loop"] / 1e6)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_loop"])
        assert r["speedup_vs_hf_eager"] is None and r["speedup_vs_hf_compiled"] is None
    for batch in (1, 2):
        dense, sp = by["dense", batch], by["sparse", batch]
        assert dense["bytes"] == counted_step_bytes(config, ctx, batch)
        assert dense["step_peak_bytes"] >= weights  # XLA's estimate includes the arguments
        # batch 2 runs every layer dense: the row times the dense engine, as generate runs it
        label = "predictor-exact" + " (dense engine)" * (batch > 1)
        assert sp["indices"] == label and (sp["mlp"], sp["heads"]) == (0.5, 0.25)
        scfg = sparse.sparse_config(config, 0.5, 0.25, dense_layers=2)
        assert sp["bytes"] == bench_decode.step_bytes(config, scfg, ctx, batch, 256, True)
        assert sp["speedup"] == pytest.approx(dense["ms"] / sp["ms"])
        assert sp["speedup_loop"] == pytest.approx(dense["ms_loop"] / sp["ms_loop"])
        assert dense["speedup"] == 1.0

    table = (out / "bench_decode.md").read_text()
    for column in ("ms (synced)", "ms_loop", "tokens/s", "prefill ms", "compile s",
                   "peak GB", "vs dense (synced / loop)", "vs hf-eager", "vs hf-compiled"):
        assert column in table
    assert sum(line.startswith("| opt-tiny |") for line in table.splitlines()) == 4

    # --merge: these rows with an HF run's (made up here; torch is not needed)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf_row = dict(model="opt-tiny", layout="hf", mode="hf-eager", context=ctx, batch=2,
                  mlp=1.0, heads=1.0, indices="-", ms=7.0, p90_ms=8.0, ms_loop=None,
                  prefill_ms=3.0, compile_s=None, peak_bytes=2_000_000_000)
    (hf_dir / "bench_decode.json").write_text(json.dumps(
        dict(meta=dict(best_gbs=None), rows=[hf_row])))
    merged = tmp_path / "merged"
    assert bench_decode.main(["--merge", f"{out},{hf_dir}", "--out", str(merged)]) == 0
    rows = json.loads((merged / "bench_decode.json").read_text())["rows"]
    assert [r["mode"] for r in rows if r["batch"] == 2] == ["hf-eager", "dense", "sparse"]
    for r in rows:
        if r["mode"] != "hf-eager":
            if r["batch"] == 2:
                assert r["speedup_vs_hf_eager"] == pytest.approx(7.0 / r["ms"])
            else:
                assert r["speedup_vs_hf_eager"] is None
            assert r["best_gbs"] == meta["best_gbs"]
    assert "| opt-tiny | hf | hf-eager | 8 | 2 |" in (merged / "bench_decode.md").read_text()
    assert {r["source"] for r in rows} == {out.name, "hf"}

    # a second run of the same settings, in a folder of the same name, whose dense rows are
    # twice as slow: each run's sparse rows are compared with their own run's dense row
    run2 = tmp_path / "second" / out.name
    run2.mkdir(parents=True)
    first = json.loads((out / "bench_decode.json").read_text())
    slow = [dict(r, ms=2 * r["ms"], ms_loop=2 * r["ms_loop"]) if r["mode"] == "dense" else r
            for r in first["rows"]]
    (run2 / "bench_decode.json").write_text(json.dumps(dict(first, rows=slow)))
    both = tmp_path / "both"
    assert bench_decode.main(["--merge", f"{out},{run2}", "--out", str(both)]) == 0
    rows = json.loads((both / "bench_decode.json").read_text())["rows"]
    for r in rows:
        if r["mode"] == "sparse":
            d = next(x for x in rows if x["mode"] == "dense" and x["batch"] == r["batch"]
                     and x["source"] == r["source"])
            assert r["speedup_loop"] == pytest.approx(d["ms_loop"] / r["ms_loop"])
            assert "dense_source" not in r
    assert {r["source"] for r in rows} == {out.name, f"second/{out.name}"}
    ratios = sorted(r["speedup_loop"] for r in rows if r["mode"] == "sparse" and r["batch"] == 1)
    assert ratios[1] == pytest.approx(2 * ratios[0])
    assert "| run |" in (both / "bench_decode.md").read_text()


def test_unknown_mode_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        bench_decode.main(["--modes", "dense,hf-fast", "--out", str(tmp_path)])


def test_unknown_select_method_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_decode.main(["--select", "radix,fastest", "--out", str(tmp_path)])
    assert "unknown --select methods ['fastest']" in capsys.readouterr().err


def test_kernel_config_flags_parse_and_label_the_rows(tmp_path):
    from dejavu_jax.kernels import AttnConfig, MLPConfig
    [got] = bench_decode.parse_kernel_configs("out_num_warps=8,out_block_rows=16", "")
    assert got == {"attn_config": AttnConfig(out_num_warps=8, out_block_rows=16)}
    assert bench_decode.config_label(got) == " [attn.out_block_rows=16,attn.out_num_warps=8]"
    assert bench_decode.parse_kernel_configs("", "") == [{}]
    grid = bench_decode.parse_kernel_configs("base/out_block_rows=16", "base/num_stages=3")
    assert grid == [{"attn_config": a, "mlp_config": m}
                    for a in (AttnConfig(), AttnConfig(out_block_rows=16))
                    for m in (MLPConfig(), MLPConfig(num_stages=3))]
    assert [bench_decode.config_label(c) for c in grid] == [
        "", " [mlp.num_stages=3]", " [attn.out_block_rows=16]",
        " [attn.out_block_rows=16,mlp.num_stages=3]"]
    assert bench_decode.config_label({}) == ""
    unrolls = bench_decode.parse_kernel_configs("", "", "dense", "1,4,all")
    assert unrolls == [{"layer_unroll": 1}, {"layer_unroll": 4}, {"layer_unroll": True}]
    assert [bench_decode.config_label(c) for c in unrolls] == [" [unroll=1]", " [unroll=4]",
                                                                " [unroll=all]"]
    with pytest.raises(SystemExit):
        bench_decode.main(["--attn-config", "no_such_field=1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_decode.main(["--layer-unroll", "0", "--out", str(tmp_path)])


def test_kernel_config_variants_are_rows_of_one_run(tmp_path, no_bandwidth_probe):
    """Each --mlp-config variant gets its own sparse rows, labelled, with its config."""
    out = tmp_path / "variants"
    assert bench_decode.main([
        "--models", "opt-tiny", "--contexts", "8", "--steps", "1", "--warmup", "1",
        "--prefill-reps", "1", "--mlp", "0.5", "--heads", "0.5", "--modes", "sparse,fixed",
        "--select", "local", "--loop-only", "--mlp-config", "base/num_stages=3",
        "--out", str(out)]) == 0
    rows = json.loads((out / "bench_decode.json").read_text())["rows"]
    got = {r["indices"]: r["kernel_config"]["mlp_config"]["num_stages"] for r in rows}
    assert got == {"predictor-local": 2, "fixed": 2, "predictor-local [mlp.num_stages=3]": 3,
                   "fixed [mlp.num_stages=3]": 3}


def test_compile_option_sets_parse_label_and_check_their_logits(tmp_path, no_bandwidth_probe):
    """--compile-options: typed values, one row per set, each compared with a base compile."""
    sets = bench_decode.parse_compile_options(
        "base/xla_gpu_enable_command_buffer=/xla_a=true+xla_b=-3+xla_c=SKIP_TEMP")
    assert sets == [None, {"xla_gpu_enable_command_buffer": ""},
                    {"xla_a": True, "xla_b": -3, "xla_c": "SKIP_TEMP"}]
    grid = bench_decode.parse_kernel_configs("", "", "dense", "", "base/xla_a=false")
    assert grid == [{}, {"compile_options": {"xla_a": False}}]
    assert bench_decode.config_label(grid[1]) == " [xla.xla_a=False]"
    with pytest.raises(ValueError, match="xla_<option>=value"):
        bench_decode.parse_compile_options("enable_fast_math=1")
    out = tmp_path / "options"
    assert bench_decode.main([
        "--models", "opt-tiny", "--contexts", "8", "--steps", "1", "--warmup", "1",
        "--prefill-reps", "1", "--mlp", "0.5", "--heads", "0.5", "--modes", "sparse",
        "--select", "local", "--layouts", "stacked",
        "--compile-options", "base/xla_cpu_enable_fast_math=false", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_decode.json").read_text())["rows"]
    assert [r["indices"] for r in rows] == [
        "predictor-local", "predictor-local [xla.xla_cpu_enable_fast_math=False]"]
    assert "logits_vs_base" not in rows[0]
    diff, spread, largest = rows[1]["logits_vs_base"]
    assert spread == 0.0          # the interpreter's sums do not vary between runs
    assert largest > 0 and diff <= 1e-5 * largest   # a math option that changes nothing here
    assert rows[1]["ms"] > 0 and rows[1]["ms_loop"] > 0


def test_step_parts_config_variants_parse():
    from dejavu_jax.kernels.bench_step_parts import parse_variants
    from dejavu_jax.kernels.head_attention import AttnConfig
    from dejavu_jax.kernels.sparse_mlp import MLPConfig
    got = parse_variants("base/block_s=32/num_warps=8,num_stages=3/seq_splits=None",
                         AttnConfig)
    assert [name for name, _ in got] == ["base", "block_s=32", "num_warps=8,num_stages=3",
                                         "seq_splits=None"]
    assert got[0][1] == AttnConfig()
    from dejavu_jax.kernels.bench_step_parts import parse_blocks
    assert parse_blocks("2x256d") == (2, 256, True) and parse_blocks("8x512") == (8, 512, False)
    from dejavu_jax.kernels.bench_step_parts import parse_out_variant
    assert parse_out_variant("cols:8x512,num_warps=8") == dict(
        kernel="cols", block_rows=8, block_d=512, num_warps=8)
    with pytest.raises(ValueError, match="unknown out-proj option"):
        parse_out_variant("cols:8x512,warps=8")
    with pytest.raises(ValueError, match="unknown out-proj option"):
        parse_out_variant("cols:8x512,group_view=1")
    with pytest.raises(ValueError, match="cols kernel only"):
        parse_out_variant("rows:16x512,num_warps=8")
    assert got[1][1].block_s == 32 and got[1][1].num_warps == AttnConfig().num_warps
    assert (got[2][1].num_warps, got[2][1].num_stages) == (8, 3)
    assert got[3][1].seq_splits is None
    assert parse_variants("fc1_d_chunks=7", MLPConfig)[0][1].fc1_d_chunks == 7
    with pytest.raises(ValueError, match="no field"):
        parse_variants("base/warps=8", AttnConfig)


def test_loop_only_grid_reuses_the_sparse_prefill(tmp_path, no_bandwidth_probe):
    out = tmp_path / "grid"
    assert bench_decode.main([
        "--models", "opt-tiny", "--contexts", "8", "--batch", "1", "--steps", "2",
        "--warmup", "1", "--prefill-reps", "1", "--mlp", "0.5", "--heads", "0.25,0.5",
        "--layouts", "stacked", "--modes", "dense,sparse,fixed", "--select",
        "local,local-apart", "--dense-qkv", "both", "--loop-only", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_decode.json").read_text())["rows"]
    assert sorted(r["indices"] for r in rows) == [
        "-", "fixed", "predictor-local", "predictor-local", "predictor-local-apart",
        "predictor-local-apart", "qkv-separate"]
    for r in rows:
        assert r["ms"] is None and r["p90_ms"] is None and r["gbs_synced"] is None
        assert r["ms_loop"] > 0 and r["compile_loop_s"] > 0 and r["compile_step_s"] == 0
    sparse_rows = [r for r in rows if r["mode"] == "sparse"]
    cached = [r for r in sparse_rows if r.get("prefill_cached")]
    # the 4 predictor rows share one prefill (same selector params); the first compiles it
    assert len(cached) == 3 and all(r["compile_prefill_s"] == 0 for r in cached)
    assert all(r["compile_prefill_s"] > 0 for r in rows if not r.get("prefill_cached"))
    dense = next(r for r in rows if r["mode"] == "dense" and r["indices"] == "-")
    for r in sparse_rows:
        assert r["speedup"] is None
        assert r["speedup_loop"] == pytest.approx(dense["ms_loop"] / r["ms_loop"])
    table = (out / "bench_decode.md").read_text()
    assert "| – / " in table


def test_grid_without_prefill_or_fixed_rows(tmp_path, no_bandwidth_probe):
    """--prefill-tokens 0 holds the whole context as zeros (no prefill to compile or time);
    without the fixed mode there are only the dense and predictor rows."""
    out = tmp_path / "noprefill"
    ctx = 24
    assert bench_decode.main([
        "--models", "opt-tiny", "--contexts", str(ctx), "--batch", "1", "--steps", "2",
        "--warmup", "1", "--mlp", "0.5", "--heads", "0.5", "--layouts", "stacked",
        "--modes", "dense,sparse", "--select", "local", "--loop-only",
        "--prefill-tokens", "0", "--host-choice", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_decode.json").read_text())["rows"]
    assert sorted(r["indices"] for r in rows) == ["-", "predictor-local"]
    config = config_lib.preset("opt-tiny")
    for r in rows:
        assert math.isfinite(r["ms_host"]) and r["ms_host"] > 0  # tokens chosen on the host
        assert r["prefill_ms"] is None and r["compile_prefill_s"] == 0
        assert r["prefill_tokens"] == 0 and r["context"] == ctx
        assert math.isfinite(r["ms_loop"]) and r["ms_loop"] > 0
        assert r["compile_s"] == pytest.approx(r["compile_loop_s"])
    dense = next(r for r in rows if r["mode"] == "dense")
    assert dense["bytes"] == counted_step_bytes(config, ctx, 1)
    with pytest.raises(SystemExit):
        bench_decode.main(["--prefill-tokens", "0", "--generate-tokens", "4",
                           "--out", str(tmp_path / "bad")])


def test_prefill_key_ignores_the_sparse_config_but_not_shapes():
    config = config_lib.preset("opt-tiny")
    a = sparse.sparse_engine(config, sparse.sparse_config(config, 0.5, 0.5), sparse.fixed_selector)
    b = sparse.sparse_engine(config, sparse.sparse_config(config, 0.1, 1.0), sparse.fixed_selector)
    params = (jax.eval_shape(lambda k: init_params(config, k, BF16), jax.random.key(0)), None)
    prompt = jnp.zeros((1, 8), jnp.int32)
    state = jax.eval_shape(lambda: a.init_state(1, 32, BF16))
    key = bench_decode.prefill_key(a, params, prompt, prompt, state)
    assert key is not None and key == bench_decode.prefill_key(b, params, prompt, prompt, state)
    longer = jnp.zeros((1, 9), jnp.int32)
    assert key != bench_decode.prefill_key(a, params, longer, longer, state)
    dense = __import__("dejavu_jax.generation", fromlist=["dense_engine"]).dense_engine(config)
    assert key != bench_decode.prefill_key(dense, params, prompt, prompt, state)


@pytest.mark.parametrize("per_layer", [False, True])
def test_random_sets_are_random_per_layer(per_layer):
    """The fixed rows' sets: each sparse layer's first k ids are its own sorted random set
    (not the first k units, which a draw of the densest layer's k would give)."""
    from dejavu_jax.eval.bench_tp import random_local_sets
    config = config_lib.preset("opt-tiny").replace(n_layers=4)
    scfg = sparse.sparse_config(config, 0.25, 0.5, dense_layers=2)
    neurons, heads = bench_decode.random_sets(config, scfg, per_layer=per_layer)
    for layer in range(2, 4):
        for sets, k, n in ((neurons, scfg.mlp_k[layer], config.ffn),
                           (heads, scfg.head_k[layer], config.n_heads)):
            ids = np.asarray(sets[layer][:k])
            assert len(set(ids.tolist())) == k and (np.diff(ids) > 0).all() and ids.max() < n
    firsts = [np.asarray(neurons[l][:scfg.mlp_k[l]]) for l in (2, 3)]
    assert not np.array_equal(firsts[0], np.arange(scfg.mlp_k[2]))
    assert not np.array_equal(firsts[0], firsts[1])
    local, _ = random_local_sets(config, scfg, tp=2)
    k_loc = scfg.mlp_k[2] // 2
    block = np.asarray(local[2]).reshape(2, -1)[:, :k_loc]
    assert all((np.diff(b) > 0).all() for b in block)
    assert not np.array_equal(block[0], np.arange(k_loc))


def test_profile_layer_sequence_is_one_middle_layer():
    from dejavu_jax.eval.profile_decode import layer_sequence
    ordered = [("embed", 1.0)]
    for layer in range(4):
        ordered += [("attn", 2.0), (f"mlp{layer}", 3.0), (f"norm{layer}", 0.5)]
    assert layer_sequence(ordered, "attn") == [("attn", 2.0), ("mlp1", 3.0), ("norm1", 0.5)]
    assert layer_sequence(ordered[:2], "attn") == []
    # two traced steps: the span across the step boundary (logits, dense layers) is skipped
    two = ordered + [("logits", 4.0), ("dense", 9.0), ("dense", 9.0)] + ordered[1:]
    seq = layer_sequence(two, "attn")
    assert [n for n, _ in seq][0] == "attn" and len(seq) == 3
    assert all(n not in ("logits", "dense") for n, _ in seq)


def test_trace_summary_splits_device_kernels_from_host_spans(tmp_path):
    """trace_kernels: kernels from the device process, the host's spans apart, span and
    busy time from the device's events alone."""
    import gzip
    from dejavu_jax.eval.profile_decode import trace_kernels
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "fc1", "ts": 10.0, "dur": 4.0},
        {"ph": "X", "pid": 1, "name": "fc2", "ts": 20.0, "dur": 6.0},
        {"ph": "X", "pid": 1, "name": "fc1", "ts": 30.0, "dur": 4.0},
        {"ph": "X", "pid": 2, "name": "Execute", "ts": 0.0, "dur": 50.0},
        {"ph": "X", "pid": 2, "name": "Update", "ts": 1.0, "dur": 7.0},
        {"ph": "X", "pid": 2, "name": "Update", "ts": 9.0, "dur": 3.0},
    ]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_kernels(str(tmp_path))
    assert got["kernels"] == {"fc1": [2, 8.0], "fc2": [1, 6.0]}
    assert got["host"] == {"Execute": [1, 50.0], "Update": [2, 10.0]}
    assert got["span_us"] == 24.0 and got["busy_us"] == 14.0
    assert got["processes"] == ["/device:GPU:0"]


def test_kernel_bench_cli_takes_model_names_and_fractions(tmp_path, capsys):
    """kernels.bench speaks the project's vocabulary: opt-30b, densities as fractions."""
    from dejavu_jax.kernels import bench as kernel_bench
    for bad, message in ((["--models", "30b"], "unknown model '30b'"),
                         (["--densities", "10"], "not a fraction"),
                         (["--head-fractions", "0.5,50"], "not a fraction")):
        with pytest.raises(SystemExit):
            kernel_bench.main(bad + ["--out", str(tmp_path)])
        assert message in capsys.readouterr().err
    kernel_bench.main(["--models", "opt-30b", "--densities", "0.05,0.1", "--head-fractions",
                       "0.5,1", "--time-limit-s", "60", "--no-sweep", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "bench.json").read_text())
    assert "--time-limit-s 60" in res["meta"]["command"]
    rows = dict(meta=res["meta"], check=[], tune=[], attn=[],
                mlp=[dict(model="opt-30b", B=1, density=0.1, K=2867, which="sparse",
                          bytes=82e6, time_us=37.0, gbps=2216.0)])
    assert "| opt-30b | 1 | 0.1 | 2867 | sparse |" in kernel_bench.markdown_table(rows)


def test_held_context_counts_the_first_slots_as_tokens():
    """A short prefill, then a held context of 20: slot 20, the first 20 slots valid and
    (sparse state) written for every layer and group, every row at position 20."""
    from dejavu_jax.batch_plan import held_context
    config = config_lib.preset("opt-tiny")
    scfg = sparse.sparse_config(config, 0.5, 0.5, dense_layers=1)
    state = sparse.init_sparse_state(config, scfg, 2, 32, jnp.float32)
    held = held_context(state, 20)
    assert int(held.dense.slot) == 20
    assert np.asarray(held.dense.positions).tolist() == [20, 20]
    want = np.arange(32) < 20
    assert (np.asarray(held.dense.valid) == want).all()
    assert (np.asarray(held.written) == want).all()
    dense_only = held_context(state.dense, 7)
    assert int(dense_only.slot) == 7 and np.asarray(dense_only.valid)[:, :7].all()


def test_time_generate_reports_chunked_and_streamed_rates():
    config = config_lib.preset("opt-tiny")
    params = init_params(config, jax.random.key(0), jnp.float32)
    from dejavu_jax.generation import dense_engine
    res = bench_decode.time_generate(dense_engine(config), params, np.array([[2, 5, 9]]), 20)
    assert res["generate_new_tokens"] == 20 and res["generate_chunk"] == 8
    for key in ("generate_ms", "stream_ms"):
        assert math.isfinite(res[key]) and res[key] > 0


def test_profile_decode_takes_threshold_modes(tmp_path, capsys):
    """profile_decode profiles activation sparsity at a level spec next to dense; a bad spec
    is a one-line error; the layer anchor is a kernel launched once per layer."""
    from dejavu_jax.eval import profile_decode
    with pytest.raises(SystemExit):
        profile_decode.main(["--model", "llama-tiny", "--modes", "threshold:nope.json",
                             "--out", str(tmp_path)])
    assert "neither uniform" in capsys.readouterr().err
    profile_decode.main(["--model", "llama-tiny", "--modes", "threshold:uniform:0.5",
                         "--steps", "2", "--trace-steps", "1", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "profile.json").read_text())["rows"]
    assert row["mode"] == "threshold:uniform:0.5"
    assert 0 < row["ms_device_loop"] < 1e4 and 0 < row["ms_synced"] < 1e4
    per_token = [("gemv", 8.0, 50.0), ("qkv", 4.0, 20.0), ("o", 4.0, 10.0)]
    assert profile_decode.once_per_layer(per_token, 4, "attention") == "qkv"
    assert profile_decode.once_per_layer(per_token, 4, "o") == "o"


def test_a_cache_larger_than_the_free_memory_is_skipped_unrun(tmp_path, monkeypatch,
                                                              no_bandwidth_probe):
    """A (context, batch) whose K/V cache exceeds the device's free bytes logs one SKIPPED
    line and runs none of its rows; the cells that fit run as before."""
    config = config_lib.preset("opt-tiny")
    engine = generation.dense_engine(config)
    small = bench_decode.state_bytes(engine, 1, bench_decode.cache_len(16, 1, 2),
                                     dict(per_layer=False))
    big = bench_decode.state_bytes(engine, 4, bench_decode.cache_len(16, 1, 2),
                                   dict(per_layer=False))
    k_and_v = 2 * config.n_layers * 4 * config.n_kv_heads * config.head_dim * 2
    assert big >= k_and_v * bench_decode.cache_len(16, 1, 2) > small
    monkeypatch.setattr(bench_decode, "device_free_bytes", lambda: (small + big) // 2)
    out = tmp_path / "fits"
    assert bench_decode.main([
        "--models", "opt-tiny", "--contexts", "16", "--batch", "1,4", "--steps", "2",
        "--warmup", "1", "--mlp", "0.5", "--heads", "0.5", "--layouts", "stacked",
        "--modes", "dense", "--loop-only", "--prefill-tokens", "0", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_decode.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1]
    assert math.isfinite(rows[0]["ms_loop"]) and rows[0]["ms_loop"] > 0
    assert "SKIPPED opt-tiny stacked ctx=16 batch=4" in (out / "bench_decode.log").read_text()


def test_dispatch_overhead_times_every_layout(tmp_path, monkeypatch):
    """`eval.dispatch_overhead` on tiny OPT: one row per layout (per-layer, small arrays
    packed, stacked K/V cache), every timing finite and positive, fewer buffers packed.
    Two layers and a vocabulary of 512 (a preset added for the run): the per-layer
    programs grow with the layer count, and none of this depends on the sizes."""
    from dejavu_jax.eval import dispatch_overhead
    small = config_lib.preset("opt-tiny").replace(n_layers=2, vocab_size=512,
                                                  name="opt-tiny-2-layers")
    monkeypatch.setitem(config_lib.PRESETS, small.name, small)
    assert dispatch_overhead.main(["--models", small.name, "--packed", "--stacked-cache",
                                   "--steps", "1", "--warmup", "0", "--out",
                                   str(tmp_path)]) == 0
    result = json.loads((tmp_path / "dispatch_overhead.json").read_text())
    rows = {r["layout"]: r for r in result["rows"]}
    assert set(rows) == {"per-layer", "per-layer-packed", "per-layer-stacked-cache"}
    timings = ("chained", "compiled_synced", "jit_synced", "jit_queued", "args_only",
               "args_weights_only", "sync_floor", "host_chosen", "callback_floor")
    for row in rows.values():
        assert all(np.isfinite(row[t]) and row[t] > 0 for t in timings), row
    assert rows["per-layer"]["args_stacked_cache"] > 0
    assert rows["per-layer-packed"]["leaves"] < rows["per-layer"]["leaves"]
    assert result["meta"]["code_fingerprint"]


def test_bench_thresholds_times_each_level_under_each_block_variant(monkeypatch):
    """`bench_thresholds.run_model` builds each level's engine with each variant's
    `ThresholdConfig` and labels its rows with the variant's name and settings."""
    from dejavu_jax import sparse
    from dejavu_jax.eval import bench_thresholds
    built = []
    real = sparse.sparse_engine

    def spy(config, scfg, selector):
        built.append(scfg.threshold_blocks)
        return real(config, scfg, selector)
    monkeypatch.setattr(sparse, "sparse_engine", spy)
    variants = bench_thresholds.block_variants("deep:down.row_blocks=8,down.num_stages=4")
    rows = bench_thresholds.run_model("llama-tiny", ["uniform:0.5"], [16], 1, 2,
                                      lambda msg: None, variants)
    assert built == [cfg for _, cfg in variants]
    sparse_rows = [r for r in rows if r["mode"] == "threshold"]
    assert [r["blocks"] for r in sparse_rows] == ["default", "deep"]
    assert sparse_rows[1]["block_settings"]["down"]["row_blocks"] == 8
    assert all(np.isfinite(r["ms_loop"]) and r["ms_loop"] > 0 for r in rows)


def test_bench_thresholds_runs_each_layout_on_its_own_weights(monkeypatch):
    """`--layouts unrolled,stacked`: the threshold rows run per-layer buffers and then the
    stacked weights (the engine's state shaped for each), labelled by layout; the dense row
    stays on per-layer buffers; every timing is finite."""
    from dejavu_jax.eval import bench_decode, bench_thresholds
    seen = []
    real = bench_decode.measure_engine

    def spy(engine, params, *args, **kwargs):
        layers = params[0].layers if isinstance(params, tuple) else params.layers
        seen.append((isinstance(layers, tuple), args[-1]["per_layer"]))
        return real(engine, params, *args, **kwargs)
    monkeypatch.setattr(bench_decode, "measure_engine", spy)
    rows = bench_thresholds.run_model("llama-tiny", ["uniform:0.5"], [16], 1, 2,
                                      lambda msg: None, None, ("unrolled", "stacked"))
    assert [(r["mode"], r.get("layout")) for r in rows] == [
        ("dense", None), ("threshold", "unrolled"), ("threshold", "stacked")]
    assert seen == [(True, True), (True, True), (False, False)]
    assert all(np.isfinite(r[k]) and r[k] > 0 for r in rows for k in ("ms", "ms_loop"))
