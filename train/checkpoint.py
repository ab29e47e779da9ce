"""Saving and loading trained predictors: an orbax checkpoint plus manifest.json.

  DIR/params/         orbax StandardCheckpointer tree of PredictorParams
  DIR/manifest.json   model, config fingerprint, shapes, inputs, per-layer metrics
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dejavu_jax.cli import first_line
from dejavu_jax.config import ModelConfig
from dejavu_jax.train.predictor_model import Predictor, PredictorParams


class PredictorCheckpointError(RuntimeError):
    """A predictor checkpoint is missing, malformed, or made for another model."""


def shapes_of(params: PredictorParams) -> dict:
    """The dims a manifest needs to rebuild the params' structure."""
    L, d, r = params.mlp.w1.shape
    return {"n_layers": L, "hidden": d, "rank": r, "ffn": params.mlp.w2.shape[-1],
            "n_heads": params.heads.w2.shape[-1], "dtype": str(params.mlp.w1.dtype),
            "activation": params.activation}


def save_predictors(directory: str | os.PathLike, params: PredictorParams, manifest: dict):
    """Write params (orbax) and manifest.json into `directory`, replacing an old checkpoint."""
    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "params"
    if target.exists():
        shutil.rmtree(target)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(target, params)
    checkpointer.wait_until_finished()
    manifest = {**manifest, "shapes": shapes_of(params)}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def abstract_params(shapes: dict) -> PredictorParams:
    """ShapeDtypeStructs of the PredictorParams described by a manifest's `shapes`."""
    L, d, r = shapes["n_layers"], shapes["hidden"], shapes["rank"]
    dtype = jnp.dtype(shapes.get("dtype", "float32"))

    def kind(n):
        s = jax.ShapeDtypeStruct
        return Predictor(mean=s((L, d), jnp.float32), inv_std=s((L, d), jnp.float32),
                         w1=s((L, d, r), dtype), w2=s((L, r, n), dtype), b2=s((L, n), dtype))

    return PredictorParams(mlp=kind(shapes["ffn"]), heads=kind(shapes["n_heads"]),
                           activation=shapes.get("activation", "none"))


def load_predictors(directory: str | os.PathLike,
                    config: ModelConfig | None = None) -> tuple[PredictorParams, dict]:
    """(params, manifest) from a predictor folder.

    With `config`, checks that the predictors were trained for it (config fingerprint,
    lookahead inputs, then shapes) and raises PredictorCheckpointError otherwise; so does a missing or
    malformed manifest, or params that cannot be restored.
    """
    directory = Path(directory).expanduser().resolve()
    path = directory / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PredictorCheckpointError(f"{path}: missing (not a predictor folder)") from None
    except json.JSONDecodeError as e:
        raise PredictorCheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise PredictorCheckpointError(f"{path}: not a JSON object")
    if "shards" in manifest:
        raise PredictorCheckpointError(f"{directory}: holds records of train.collect, not "
                                       "predictors (train them with train.predictors)")
    if config is not None:
        if not config.fits_fingerprint(manifest.get("config_fingerprint")):
            raise PredictorCheckpointError(
                f"{directory}: predictors were trained for model {manifest.get('model')!r} "
                f"(config fingerprint {manifest.get('config_fingerprint')}), not for "
                f"{config.name!r} ({config.fingerprint()})")
    if config is not None and manifest.get("lookahead", True) is False:
        raise PredictorCheckpointError(
            f"{directory}: these predictors read each layer's own input (trained with "
            "--same-layer); the sparse decode and the scorers feed the previous layer's "
            "(lookahead): train them without --same-layer")
    shapes = manifest.get("shapes")
    if not isinstance(shapes, dict):
        raise PredictorCheckpointError(f"{path}: no 'shapes' entry (an incomplete manifest)")
    try:
        dims = (shapes["n_layers"], shapes["hidden"], shapes["ffn"], shapes["n_heads"])
        abstract = abstract_params(shapes)
    except (KeyError, TypeError, ValueError) as e:
        raise PredictorCheckpointError(f"{path}: malformed 'shapes' {shapes} "
                                       f"({type(e).__name__}: {e})") from None
    if config is not None and dims != (config.n_layers, config.hidden, config.ffn,
                                       config.n_heads):
        raise PredictorCheckpointError(f"{directory}: predictor shapes {shapes} do not fit "
                                       f"{config.name!r}")
    checkpointer = ocp.StandardCheckpointer()
    try:
        params = checkpointer.restore(directory / "params", abstract)
    except Exception as e:  # orbax and tensorstore: FileNotFoundError, ValueError, ...
        reason = first_line(e)
        raise PredictorCheckpointError(f"{directory / 'params'}: cannot restore the "
                                       f"predictors ({_brief(reason)})") from None
    finally:
        checkpointer.close()
    return params, manifest


def _brief(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters (tensorstore's errors carry their whole spec)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."
