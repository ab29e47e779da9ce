"""Self-generated text: continuations of corpus prompts by a tiny random model."""

import jax
import numpy as np
import pytest

from dejavu_jax import config as config_lib
from dejavu_jax.params import init_params
from dejavu_jax.sampling import SamplingConfig
from dejavu_jax.train import corpus as corpus_lib
from dejavu_jax.train import self_text


class CharTokenizer:
    """One token per lower-case letter or space (ids 3..29); decodes them back."""

    ALPHABET = " abcdefghijklmnopqrstuvwxyz"

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[3 + self.ALPHABET.index(c) for c in t if c in self.ALPHABET]
                              for t in texts]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.ALPHABET[(t - 3) % len(self.ALPHABET)] if t >= 3 else ""
                       for t in ids)


@pytest.fixture
def corpus(tmp_path):
    words = "the of a river stone quick brown fox jumps over lazy dog again".split()
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(200)) + "\n")
    return corpus_lib.resolve_files([str(path)])


def test_writes_requested_continuations(tmp_path, corpus):
    c = config_lib.preset("llama-tiny")
    params = init_params(c, jax.random.key(0), np.float32)
    new = 12
    texts, stats = self_text.generate_continuations(
        c, params, CharTokenizer(), corpus, tokens=5 * new, prompt_tokens=8, new_tokens=new,
        batch=2, sampling=SamplingConfig(0.8), seed=1, stop_ids=(), progress=False,
        log=lambda s: None)
    assert stats["tokens"] == 5 * new and stats["generate_calls"] == 3
    out = tmp_path / "selfgen" / "t.txt"
    self_text.write_paragraphs(texts, out)
    paragraphs = out.read_text().strip("\n").split("\n\n")
    assert len(paragraphs) == 5 and all(p.strip() for p in paragraphs)
    # the file reads back as a corpus
    assert corpus_lib.corpus_chunks(corpus_lib.resolve_files([str(out)]), 4)


def test_bad_input(tmp_path, corpus, capsys):
    c = config_lib.preset("llama-tiny")
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        self_text.generate_continuations(c, None, CharTokenizer(), corpus, tokens=0)
    for argv, message in ((["--model", str(tmp_path / "missing.gguf")], "no such file"),
                          (["--preset", "llama-tiny", "--tokens", "0"], "must be >= 1")):
        with pytest.raises(SystemExit) as e:
            self_text.main(argv + (["--tokens", "10"] if "--tokens" not in argv else [])
                           + ["--out", str(tmp_path / "x.txt")])
        assert e.value.code == 2 and message in capsys.readouterr().err
