"""Tensor parallelism on 8 fake CPU devices: layouts, dense and sparse parity, loading.

The device count must be fixed before jax starts, so under a normal pytest run (one CPU
device) this module runs itself once in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8; run it directly with that flag set to
see the individual tests.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import model, sharding, sparse, tp_decode
from dejavu_jax.generation import left_pad

N_DEVICES = 8
HF = Path(__file__).parent / "fixtures" / "hf"
TOL = 1e-5

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.environ.get("DEJAVU_SHARDING_INNER") == "1", reason="outer run only")
def test_two_processes_with_jax_distributed(tmp_path):
    """Multi-host, on one machine: 2 processes x 2 CPU devices joined by
    jax.distributed.initialize (gloo collectives), loading straight into shards; their
    tp=4 logits equal one device's."""
    worker = Path(__file__).parent / "multihost_worker.py"
    port, out = str(_free_port()), tmp_path / "logits.npy"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), "2", port,
                               str(HF / "opt-preln"), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(l[-3000:] for l in logs)
    config, params = dj.load_pretrained(HF / "opt-preln", dtype=jnp.float32, progress=False)
    engine = dj.dense_engine(config)
    ids = jnp.asarray([[5, 9, 14, 3]])
    state = engine.init_state(1, 16, jnp.float32)
    first, state = jax.jit(engine.prefill)(params, ids, jnp.ones_like(ids), state)
    second, _ = jax.jit(engine.step)(params, state, jnp.asarray([7]))
    assert_finite_close(np.load(out), np.stack([first, second]), atol=TOL, rtol=0)


if jax.device_count() < N_DEVICES:

    def test_sharding_suite_on_8_fake_cpu_devices():
        from conftest import run_on_fake_devices
        run_on_fake_devices(__file__, N_DEVICES, "DEJAVU_SHARDING_INNER", 900)

else:

    def _opt8():
        """OPT-shaped tiny model whose 8 heads and 256 neurons split over 1..8 devices."""
        return dj.preset("opt-tiny").replace(n_heads=8, n_kv_heads=8, head_dim=8, n_layers=2,
                                             vocab_size=512, name="opt-tp8")

    def _llama():  # GQA: 4 heads, 2 KV heads
        return dj.preset("llama-tiny").replace(n_layers=2, vocab_size=512)

    _PARAMS = {}

    def _params(config):
        """One-device random weights from numpy (cached; `init_params` compiles for seconds)."""
        if config not in _PARAMS:
            rng = np.random.default_rng(1)
            shapes = jax.eval_shape(lambda: dj.init_params(config, jax.random.key(0)))
            _PARAMS[config] = jax.tree_util.tree_map_with_path(
                lambda path, a: jnp.asarray(
                    ("norm_scale" in jax.tree_util.keystr(path)) + 0.1 * rng.normal(size=a.shape),
                    jnp.float32), shapes)
        return _PARAMS[config]

    PROMPTS = [[5, 9, 14, 3], [8, 2]]

    def _decode(engine, params, steps=4, prompts=PROMPTS):
        """Prefill + teacher-forced steps: list of logits [B, V] (numpy)."""
        ids, mask = (jnp.asarray(a) for a in left_pad(prompts))
        state = engine.init_state(ids.shape[0], 64, jnp.float32)
        logits, state = jax.jit(engine.prefill)(params, ids, mask, state)
        out = [np.asarray(logits)]
        step = jax.jit(engine.step)
        for t in range(steps):
            tok = jnp.full((ids.shape[0],), 11 + 7 * t, jnp.int32)
            logits, state = step(params, state, tok)
            out.append(np.asarray(logits))
        return out, state

    def _max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

    _REFERENCE = {}

    def _dense_reference(config, steps):
        """One-device dense decode logits (cached across tests)."""
        if (config, steps) not in _REFERENCE:
            _REFERENCE[config, steps] = _decode(dj.dense_engine(config), _params(config),
                                                steps)[0]
        return _REFERENCE[config, steps]

    @pytest.mark.parametrize("tp", [1, 2, 4, 8])
    def test_dense_logits_equal_one_device_for_every_mesh_size(tp):
        config = _opt8()
        params = _params(config)
        mesh = sharding.make_mesh(tp=tp)
        sharded = sharding.shard_params(params, mesh)
        assert sharded.layers.w_in.sharding.spec == sharding.P(None, "tp" if tp > 1 else None,
                                                               None)
        if tp == N_DEVICES:  # full-sequence logits too
            ids, mask = (jnp.asarray(a) for a in left_pad(PROMPTS))
            full = np.asarray(model.logits(config, params, ids, mask))
            assert np.abs(np.asarray(model.logits(config, sharded, ids, mask)) - full).max() <= TOL
        many, state = _decode(tp_decode.tp_dense_engine(config, mesh), sharded, steps=2)
        assert _max_diff(_dense_reference(config, 2), many) <= TOL
        if tp > 1:
            assert state.k.sharding.spec[2] == "tp"  # the cache stays split by KV head

    def test_dense_data_and_tensor_axes_together():
        config = _opt8()
        mesh = sharding.make_mesh(tp=2, data=2)
        many, state = _decode(tp_decode.tp_dense_engine(config, mesh),
                              sharding.shard_params(_params(config), mesh), steps=2)
        assert _max_diff(_dense_reference(config, 2), many) <= TOL
        assert tuple(state.k.sharding.spec)[:3] == ("data", None, "tp")

    def _full_sets_per_shard(config, tp):
        """Fixed sets selecting every unit: each shard's block lists its local ids."""
        L = config.n_layers
        return (jnp.tile(jnp.arange(config.ffn // tp, dtype=jnp.int32), (L, tp)),
                jnp.tile(jnp.arange(config.n_heads // tp, dtype=jnp.int32), (L, tp)))

    @pytest.mark.parametrize("preset,tp,unrolled,policy", [
        ("opt", 4, False, "kernels"), ("opt", 8, True, "kernels"), ("llama", 2, False, "kernels"),
        ("opt", 4, True, "union")])
    def test_sparse_density_one_equals_dense(preset, tp, unrolled, policy):
        """Two prompts with every unit selected: through the kernels' batch path (policy
        "kernels") and through XLA's dense layer with the psum ("union")."""
        config = _opt8() if preset == "opt" else _llama()
        params = _params(config)
        mesh = sharding.make_mesh(tp=tp)
        L = config.n_layers
        scfg = sparse.SparseConfig((config.ffn,) * L, (config.n_heads,) * L, dense_layers=1,
                                   kv_window=4, batch_policy=policy)
        sets = _full_sets_per_shard(config, tp)
        sharded = sharding.shard_params(params, mesh)
        if unrolled:
            sharded = dj.params.unstack_layers(sharded)
        engine = tp_decode.tp_sparse_engine(config, scfg, sparse.fixed_selector, mesh)
        many, state = _decode(engine, (sharded, sets), steps=2)
        assert _max_diff(_dense_reference(config, 2), many) <= TOL
        assert state.written.sharding.spec[2] == "tp"

    @pytest.mark.parametrize("mlp_share", [2, 4], ids=["masked-dense-mlp", "kernel-mlp"])
    def test_a_batch_with_every_head_equals_one_device(mlp_share):
        """Two prompts, tp=4, every head and 1/mlp_share of each shard's neurons: the
        dense attention with the psum, and the masked dense MLP (half the neurons) or the
        gather kernel (a quarter), against one device with the same global sets."""
        config = _opt8()
        params = _params(config)
        tp, L = 4, config.n_layers
        F_shard = config.ffn // tp
        k = F_shard // mlp_share
        rng = np.random.default_rng(4)
        local = np.sort(np.stack([rng.permutation(F_shard)[:k] for _ in range(L * tp)]),
                        axis=1).reshape(L, tp, k)
        glob = (local + (np.arange(tp) * F_shard)[None, :, None]).reshape(L, tp * k)
        heads_local = _full_sets_per_shard(config, tp)[1]
        scfg_tp = sparse.SparseConfig((tp * k,) * L, (config.n_heads,) * L,
                                      dense_layers=1, kv_window=4)
        mesh = sharding.make_mesh(tp=tp)
        engine = tp_decode.tp_sparse_engine(config, scfg_tp, sparse.fixed_selector, mesh)
        sets_tp = (jnp.asarray(local.reshape(L, tp * k), jnp.int32), heads_local)
        many, state = _decode(engine, (sharding.shard_params(params, mesh), sets_tp), steps=3)
        one_engine = sparse.sparse_engine(config, scfg_tp, sparse.fixed_selector)
        sets_one = (jnp.asarray(glob, jnp.int32),
                    jnp.tile(jnp.arange(config.n_heads, dtype=jnp.int32), (L, 1)))
        one, _ = _decode(one_engine, (params, sets_one), steps=3)
        assert _max_diff(one, many) <= TOL
        # every head's entry of every valid token is written (the dense attention marks them)
        written, valid = np.asarray(state.written)[:, 1:], np.asarray(state.dense.valid)
        assert np.all(written | ~valid[:, None, None, :])

    def _random_predictors(config, seed, zero_w2=False, rank=8):
        from dejavu_jax.train.predictor_model import Predictor, PredictorParams
        rng = np.random.default_rng(seed)
        L, d = config.n_layers, config.hidden

        def one(n):
            w2 = np.zeros((L, rank, n)) if zero_w2 else rng.normal(size=(L, rank, n))
            arrays = dict(mean=0.1 * rng.normal(size=(L, d)), inv_std=1 + rng.random((L, d)),
                          w1=rng.normal(size=(L, d, rank)), w2=w2, b2=rng.normal(size=(L, n)))
            return Predictor(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()})

        return PredictorParams(mlp=one(config.ffn), heads=one(config.n_heads))

    def _numpy_per_shard_top_k(scores, k, tp):
        """The rule, in numpy: each of tp equal blocks of units keeps its ceil(k/tp) best."""
        n = scores.shape[-1] // tp
        kl = -(-k // tp)
        return np.concatenate([np.sort(np.argsort(-scores[s * n:(s + 1) * n], kind="stable")[:kl])
                               + s * n for s in range(tp)])

    def _numpy_scores(p, layer, x):
        x = x.astype(np.float64)
        xn = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
        xn = (xn - np.asarray(p.mean[layer])) * np.asarray(p.inv_std[layer])
        return xn @ np.asarray(p.w1[layer]) @ np.asarray(p.w2[layer]) + np.asarray(p.b2[layer])

    @pytest.mark.parametrize("decode_form", [False, True])
    def test_per_shard_selection_equals_numpy_rule(decode_form, tp=2):  # k=17: 9 per shard
        from dejavu_jax.train.predictor_model import decode_predictors
        config = _llama().replace(n_heads=8, n_kv_heads=4, ffn=160)
        mesh = sharding.make_mesh(tp=tp)
        preds = _random_predictors(config, 7)
        x = np.random.default_rng(8).normal(size=(1, config.hidden)).astype(np.float32)
        select = sparse.predictor_selector(config.group_size)
        if decode_form:
            sharded = tp_decode.shard_predictors(decode_predictors(preds), mesh)
            assert sharded.w2_mlp.sharding.spec == sharding.P(None, None, "tp")
            assert sharded.b2_heads.sharding.spec == sharding.P(None, "tp")
        else:
            sharded = tp_decode.shard_predictors(preds, mesh)
            assert sharded.mlp.w2.sharding.spec == sharding.P(None, None, "tp")
        for layer, k_mlp, k_heads in [(0, 40, 2), (1, 17, 4)]:
            # under jit, as the engine's step runs it (eagerly, each of its ops on the mesh
            # compiles by itself)
            neurons, heads = jax.jit(
                lambda sharded, x, layer=layer, k_mlp=k_mlp, k_heads=k_heads:
                tp_decode.select_per_shard(config, select, sharded, mesh, layer, x, k_mlp,
                                           k_heads))(sharded, jnp.asarray(x))
            mlp = _numpy_scores(preds.mlp, layer, x)[0]
            head_scores = _numpy_scores(preds.heads, layer, x)[0]    # per query head
            np.testing.assert_array_equal(neurons, _numpy_per_shard_top_k(mlp, k_mlp, tp))
            np.testing.assert_array_equal(heads, _numpy_per_shard_top_k(head_scores, k_heads,
                                                                        tp))

    def test_sparse_decode_below_density_one_uses_per_shard_top_k():
        """Predictors whose scores are their bias only (w2 = 0) select the same sets at every
        step; the sharded engine must equal one device running those sets (numpy rule)."""
        config, tp = _opt8(), 4
        mesh = sharding.make_mesh(tp=tp)
        params = _params(config)
        preds = _random_predictors(config, 9, zero_w2=True)
        # shard 0's neurons score highest: a global top-k would differ from the per-shard one
        preds = preds.replace(mlp=preds.mlp.replace(b2=preds.mlp.b2.at[:, :64].add(10.0)))
        scfg = sparse.sparse_config(config, mlp_density=0.25, head_density=0.5, dense_layers=0)
        L = config.n_layers
        sets = (np.stack([_numpy_per_shard_top_k(np.asarray(preds.mlp.b2[l]), scfg.mlp_k[l], tp)
                          for l in range(L)]),
                np.stack([_numpy_per_shard_top_k(np.asarray(preds.heads.b2[l]), scfg.head_k[l],
                                                 tp) for l in range(L)]))
        assert not np.isin(np.arange(64), sets[0][0]).all()
        engine = tp_decode.tp_sparse_engine(config, scfg, sparse.predictor_selector(1), mesh)
        prompts = PROMPTS[:1]  # batch 1: a set is one row's top-k (no batch union)
        many, _ = _decode(engine, (sharding.shard_params(params, mesh),
                                   tp_decode.shard_predictors(preds, mesh)), 3, prompts)
        ref_cfg = sparse.SparseConfig(tuple(len(s) for s in sets[0]),
                                      tuple(len(s) for s in sets[1]), kv_window=16)
        ref = sparse.sparse_engine(config, ref_cfg, sparse.fixed_selector)
        one, _ = _decode(ref, (params, tuple(jnp.asarray(s, jnp.int32) for s in sets)), 3,
                         prompts)
        assert _max_diff(one, many) <= TOL

    def test_init_sharded_equals_init_and_no_large_weight_is_replicated():
        config = _opt8()
        mesh = sharding.make_mesh(tp=4)
        params = sharding.init_params_sharded(config, jax.random.key(1), jnp.float32, mesh)
        want = dj.init_params(config, jax.random.key(1), jnp.float32)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        specs = sharding.param_specs(params, mesh)
        for name in ("wq", "wk", "wv", "bq", "bk", "bv"):
            assert getattr(specs.layers, name)[1] == "tp", name
        assert specs.layers.wo[2] == "tp"                 # [L, d, H, hd]: by head
        for name in ("w_in", "w_out_t", "b_in"):
            assert getattr(specs.layers, name)[1] == "tp", name
        assert specs.embed[0] == "tp"
        allowed = {".pos_embed"}  # one row read per token: replicated on purpose
        assert set(sharding.replicated_leaves(params, min_size=config.hidden * 8)) <= allowed
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):  # 1/4 on each device
            shard = leaf.addressable_shards[0].data
            name = jax.tree_util.keystr(path)
            assert shard.size * 4 == leaf.size or leaf.size < 8 * config.hidden or \
                name in allowed, name
        llama = sharding.param_specs(jax.eval_shape(lambda: _params(_llama())),
                                     sharding.make_mesh(tp=2))
        assert llama.layers.w_gate[1] == "tp" and llama.layers.wk[1] == "tp"

    def test_clear_error_when_devices_do_not_divide_heads_or_neurons():
        with pytest.raises(sharding.ShardingError, match=r"KV heads.*= 2.*divisible by 4"):
            sharding.init_params_sharded(_llama(), jax.random.key(0), jnp.float32,
                                         sharding.make_mesh(tp=4))
        bad_ffn = _opt8().replace(ffn=100)
        with pytest.raises(sharding.ShardingError, match=r"neurons.*= 100.*\[1, 2, 4\]"):
            tp_decode.tp_dense_engine(bad_ffn, sharding.make_mesh(tp=8))
        with pytest.raises(sharding.ShardingError, match="needs 16 devices"):
            sharding.make_mesh(tp=8, data=2)
        assert sharding.parse_mesh("data=2,tp=4") == {"data": 2, "tp": 4}
        with pytest.raises(ValueError):
            sharding.parse_mesh("pp=2")

    def test_generate_says_when_the_prompts_do_not_divide_over_data(capsys):
        """Three prompts over data=2: the CLI notes that every data group decodes the whole
        batch, and the ids are those of one device (the checkpoint of tiny OPT loads with no
        compile, where a preset's weights are initialised, with one for every device layout)."""
        from dejavu_jax import generate as gen_cli
        args = ["--model", str(HF / "opt-preln"), "--print-ids", "--no-stream",
                "--max-new-tokens", "3", "--prompt-ids", "2,100,200", "--prompt-ids", "2,7",
                "--prompt-ids", "2,9,4,8"]

        def run(extra):
            assert gen_cli.main(args + extra) == 0
            captured = capsys.readouterr()
            return [l for l in captured.out.splitlines() if "generated ids" in l], captured.err

        ids_mesh, err = run(["--mesh", "data=2,tp=2"])
        assert "note: 3 prompts do not divide over data=2" in err
        ids_one, err_one = run([])
        assert ids_mesh == ids_one and len(ids_one) == 3 and "do not divide" not in err_one

    def test_fused_qkv_is_refused():
        from dejavu_jax.params import fuse_qkv
        shapes = jax.eval_shape(lambda: fuse_qkv(dj.init_params(_opt8(), jax.random.key(0))))
        with pytest.raises(ValueError, match="fuse_qkv"):
            sharding.param_specs(shapes, sharding.make_mesh(tp=2))

    def test_vocab_that_does_not_divide_is_replicated():
        config = _opt8().replace(vocab_size=510)
        shapes = jax.eval_shape(lambda: dj.init_params(config, jax.random.key(0)))
        specs = sharding.param_specs(shapes, sharding.make_mesh(tp=4))
        assert specs.embed == sharding.P(None, None) and specs.layers.wq[1] == "tp"

    @pytest.mark.parametrize("name,tp", [("opt-preln", 4), ("llama-gqa", 2),
                                         ("opt-postln-proj", 2)])
    def test_loading_straight_into_shards(name, tp):
        from dejavu_jax.sharded_loading import load_pretrained_sharded
        mesh = sharding.make_mesh(tp=tp)
        config, ref = dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)
        config2, params = load_pretrained_sharded(HF / name, mesh, dtype=jnp.float32)
        assert config2 == config
        specs = sharding.param_specs(params, mesh)
        for got, want, spec in zip(jax.tree.leaves(params), jax.tree.leaves(ref),
                                   jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s,
                                                                                       sharding.P))):
            assert got.sharding.spec == spec
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert params.layers.w_out_t.addressable_shards[0].data.shape[1] == config.ffn // tp
