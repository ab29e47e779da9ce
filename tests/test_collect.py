"""Activation collection: records match an independent numpy forward; resume; errors."""

import json

import jax
import numpy as np
import pytest

from dejavu_jax import config as config_lib
from dejavu_jax.params import OPT_POSITION_OFFSET, init_params
from dejavu_jax.train import collect as collect_lib
from dejavu_jax.train import corpus as corpus_lib
from dejavu_jax.train import records as rec

WINDOW = 24


class CharTokenizer:
    """One token per character; enough to drive the corpus code without Hugging Face."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[3 + ord(c) % 500 for c in t] for t in texts]}


@pytest.fixture
def corpus(tmp_path):
    words = "the of a river stone quick brown fox jumps over lazy dog again".split()
    rng = np.random.default_rng(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        lines = [" ".join(rng.choice(words, 12)) for _ in range(120)]
        (folder / name).write_text("\n".join(lines) + "\n")
    return corpus_lib.resolve_files([str(folder)])


def _norm(x, scale, bias, eps):
    if bias is None:
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale
    x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale + bias


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def numpy_forward(c, params, ids):
    """Per-layer attn_in, mlp_in, mlp_act, head_norm [L, T, ...] for one window, in numpy."""
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    lp = P.layers
    T = len(ids)
    pos = np.arange(T)
    x = P.embed[ids]
    if c.family == "opt":
        x = x + P.pos_embed[pos + OPT_POSITION_OFFSET]
    out = {k: [] for k in ("attn_in", "mlp_in", "mlp_act", "head_norm")}
    b = lambda a, i: 0.0 if a is None else a[i]  # noqa: E731
    for i in range(c.n_layers):
        out["attn_in"].append(x)
        y = _norm(x, lp.attn_norm_scale[i], None if lp.attn_norm_bias is None
                  else lp.attn_norm_bias[i], c.norm_eps)
        q = np.einsum("td,hkd->thk", y, lp.wq[i]) + b(lp.bq, i)
        k = np.einsum("td,hkd->thk", y, lp.wk[i]) + b(lp.bk, i)
        v = np.einsum("td,hkd->thk", y, lp.wv[i]) + b(lp.bv, i)
        if c.family == "llama":
            q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
        kv_of = np.arange(c.n_heads) // c.group_size
        s = np.einsum("thk,shk->hts", q * c.head_dim ** -0.5, k[:, kv_of])
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        heads = np.einsum("hts,shk->thk", w, v[:, kv_of])
        per_head = np.einsum("thk,dhk->thd", heads, lp.wo[i])
        out["head_norm"].append(np.linalg.norm(per_head, axis=-1))
        x = x + per_head.sum(1) + b(lp.bo, i)
        out["mlp_in"].append(x)
        y = _norm(x, lp.mlp_norm_scale[i], None if lp.mlp_norm_bias is None
                  else lp.mlp_norm_bias[i], c.norm_eps)
        h = y @ lp.w_in[i].T + b(lp.b_in, i)
        if c.gated_mlp:
            g = y @ lp.w_gate[i].T
            act = g / (1 + np.exp(-g)) * h
        else:
            act = np.maximum(h, 0)
        out["mlp_act"].append(act)
        x = x + act @ lp.w_out_t[i] + b(lp.b_out, i)
    return {k: np.stack(v) for k, v in out.items()}


def _read_all(root):
    r = rec.Records(root)
    shards = [r.shard(i) for i in range(len(r.shards))]
    return r, {n: np.concatenate([s[n] for s in shards], axis=1) for n in rec.RECORD_NAMES}


@pytest.mark.parametrize("name", ["opt-tiny", "llama-tiny"])
def test_records_match_numpy_forward(tmp_path, corpus, name):
    c = config_lib.preset(name)
    params = init_params(c, jax.random.key(1), np.float32, std=0.1)
    m = collect_lib.collect(c, params, CharTokenizer(), corpus, tmp_path / "rec", tokens=92,
                            window=WINDOW, batch=2, shard_tokens=46, progress=False,
                            log=lambda s: None)
    assert m["complete"] and m["tokens"] == 92 and len(m["shards"]) == 2
    # the size the CLI announces is the arrays' bytes on disk (less the .npy headers)
    arrays = [f for f in (tmp_path / "rec").rglob("*.npy")]
    data_bytes = sum(np.load(f, mmap_mode="r").nbytes for f in arrays)
    assert data_bytes == 92 * collect_lib.record_bytes_per_token(c)
    assert m["label_rules"]["mlp"] == ("positive" if name == "opt-tiny" else "top:0.3")
    assert m["config_fingerprint"] == c.fingerprint()
    _, got = _read_all(tmp_path / "rec")
    windows = list(corpus_lib.token_windows(CharTokenizer(), corpus, WINDOW, 0, c.bos_token_id))
    rule = rec.LabelRule.parse(m["label_rules"]["mlp"])
    per = WINDOW - 1
    for w in range(4):
        ref = numpy_forward(c, params, windows[w])
        sl = slice(w * per, (w + 1) * per)
        for key in ("attn_in", "mlp_in", "head_norm"):  # BOS position not recorded
            np.testing.assert_allclose(got[key][:, sl].astype(np.float64), ref[key][:, 1:],
                                       rtol=2e-3, atol=2e-4, err_msg=key)
        act = ref["mlp_act"][:, 1:]
        want = rec.apply_rule(rule, act)
        labels = rec.unpack_labels(got["mlp_label"][:, sl], c.ffn)
        assert labels.shape == want.shape
        differ = labels != want
        if rule.kind == "positive":
            near = np.abs(act) < 1e-5
        else:  # only at the top-30% boundary may float rounding swap a neuron
            k = rule.count(c.ffn)
            kth = -np.sort(-np.abs(act), -1)[..., k - 1:k]
            near = np.abs(np.abs(act) - kth) < 1e-5 * np.abs(act).max()
        assert not (differ & ~near).any(), f"{differ.sum()} labels differ"
        assert np.all(labels.sum(-1) == rule.count(c.ffn)) if rule.kind == "top" else True


def test_resume_after_interruption(tmp_path, corpus, monkeypatch):
    c = config_lib.preset("opt-tiny")
    params = init_params(c, jax.random.key(0), np.float32)
    kw = dict(tokens=92, window=WINDOW, batch=2, shard_tokens=46, progress=False,
              log=lambda s: None)
    clean = collect_lib.collect(c, params, CharTokenizer(), corpus, tmp_path / "clean", **kw)

    real_write = rec.write_shard
    calls = []

    def failing_write(root, index, arrays):
        calls.append(index)
        if index == 1:
            raise KeyboardInterrupt
        return real_write(root, index, arrays)

    monkeypatch.setattr(rec, "write_shard", failing_write)
    with pytest.raises(KeyboardInterrupt):
        collect_lib.collect(c, params, CharTokenizer(), corpus, tmp_path / "run", **kw)
    partial = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not partial["complete"] and len(partial["shards"]) == 1
    calls.clear()
    monkeypatch.setattr(rec, "write_shard", lambda *a: (calls.append(a[1]), real_write(*a))[1])
    done = collect_lib.collect(c, params, CharTokenizer(), corpus, tmp_path / "run", **kw)
    assert calls == [1] and done["complete"] and done["shards"] == clean["shards"]
    _, a = _read_all(tmp_path / "clean")
    _, b = _read_all(tmp_path / "run")
    for n in rec.RECORD_NAMES:
        np.testing.assert_array_equal(a[n], b[n])
    with pytest.raises(rec.RecordsError, match="different settings"):
        collect_lib.collect(c, params, CharTokenizer(), corpus, tmp_path / "run",
                            **{**kw, "window": WINDOW + 8})


def test_corpus_errors(tmp_path, capsys):
    with pytest.raises(corpus_lib.CorpusError, match="no such file"):
        corpus_lib.resolve_files([str(tmp_path / "missing" / "*.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(corpus_lib.CorpusError, match="no chunk long enough"):
        corpus_lib.corpus_chunks([empty], 64)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(corpus_lib.CorpusError, match="binary.txt"):
        corpus_lib.corpus_chunks([binary], 8)
    with pytest.raises(SystemExit) as exit_:
        collect_lib.main(["--preset", "opt-tiny", "--corpus", str(empty), "--out",
                          str(tmp_path / "out"), "--no-progress"])
    assert exit_.value.code == 2 and "no chunk long enough" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_incomplete_records_refused(tmp_path):
    rec.write_manifest(tmp_path, {"format_version": rec.FORMAT_VERSION, "complete": False,
                                  "shards": []})
    with pytest.raises(rec.RecordsError, match="incomplete"):
        rec.Records(tmp_path)
    with pytest.raises(rec.RecordsError, match="no manifest"):
        rec.Records(tmp_path / "nowhere")


def test_label_rules():
    v = np.array([[3.0, -5.0, 0.0, 1.0, -0.5]])
    assert rec.apply_rule(rec.LabelRule.parse("positive"), v).tolist() == [
        [True, False, False, True, False]]
    assert rec.apply_rule(rec.LabelRule.parse("top:0.4"), v).tolist() == [
        [True, True, False, False, False]]
    assert rec.apply_rule(rec.LabelRule.parse("threshold:1"), v).tolist() == [
        [True, True, False, True, False]]
    import jax.numpy as jnp
    assert np.asarray(rec.apply_rule(rec.LabelRule.parse("top:0.4"), jnp.asarray(v))).tolist() \
        == [[True, True, False, False, False]]
    with pytest.raises(ValueError):
        rec.LabelRule.parse("top:2")
    # contribution: |act| times the down-projection row's norm, so a small activation of a
    # neuron with a large row can outrank a large one
    rule = rec.LabelRule.parse("contribution:0.4")
    scaled = rec.contribution_values(rule, v[None], np.asarray([[0.1, 1.0, 1.0, 4.0, 1.0]]))
    assert rec.apply_rule(rule, scaled[0]).tolist() == [[False, True, False, True, False]]
    bits = np.random.default_rng(0).random((2, 3, 13)) > 0.5
    np.testing.assert_array_equal(rec.unpack_labels(rec.pack_labels(bits), 13), bits)


def test_unreachable_dataset_is_a_clear_corpus_error(monkeypatch, tmp_path):
    from dejavu_jax.train import corpus as corpus_lib
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import pytest as _pytest
    with _pytest.raises(corpus_lib.CorpusError, match="no-such-dataset-xyz"):
        corpus_lib.dataset_to_file("no-such-dataset-xyz/abc")


def test_a_dataset_with_the_hub_unreachable_fails_at_once(monkeypatch, tmp_path):
    """No hub answering (a closed local port as the endpoint) and not offline: one
    CorpusError at once, not the download libraries' retries."""
    import time

    from dejavu_jax.train import corpus as corpus_lib
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(corpus_lib.CorpusError, match="not reachable.*--corpus"):
        corpus_lib.dataset_to_file("some/corpus")
    assert time.perf_counter() - start < 10


def test_dataset_rows_are_written_to_a_cached_corpus_file(monkeypatch, tmp_path):
    import datasets

    from dejavu_jax.train import corpus as corpus_lib
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")   # the datasets cache (here, the fake)
    rows = [{"text": "first line of a document\n"}, {"text": "second document"}]
    calls = []

    def fake_load(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    path = corpus_lib.dataset_to_file("some/corpus:en:validation")
    assert calls == [("some/corpus", "en", "validation", True)]
    assert path.read_text() == "first line of a document\nsecond document\n"
    assert corpus_lib.dataset_to_file("some/corpus:en:validation") == path and len(calls) == 1


def test_windows_past_the_model_positions_or_vocabulary_are_refused(tmp_path, corpus):
    """A window longer than an OPT model's learned positions gave non-finite records, and
    a tokenizer with ids past the embedding recorded clamped rows: both are errors before
    any shard is written; a window that fits records finite values."""
    c = config_lib.preset("opt-tiny").replace(max_positions=WINDOW - 1)
    params = init_params(c, jax.random.key(0), np.float32)
    kw = dict(tokens=46, batch=2, progress=False, log=lambda s: None)
    with pytest.raises(ValueError, match=f"{WINDOW - 1} positions"):
        collect_lib.collect(c, params, CharTokenizer(), corpus, tmp_path / "long",
                            window=WINDOW, **kw)
    assert not list((tmp_path / "long").glob("shard_*"))
    m = collect_lib.collect(c, params, CharTokenizer(), corpus, tmp_path / "fits",
                            window=WINDOW - 1, **kw)
    _, arrays = _read_all(tmp_path / "fits")
    assert m["complete"] and arrays["attn_in"].shape[1] == m["tokens"] >= 46
    assert np.isfinite(arrays["attn_in"].astype(np.float32)).all()
    small = config_lib.preset("opt-tiny").replace(vocab_size=100)  # CharTokenizer: ids to 502
    small_params = init_params(small, jax.random.key(0), np.float32)
    with pytest.raises(ValueError, match=r"outside the vocabulary.*\[0, 100\)"):
        collect_lib.collect(small, small_params, CharTokenizer(), corpus, tmp_path / "vocab",
                            window=WINDOW, **kw)
    assert not list((tmp_path / "vocab").glob("shard_*"))


def test_a_long_line_gives_a_window_per_window_sized_piece(tmp_path):
    """A corpus of one long line gave one window (a chunk per line end), so collection and
    profiling reported the corpus run out after a window; now the line past its first
    window's share (2 x 6 characters per token) is cut after spaces into more windows,
    each reading its own text."""
    line = "".join(f"x{i:04d} " for i in range(100))  # 600 characters, one line
    (tmp_path / "one.txt").write_text(line)
    windows = list(corpus_lib.token_windows(CharTokenizer(), [tmp_path / "one.txt"], 8, 0,
                                            None))
    texts = sorted("".join(chr(t - 3) for t in w) for w in windows)
    starts = [0] + list(range(96, 600 - 48 + 1, 48))  # ten 48-character pieces after 96
    assert texts == sorted(line[s:s + 8] for s in starts)
    assert texts[0] == "x0000 x0" and len(texts) == 11


def test_lines_shorter_than_three_windows_give_the_same_windows_as_before(corpus):
    """Every chunk of a corpus of short lines is under 3 x the window's characters, so no
    piece is added: the windows (and records made before) stay the same."""
    min_chars = WINDOW * corpus_lib.CHARS_PER_TOKEN
    chunks = corpus_lib.corpus_chunks(corpus, WINDOW)
    assert max(map(len, chunks)) < 3 * min_chars
    assert all(corpus_lib.overflow(c, min_chars) == [] for c in chunks)
    order = np.random.default_rng(5).permutation(len(chunks))
    tok = CharTokenizer()
    expected = [tok([chunks[i]])["input_ids"][0][:WINDOW] for i in order]
    got = list(corpus_lib.token_windows(tok, corpus, WINDOW, 5, None))
    assert [w.tolist() for w in got] == expected


def test_overwrite_deletes_only_a_records_folder(tmp_path, capsys, corpus, monkeypatch):
    """--overwrite removed whatever folder --out named, notes and all; now a folder with
    anything but records is refused before the model loads, and so is an --out that is a
    file. A records folder, a half-written shard included, is still one to replace."""
    monkeypatch.setattr(collect_lib.ModelSource, "load",
                        lambda self: pytest.fail("the model loaded before --out was checked"))
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("keep me")
    (folder / "manifest.json").write_text("{}")
    argv = ["--preset", "opt-tiny", "--corpus", str(corpus[0]), "--window", "16",
            "--no-progress", "--overwrite"]
    for out, words in [(folder, "holds 2 entries that are not records (notes.txt, sub)"),
                       (corpus[0], "is a file")]:
        with pytest.raises(SystemExit) as exit_:
            collect_lib.main(argv + ["--out", str(out)])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and last.startswith(f"error: --out {out}") and words in last
    assert (folder / "notes.txt").read_text() == "keep me" and (folder / "sub").is_dir()
    c = config_lib.preset("opt-tiny")
    params = init_params(c, jax.random.key(0), np.float32)
    records = tmp_path / "records"
    collect_lib.collect(c, params, CharTokenizer(), corpus, records, tokens=46, window=WINDOW,
                        batch=2, shard_tokens=23, progress=False, log=lambda s: None)
    (records / "shard_00009.tmp").mkdir()
    assert sorted(p.name for p in records.iterdir()) == [
        "manifest.json", "shard_00000", "shard_00001", "shard_00009.tmp"]
    assert rec.foreign_entries(records) == []


def test_model_names_resolve_to_their_cached_checkpoint(tmp_path, monkeypatch, capsys):
    """`--model smollm2-135m` was refused as no such file, though generate, eval and
    train.profile take the name; now it loads the name's cached file. An unknown name is
    one error line listing the names."""
    from dejavu_jax import fetch_model
    cached = tmp_path / "m.gguf"
    monkeypatch.setattr(fetch_model, "resolve_model",
                        lambda name: str(cached) if name == "smollm2-135m" else name)
    loaded = []

    def load(self):
        loaded.append(self.path)
        raise SystemExit(0)

    monkeypatch.setattr(collect_lib.ModelSource, "load", load)
    args = collect_lib.build_parser().parse_args(["--model", "smollm2-135m", "--out", "o"])
    with pytest.raises(SystemExit):
        collect_lib.load_source(args)
    assert loaded == [str(cached.resolve())]
    with pytest.raises(SystemExit) as exit_:
        collect_lib.build_parser().parse_args(["--model", "smollm2-nope", "--out", "o"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "smollm2-nope" in last and "smollm2-135m, " in last
