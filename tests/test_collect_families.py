"""Predictor collection and training on tiny Qwen2 and Gemma 3 configs: records of the
right shapes, finite values, one training step, and the trained predictors' scores driving
the sparse decode path's selector."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax import sparse
from dejavu_jax.train import collect as collect_lib
from dejavu_jax.train import predictors as pred_lib
from dejavu_jax.train import records as rec
from dejavu_jax.train.predict import predictor_scores

TINY = dict(vocab_size=512, hidden=32, embed_dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
            head_dim=8, ffn=64)
CONFIGS = {
    # q/k/v biases, a rope base of 1e6, BOS inside the tiny vocabulary
    "qwen2": dict(**TINY, bos_token_id=1, eos_token_id=2, pad_token_id=None),
    # GeGLU, q/k norms, pre- and post-norms, a sliding window of 4 on layer 0
    "gemma3": dict(**TINY, sliding_window=4, sliding_layers=(True, False), embed_scale=32 ** 0.5,
                   query_scale=8 ** -0.5),
}
BASE = {"qwen2": "qwen2.5-0.5b", "gemma3": "gemma3-270m"}


class CharTokenizer:
    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[3 + ord(c) % 500 for c in t] for t in texts]}


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_collect_and_train_one_step(tmp_path, family):
    config = dj.preset(BASE[family]).replace(name=f"{family}-tiny", **CONFIGS[family])
    assert config.family == family
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.2)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the river carried {i % 7} stones past the mill\n"
                            for i in range(40)))
    m = collect_lib.collect(config, params, CharTokenizer(), [text], tmp_path / "rec",
                            tokens=120, window=16, batch=4, progress=False, log=lambda s: None)
    assert m["complete"] and m["tokens"] == 120
    records = rec.Records(tmp_path / "rec")
    shard = records.shard(0)
    L, F, H, d = config.n_layers, config.ffn, config.n_heads, config.hidden
    assert shard["attn_in"].shape == (L, 120, d) and shard["mlp_in"].shape == (L, 120, d)
    assert shard["head_norm"].shape == (L, 120, H)
    assert shard["mlp_label"].shape == (L, 120, -(-F // 8))
    for key in ("attn_in", "mlp_in", "head_norm"):
        assert np.isfinite(np.asarray(shard[key], np.float32)).all(), key
    labels = rec.unpack_labels(shard["mlp_label"], F)  # top-30% rule: a fixed count per token
    assert (labels.sum(-1) == rec.LabelRule.parse(m["label_rules"]["mlp"]).count(F)).all()

    tc = pred_lib.TrainConfig(rank=8, epochs=1, batch_size=96, max_val_tokens=24)
    best, summary, _ = pred_lib.train(records, tc, progress=False, log=lambda s: None)
    assert summary["epochs_run"] == 1 and np.isfinite(summary["history"][0]["train_loss"])

    x = jnp.asarray(np.asarray(shard["attn_in"][0, :3], np.float32))  # lookahead input
    layer = jnp.int32(1)
    mlp, heads = predictor_scores(best, layer, x)
    assert mlp.shape == (3, F) and heads.shape == (3, H)
    assert np.isfinite(np.asarray(mlp)).all() and np.isfinite(np.asarray(heads)).all()
    select = sparse.predictor_selector(config.group_size)
    for row in range(3):  # one token: its own top-k of the scores
        n_idx, h_idx = select(best, layer, x[row:row + 1], 16, 2)
        want_n = np.sort(np.argsort(-np.asarray(mlp[row]), kind="stable")[:16])
        want_h = np.sort(np.argsort(-np.asarray(heads[row]), kind="stable")[:2])
        np.testing.assert_array_equal(np.asarray(n_idx), want_n)
        np.testing.assert_array_equal(np.asarray(h_idx), want_h)
