"""The on-disk format of recorded activations: shards of .npy files plus manifest.json.

A records folder holds
  manifest.json                 what was recorded, from what, and which shards are complete
  shard_00000/attn_in.npy       [L, n, d] fp16  residual stream entering attention (pre-norm)
  shard_00000/mlp_in.npy        [L, n, d] fp16  residual stream entering the MLP (pre-norm)
  shard_00000/mlp_label.npy     [L, n, ceil(F/8)] uint8  neuron labels, bit-packed (little)
  shard_00000/head_norm.npy     [L, n, H] fp16  ||H_i(y) W_O^i|| per query head
Head labels are derived from the stored norms at training time (`head_labels`), so the
rule can change without recollecting; MLP labels are fixed at collection (the full
activations would be F/8 times larger than the packed bits).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
RECORD_NAMES = ("attn_in", "mlp_in", "mlp_label", "head_norm")
FP16_MAX = float(np.finfo(np.float16).max)


class RecordsError(RuntimeError):
    """A records folder is missing, incomplete or inconsistent."""


@dataclass(frozen=True)
class LabelRule:
    """How a per-token vector of magnitudes becomes active/inactive labels.

    kind: "positive" (value > 0, ReLU's rule), "top" (the top `value` fraction by
      magnitude, at least one), "contribution" (the top `value` fraction by a neuron's
      contribution to the output, |act_i| * ||w_out_i||: `apply_rule` takes those products,
      see `contribution_values`) or "threshold" (magnitude >= `value`).
    """

    kind: str
    value: float = 0.0

    def __post_init__(self):
        if self.kind not in ("positive", "top", "contribution", "threshold"):
            raise ValueError(f"unknown label rule {self.kind!r}")
        if self.kind in ("top", "contribution") and not 0.0 < self.value <= 1.0:
            raise ValueError(f"top fraction must be in (0, 1], got {self.value}")
        if self.kind == "threshold" and not math.isfinite(self.value):
            raise ValueError(f"threshold must be finite, got {self.value}")

    @classmethod
    def parse(cls, text: str) -> "LabelRule":
        """Parse 'positive', 'top:0.3' or 'threshold:1.5'."""
        kind, _, value = text.partition(":")
        if kind == "positive":
            return cls("positive")
        try:
            return cls(kind, float(value))
        except ValueError:
            raise ValueError(f"bad label rule {text!r}; use 'positive', 'top:FRACTION', "
                             "'contribution:FRACTION' or 'threshold:VALUE'") from None

    def __str__(self) -> str:
        return self.kind if self.kind == "positive" else f"{self.kind}:{self.value:g}"

    def count(self, n: int) -> int:
        """Labels per token under a "top" rule over n units."""
        return max(1, int(round(self.value * n)))


def apply_rule(rule: LabelRule, values: np.ndarray) -> np.ndarray:
    """Boolean labels [..., n] from values [..., n] (numpy or jax arrays)."""
    xp = _array_module(values)
    if rule.kind == "positive":
        return values > 0
    mag = xp.abs(values)
    if rule.kind == "threshold":
        return mag >= rule.value
    k = rule.count(values.shape[-1])
    if xp is np:  # O(n) selection; much faster than a sort on CPU
        kth = -np.partition(-mag, k - 1, axis=-1)[..., k - 1:k]
    else:
        import jax
        kth = jax.lax.top_k(mag, k)[0][..., k - 1:k]
    return mag >= kth


def contribution_values(rule: LabelRule, act, w_out_norms):
    """The values a rule labels from activations act [L, n, F]: |act| * ||w_out row||
    ([L, F]) for the contribution rule, act itself for the others."""
    if rule.kind != "contribution":
        return act
    return act * w_out_norms[:, None, :]


def _array_module(x):
    if isinstance(x, np.ndarray):
        return np
    import jax.numpy as jnp
    return jnp


def default_mlp_rule(activation: str) -> LabelRule:
    """ReLU models: active where act > 0 (the paper). Others: top 30% by |act|."""
    return LabelRule("positive") if activation == "relu" else LabelRule("top", 0.3)


def pack_labels(labels: np.ndarray) -> np.ndarray:
    """Bool [..., F] -> uint8 [..., ceil(F/8)] (little bit order)."""
    return np.packbits(np.asarray(labels, bool), axis=-1, bitorder="little")


def unpack_labels(packed: np.ndarray, n: int) -> np.ndarray:
    """uint8 [..., ceil(n/8)] -> bool [..., n]."""
    return np.unpackbits(packed, axis=-1, count=n, bitorder="little").astype(bool)


def to_fp16(x: np.ndarray) -> np.ndarray:
    """fp16 copy, saturating at ±65504 instead of overflowing to inf."""
    return np.clip(np.asarray(x, np.float32), -FP16_MAX, FP16_MAX).astype(np.float16)


def shard_name(index: int) -> str:
    """Folder name of shard `index`."""
    return f"shard_{index:05d}"


def write_shard(root: Path, index: int, arrays: dict[str, np.ndarray]) -> dict:
    """Write one shard atomically (temp folder, then rename); returns its manifest entry.

    arrays: the four RECORD_NAMES, each with shape [L, n, ...].
    """
    missing = set(RECORD_NAMES) - set(arrays)
    if missing:
        raise ValueError(f"shard is missing records {sorted(missing)}")
    n = {a.shape[1] for a in arrays.values()}
    if len(n) != 1:
        raise ValueError(f"records disagree on the token count: {n}")
    final = root / shard_name(index)
    tmp = root / (shard_name(index) + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in RECORD_NAMES:
        np.save(tmp / f"{name}.npy", arrays[name])
    if final.exists():
        _remove_tree(final)
    os.replace(tmp, final)
    return {"name": final.name, "tokens": int(n.pop())}


def foreign_entries(root: Path) -> list[str]:
    """The names in folder `root` that no records folder holds (anything but its manifest
    and shards, finished or half-written), sorted."""
    ok = re.compile(r"(manifest\.json|shard_\d{5})(\.tmp)?")
    return sorted(p.name for p in root.iterdir() if not ok.fullmatch(p.name))


def _remove_tree(path: Path):
    for p in sorted(path.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    path.rmdir()


def write_manifest(root: Path, manifest: dict):
    """Write manifest.json atomically."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, root / "manifest.json")


def read_manifest(root: Path) -> dict | None:
    """The manifest of a records folder, or None when there is none."""
    path = Path(root) / "manifest.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecordsError(f"{path}: invalid JSON ({e})") from None


class Records:
    """Read access to a complete records folder, one memory-mapped shard at a time."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        manifest = read_manifest(self.root)
        if manifest is None:
            raise RecordsError(f"{self.root}: no manifest.json (run dejavu_jax.train.collect)")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RecordsError(f"{self.root}: records format {manifest.get('format_version')} "
                               f"!= {FORMAT_VERSION}")
        if not manifest.get("complete"):
            raise RecordsError(f"{self.root}: collection is incomplete "
                               f"({len(manifest.get('shards', []))} shards); rerun collect "
                               "with the same arguments to resume")
        self.manifest = manifest
        self.shards = [s["name"] for s in manifest["shards"]]
        dims = manifest["dims"]
        self.n_layers, self.hidden = dims["n_layers"], dims["hidden"]
        self.ffn, self.n_heads = dims["ffn"], dims["n_heads"]
        self.n_kv_heads = dims.get("n_kv_heads", self.n_heads)

    def shard(self, i: int) -> dict[str, np.ndarray]:
        """Shard i's records as read-only memory maps."""
        folder = self.root / self.shards[i]
        try:
            return {n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in RECORD_NAMES}
        except (OSError, ValueError) as e:
            raise RecordsError(f"{folder}: cannot read shard ({e})") from None

    @property
    def n_tokens(self) -> int:
        """Recorded tokens over all shards."""
        return sum(s["tokens"] for s in self.manifest["shards"])
