"""Phi-3's LongRoPE: the short and long factors and the attention factor as transformers
reads and applies them, checked against numpy, against the linear RoPE they equal when
every factor is the same, and against transformers' logits on the `phi3-longrope` fixture,
past its original context and across it: a sequence longer than the original context is
computed with the long factors at every position, so crossing it means recomputing the
cache. (transformers' own generate means to do so but then runs the newest token alone;
the fixture's reference is its model's full forward at each length.)"""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import model, ops, sparse
from dejavu_jax.config import from_hf_config

HF = Path(__file__).parent / "fixtures" / "hf"
HEAD_DIM = 8
PHI3 = dict(model_type="phi3", vocab_size=128, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, original_max_position_embeddings=16,
            rope_theta=10000.0)
SHORT = [1.0, 1.3, 2.5, 7.0]
LONG = [1.5, 3.0, 9.0, 20.0]


def phi3(short=SHORT, long=LONG, kind="longrope", **rope):
    return from_hf_config({**PHI3, "rope_scaling": {
        "type": kind, "short_factor": short, "long_factor": long, **rope}})


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])   # Phi3Config's older names
def test_longrope_settings_as_transformers_reads_them(kind):
    config = phi3(kind=kind)
    attention, original, *factors = config.rope_longrope
    assert factors == SHORT + LONG and original == 16.0 and config.max_positions == 64
    assert attention == pytest.approx(math.sqrt(1 + math.log(64 / 16) / math.log(16)))
    assert config.rope_yarn is None and config.rope_linear_factor == 1.0
    assert phi3(attention_factor=1.25).rope_longrope[0] == 1.25
    assert phi3(factor=1.0).rope_longrope[0] == 1.0
    no_original = {k: v for k, v in PHI3.items() if k != "original_max_position_embeddings"}
    assert from_hf_config({**no_original, "rope_scaling": {
        "type": "longrope", "short_factor": SHORT, "long_factor": LONG}}).rope_longrope[1] \
        == 4096.0


@pytest.mark.parametrize("short, long, words", [
    (SHORT[:3], LONG, "short_factor, a list of 4 numbers"),
    (None, LONG, "short_factor, a list of 4 numbers"),
    (SHORT, None, "long_factor, a list of 4 numbers"),
    ([1.0, 0.0, 1.0, 1.0], LONG, r"short_factor\[1\] must be positive"),
    (SHORT, [1.0, 1.0, 1.0, -2.0], r"long_factor\[3\] must be positive"),
])
def test_bad_factors_are_refused(short, long, words):
    with pytest.raises(ValueError, match=words):
        phi3(short=short, long=long)


def test_other_phi3_rope_types_are_refused():
    with pytest.raises(ValueError, match="Phi-3 rope type 'linear' is not supported"):
        from_hf_config({**PHI3, "rope_scaling": {"type": "linear", "factor": 2.0}})


@pytest.mark.parametrize("long_factors", [False, True])
def test_longrope_tables_against_numpy(long_factors):
    attention, positions = 1.2, np.array([0, 1, 5, 15, 40])
    cos, sin = ops.rope_tables(jnp.asarray(positions), HEAD_DIM, 1e4,
                               longrope=(attention, 16.0, *SHORT, *LONG),
                               long_factors=long_factors)
    factors = np.asarray(LONG if long_factors else SHORT)
    inv = 1.0 / (factors * 1e4 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    angles = np.concatenate([positions[:, None] * inv] * 2, axis=-1)
    np.testing.assert_allclose(np.asarray(cos), attention * np.cos(angles), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin), attention * np.sin(angles), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, factor", [(16, 2.5), (20, 6.0)])
def test_equal_factors_give_linear_ropes_logits(length, factor):
    """Every short factor 2.5 and long factor 6, attention factor a: up to the original
    context of 16 the frequencies of linear RoPE with factor 2.5, past it with factor 6
    (for the whole sequence), and q and k each scaled by a, so the logits by a^2."""
    config = phi3(short=[2.5] * 4, long=[6.0] * 4, attention_factor=1.3)
    linear = from_hf_config({**PHI3, "rope_scaling": {"type": "linear", "factor": factor},
                             "model_type": "llama"}).replace(
        query_scale=1.3 ** 2 * HEAD_DIM ** -0.5, norm_eps=config.norm_eps)
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, length)))
    got = np.asarray(dj.logits(config, params, ids))
    want = np.asarray(dj.logits(linear.replace(name=config.name), params, ids))
    assert np.isfinite(got).all() and np.abs(got).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    plain = np.asarray(dj.logits(from_hf_config({**PHI3}), params, ids))
    assert np.abs(plain - got).max() > 1e-2 * np.abs(got).max()   # the scaling shows


def _short_factors_only(config):
    """`config` with its long factors replaced by its short ones."""
    half = config.rotated_dims // 2
    return config.replace(rope_longrope=config.rope_longrope[:2 + half]
                          + config.rope_longrope[2:2 + half])


FIXTURES = ["phi3-longrope", "phi3-partial"]   # the second: RoPE on half of each head


def _fixture(name):
    config, params = dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)
    return config, params, np.load(HF / name / "reference.npz")


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_past_the_original_context_match_hugging_face(name):
    """80 tokens (the original context is 64), one row left-padded: transformers' logits,
    with the long factors for every position; the short ones give other logits."""
    config, params, ref = _fixture(name)
    ids, mask = ref["long_input_ids"], ref["long_attention_mask"]
    real = mask.astype(bool)
    want = ref["long_logits"][real]
    got = np.asarray(dj.logits(config, params, ids, mask))[real]
    assert_finite_close(got, want, atol=1e-4 * np.abs(want).max())
    short = np.asarray(dj.logits(_short_factors_only(config), params, ids, mask))[real]
    assert np.abs(short - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("name,chunk", [("phi3-longrope", 1), ("phi3-longrope", 8),
                                        ("phi3-partial", 8)])
def test_generation_across_the_original_context_matches_hugging_face(name, chunk):
    """A 60-token prompt, 12 greedy tokens: the sequence passes 64 tokens at the 5th, where
    the cache is recomputed with the long factors; the ids and every step's logits are
    those of transformers' full forward of the sequence so far, for any chunk length."""
    config, params, ref = _fixture(name)
    prompt, want = ref["cross_prompt_ids"].tolist(), ref["cross_generated_ids"].tolist()
    out = dj.generate_tokens(dj.dense_engine(config), params, [prompt], len(want),
                             stop_ids=[], chunk=chunk)
    assert out.tokens[0] == want
    logits, scale = ref["cross_generated_logits"], np.abs(ref["cross_generated_logits"]).max()
    state = model.init_state(config, 1, 128, jnp.float32)
    seq = list(prompt)
    step_logits, state = model.prefill(config, params, jnp.asarray([seq]),
                                       jnp.ones((1, len(seq)), jnp.int32), state)
    for i, token in enumerate(want):
        assert_finite_close(step_logits[0], logits[i], atol=1e-4 * scale, err_msg=f"step {i}")
        seq.append(token)
        if len(seq) == 65:   # the step into the long factors is refused: prefill again
            with pytest.raises(ValueError, match="prefill the whole sequence again"):
                model.decode_step(config, params, state, jnp.asarray([token], jnp.int32))
            state = model.init_state(config, 1, 128, jnp.float32)
            step_logits, state = model.prefill(config, params, jnp.asarray([seq]),
                                               jnp.ones((1, len(seq)), jnp.int32), state)
        else:
            step_logits, state = model.decode_step(config, params, state,
                                                   jnp.asarray([token], jnp.int32))


def test_a_batch_crossing_the_original_context_keeps_its_rows():
    """Two prompts, one shorter, greedy across the crossing: each row's ids are those of
    the same batch decoded with the whole sequence recomputed at every token (dj.logits on
    the left-padded batch, as transformers without a cache), and a row that stops before
    the crossing keeps its tokens."""
    config, params, ref = _fixture("phi3-longrope")
    long_prompt = ref["cross_prompt_ids"].tolist()
    prompts = [long_prompt, long_prompt[7:30]]
    got = dj.generate_tokens(dj.dense_engine(config), params, prompts, 9, stop_ids=[])
    from dejavu_jax.generation import left_pad
    rows = [list(p) for p in prompts]
    for _ in range(9):
        ids, mask = left_pad(rows, config.padding_id)
        last = np.asarray(dj.logits(config, params, ids, mask))[:, -1]
        for row, token in zip(rows, last.argmax(-1)):
            row.append(int(token))
    assert got.tokens == [r[len(p):] for r, p in zip(rows, prompts)]
    stop = got.tokens[1][1]   # row 1 stops at its second token, before the crossing

    def upto(tokens):
        return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens

    stopped = dj.generate_tokens(dj.dense_engine(config), params, prompts, 9, stop_ids=[stop])
    assert len(upto(got.tokens[1])) == 2 and stopped.tokens == [upto(t) for t in got.tokens]


@pytest.mark.parametrize("name", FIXTURES)
def test_the_sparse_engine_crosses_the_original_context_as_transformers(name):
    """Every unit selected, kv_window 4, through the sparse engine: the reference's greedy
    ids across the crossing (the sparse prefill, steps and missing-KV window take the
    factors of the sequence's length)."""
    config, params, ref = _fixture(name)
    scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=1, kv_window=4)
    eng = sparse.sparse_engine(config, scfg, sparse.fixed_selector)
    sets = (jnp.tile(jnp.arange(config.ffn, dtype=jnp.int32), (config.n_layers, 1)),
            jnp.tile(jnp.arange(config.n_heads, dtype=jnp.int32), (config.n_layers, 1)))
    want = ref["cross_generated_ids"].tolist()
    out = dj.generate_tokens(eng, (params, sets), [ref["cross_prompt_ids"].tolist()],
                             len(want), stop_ids=[])
    assert out.tokens[0] == want


def test_the_sparse_step_applies_longrope_as_the_dense_one():
    """Every unit selected, kv_window 4, past the original context of 16: each sparse
    step's logits equal the dense model's, so the sparse path's rotary tables (the step's
    and the missing-KV window's) carry the long factors and the attention factor too."""
    from test_sparse import _full_sets, _full_sparse, _run_both
    config = phi3()
    params = dj.init_params(config, jax.random.key(1), jnp.float32, std=0.3)
    scfg = _full_sparse(config, kv_window=4, batch_policy="kernels")
    prompts = [list(range(3, 22)), list(range(40, 57))]
    steps = _run_both(config, params, scfg, _full_sets(config), prompts, steps=6)
    scale = max(np.abs(d).max() for d, _ in steps)
    for i, (dense_logits, sparse_logits) in enumerate(steps):
        assert_finite_close(sparse_logits, dense_logits, atol=2e-6 * scale, err_msg=f"step {i}")
    far = _run_both(_short_factors_only(config), params, scfg, _full_sets(config), prompts, steps=6, dense=False)
    assert np.abs(far[-1][1] - steps[-1][1]).max() > 1e-3 * scale


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 8), (128, 96), (10, 4)])
def test_partial_rotary_layout_rotates_as_transformers(head_dim, rotary_dim):
    """RoPE on the first `rotary_dim` dimensions of a head, as transformers' Phi-3 applies
    it (rotate halves of those dimensions, pass the others), equals our whole-head
    rotation of the head in `rotary_order` with the tables `rope_tables` makes for it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, head_dim))                # [positions, heads, head_dim]
    positions = np.array([0, 7, 300])
    inv = 1.0 / (1e4 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    angles = positions[:, None] * inv
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, None] for f in (np.cos, np.sin))
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    turned = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
    want = np.concatenate([rot * cos + turned * sin, rest], -1)
    order = ops.rotary_order(head_dim, rotary_dim)
    assert sorted(order.tolist()) == list(range(head_dim))
    tables = ops.rope_tables(jnp.asarray(positions), head_dim, 1e4, rotary_dim=rotary_dim)
    got = np.asarray(ops.apply_rope(jnp.asarray(x[..., order], jnp.float32), *tables))
    np.testing.assert_allclose(got, want[..., order], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("partial, words", [
    (0.5, None), (1.5, "partial_rotary_factor must be in"),
    (0.1, "rotary_dim .* must be an even number")])
def test_partial_rotary_factor_read_for_phi3_only(partial, words):
    """Phi-3 reads partial_rotary_factor (a rotary width of head_dim x factor, even); the
    other Llama-family models, whose transformers code rotates whole heads, refuse it."""
    hf = {**PHI3, "partial_rotary_factor": partial}
    if words is None:
        assert from_hf_config(hf).rotary_dim == HEAD_DIM // 2
        with pytest.raises(ValueError, match="supported for phi3 only"):
            from_hf_config({**hf, "model_type": "llama"})
    else:
        with pytest.raises(ValueError, match=words):
            from_hf_config(hf)
