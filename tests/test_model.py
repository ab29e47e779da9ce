"""Dense model: Hugging Face parity, cached decode, generation and the decode step's memory."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite_close

import dejavu_jax as dj
from dejavu_jax import model
from dejavu_jax.generation import dense_engine, generate_tokens
from dejavu_jax.params import fuse_qkv, has_fused_qkv, unstack_layers

HF = Path(__file__).parent / "fixtures" / "hf"
VARIANTS = ["opt-preln", "opt-postln-proj", "opt-fp16-prefix", "opt-bin",
            "llama-gqa", "llama-mha", "qwen2", "gemma3", "mistral-window", "llama-rope3",
            "llama-yarn", "qwen3-window", "phi3-window", "phi3-longrope", "phi3-partial",
            "gemma", "gemma2"]


def _load(name):
    config, params = dj.load_pretrained(HF / name, dtype=jnp.float32, progress=False)
    ref = np.load(HF / name / "reference.npz")
    return config, params, ref


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_hugging_face(name):
    config, params, ref = _load(name)
    out = np.asarray(dj.logits(config, params, ref["input_ids"], ref["attention_mask"]))
    real = ref["attention_mask"].astype(bool)
    want = ref["logits"][real]
    err = np.abs(out[real] - want).max()
    scale = np.abs(want).max()
    assert scale > 1.0, "reference logits are too flat to detect mapping errors"
    assert err <= 1e-4 * scale, f"{name}: max abs error {err:.3g} vs logit scale {scale:.3g}"


@pytest.mark.parametrize("name", ["opt-preln", "opt-postln-proj", "llama-gqa", "gemma3",
                                  "mistral-window", "llama-rope3", "llama-yarn",
                                  "qwen3-window", "phi3-window", "phi3-longrope",
                                  "phi3-partial", "gemma", "gemma2"])
def test_cached_decode_reproduces_full_forward(name):
    config, params, ref = _load(name)
    ids, mask = ref["input_ids"], ref["attention_mask"]
    full = np.asarray(dj.logits(config, params, ids, mask))
    split = int((mask == 0).sum(axis=1).max()) + 2  # decode steps feed real tokens only
    state = model.init_state(config, ids.shape[0], 64, jnp.float32)
    step_logits, state = model.prefill(config, params, jnp.asarray(ids[:, :split]),
                                       jnp.asarray(mask[:, :split]), state)
    scale = np.abs(full).max()
    assert_finite_close(step_logits, full[:, split - 1], atol=1e-5 * scale)
    for t in range(split, ids.shape[1]):
        step_logits, state = model.decode_step(config, params, state, jnp.asarray(ids[:, t]))
        assert_finite_close(step_logits, full[:, t], atol=1e-5 * scale,
                                   err_msg=f"position {t}")


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_ids_match_hugging_face(name):
    config, params, ref = _load(name)
    prompt = ref["prompt_ids"].tolist()
    want = ref["generated_ids"].tolist()
    result = generate_tokens(dense_engine(config), params, [prompt], max_new_tokens=len(want),
                             stop_ids=[])
    assert result.tokens[0] == want


@pytest.mark.parametrize("name", ["opt-preln", "opt-bin", "llama-mha", "qwen2", "gemma3",
                                  "qwen3-window", "phi3-window", "phi3-longrope",
                                  "phi3-partial", "gemma", "gemma2"])
def test_decode_logits_along_greedy_path_match_hugging_face(name):
    config, params, ref = _load(name)
    _check_greedy_path_logits(config, params, ref)


def _check_greedy_path_logits(config, params, ref, per_layer=False):
    """Prefill the prompt, then decode HF's greedy tokens: every step's logits match HF's."""
    prompt, generated = ref["prompt_ids"], ref["generated_ids"]
    want = ref["generated_logits"]
    scale = np.abs(want).max()
    state = model.init_state(config, 1, 64, jnp.float32, per_layer=per_layer)
    step_logits, state = model.prefill(config, params, jnp.asarray(prompt[None]),
                                       jnp.ones((1, len(prompt)), jnp.int32), state)
    for i, token in enumerate(generated):
        np.testing.assert_allclose(step_logits[0], want[i], atol=1e-4 * scale,
                                   err_msg=f"step {i}")
        step_logits, state = model.decode_step(config, params, state,
                                               jnp.asarray([token], jnp.int32))


@pytest.mark.parametrize("name", ["opt-preln", "llama-gqa"])
def test_per_layer_weights_decode_with_a_stacked_cache(name):
    """Per-layer weights with the K/V cache as one stacked pair (as
    `eval.dispatch_overhead --stacked-cache` hands them over) decode HF's greedy logits."""
    config, params, ref = _load(name)
    _check_greedy_path_logits(config, unstack_layers(params), ref, per_layer=False)


def test_gemma3_fixture_exercises_every_switch():
    """The Gemma 3 fixture's config is what its config.json says, and dropping any one of
    its switches (sliding windows, per-type RoPE, query scale, post-norms, soft-cap,
    embedding scale) moves the logits well away from Hugging Face's."""
    config, params, ref = _load("gemma3")
    assert config.family == "gemma3" and config.activation == "gelu_tanh"
    assert config.sliding_layers == (True, True, False, True) and config.sliding_window == 6
    assert (config.rope_theta, config.rope_local_theta, config.rope_linear_factor) == (
        1e6, 1e4, 2.0)
    assert config.query_scale == 20 ** -0.5 and config.final_logit_softcap == 20.0
    assert config.qk_norm and config.post_norms and config.embed_scale == 8.0
    real = ref["attention_mask"].astype(bool)
    scale = np.abs(ref["logits"][real]).max()
    variants = {"no window": dict(sliding_layers=(), sliding_window=None),
                "one rope": dict(rope_local_theta=None),
                "no rope scaling": dict(rope_linear_factor=1.0),
                "head_dim scale": dict(query_scale=None),
                "no soft-cap": dict(final_logit_softcap=None),
                "no embed scale": dict(embed_scale=None)}
    for what, change in variants.items():
        out = np.asarray(dj.logits(config.replace(**change), params, ref["input_ids"],
                                   ref["attention_mask"]))
        assert np.abs(out[real] - ref["logits"][real]).max() > 100 * 1e-4 * scale, what


def test_gemma_fixture_reads_as_llamas_layout_with_gemmas_switches():
    """The Gemma (1) fixture: Llama's layout with the tanh GELU (also where a config.json
    says "gelu", as Gemma's first releases do), norms of 1 + w and a scaled embedding.
    Without the embedding scale the logits move well away from Hugging Face's; the exact
    GELU, close to the tanh one, moves them 100 times further than ours are."""
    config, params, ref = _load("gemma")
    assert config.family == "gemma" and config.activation == "gelu_tanh" and config.gated_mlp
    assert (config.n_kv_heads, config.head_dim, config.embed_scale) == (1, 24, 8.0)
    assert not (config.post_norms or config.qk_norm or config.sliding_layers)
    from dejavu_jax.config import from_hf_config
    legacy = json.loads((HF / "gemma" / "config.json").read_text()) | {"hidden_act": "gelu"}
    assert from_hf_config(legacy).activation == "gelu_tanh"
    real = ref["attention_mask"].astype(bool)
    want = ref["logits"][real]

    def error(c):
        out = np.asarray(dj.logits(c, params, ref["input_ids"], ref["attention_mask"]))
        return np.abs(out[real] - want).max()

    assert error(config.replace(embed_scale=None)) > 1e-2 * np.abs(want).max()
    assert error(config.replace(activation="gelu")) > 100 * error(config)


def test_gemma2_fixture_exercises_every_switch():
    """The Gemma 2 fixture reads as Gemma's layout without q/k norms, one RoPE base,
    sliding windows on the even layers and soft-capped attention and final logits; dropping
    either cap, the windows or the query scale moves the logits well away from Hugging
    Face's."""
    config, params, ref = _load("gemma2")
    assert config.family == "gemma3" and not config.qk_norm and config.post_norms
    assert config.sliding_layers == (True, False, True, False) and config.sliding_window == 6
    assert config.rope_theta == 1e4 and config.rope_local_theta is None
    assert config.attn_logit_softcap == 3.0 and config.final_logit_softcap == 15.0
    assert config.query_scale == 20 ** -0.5 and config.embed_scale == 8.0
    assert params.layers.q_norm_scale is None
    real = ref["attention_mask"].astype(bool)
    scale = np.abs(ref["logits"][real]).max()
    for what, change in {"no attention cap": dict(attn_logit_softcap=None),
                         "no final cap": dict(final_logit_softcap=None),
                         "no window": dict(sliding_layers=(), sliding_window=None),
                         "head_dim scale": dict(query_scale=None)}.items():
        out = np.asarray(dj.logits(config.replace(**change), params, ref["input_ids"],
                                   ref["attention_mask"]))
        assert np.abs(out[real] - ref["logits"][real]).max() > 100 * 1e-4 * scale, what


def test_phi3_longrope_fixture_reads_its_factors():
    """The LongRoPE fixture's short and long factors and attention factor (sqrt(1 + ln 4 /
    ln 64)) are read as transformers reads them; plain RoPE moves the logits well away from
    Hugging Face's."""
    import math
    config, params, ref = _load("phi3-longrope")
    attention, original, *factors = config.rope_longrope
    assert original == 64 and factors == [1.0, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5, 7.0,
                                          1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0]
    assert attention == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    real = ref["attention_mask"].astype(bool)
    scale = np.abs(ref["logits"][real]).max()
    out = np.asarray(dj.logits(config.replace(rope_longrope=None), params, ref["input_ids"],
                               ref["attention_mask"]))
    assert np.abs(out[real] - ref["logits"][real]).max() > 100 * 1e-4 * scale


def test_qwen3_fixture_exercises_every_switch():
    """The Qwen3 fixture reads as Llama's layout with q/k norms, its own head width, no
    biases and Qwen's sliding layers; without the q/k norms or the windows the logits move
    well away from Hugging Face's."""
    config, params, ref = _load("qwen3-window")
    assert config.family == "llama" and config.qk_norm and config.head_dim == 24
    assert not config.attention_bias and params.layers.bq is None and params.layers.bo is None
    assert config.sliding_layers == (False, True, True) and config.sliding_window == 5
    assert config.rope_theta == 1e6 and not config.tie_embeddings
    real = ref["attention_mask"].astype(bool)
    scale = np.abs(ref["logits"][real]).max()
    for what, change in {"no q/k norms": dict(qk_norm=False),
                         "no window": dict(sliding_layers=(), sliding_window=None)}.items():
        out = np.asarray(dj.logits(config.replace(**change), params, ref["input_ids"],
                                   ref["attention_mask"]))
        assert np.abs(out[real] - ref["logits"][real]).max() > 100 * 1e-4 * scale, what


def test_phi3_fixture_reads_its_fused_projections_and_window():
    """The Phi-3 fixture stores q/k/v and gate/up as one tensor each: loaded as the Llama
    family, its parts are the fused tensors' rows in order, and its window of 5 on every
    layer matters (without it the logits move well away from Hugging Face's)."""
    from safetensors.numpy import load_file
    config, params, ref = _load("phi3-window")
    assert config.family == "llama" and not config.qk_norm and not config.attention_bias
    assert config.sliding_layers == (True,) * 3 and config.sliding_window == 5
    sd = load_file(HF / "phi3-window" / "model.safetensors")
    qkv = sd["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = sd["model.layers.1.mlp.gate_up_proj.weight"]
    hd, H, F = config.head_dim, config.n_heads, config.ffn
    np.testing.assert_array_equal(np.asarray(params.layers.wq[1]).reshape(H * hd, -1),
                                  qkv[:H * hd])
    np.testing.assert_array_equal(np.asarray(params.layers.w_gate[1]), gate_up[:F])
    np.testing.assert_array_equal(np.asarray(params.layers.w_in[1]), gate_up[F:])
    real = ref["attention_mask"].astype(bool)
    scale = np.abs(ref["logits"][real]).max()
    out = np.asarray(dj.logits(config.replace(sliding_layers=(), sliding_window=None), params,
                               ref["input_ids"], ref["attention_mask"]))
    assert np.abs(out[real] - ref["logits"][real]).max() > 100 * 1e-4 * scale


@pytest.mark.parametrize("name,unrolled", [("opt-preln", False), ("llama-gqa", False),
                                           ("llama-gqa", True)])
def test_fused_qkv_decodes_like_hugging_face(name, unrolled):
    """`fuse_qkv` (one q/k/v GEMV; GQA splits it unevenly) keeps the decode logits of HF."""
    config, params, ref = _load(name)
    if unrolled:
        params = unstack_layers(params)
    fused = fuse_qkv(params, free_originals=unrolled)
    layers = fused.layers if unrolled else (fused.layers,)
    assert has_fused_qkv(fused) and not has_fused_qkv(params)
    originals = params.layers if unrolled else (params.layers,)
    assert all(lp.wq.is_deleted() == unrolled for lp in originals)
    assert all(lp.wq is None and lp.wk is None and lp.wv is None for lp in layers)
    assert layers[0].wqkv.shape[-3] == config.n_heads + 2 * config.n_kv_heads
    _check_greedy_path_logits(config, fused, ref, per_layer=unrolled)
    generated = ref["generated_ids"]
    result = generate_tokens(dense_engine(config), fused, [ref["prompt_ids"].tolist()],
                             max_new_tokens=len(generated), stop_ids=[])
    assert result.tokens[0] == generated.tolist()


def test_left_padded_batch_generates_like_single_prompts():
    config = dj.preset("llama-tiny")
    params = dj.init_params(config, jax.random.key(3), jnp.float32, std=0.2)
    prompts = [[5, 9, 14, 3, 7], [11, 4]]
    batch = generate_tokens(dense_engine(config), params, prompts, max_new_tokens=6,
                            stop_ids=[])
    for row, p in enumerate(prompts):
        alone = generate_tokens(dense_engine(config), params, [p], max_new_tokens=6,
                                stop_ids=[])
        assert batch.tokens[row] == alone.tokens[0]


@pytest.mark.parametrize("pad", ["vocab_size", -1, None])
def test_a_pad_id_outside_the_vocabulary_still_pads(pad):
    """A config whose pad_token_id lies outside the embedding (or is absent) pads the
    batch with an id inside it: the padded row generates Hugging Face's greedy ids of its
    prompt alone, with finite logits."""
    config, params, ref = _load("llama-gqa")
    config = config.replace(pad_token_id=config.vocab_size if pad == "vocab_size" else pad)
    prompt = ref["prompt_ids"].tolist()
    longer = [5, 9, 14, 3, 7, 11, 4, 8, 20, 30]
    result = generate_tokens(dense_engine(config), params, [longer, prompt],
                             max_new_tokens=len(ref["generated_ids"]), stop_ids=[])
    assert result.tokens[1] == ref["generated_ids"].tolist()


@pytest.mark.parametrize("engine", ["dense", "oracle", "predictors"])
def test_prefill_into_a_used_state_forgets_its_earlier_tokens(engine):
    """A decode state that already holds a longer sequence, prefilled with a new prompt,
    decodes the greedy ids of that prompt alone (Hugging Face's; with predicted sets at
    half the heads and neurons, the same engine's on a fresh state): the earlier cache
    entries past the prompt are neither attended to nor taken as written."""
    from dejavu_jax import sparse
    from dejavu_jax.eval.bench_decode import random_predictors
    config, params, ref = _load("llama-gqa")
    if engine == "dense":
        eng, engine_params = dense_engine(config), params
    elif engine == "oracle":
        scfg = sparse.sparse_config(config, 1.0, 1.0, dense_layers=0, oracle=True)
        eng, engine_params = sparse.sparse_engine(config, scfg, sparse.no_selector), (params, None)
    else:
        scfg = sparse.sparse_config(config, 0.5, 0.5, dense_layers=1)
        eng = sparse.sparse_engine(config, scfg, sparse.predictor_selector(config.group_size))
        engine_params = (params, random_predictors(config, 8, jax.random.key(4)))
    prefill, step = jax.jit(eng.prefill), jax.jit(eng.step)

    def greedy(state, prompt, n):
        logits, state = prefill(engine_params, prompt, np.ones_like(prompt), state)
        out = [int(np.argmax(logits[0]))]
        for _ in range(n - 1):
            logits, state = step(engine_params, state, jnp.asarray([out[-1]], jnp.int32))
            assert np.isfinite(np.asarray(logits)).all()
            out.append(int(np.argmax(logits[0])))
        return out, state

    earlier = np.arange(3, 23, dtype=np.int32)[None]
    _, used = greedy(eng.init_state(1, 64, jnp.float32), earlier, 24)
    prompt = ref["prompt_ids"][None].astype(np.int32)
    got, _ = greedy(used, prompt, 16)
    if engine == "predictors":
        assert got == greedy(eng.init_state(1, 64, jnp.float32), prompt, 16)[0]
    else:
        assert got[:len(ref["generated_ids"])] == ref["generated_ids"].tolist()


def test_generation_stops_at_eos():
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(0), jnp.float32, std=0.2)
    free = generate_tokens(dense_engine(config), params, [[2, 100, 200]], max_new_tokens=8,
                           stop_ids=[])
    stop_token = free.tokens[0][2]
    stopped = generate_tokens(dense_engine(config), params, [[2, 100, 200]],
                              max_new_tokens=8, stop_ids=[stop_token])
    assert stopped.tokens[0] == free.tokens[0][:free.tokens[0].index(stop_token) + 1]


@pytest.mark.parametrize("sampling", [dj.SamplingConfig(),
                                      dj.SamplingConfig(temperature=0.8, top_p=0.9)])
def test_chunked_generation_equals_a_per_token_loop(sampling):
    """Tokens made `chunk` steps per device call equal a plain host loop over prefill and
    decode_step with the same key splits; stop ids end rows mid-chunk."""
    from dejavu_jax.generation import left_pad
    from dejavu_jax.sampling import sample
    # a vocabulary of 512: each sampled step sorts the logits, and their count is not what
    # is checked
    config = dj.preset("llama-tiny").replace(vocab_size=512)
    params = dj.init_params(config, jax.random.key(7), jnp.float32, std=0.3)
    prompts, n_new = [[5, 9, 14, 3], [8, 2]], 11
    ids, mask = left_pad(prompts)
    state = model.init_state(config, 2, 64, jnp.float32)
    key = jax.random.key(3)
    key, sub = jax.random.split(key)
    logits, state = model.prefill(config, params, jnp.asarray(ids), jnp.asarray(mask), state)
    tok = sample(logits, sub, sampling)
    want = [np.asarray(tok)]
    for _ in range(n_new - 1):
        key, sub = jax.random.split(key)
        logits, state = model.decode_step(config, params, state, tok)
        tok = sample(logits, sub, sampling)
        want.append(np.asarray(tok))
    want = np.stack(want, 1)                                    # [B, n_new]
    # greedy runs the sampler's argmax branch in the chunked loop, at 3 calls of 4 steps;
    # the chunk sizes' and the stop ids' handling, which the sampler does not enter, is
    # checked once, with sampling
    chunks = (4,) if sampling.temperature == 0 else (1, 4, 32)
    seen = []
    for chunk in chunks:
        got = generate_tokens(dense_engine(config), params, prompts, n_new, sampling, seed=3,
                              stop_ids=[], chunk=chunk, on_token=seen.append)
        assert got.tokens == want.tolist(), chunk
    assert len(seen) == len(chunks) * n_new
    if sampling.temperature == 0:
        return
    stop = int(want[0, 5])                                      # row 0 ends mid-chunk
    for chunk in (1, 4):                      # with a queued call discarded at the stop
        got = generate_tokens(dense_engine(config), params, prompts, n_new, sampling, seed=3,
                              stop_ids=[stop], chunk=chunk)
        for row in range(2):
            full = want[row].tolist()
            end = full.index(stop) + 1 if stop in full else n_new
            assert got.tokens[row] == full[:end], chunk
    # every row stopped while a call is queued: it is dropped, the result unchanged
    free = generate_tokens(dense_engine(config), params, prompts[:1], n_new, sampling, seed=3,
                           stop_ids=[], chunk=1).tokens[0]
    end = free.index(free[5]) + 1                              # stops by token 6 of 11
    alone = generate_tokens(dense_engine(config), params, prompts[:1], n_new, sampling, seed=3,
                            stop_ids=[free[5]], chunk=1)
    assert alone.tokens[0] == free[:end] and alone.decode_steps < n_new - 1


def test_decode_step_updates_cache_in_place():
    config = dj.preset("opt-tiny").replace(n_layers=6)
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    state = model.init_state(config, 1, 2048, jnp.float32)
    compiled = model.decode_step.lower(config, params, state,
                                       jnp.zeros((1,), jnp.int32)).compile()
    memory = compiled.memory_analysis()
    cache_bytes = state.k.nbytes + state.v.nbytes
    assert memory.alias_size_in_bytes >= cache_bytes, "cache buffers are not donated"
    assert memory.temp_size_in_bytes < cache_bytes / 2, "the step copies the whole cache"


def test_logits_rejects_bad_shapes():
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="batch, time"):
        dj.logits(config, params, np.arange(5))
    with pytest.raises(ValueError, match="attention_mask shape"):
        dj.logits(config, params, np.ones((1, 5), int), np.ones((1, 4), int))


def test_generation_rejects_out_of_vocab_and_too_long():
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_tokens(dense_engine(config), params, [[2, config.vocab_size]])
    with pytest.raises(ValueError, match="learned positions"):
        generate_tokens(dense_engine(config), params, [[2, 3]],
                        max_new_tokens=config.max_positions)


def test_lengths_past_the_models_positions_are_refused():
    """OPT has no position embedding past its learned positions (its logits would be
    NaN): a longer sequence is refused; a rotary model refuses a generation past its
    context length before allocating its cache."""
    config = dj.preset("opt-tiny").replace(max_positions=16)
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    ids = np.arange(3, 19)[None]
    assert np.isfinite(np.asarray(dj.logits(config, params, ids))).all()
    with pytest.raises(ValueError, match="17 tokens exceed the model's 16 learned positions"):
        dj.logits(config, params, np.arange(3, 20)[None])
    llama = dj.preset("llama-tiny")
    with pytest.raises(ValueError, match="positions of context"):
        generate_tokens(dense_engine(llama), dj.init_params(llama, jax.random.key(0)),
                        [[2, 3]], max_new_tokens=llama.max_positions)


def test_generate_tokens_takes_an_id_array_and_refuses_malformed_arguments():
    """A 2-D numpy array of prompts decodes as the same lists do; a fractional token count
    or a single stop id (not a sequence) is one ValueError, not an error from deep inside."""
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    engine = dense_engine(config)
    rows = [[5, 9, 13], [7, 8, 21]]
    as_lists = generate_tokens(engine, params, rows, 4, stop_ids=[])
    as_array = generate_tokens(engine, params, np.asarray(rows), 4, stop_ids=[])
    assert as_array.tokens == as_lists.tokens and len(as_lists.tokens[0]) == 4
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        generate_tokens(engine, params, rows, 2.5)
    with pytest.raises(ValueError, match="stop_ids must be a sequence"):
        generate_tokens(engine, params, rows, 2, stop_ids=5)
    for stop in ([2.5], [config.vocab_size], [-1]):   # ids no token can match
        with pytest.raises(ValueError, match="stop_ids"):
            generate_tokens(engine, params, rows, 2, stop_ids=stop)


@pytest.mark.parametrize("chunk", [1, 8])
def test_non_finite_logits_stop_generation_at_their_token(chunk):
    """A NaN in the weights read at one position makes that step's logits NaN: generation
    stops there with NonFiniteLogits naming the token, never a garbage id."""
    from dejavu_jax.generation import NonFiniteLogits
    from dejavu_jax.params import OPT_POSITION_OFFSET
    config = dj.preset("opt-tiny")
    params = dj.init_params(config, jax.random.key(0), jnp.float32)
    engine = dense_engine(config)
    prompt = [[5, 9, 13]]
    clean = generate_tokens(engine, params, prompt, 5, stop_ids=[], chunk=chunk)
    assert len(clean.tokens[0]) == 5
    for position, token in ((1, 1), (3, 2), (5, 4)):  # prompt positions 0-2, then steps
        nan_row = params.pos_embed.at[position + OPT_POSITION_OFFSET].set(jnp.nan)
        with pytest.raises(NonFiniteLogits, match=f"row 0 .* at generated token {token}:"):
            generate_tokens(engine, params.replace(pos_embed=nan_row), prompt, 5,
                            stop_ids=[], chunk=chunk)


def test_params_of_another_model_are_refused_by_name():
    """Params whose shapes are not the config's (another preset's, a layer short) are one
    ValueError naming the weight, from logits and from generate_tokens."""
    opt, llama = dj.preset("opt-tiny"), dj.preset("llama-tiny")
    llama_params = dj.init_params(llama, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="do not fit opt-tiny: embed has shape"):
        dj.logits(opt, llama_params, [[1, 2, 3]])
    per_layer = unstack_layers(llama_params)
    short = per_layer.replace(layers=per_layer.layers[:-1])
    with pytest.raises(ValueError, match=f"{llama.n_layers - 1} layers"):
        generate_tokens(dense_engine(llama), short, [[1, 2, 3]], 2)
    wide = llama.replace(ffn=llama.ffn * 2)
    with pytest.raises(ValueError, match="layer weight w_in has shape"):
        dj.logits(wide, llama_params, [[1, 2, 3]])
    assert np.isfinite(np.asarray(dj.logits(llama, llama_params, [[1, 2, 3]]))).all()


def test_llama3_rope_scaling_changes_the_logits():
    """The llama-rope3 fixture matches transformers only with its frequency scaling: the
    same weights under plain RoPE give other logits (the parity tests above are not weak)."""
    config, params, ref = _load("llama-rope3")
    assert config.rope_llama3 == (8.0, 1.0, 4.0, 64.0)
    plain = np.asarray(dj.logits(config.replace(rope_llama3=None), params, ref["input_ids"],
                                 ref["attention_mask"]))
    real = ref["attention_mask"].astype(bool)
    assert np.abs(plain[real] - ref["logits"][real]).max() > 1e-2 * np.abs(ref["logits"]).max()


def test_yarn_rope_scaling_changes_the_logits():
    """The llama-yarn fixture (factor 4, beta_fast 16, beta_slow 2, untruncated ramp, no
    original context given) matches transformers only with YaRN's frequencies and its
    attention factor: without either, the same weights give other logits."""
    config, params, ref = _load("llama-yarn")
    factor, attention, beta_fast, beta_slow, original, truncate = config.rope_yarn
    assert (factor, beta_fast, beta_slow, original, truncate) == (4.0, 16.0, 2.0, 128.0, 0.0)
    np.testing.assert_allclose(attention, 0.1 * np.log(4.0) + 1.0)
    real = ref["attention_mask"].astype(bool)
    scale = np.abs(ref["logits"]).max()
    for changed in (config.replace(rope_yarn=None),
                    config.replace(rope_yarn=(factor, 1.0, beta_fast, beta_slow, original,
                                              truncate))):
        other = np.asarray(dj.logits(changed, params, ref["input_ids"], ref["attention_mask"]))
        assert np.abs(other[real] - ref["logits"][real]).max() > 1e-2 * scale
