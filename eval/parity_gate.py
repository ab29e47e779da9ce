"""Benchmarks on the GPU open with `eval.kernel_parity` on the code they measure: a row
whose code fails parity is not a result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from dejavu_jax.eval.provenance import code_fingerprint


def add_parity_argument(p: argparse.ArgumentParser) -> None:
    """--parity FILE: a passing kernel_parity.json of the same code on the same device
    kind, to reuse instead of running the checks again."""
    p.add_argument("--parity", type=Path, metavar="FILE",
                   help="a kernel_parity.json that this code passed on this device kind, "
                        "reused instead of running the checks first (on a GPU)")


def require_parity(reuse: Path | None, out: Path, log=print) -> dict:
    """The parity verdict a benchmark records in its metadata. Off the GPU the kernels run
    their jnp references, so nothing is checked. On the GPU: `reuse` when it passed for
    this code (same fingerprint) on this device kind, else a fresh run of the checks
    (written under `out`/kernel_parity). Exits with an error when they fail."""
    from dejavu_jax.eval import kernel_parity
    backend = jax.default_backend()
    if backend != "gpu":
        return dict(status=f"not run: on {backend} the kernels run their jnp references")
    device = str(jax.devices()[0].device_kind)
    fingerprint = code_fingerprint()
    if reuse is not None and Path(reuse).is_file():
        meta = json.loads(Path(reuse).read_text()).get("meta", {})
        if (meta.get("passed") and meta.get("code_fingerprint") == fingerprint
                and meta.get("device") == device):
            return dict(status="passed", file=str(reuse), fingerprint=fingerprint,
                        checks=meta.get("checks"))
        log(f"{reuse} is not a pass of this code on {device}: running kernel_parity")
    elif reuse is not None:
        log(f"{reuse} does not exist: running kernel_parity")
    folder = Path(out) / "kernel_parity"
    if kernel_parity.main(["--out", str(folder)]) != 0:
        raise SystemExit(f"error: kernel_parity failed on this code ({folder}); no benchmark "
                         "rows are reported")
    meta = json.loads((folder / "kernel_parity.json").read_text())["meta"]
    return dict(status="passed", file=str(folder / "kernel_parity.json"),
                fingerprint=fingerprint, checks=meta.get("checks"))
