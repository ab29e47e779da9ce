"""SmolLM2-135M (real weights from GGUF) against Hugging Face transformers' logits."""

import os
from pathlib import Path

import numpy as np
import pytest

import dejavu_jax as dj
from dejavu_jax.generation import dense_engine, generate_tokens
from dejavu_jax.gguf_loader import smollm2_cache_path

REF = Path(__file__).parent / "fixtures" / "smollm2_reference.npz"


def _gguf_path() -> Path:
    env = os.environ.get("DEJAVU_SMOLLM2_GGUF")
    return Path(env) if env else smollm2_cache_path()


pytestmark = pytest.mark.skipif(
    not _gguf_path().is_file(),
    reason=f"SmolLM2 GGUF not found at {_gguf_path()}; run "
           "`python -c 'from dejavu_jax.gguf_loader import fetch_smollm2; fetch_smollm2()'`")


@pytest.fixture(scope="module")
def smollm2():
    config, params = dj.load_pretrained(_gguf_path(), progress=False)
    return config, params, np.load(REF)


def test_smollm2_logits_match_transformers(smollm2):
    config, params, ref = smollm2
    assert (config.n_layers, config.hidden, config.n_heads, config.n_kv_heads) == (30, 576, 9, 3)
    for i in range(int(ref["n_prompts"])):
        ids = ref[f"input_ids_{i}"]
        out = np.asarray(dj.logits(config, params, ids[None]))[0]
        np.testing.assert_array_equal(out.argmax(-1), ref[f"top1_{i}"])
        err = np.abs(out[-1] - ref[f"last_logits_{i}"]).max()
        assert err <= 1e-2, f"prompt {i}: max abs logit error {err}"


def test_smollm2_greedy_generation_matches_transformers(smollm2):
    """The prompts in one left-padded batch (the longest one unpadded): each row's greedy
    ids are transformers' for that prompt alone. One batch runs a third of the steps that
    one prompt at a time would, and this model's steps take most of the test's time."""
    config, params, ref = smollm2
    n = int(ref["n_prompts"])
    prompts = [ref[f"input_ids_{i}"].tolist() for i in range(n)]
    want = [ref[f"generated_{i}"].tolist() for i in range(n)]
    assert len({len(w) for w in want}) == 1  # one max_new_tokens for the batch
    got = generate_tokens(dense_engine(config), params, prompts, max_new_tokens=len(want[0]),
                          stop_ids=[])
    for i in range(n):
        assert got.tokens[i] == want[i], f"prompt {i}"
