"""Sparsity profiles: a model's calibrated activation thresholds with their measured cost.

A profile is a small JSON file: the model it was made for (name and config fingerprint),
the method (which threshold sites), each layer's level (fraction of a site's channels
dropped on calibration text) and threshold, what the search measured, and with the gate
site the per-neuron weights of its ranking (float16 in base64: about 120 KB for
SmolLM2-135M, 670 KB for Qwen2.5-1.5B; `activation_sparsity.gate_magnitude`).
`train.profile` makes them; `generate --sparse` and the evaluation CLIs read them.
Profiles for the fetchable models ship in `dejavu_jax/shipped_profiles/`; profiles made
here go to `$DEJAVU_CACHE/profiles/` unless written elsewhere.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np

from dejavu_jax.activation_sparsity import SITES
from dejavu_jax.config import ModelConfig

METHODS = {"teal": ("qkv", "o", "gate_up", "down"), "cats": ("gate",),
           "teal+cats": ("qkv", "o", "gate_up", "gate", "down")}
SHIPPED = Path(__file__).resolve().parent / "shipped_profiles"


class ProfileError(ValueError):
    """A profile file is missing, malformed, or made for another model."""


def method_sites(config: ModelConfig, method: str) -> tuple[str, ...]:
    """The threshold sites of `method` (METHODS); ProfileError for an unknown method or one
    the model cannot run (the gate site needs a gated MLP)."""
    if method not in METHODS:
        raise ProfileError(f"unknown sparsity method {method!r}; known: {', '.join(METHODS)}")
    if "gate" in METHODS[method] and not config.gated_mlp:
        raise ProfileError(f"method {method!r} thresholds the gate, and {config.name} has no "
                           "gated MLP; use 'teal'")
    return METHODS[method]


@dataclasses.dataclass
class SparsityProfile:
    """Per-layer thresholds of one model and method, and how they were measured."""

    model: str
    fingerprint: str
    method: str
    sites: tuple[str, ...]
    levels: list[list[float]]
    thresholds: list[list[float]]
    measured: dict = dataclasses.field(default_factory=dict)
    calibration: dict = dataclasses.field(default_factory=dict)
    gate_weights: list[str] | None = None  # per layer, base64 of float16 [F]

    def threshold_array(self) -> np.ndarray:
        """The thresholds as the engine's selector params: float32 [L, len(SITES)]."""
        return np.asarray(self.thresholds, np.float32)

    def gate_weight_array(self) -> np.ndarray | None:
        """The gate site's per-neuron weights, float32 [L, F], or None (|act(gate)| alone)."""
        if self.gate_weights is None:
            return None
        return np.stack([np.frombuffer(base64.b64decode(row), "<f2")
                         for row in self.gate_weights]).astype(np.float32)

    def weighted_params(self, params):
        """`params` with this profile's gate weights in their layers (none: removed), the
        form the threshold decode and scorer run a profile with."""
        from dejavu_jax.params import with_gate_weights
        return with_gate_weights(params, self.gate_weight_array())

    def check(self, config: ModelConfig) -> None:
        """ProfileError unless the profile fits `config` (fingerprint and layer count)."""
        if not config.fits_fingerprint(self.fingerprint):
            raise ProfileError(f"profile for model {self.model!r} (fingerprint "
                               f"{self.fingerprint}) does not fit {config.name!r} "
                               f"({config.fingerprint()})")
        if np.shape(self.thresholds) != (config.n_layers, len(SITES)):
            raise ProfileError(f"profile thresholds have shape {np.shape(self.thresholds)}, "
                               f"expected ({config.n_layers}, {len(SITES)})")
        try:
            w = self.gate_weight_array()
        except (ValueError, TypeError) as e:
            raise ProfileError(f"profile gate weights are malformed: {e}") from None
        if w is not None and (w.shape != (config.n_layers, config.ffn)
                              or not np.all(np.isfinite(w)) or np.any(w <= 0)):
            raise ProfileError(f"profile gate weights have shape {w.shape} or values that "
                               f"are not positive, expected ({config.n_layers}, {config.ffn})"
                               " positive weights")

    def summary(self) -> str:
        """One line: method, what the search measured (perplexity cost and bytes skipped)."""
        m = self.measured
        parts = [f"profile {self.method} ({'+'.join(self.sites)})"]
        for text, t in m.get("test", {}).items():  # measured on evaluation text
            parts.append(f"perplexity cost {t['ppl_cost']:+.1%} on {t['tokens']} tokens of "
                         f"{text}, {t['bytes_skipped']:.1%} of the decoder weight bytes "
                         "skipped")
        if m.get("test"):
            return "; ".join([", ".join(parts[:2])] + parts[2:])
        if "ppl_cost" in m:
            parts.append(f"expected perplexity cost {m['ppl_cost']:+.1%} on "
                         f"{m.get('text', 'search text')}")
        if "bytes_skipped" in m:
            parts.append(f"{m['bytes_skipped']:.1%} of the decoder weight bytes skipped")
        return ", ".join(parts)

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (atomically); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".part")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        tmp.replace(path)
        return path


def encode_gate_weights(weights) -> list[str] | None:
    """Gate weights [L, F] as the profile stores them (None stays None)."""
    if weights is None:
        return None
    w = np.asarray(weights, np.float32).astype("<f2")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in w]


def _number_table(values) -> np.ndarray | None:
    """`values` as a float64 table [rows, columns], or None unless it is one of numbers."""
    try:
        table = np.asarray(values, np.float64)
    except (ValueError, TypeError):
        return None
    return table if table.ndim == 2 else None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def malformed(profile: SparsityProfile) -> str | None:
    """What makes a profile unusable whatever the model (an unknown method or site,
    thresholds that are not finite numbers >= 0, levels outside [0, 1], a malformed
    `measured` record), or None."""
    if profile.method not in METHODS:
        return f"unknown method {profile.method!r}; known: {', '.join(METHODS)}"
    unknown = [site for site in profile.sites if site not in SITES]
    if unknown or not profile.sites:
        return f"unknown activation sites {unknown or '(none)'}; known: {', '.join(SITES)}"
    for name in ("thresholds", "levels"):
        table = _number_table(getattr(profile, name))
        if table is None:
            return f"{name} must be a table of numbers (one row per layer)"
        if not np.all(np.isfinite(table)) or np.any(table < 0):
            return f"{name} must be finite numbers >= 0"
        if name == "levels" and np.any(table > 1):
            return "levels are fractions of channels, in [0, 1]"
    m = profile.measured
    if not isinstance(m, dict):
        return "measured must be a JSON object"
    for key in ("ppl_cost", "bytes_skipped"):
        if key in m and not _is_number(m[key]):
            return f"measured.{key} must be a number"
    tests = m.get("test", {})
    if not isinstance(tests, dict) or not all(
            isinstance(t, dict) and all(_is_number(t.get(k))
                                        for k in ("ppl_cost", "tokens", "bytes_skipped"))
            for t in tests.values()):
        return "measured.test must map each text to its ppl_cost, tokens and bytes_skipped"
    return None


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "true or false", type(None): "null"}


def _field_problem(raw) -> str | None:
    """What keeps the JSON value `raw` from being a profile's fields (not an object,
    fields missing or unknown, `sites` not a list), or None."""
    if not isinstance(raw, dict):
        return f"the file holds {_JSON_TYPES.get(type(raw), 'a value')}, not an object"
    fields = dataclasses.fields(SparsityProfile)
    missing = [f.name for f in fields if f.name not in raw
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    unknown = sorted(set(raw) - {f.name for f in fields})
    problems = []
    if missing:
        problems.append(f"missing field(s) {', '.join(repr(n) for n in missing)}")
    if unknown:
        problems.append(f"unknown field(s) {', '.join(repr(n) for n in unknown)}")
    if problems:
        return "; ".join(problems)
    if not isinstance(raw["sites"], list):
        got = _JSON_TYPES.get(type(raw["sites"]), "a value")
        return f"sites must be a list of site names, got {got}"
    return None


def load_profile(path: str | Path, config: ModelConfig | None = None) -> SparsityProfile:
    """A profile from its JSON file, checked against `config` when given; ProfileError for
    a missing or malformed file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: not a sparsity profile: not UTF-8 text ({e.reason} at "
                           f"byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not a sparsity profile: not valid JSON ({e.msg} at line "
                           f"{e.lineno}, column {e.colno})") from None
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the profile ({e.strerror or e})") from None
    problem = _field_problem(raw)
    if problem:
        raise ProfileError(f"{path}: not a sparsity profile: {problem}")
    profile = SparsityProfile(**{**raw, "sites": tuple(raw["sites"])})
    problem = malformed(profile)
    if problem:
        raise ProfileError(f"{path}: not a usable sparsity profile: {problem}")
    if config is not None:
        profile.check(config)
    return profile


def profile_dirs() -> list[Path]:
    """Where profiles are looked for by model: the cache's profiles/, then the shipped."""
    from dejavu_jax.paths import cache_root
    return [cache_root() / "profiles", SHIPPED]


def default_profile_path(config: ModelConfig, method: str | None = None) -> Path | None:
    """A profile that fits `config` (of `method`, else the first found in `profile_dirs`
    order, shipped profiles named `<model>.json` first among their folder's), or None."""
    for folder in profile_dirs():
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json"), key=lambda p: (p.stem != config.name, p.name)):
            try:
                profile = load_profile(path)
            except ProfileError:
                continue
            if config.fits_fingerprint(profile.fingerprint) and method in (None, profile.method):
                return path
    return None
