"""Evaluation on several devices: `--devices N` / `--mesh` of the perplexity and task CLIs.

On 8 fake CPU devices: dense perplexity and multiple-choice scores with the weights in the
tensor-parallel layout equal one device's; sparse and oracle scoring under a mesh apply the
tensor-parallel decode's per-shard top-k (ceil(k / tp) of each device's own units), checked
against the same rule on one device, against numpy, and against `tp_decode`'s sparse
engine; a mesh that does not divide the model fails with the ShardingError message.

The device count must be fixed before jax starts, so under a normal pytest run (one CPU
device) this module runs itself in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, as tests/test_sharding.py does.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

from dejavu_jax.eval import sparse_scoring as ss

N_DEVICES = 8
REL = 1e-5
INNER = os.environ.get("DEJAVU_EVAL_MESH_INNER") == "1"


def _numpy_block_top_k(scores: np.ndarray, k: int, shards: int) -> np.ndarray:
    """The per-shard rule in numpy: each of `shards` equal blocks of a row keeps its k
    best (ties to the lower index, as lax.top_k)."""
    n = scores.shape[-1] // shards
    out = np.zeros(scores.shape, bool)
    for row in np.ndindex(scores.shape[:-1]):
        for s in range(shards):
            block = scores[row][s * n:(s + 1) * n]
            out[row + (s * n + np.argsort(-block, kind="stable")[:k],)] = True
    return out


@pytest.mark.skipif(INNER, reason="outer run only")
def test_block_top_k_mask_equals_numpy_rule():
    rng = np.random.default_rng(0)
    for shape, shards, k in [((3, 5, 12), 2, 4), ((2, 16), 4, 1), ((4, 8), 4, 2), ((6,), 1, 2)]:
        scores = rng.integers(0, 4, shape).astype(np.float32)  # many ties
        got = np.asarray(ss.top_k_mask(jnp.asarray(scores), k, shards))
        np.testing.assert_array_equal(got, _numpy_block_top_k(scores, k, shards))
    with pytest.raises(ValueError, match="equal blocks"):
        ss.top_k_mask(jnp.zeros((2, 10)), 2, 4)


if jax.device_count() < N_DEVICES:

    def test_eval_mesh_suite_on_8_fake_cpu_devices():
        from conftest import run_on_fake_devices
        run_on_fake_devices(__file__, N_DEVICES, "DEJAVU_EVAL_MESH_INNER", 600)

else:
    import dejavu_jax as dj
    from dejavu_jax import sharding, sparse, tp_decode
    from dejavu_jax.eval import common, perplexity as ppl_mod, tasks as tasks_mod
    from dejavu_jax.generation import left_pad

    IDS = np.random.default_rng(0).integers(0, 500, 70)

    class _CharTokenizer:
        """One token per character (code point): presets come without a tokenizer."""

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    _WEIGHTS = {}
    _LOAD_WEIGHTS = common.load_weights

    def _weights(args, mesh=None):
        """common.load_weights, cached per (preset, mesh): initialising compiles for seconds,
        once per layout. A preset's first load runs the loader (on one device or straight
        into the mesh's shards); its other layouts place those weights with
        `sharding.shard_params`, whose layout is the sharded init's (both take
        `sharding.param_shardings`)."""
        key = (args.preset, None if mesh is None else tuple(mesh.shape.items()))
        if key not in _WEIGHTS:
            loaded = next((v for k, v in _WEIGHTS.items() if k[0] == args.preset), None)
            if loaded is None:
                _WEIGHTS[key] = _LOAD_WEIGHTS(args, mesh)[:2]
            else:
                config, params = loaded
                params = jax.device_put(jax.device_get(params), jax.devices()[0])
                _WEIGHTS[key] = config, (params if mesh is None
                                         else sharding.shard_params(params, mesh))
        return (*_WEIGHTS[key], None)

    def _load(argv):
        """(args, mesh, config, params) through the CLI's own option handling and loaders."""
        args = ppl_mod.build_parser().parse_args(argv)
        mesh = common.mesh_from_args(args)
        return args, mesh, *_weights(args, mesh)[:2]

    @pytest.fixture
    def cli(monkeypatch):
        """The CLIs' mains with the char tokenizer and cached weights."""
        monkeypatch.setattr(common, "load_tokenizer_for", lambda *a: _CharTokenizer())
        monkeypatch.setattr(common, "load_weights", _weights)

    def _ppl(argv):
        """Dense perplexity of IDS as the CLI sets it up."""
        args = ppl_mod.build_parser().parse_args(argv)
        mesh = common.mesh_from_args(args)
        config, params, _ = _weights(args, mesh)
        mode, pred = common.mode_from_args(args, config, mesh)
        return ppl_mod.perplexity(config, mode, params, pred, IDS, window=32, stride=16,
                                  batch_tokens=64, mesh=mesh)

    @pytest.mark.parametrize("preset,meshes", [
        ("opt-tiny", [["--devices", "2"], ["--devices", "4"]]),
        ("llama-tiny", [["--devices", "2"], ["--mesh", "tp=2,data=2"]])])
    def test_dense_perplexity_on_a_mesh_equals_one_device(preset, meshes):
        # llama-tiny loads on one device, opt-tiny straight into the --devices 2 shards
        # (gathered onto one device here; that the sharded init equals the plain one is
        # tests/test_sharding.py's); `_weights` places them in the other layouts
        if preset == "opt-tiny":
            _load(["--preset", preset, *meshes[0]])
        one = _ppl(["--preset", preset])
        assert one["tokens"] == len(IDS) - 1 and "mesh" not in one
        for extra in meshes:
            got = _ppl(["--preset", preset, *extra])
            _, mesh, _, params = _load(["--preset", preset, *extra])
            assert params.layers.w_in.sharding.spec[1] == "tp"  # loaded into the TP layout
            assert got["mesh"] == dict(mesh.shape)
            assert got["tokens"] == one["tokens"]
            assert got["total_nll"] == pytest.approx(one["total_nll"], rel=REL), extra
            assert got["perplexity"] == pytest.approx(one["perplexity"], rel=REL), extra

    def test_perplexity_cli_with_devices(cli, tmp_path, capsys):
        text = tmp_path / "text.txt"
        text.write_text("the cat sat on the mat. " * 4)
        outs = {}
        for name, extra in [("one", []), ("tp2", ["--devices", "2"])]:
            out = tmp_path / f"{name}.json"
            assert ppl_mod.main(["--preset", "llama-tiny", "--text", str(text), "--window", "32",
                                 "--stride", "16", "--batch-tokens", "64", "--no-progress",
                                 "--out", str(out), *extra]) == 0
            outs[name] = json.loads(out.read_text())
        assert "on mesh data=1,tp=2" in capsys.readouterr().out
        assert outs["tp2"]["mesh"] == {"data": 1, "tp": 2}
        assert outs["tp2"]["tokens"] == outs["one"]["tokens"] == 95
        assert outs["tp2"]["nll"] == pytest.approx(outs["one"]["nll"], rel=REL)

    def test_multiple_choice_scores_on_two_devices_equal_one_device(cli, tmp_path):
        rows = [{"query": "the cat sat on the", "choices": ["mat", "dog", "moon"], "gold": 0},
                {"query": "one two three", "choices": [" four", " five six"], "gold": 1}]
        task = tmp_path / "mc.jsonl"
        task.write_text("\n".join(json.dumps(r) for r in rows))
        prepared = tasks_mod.prepare(_CharTokenizer(), [str(task)], None)
        requests = prepared["mc"][1]
        scores = {}
        for extra in ([], ["--devices", "2"]):
            args, mesh, config, params = _load(["--preset", "llama-tiny", *extra])
            mode, pred = common.mode_from_args(args, config, mesh)
            scores[len(extra)] = tasks_mod.score_requests(config, mode, params, pred, requests,
                                                          batch_tokens=64, mesh=mesh)
        (ll1, g1), (ll2, g2) = scores[0], scores[2]
        assert ll1.shape == (5,) and np.all(ll1 < 0)
        assert_finite_close(ll2, ll1, rtol=REL)
        np.testing.assert_array_equal(g2, g1)
        out = tmp_path / "tp2.json"  # and the CLI end to end
        assert tasks_mod.main(["--preset", "llama-tiny", "--tasks", str(task), "--devices", "2",
                               "--batch-tokens", "64", "--no-progress", "--out", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["mesh"] == {"data": 1, "tp": 2} and res["tasks"]["mc"]["items"] == 2

    def test_bad_divisor_fails_with_the_sharding_error(tmp_path, capsys):
        bad = ppl_mod.build_parser().parse_args(["--preset", "llama-tiny", "--devices", "4"])
        with pytest.raises(sharding.ShardingError,
                           match=r"KV heads \(n_kv_heads\) = 2 is not divisible by 4.*"
                                 r"device counts that work: \[1, 2\]"):
            common.load_weights(bad, common.mesh_from_args(bad))
        text, task = tmp_path / "text.txt", tmp_path / "x.jsonl"
        text.write_text("some text to score")
        task.write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n')

        def error_of(main, argv):
            """The one `error:` line a CLI exits with (status 2)."""
            with pytest.raises(SystemExit) as exit_:
                main(argv)
            err = capsys.readouterr().err
            assert exit_.value.code == 2 and "Traceback" not in err, err
            return err.strip().splitlines()[-1]

        assert error_of(ppl_mod.main, ["--preset", "llama-tiny", "--devices", "4", "--text",
                                       str(text), "--no-progress"]
                        ).startswith("error: cannot split 'llama-tiny' over tp=4")
        assert re.search(r"KV heads \(n_kv_heads\) = 4 is not divisible by 3.*\[1, 2, 4\]",
                         error_of(tasks_mod.main, ["--preset", "opt-tiny", "--devices", "3",
                                                   "--tasks", str(task)]))
        assert "needs 16 devices; 8 available" in error_of(
            ppl_mod.main, ["--preset", "opt-tiny", "--mesh", "tp=8,data=2", "--text", str(text)])
        assert "not both" in error_of(tasks_mod.main, ["--preset", "opt-tiny", "--devices", "2",
                                                       "--mesh", "tp=2", "--tasks", str(task)])
        with pytest.raises(sharding.ShardingError, match="divisible by 8"):
            ss.make_mode(dj.preset("llama-tiny"), "oracle", 0.5, shards=8)

    # ------------------------------------------------ sparse / oracle: per-shard selection

    _SMALL = {}

    def _small():
        """OPT-shaped, 8 heads and 64 neurons over 3 layers (splits over 1, 2, 4, 8)."""
        if not _SMALL:
            config = dj.preset("opt-tiny").replace(n_heads=8, n_kv_heads=8, head_dim=8, ffn=64,
                                                   n_layers=3, vocab_size=256, name="opt-eval-tp")
            rng = np.random.default_rng(3)  # numpy: `init_params` compiles for seconds
            shapes = jax.eval_shape(lambda: dj.init_params(config, jax.random.key(0)))
            params = jax.tree_util.tree_map_with_path(
                lambda path, a: jnp.asarray(("norm_scale" in jax.tree_util.keystr(path))
                                            + 0.15 * rng.normal(size=a.shape), jnp.float32),
                shapes)
            _SMALL["model"] = config, params
        return _SMALL["model"]

    def _random_predictors(config, seed, rank=8):
        from dejavu_jax.train.predictor_model import Predictor, PredictorParams
        rng = np.random.default_rng(seed)
        L, d = config.n_layers, config.hidden

        def one(n):
            arrays = dict(mean=0.1 * rng.normal(size=(L, d)), inv_std=1 + rng.random((L, d)),
                          w1=rng.normal(size=(L, d, rank)), w2=rng.normal(size=(L, rank, n)),
                          b2=rng.normal(size=(L, n)))
            return Predictor(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()})

        return PredictorParams(mlp=one(config.ffn), heads=one(config.n_heads))

    def _window(config, batch=2, length=12):
        ids = np.random.default_rng(4).integers(0, config.vocab_size, (batch, length))
        return jnp.asarray(ids, jnp.int32)

    @pytest.mark.parametrize("name,tp,data", [("oracle", 4, 2), ("sparse", 2, 2)])
    def test_sparse_scoring_on_a_mesh_applies_the_per_shard_rule(name, tp, data):
        """Sharded weights under GSPMD give the one-device scorer's figures with the same
        per-shard rule; at every sparse position each shard keeps exactly ceil(k / tp) of
        its units (a global top-k would not split evenly at every one of them)."""
        config, params = _small()
        mesh = sharding.make_mesh(tp=tp, data=data)
        mode = ss.make_mode(config, name, 0.3, 0.5, dense_layers=1, shards=tp)
        pred = _random_predictors(config, 5) if name == "sparse" else None
        ids = _window(config)
        mask, prefix = jnp.ones_like(ids), jnp.asarray([1, 3], jnp.int32)
        want, want_sets = ss.window_logits(config, mode.scfg, params, pred, ids, mask, prefix,
                                           shards=tp)
        put = lambda a: common.put_batch(mesh, np.asarray(a))  # noqa: E731
        got, got_sets = ss.window_logits(
            config, mode.scfg, sharding.shard_params(params, mesh), None if pred is None else
            tp_decode.shard_predictors(pred, mesh), put(ids), put(mask), put(prefix), shards=tp)
        assert_finite_close(np.asarray(got), np.asarray(want), rtol=REL, atol=1e-5)
        for g, w in zip(got_sets, want_sets):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        neurons = np.asarray(want_sets[0])  # [L, B, T, F]
        per_block = neurons.reshape(*neurons.shape[:-1], tp, -1).sum(-1)
        k_local = ss.local_k(mode.scfg.mlp_k[1], tp)
        assert (per_block[1:, 1, 3:] == k_local).all()  # sparse layers, sparse positions
        assert neurons[0].all() and neurons[:, 1, :3].all()  # dense layer, dense prefix
        groups = np.asarray(want_sets[1])  # [L, B, T, Hk]: head density 0.5 -> 4 of 8 groups
        per_block = groups.reshape(*groups.shape[:-1], tp, -1).sum(-1)
        assert (per_block[1:, 1, 3:] == ss.local_k(mode.scfg.head_k[1], tp)).all()
        desc = mode.describe(config)
        assert desc["selection_shards"] == tp and desc["mlp_k_per_shard"][1] == k_local

    _TP_CALLS = []

    def _recording_selector(config, name, monkeypatch):
        """The engine's selector, every selection appended to _TP_CALLS as (decode step,
        shard, layer or None, local ids) by each shard. Predictors: the selector's calls;
        oracle: the engine's `select_top_k` calls (monkeypatched), made inside the layer.
        Callbacks are unordered across devices but run in program order on each CPU device."""
        from dejavu_jax.train import predict as predict_mod
        step = _TP_CALLS  # _TP_CALLS[0] is the current decode step
        if name == "oracle":
            original = predict_mod.select_top_k

            def recording_top_k(scores, k, capacity=None):
                idx = original(scores, k, capacity)
                jax.debug.callback(lambda s, i: step.append((step[0], int(s), None, i.tolist())),
                                   jax.lax.axis_index(tp_decode.TP), idx)
                return idx

            monkeypatch.setattr(predict_mod, "select_top_k", recording_top_k)
            return sparse.no_selector
        base = sparse.predictor_selector(config.group_size)

        def select(pred, layer, x, k_mlp, k_heads):
            neurons, groups = base(pred, layer, x, k_mlp, k_heads)
            jax.debug.callback(
                lambda s, l, n, g: step.append((step[0], int(s), int(l), (n.tolist(),
                                                                          g.tolist()))),
                jax.lax.axis_index(tp_decode.TP), layer, neurons, groups)
            return neurons, groups

        return select

    def _engine_sets(config, scfg, name, tp, calls, steps):
        """{(step, layer): (neuron ids, KV-group ids)} as global ids, from each shard's
        recorded local selections (see tests/test_eval.py's `_sets_of_calls`: a layer's
        predicted set is its first call in the step with the layer's own k)."""
        F, Hk = config.ffn // tp, config.n_kv_heads // tp
        layers = range(scfg.dense_layers, config.n_layers)
        sets = {(i, l): (set(), set()) for i in range(steps) for l in layers}
        for shard in range(tp):
            mine = [c for c in calls if c[1] == shard]
            per_step = {}
            if name == "oracle":
                assert len(mine) == steps * 2 * len(layers), (shard, len(mine))
                for (i, _, _, groups), (i2, _, _, neurons), layer in zip(
                        mine[::2], mine[1::2], list(layers) * steps):
                    assert i == i2
                    per_step[i, layer] = (neurons, groups)
            else:
                for i, _, layer, (neurons, groups) in mine:
                    own = (ss.local_k(scfg.mlp_k[layer], tp), ss.local_k(scfg.head_k[layer], tp))
                    if (len(neurons), len(groups)) == own:
                        per_step.setdefault((i, layer), (neurons, groups))
            for key, (neurons, groups) in per_step.items():
                sets[key][0].update(shard * F + n for n in neurons)
                sets[key][1].update(shard * Hk + g for g in groups)
        for (i, layer), (neurons, groups) in sets.items():
            assert (len(neurons), len(groups)) == (tp * ss.local_k(scfg.mlp_k[layer], tp),
                                                   tp * ss.local_k(scfg.head_k[layer], tp))
        return sets

    @pytest.mark.parametrize("name,tp", [("oracle", 2), ("sparse", 2), ("oracle", 4),
                                         ("sparse", 4)])
    def test_sparse_scoring_on_a_mesh_equals_the_tensor_parallel_decode(name, tp,
                                                                        monkeypatch):
        """Teacher-forced `tp_decode.tp_sparse_engine` (dense prefill of one token, then one
        step per token, batch 1) gives the logits the mesh scorer gives at every position,
        and the scorer's masks hold the sets the shards selected at every decoded token."""
        config, params = _small()
        mesh = sharding.make_mesh(tp=tp)
        mode = ss.make_mode(config, name, 0.3, 0.5, dense_layers=1, shards=tp)
        pred = _random_predictors(config, 6) if name == "sparse" else None
        sharded = sharding.shard_params(params, mesh)
        sharded_pred = None if pred is None else tp_decode.shard_predictors(pred, mesh)
        ids = np.asarray(_window(config, batch=1, length=8))[0]
        arr = jnp.asarray(ids[None])
        scored, (neuron_mask, group_mask, _) = ss.window_logits(
            config, mode.scfg, sharded, sharded_pred, arr, jnp.ones_like(arr),
            jnp.asarray([1], jnp.int32), shards=tp)
        select = _recording_selector(config, name, monkeypatch)
        engine = tp_decode.tp_sparse_engine(config, mode.scfg, select, mesh)
        prompt, prompt_mask = (jnp.asarray(a) for a in left_pad([ids[:1].tolist()]))
        state = engine.init_state(1, 16, jnp.float32)
        logits, state = jax.jit(engine.prefill)((sharded, sharded_pred), prompt, prompt_mask,
                                                state)
        decoded = [np.asarray(logits[0])]
        step = jax.jit(engine.step)
        _TP_CALLS[:] = [0]
        for i, tok in enumerate(ids[1:]):
            _TP_CALLS[0] = i
            logits, state = step((sharded, sharded_pred), state, jnp.asarray([tok], jnp.int32))
            jax.effects_barrier()
            decoded.append(np.asarray(logits[0]))
        assert_finite_close(np.stack(decoded), np.asarray(scored[0]), atol=1e-4, rtol=1e-4)
        sets = _engine_sets(config, mode.scfg, name, tp, _TP_CALLS[1:], len(ids) - 1)
        neuron_mask, group_mask = np.asarray(neuron_mask)[:, 0], np.asarray(group_mask)[:, 0]
        for (i, layer), want in sets.items():
            got = (set(np.flatnonzero(neuron_mask[layer, 1 + i]).tolist()),
                   set(np.flatnonzero(group_mask[layer, 1 + i]).tolist()))
            assert got == want, f"step {i} layer {layer}"
        assert len({frozenset(n) for n, _ in sets.values()}) > 1  # sets change per token
