"""The GPU parity tool's split-predictor check, run through the Pallas interpreter.

On the GPU the kernel path's predictor hidden units are summed in another order than the
reference's, and are then rounded to bfloat16: one fp32 rounding step there moves a score
by a bfloat16 step, which can swap two near-equal scores at the top-k boundary. The check
must accept such sets (a top-k of the reference scores, up to key ties) and still catch
sets that are not a top-k. Here the kernel path's hidden units are moved by a relative
2**-8, alternating in sign, to stand in for that rounding; a move of a third of their
size stands in for a wrong selection.
"""

import jax.numpy as jnp
import pytest

from dejavu_jax.eval import kernel_parity
from dejavu_jax.kernels import predictor_select

STEPS = 4


def _moved_hidden_units(monkeypatch, relative):
    real = predictor_select._hidden_loader

    def moved(act_refs, r, valid, rows, **kw):
        a = real(act_refs, r, valid, rows, **kw)
        return a * (1 + relative * jnp.where(r % 2 == 0, 1.0, -1.0))

    monkeypatch.setattr(predictor_select, "_hidden_loader", moved)
    monkeypatch.setattr(kernel_parity, "SPLIT_VARIANTS", ((True, "stacked"),), raising=False)


def test_split_check_accepts_sets_moved_by_a_rounding_step(monkeypatch, tmp_path):
    _moved_hidden_units(monkeypatch, 2.0 ** -8)
    code = kernel_parity.main(["--impl", "interpret", "--checks", "split", "--steps",
                               str(STEPS), "--out", str(tmp_path)])
    assert code == 0
    row = _split_row(tmp_path)
    equal, total = map(int, row["sets_equal"].split("/"))
    assert equal < total, "the moved hidden units changed no set: the test shows nothing"
    assert row["logits_vs_reference_path"] > 1e-3     # another set, another step
    assert 0 < row["selection_slack"] <= kernel_parity.TIE_SLACK
    assert row["logits"] <= 1e-4 and row["k_cache"] <= 1e-4


def test_split_check_rejects_sets_that_are_not_a_top_k(monkeypatch, tmp_path):
    _moved_hidden_units(monkeypatch, 0.3)
    code = kernel_parity.main(["--impl", "interpret", "--checks", "split", "--steps",
                               str(STEPS), "--out", str(tmp_path)])
    row = _split_row(tmp_path)
    assert row["selection_slack"] > kernel_parity.TIE_SLACK
    assert code == 1


def _split_row(folder):
    import json
    rows = json.loads((folder / "kernel_parity.json").read_text())["rows"]
    (row,) = [r for r in rows
              if r["check"] == "split" and r["ride"] and r["layout"] == "stacked"]
    return row


def test_steps_must_be_positive():
    with pytest.raises(SystemExit):
        kernel_parity.main(["--steps", "0"])


def test_the_gate_reports_no_rows_for_code_that_fails_parity(monkeypatch, tmp_path):
    """On a GPU a benchmark reuses a passing parity file of the same code and device, and
    otherwise runs the checks; a failing run stops it before any row (SystemExit)."""
    import json
    import types

    import jax

    from dejavu_jax.eval import parity_gate
    from dejavu_jax.eval.provenance import code_fingerprint
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(device_kind="H200")])
    runs = []

    def fake_main(argv, verdict):
        runs.append(argv)
        folder = tmp_path / "out" / "kernel_parity"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel_parity.json").write_text(json.dumps({"meta": {"checks": 3}}))
        return verdict

    passing = tmp_path / "pass.json"
    meta = dict(passed=True, code_fingerprint=code_fingerprint(), device="H200", checks=44)
    passing.write_text(json.dumps({"meta": meta}))
    monkeypatch.setattr(kernel_parity, "main", lambda argv: fake_main(argv, 0))
    got = parity_gate.require_parity(passing, tmp_path / "out", log=lambda *_: None)
    assert got["status"] == "passed" and got["checks"] == 44 and not runs
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"meta": {**meta, "code_fingerprint": "other"}}))
    got = parity_gate.require_parity(stale, tmp_path / "out", log=lambda *_: None)
    assert got["status"] == "passed" and got["checks"] == 3 and len(runs) == 1
    monkeypatch.setattr(kernel_parity, "main", lambda argv: fake_main(argv, 1))
    with pytest.raises(SystemExit, match="no benchmark rows"):
        parity_gate.require_parity(None, tmp_path / "out", log=lambda *_: None)
    assert len(runs) == 2


@pytest.mark.parametrize("moved", [0.0, 1e-2])
def test_batch_select_check_replays_the_chosen_sets(monkeypatch, tmp_path, moved):
    """The batch check passes on the riding path and fails once the MLP norm's launch
    that carries the selection's first product returns other rows."""
    import json

    from dejavu_jax import sparse
    real = sparse.kernels.layer_norm

    def norm(*a, riders=(), **kw):
        out = real(*a, riders=riders, **kw)
        return (out[0] + moved, out[1]) if riders else out

    monkeypatch.setattr(sparse.kernels, "layer_norm", norm)
    monkeypatch.setattr(kernel_parity, "BATCH_SELECT_HEADS", (0.5,))
    monkeypatch.setattr(kernel_parity, "BATCH_SELECT_METHODS", ("local",))
    code = kernel_parity.main(["--impl", "interpret", "--checks", "batch-select", "--steps",
                               "1", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "kernel_parity.json").read_text())["rows"]
    assert row["rides"] and row["select"] == "local"
    assert code == (1 if moved else 0)
    assert (row["logits"] > 1e-3) == bool(moved)


def test_gemma2_decode_check_runs_the_soft_cap_through_the_kernels():
    """The Gemma 2 case of the decode check: the interpreted kernels match the references
    in both layouts (each batch row with its own heads included), and the soft-cap bends
    the reference's logits, so a kernel that skipped it would fail the check."""
    import dataclasses

    import jax
    import numpy as np

    from dejavu_jax import sparse
    from dejavu_jax.params import init_params
    case = ("gemma2-tiny", ((0.3, 0.5),), ("unrolled", "rows"))
    rows = kernel_parity.decode_rows("interpret", 3, cases=[case])
    assert [r["layout"] for r in rows] == ["unrolled", "rows"]
    assert all(kernel_parity.row_passes(r, 1e-4) for r in rows), rows
    config = kernel_parity.tiny_config("gemma2-tiny")
    params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
    scfg = dataclasses.replace(sparse.sparse_config(config, 0.3, 0.5, dense_layers=1,
                                                    kv_window=4),
                               batch_policy="kernels", impl="reference")
    sets = kernel_parity.random_sets(config, scfg, seed=3)
    capped = kernel_parity._decode(config, scfg, params, sets, 3, False)[0]
    uncapped = kernel_parity._decode(config.replace(attn_logit_softcap=None), scfg, params,
                                     sets, 3, False)[0]
    assert np.isfinite(capped).all()
    assert np.abs(capped - uncapped).max() > 1e-2 * np.abs(capped).max()


def test_threshold_check_decodes_a_capped_batch_through_the_kernels(monkeypatch):
    """The threshold check's two-row Gemma 2 case runs the activation-sparse kernels (not
    the dense layers a batch decodes with by default) and matches the reference, whose
    logits the soft-cap bends beyond the check's tolerance."""
    import dataclasses

    import jax
    import numpy as np

    from dejavu_jax import sparse
    from dejavu_jax.kernels import threshold_matvec as tm
    from dejavu_jax.params import init_params
    case = [c for c in kernel_parity.THRESHOLD_CASES if c[0] == "gemma2-tiny"]
    assert case and case[0][2] == 2
    calls = []
    real = tm.threshold_matvec
    monkeypatch.setattr(tm, "threshold_matvec",
                        lambda *a, **kw: calls.append(kw.get("impl")) or real(*a, **kw))
    kernel_parity._compiled.cache_clear()   # built once per configuration
    rows = kernel_parity.threshold_rows("interpret", 2, case, kernels=False)
    kernel_parity._compiled.cache_clear()
    # the default ThresholdConfig, then every kernel switch on
    assert [r["kernels"] for r in rows] == ["defaults", "all"]
    assert all(kernel_parity.row_passes(r, 1e-4) for r in rows), rows
    assert "interpret" in calls
    config = kernel_parity.tiny_config("gemma2-tiny")
    params = init_params(config, jax.random.key(0), jnp.float32, std=0.1)
    thresholds = jnp.zeros((config.n_layers, 5), jnp.float32)
    scfg = dataclasses.replace(sparse.threshold_config(config, rows[0]["sites"]),
                               batch_policy="kernels", impl="reference")
    capped, uncapped = (kernel_parity._decode(c, scfg, params, thresholds, 2, False,
                                              sparse.no_selector, batch=2)[0]
                        for c in (config, config.replace(attn_logit_softcap=None)))
    assert np.abs(capped - uncapped).max() > 1e-2


def test_switches_check_runs_each_switch_against_its_reference(tmp_path):
    """Check 8 runs the input-sparse GEMV with its column blocks first and the evict-first
    hint, the residual added in the launch and from partials, and the MLP pair and
    head-sparse attention with the hint, each within the tolerance of its jnp reference
    (interpreted)."""
    import json
    code = kernel_parity.main(["--impl", "interpret", "--checks", "switches", "--out",
                               str(tmp_path)])
    rows = json.loads((tmp_path / "kernel_parity.json").read_text())["rows"]
    assert code == 0 and all(r["check"] == "switches" and r["ok"] for r in rows)
    gemv = [r for r in rows if r["kernel"] == "threshold_matvec"]
    assert {r["residual_atomics"] for r in gemv} == {True, False}
    assert all(r["columns_first"] and r["evict_first"] for r in gemv)
    assert {(r["B"], r["gated"]) for r in rows if r["kernel"] == "sparse_mlp"} == {
        (1, False), (3, True)}
    assert {(r["B"], r["n_kv"]) for r in rows if r["kernel"] == "head_sparse_attention"} == {
        (1, 8), (3, 4)}
    assert all(0 <= r["logits"] < 1e-4 for r in rows)
