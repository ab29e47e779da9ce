"""Per-layer batch plans (`SparseConfig.batch_layers`) and their measurement
(`dejavu_jax.batch_plan`): every mode gives each row the logits of that row decoded alone
with the same sets, "dense" layers run the dense layer with no selection, and the measured
plan is never timed slower than the all-dense step it is compared with."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import batch_plan, kernels, sparse
from dejavu_jax.generation import dense_engine, left_pad

PROMPTS = [[5, 9, 14, 3, 7], [8, 2], [11, 4, 6]]


def _setup(preset="opt-tiny"):
    config = dj.preset(preset)
    params = dj.init_params(config, jax.random.key(5), jnp.float32, std=0.1)
    L, F, H = config.n_layers, config.ffn, config.n_heads
    rng = np.random.default_rng(2)
    k, kh = F // 4, H // 2
    neurons = np.sort(np.stack([rng.permutation(F)[:k] for _ in range(L)]), axis=1)
    heads = np.sort(np.stack([rng.permutation(H)[:kh] for _ in range(L)]), axis=1)
    sets = (jnp.asarray(neurons, jnp.int32), jnp.asarray(heads, jnp.int32))
    scfg = sparse.SparseConfig((k,) * L, (kh,) * L, dense_layers=1, kv_window=4,
                               batch_policy="union")
    return config, params, sets, scfg


def _decode(engine, params, rows, tokens):
    ids, mask = (jnp.asarray(a) for a in left_pad([PROMPTS[r] for r in rows]))
    state = engine.init_state(len(rows), 32, jnp.float32)
    prefill, step = jax.jit(engine.prefill), jax.jit(engine.step)
    logits, state = prefill(params, ids, mask, state)
    out = []
    for t in range(tokens.shape[0]):
        logits, state = step(params, state, jnp.asarray(tokens[t, rows]))
        out.append(np.asarray(logits))
    out = np.stack(out)
    assert np.isfinite(out).all()
    return out


@pytest.mark.parametrize("plan", [("dense", "sparse", "sparse", "sparse"),
                                  ("dense", "masked", "masked", "masked"),
                                  ("dense", "dense", "sparse", "masked")])
def test_every_mode_gives_each_row_its_own_logits(plan, monkeypatch):
    """A batch of 3 under a plan: each row's logits at every step equal that prompt decoded
    alone (batch 1, the sparse kernels' references) with the same sets and the plan's
    dense layers dense; the MLP kernel runs for a batch only in "sparse" layers."""
    config, params, sets, scfg = _setup()
    cfg = dataclasses.replace(scfg, batch_layers=plan)
    alone_cfg = dataclasses.replace(scfg, dense_layers=plan.count("dense"))
    calls = []
    real = kernels.sparse_mlp
    monkeypatch.setattr(kernels, "sparse_mlp",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    eng = sparse.sparse_engine(config, cfg, sparse.fixed_selector)
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, (3, 3))
    batch = _decode(eng, (params, sets), [0, 1, 2], tokens)
    batch_calls = [b for b in calls if b == 3]
    assert bool(batch_calls) == ("sparse" in plan)
    alone_eng = sparse.sparse_engine(config, alone_cfg, sparse.fixed_selector)
    for r in range(3):
        alone = _decode(alone_eng, (params, sets), [r], tokens)
        assert np.abs(batch[:, r] - alone[:, 0]).max() <= 1e-5


def test_an_all_dense_plan_is_the_dense_model_and_selects_nothing():
    """Every layer "dense": the logits are the dense engine's, and the selector is never
    called."""
    config, params, sets, scfg = _setup("llama-tiny")
    cfg = dataclasses.replace(scfg, batch_layers=("dense",) * config.n_layers)

    def never(*a):
        raise AssertionError("a dense layer selected")

    tokens = np.random.default_rng(1).integers(3, config.vocab_size, (3, 2))
    got = _decode(sparse.sparse_engine(config, cfg, never), (params, sets), [0, 1], tokens)
    want = _decode(dense_engine(config), params, [0, 1], tokens)
    assert np.abs(got - want).max() <= 1e-5


def test_batch_layers_validation():
    config, _, _, scfg = _setup()
    L = config.n_layers
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        dataclasses.replace(scfg, batch_layers=("fast",) * L)
    with pytest.raises(ValueError, match="modes for"):
        dataclasses.replace(scfg, batch_layers=("dense",) * (L + 1))
    with pytest.raises(ValueError, match="batch_policy 'union'"):
        dataclasses.replace(scfg, batch_policy="dense", batch_layers=("dense",) * L)


def test_layer_classes_group_equal_k_and_merge_past_the_limit():
    config = dj.preset("llama-tiny")
    L = config.n_layers
    scfg = sparse.sparse_config(config, [0.5] * (L - 1) + [0.25], 0.5, dense_layers=1)
    assert batch_plan.layer_classes(config, scfg) == [tuple(range(1, L - 1)), (L - 1,)]
    assert batch_plan.layer_classes(config, scfg, max_classes=1) == [tuple(range(1, L))]
    assert batch_plan.plan_layers(config, [(1,)], ["masked"])[:2] == ("dense", "masked")


def test_measured_plan_keeps_the_fastest_and_never_beats_dense_by_default(monkeypatch):
    """With step times forced (all dense 10, sparse 8, masked 9 ms), the plan takes the
    sparse mode; with every sparse mode slower than dense it stays all dense."""
    config, params, sets, scfg = _setup()
    times = {}

    def fake_chained(step, p, state, tokens, steps, repeats):
        return times[step.batch_layers[-1]], state   # the fake engine's step: its config

    monkeypatch.setattr(batch_plan, "chained_ms", fake_chained)
    monkeypatch.setattr(sparse, "sparse_engine",
                        lambda c, s, sel: type("Engine", (), {"step": s})())
    tokens = jnp.asarray([3, 4])
    for t, want in (({"dense": 10.0, "sparse": 8.0, "masked": 9.0}, "sparse"),
                    ({"dense": 10.0, "sparse": 12.0, "masked": 10.5}, "dense")):
        times.clear()
        times.update(t)
        plan, _ = batch_plan.measure_batch_plan(config, scfg, sparse.fixed_selector,
                                                (params, sets), None, tokens)
        assert plan.layers == ("dense",) + (want,) * (config.n_layers - 1)
        assert plan.ms == t[want] and plan.dense_ms == 10.0
        assert [label for label, _ in plan.trials][0] == "all dense"


def test_measured_plan_on_the_cpu_runs_and_reports():
    """The real measurement on a tiny model: a plan of valid modes, the all-dense step
    timed first, and a chosen step no slower than it."""
    config, params, sets, scfg = _setup()
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    state = eng.init_state(2, 8 + batch_plan.steps_needed(1, 2, 1), jnp.float32)
    plan, state = batch_plan.measure_batch_plan(
        config, scfg, sparse.fixed_selector, (params, sets), state, jnp.asarray([3, 4]),
        steps=2, repeats=1)
    assert set(plan.layers) <= set(batch_plan.LAYER_MODES) and plan.layers[0] == "dense"
    assert len(plan.trials) == 3 and plan.ms <= plan.dense_ms
    assert "ms/step" in plan.summary()
