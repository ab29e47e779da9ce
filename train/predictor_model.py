"""The sparsity predictors' weights and forward pass, stacked over layers.

Per layer and per kind (MLP neurons, attention heads) a low-rank network
    x -> x_hat = (x / rms(x) - mean) * inv_std      fixed input normalisation
      -> h = x_hat @ w1                              [r]
      -> act(h) @ w2 + b2                            [n] logits (act: none by default)
The normalisation makes the scores independent of the residual stream's scale and
evens out its outlier dimensions; its mean and inv_std are statistics of the training
inputs and are not trained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

F32 = jnp.float32
ACTIVATIONS = ("none", "relu", "gelu")


@struct.dataclass
class Predictor:
    """One kind of predictor for all layers; leaves have a leading layer axis L."""

    mean: jax.Array      # [L, d]
    inv_std: jax.Array   # [L, d]
    w1: jax.Array        # [L, d, r]
    w2: jax.Array        # [L, r, n]
    b2: jax.Array        # [L, n]


@struct.dataclass
class PredictorParams:
    """MLP-neuron and attention-head predictors; `activation` is static."""

    mlp: Predictor
    heads: Predictor
    activation: str = struct.field(pytree_node=False, default="none")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(layers, input width, neurons, query heads) the predictors score."""
        L, d = self.mlp.w1.shape[:2]
        return L, d, self.mlp.w2.shape[-1], self.heads.w2.shape[-1]


def rms_normalise(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) over the last axis, in fp32."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def input_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, inv_std) [L, d] of RMS-normalised inputs x [L, N, d]."""
    xn = np.asarray(rms_normalise(jnp.asarray(x)))
    mean = xn.mean(axis=1)
    std = xn.std(axis=1)
    return mean.astype(np.float32), (1.0 / np.maximum(std, 1e-3)).astype(np.float32)


def init_predictor(key: jax.Array, n_layers: int, d: int, r: int, n: int,
                   mean: np.ndarray, inv_std: np.ndarray, base_rate: np.ndarray) -> Predictor:
    """Random weights (variance-preserving), output bias at the logit of `base_rate` [L, n]."""
    k1, k2 = jax.random.split(key)
    p = np.clip(base_rate, 1e-4, 1 - 1e-4)
    return Predictor(
        mean=jnp.asarray(mean, F32), inv_std=jnp.asarray(inv_std, F32),
        w1=jax.random.normal(k1, (n_layers, d, r), F32) * d ** -0.5,
        w2=jax.random.normal(k2, (n_layers, r, n), F32) * r ** -0.5 * 0.1,
        b2=jnp.asarray(np.log(p / (1 - p)), F32))


def _activation(name: str, h: jax.Array) -> jax.Array:
    if name == "none":
        return h
    if name == "relu":
        return jax.nn.relu(h)
    if name == "gelu":
        return jax.nn.gelu(h)
    raise ValueError(f"unknown predictor activation {name!r}; known: {ACTIVATIONS}")


def predictor_logits(p: Predictor, x: jax.Array, activation: str = "none") -> jax.Array:
    """Scores [..., n] of ONE layer's predictor (leaves without the layer axis), x [..., d]."""
    xn = (rms_normalise(x) - p.mean) * p.inv_std
    h = jnp.einsum("...d,dr->...r", xn.astype(p.w1.dtype), p.w1, preferred_element_type=F32)
    h = _activation(activation, h)
    out = jnp.einsum("...r,rn->...n", h.astype(p.w2.dtype), p.w2, preferred_element_type=F32)
    return out + p.b2.astype(F32)


@struct.dataclass
class DecodePredictors:
    """Both kinds of predictors in the form a decode step reads (`decode_predictors`).

    The input normalisation is folded into w1 and a bias b1, and both kinds' first layers
    are one matrix, so one step scores x with one RMS norm and three matrix products.
    The first layer is stored by rows (output units), as the decode step's gathered GEMV
    reads it (`kernels.predictor_select`).
    """

    w1t: jax.Array       # [L, r_mlp + r_heads, d]: (inv_std * w1)ᵀ of each kind, stacked
    b1: jax.Array        # [L, r_mlp + r_heads] fp32: -(mean * inv_std) @ w1
    w2_mlp: jax.Array    # [L, r_mlp, F]
    b2_mlp: jax.Array    # [L, F]
    w2_heads: jax.Array  # [L, r_heads, H]
    b2_heads: jax.Array  # [L, H]
    activation: str = struct.field(pytree_node=False, default="none")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(layers, input width, neurons, query heads) the predictors score."""
        L, _, d = self.w1t.shape
        return L, d, self.w2_mlp.shape[-1], self.w2_heads.shape[-1]


def decode_predictors(pred: PredictorParams) -> DecodePredictors:
    """The decode form of trained predictors: the same scores as `predictor_logits` up to
    rounding of the folded w1 in its dtype. Compute it once, when the predictors load.

    With low-precision (bf16) weights the mean is subtracted after x/rms(x) is cast to
    that dtype, which rounds more where |mean| is large against the spread; trained
    predictors are fp32, where the two forms agree to fp32 rounding."""
    def fold(p: Predictor):
        w1 = p.w1.astype(F32)
        scaled = (p.inv_std[:, :, None] * w1).astype(p.w1.dtype)
        bias = -jnp.einsum("ld,ldr->lr", p.mean * p.inv_std, w1,
                           precision=jax.lax.Precision.HIGHEST)
        return scaled, bias

    (w1m, b1m), (w1h, b1h) = fold(pred.mlp), fold(pred.heads)
    return DecodePredictors(
        w1t=jnp.swapaxes(jnp.concatenate([w1m, w1h], axis=-1), 1, 2),
        b1=jnp.concatenate([b1m, b1h], axis=-1),
        w2_mlp=pred.mlp.w2, b2_mlp=pred.mlp.b2, w2_heads=pred.heads.w2,
        b2_heads=pred.heads.b2, activation=pred.activation)


def decode_logits(p: DecodePredictors, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mlp scores [..., F], head scores [..., H]) of ONE layer (leaves without the layer
    axis) for residual stream x [..., d]."""
    h = jnp.einsum("...d,rd->...r", rms_normalise(x).astype(p.w1t.dtype), p.w1t,
                   preferred_element_type=F32) + p.b1
    h = _activation(p.activation, h)
    r_mlp = p.w2_mlp.shape[0]

    def out(hk, w2, b2):
        return jnp.einsum("...r,rn->...n", hk.astype(w2.dtype), w2,
                          preferred_element_type=F32) + b2.astype(F32)

    return out(h[..., :r_mlp], p.w2_mlp, p.b2_mlp), out(h[..., r_mlp:], p.w2_heads, p.b2_heads)


def all_layer_logits(p: Predictor, x: jax.Array, activation: str = "none") -> jax.Array:
    """Scores [L, B, n] of every layer's predictor on its own inputs x [L, B, d]."""
    return jax.vmap(lambda q, xi: predictor_logits(q, xi, activation))(p, x)


def layer_slice(tree, layer: jax.Array):
    """Layer `layer` (a traced int32 scalar is fine) of a layer-stacked pytree."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), tree)


def input_layers(n_layers: int, lookahead: bool) -> np.ndarray:
    """Which layer's recorded input feeds each layer's predictor.

    Lookahead: layer l reads layer l-1's attention input (layer 0 reads its own), so
    the sets of layer l can be computed while layer l-1 runs. Otherwise layer l reads
    its own inputs.
    """
    own = np.arange(n_layers)
    return np.maximum(own - 1, 0) if lookahead else own
