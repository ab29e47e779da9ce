"""What made a result: the code (commit and a fingerprint of its sources), the versions,
the device and the date."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("dejavu_jax", "kernels", "eval", "train")


def code_fingerprint() -> str:
    """sha256 (16 hex digits) of every Python source of the package, by relative path: two
    checkouts with the same fingerprint run the same code."""
    digest = hashlib.sha256()
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def commit() -> str | None:
    """$DEJAVU_COMMIT when set (a copy of the tree, whose git metadata, if any, may be
    stale), else the checkout's commit from git (with "+changes" when its sources differ
    from it), else None."""
    if os.environ.get("DEJAVU_COMMIT"):
        return os.environ["DEJAVU_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            changed = subprocess.run(["git", "status", "--porcelain", "--", *CODE_DIRS],
                                     cwd=ROOT, capture_output=True, text=True, timeout=10)
            dirty = any(line.endswith(".py") for line in changed.stdout.splitlines())
            return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def versions() -> dict:
    """Versions of Python and of the libraries a result depends on (those installed)."""
    from importlib import metadata
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "triton", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_meta() -> dict:
    """Date (UTC), commit, code fingerprint, versions and device of a run."""
    import jax
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=commit(), code_fingerprint=code_fingerprint(), versions=versions(),
                device=str(jax.devices()[0].device_kind), backend=jax.default_backend())
