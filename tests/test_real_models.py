"""Real registered models (GGUF, dequantised) against Hugging Face transformers' logits.

References: tests/fixtures/real/<name>.npz, made by tests/fixtures/make_real_model_reference.py
with transformers reading the same GGUF in float32. A model that is not in the fetch cache
is skipped (`python -m dejavu_jax.fetch_model NAME` fetches it); CI fetches none of these.
"""

from pathlib import Path

import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax.generation import dense_engine, generate_tokens
from dejavu_jax.gguf_loader import tokenizer_from_gguf
from dejavu_jax.models_registry import model_source

REFERENCES = Path(__file__).parent / "fixtures" / "real"
NAMES = ["gemma3-270m", "qwen2.5-0.5b", "qwen2.5-1.5b"]
SHAPES = {"gemma3-270m": ("gemma3", 18, 640, 4, 1), "qwen2.5-0.5b": ("qwen2", 24, 896, 14, 2),
          "qwen2.5-1.5b": ("qwen2", 28, 1536, 12, 2)}


def _cached(name) -> Path:
    source = model_source(name)
    if not source.is_cached():
        pytest.skip(f"{name} is not in the fetch cache ({source.cache_path()}); "
                    f"`python -m dejavu_jax.fetch_model {name}` fetches it "
                    f"({source.size / 1e6:.0f} MB)")
    return source.cache_path()


@pytest.fixture(scope="module", params=NAMES)
def real_model(request):
    name = request.param
    path = _cached(name)
    config, params = dj.load_pretrained(path, progress=False)
    yield name, path, config, params, np.load(REFERENCES / f"{name}.npz")
    del params


def test_logits_and_greedy_tokens_match_transformers(real_model):
    name, _, config, params, ref = real_model
    assert (config.family, config.n_layers, config.hidden, config.n_heads,
            config.n_kv_heads) == SHAPES[name]
    for i in range(int(ref["n_prompts"])):
        ids = ref[f"input_ids_{i}"]
        assert ids.max() < config.vocab_size
        out = np.asarray(dj.logits(config, params, ids[None]))[0]
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out.argmax(-1), ref[f"top1_{i}"], err_msg=f"prompt {i}")
        err = np.abs(out[-1, ref[f"logit_ids_{i}"]] - ref[f"logits_{i}"]).max()
        assert err <= 1e-3, f"{name} prompt {i}: max abs logit error {err}"  # measured <= 3.2e-5
        want = ref[f"generated_{i}"].tolist()
        got = generate_tokens(dense_engine(config), params, [ids.tolist()],
                              max_new_tokens=len(want), stop_ids=[])
        assert got.tokens[0] == want, f"{name} prompt {i}"


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "gemma3-270m"])
def test_tokenizer_matches(name):
    """Qwen2: transformers' own GGUF tokenizer gave the reference ids. Gemma 3: the
    SentencePiece library did, from the GGUF's pieces and scores (transformers' Gemma GGUF
    conversion splits words, so its ids are no reference there)."""
    tok = tokenizer_from_gguf(_cached(name))
    ref = np.load(REFERENCES / f"{name}.npz")
    for i in range(int(ref["n_prompts"])):
        text, ids = str(ref[f"text_{i}"]), ref[f"input_ids_{i}"].tolist()
        chat = bool(ref[f"chat_{i}"])  # chat-template text holds its special tokens
        assert tok(text, add_special_tokens=not chat)["input_ids"] == ids, text
        assert tok.decode(ids, skip_special_tokens=not chat) == text
    if name == "gemma3-270m":
        assert tok.convert_ids_to_tokens([5279, 7001]) == ["\u2581capital", "\u2581France"]
        assert getattr(tok, "chat_template", None) is None  # the base model: plain text
    else:
        assert "<|im_start|>" in tok.chat_template
