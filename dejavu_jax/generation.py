"""Autoregressive generation over any decode engine (dense or sparse).

An engine is a set of pure functions: prefill, step and init_state. Generation jits
"`chunk` steps of decode-then-sample" as one `lax.scan` per engine and sampling setting,
with the state donated so the KV cache is updated in place: the tokens of a chunk are
produced on the device without a host round trip, and the host streams them and checks
the stop ids once per chunk. The next chunk is queued before the host reads the current
one, so host work overlaps the device's; chunk=1 hands the host every token as it is made.
A host chooser (`choose`) picks every token on the host from inside the device loop
(`host_choice`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import model
from dejavu_jax.config import ModelConfig
from dejavu_jax.host_choice import Chooser, host_chosen, raise_failed_choice
from dejavu_jax.inputs import check_token_ids
from dejavu_jax.params import ModelParams, check_fits
from dejavu_jax.sampling import SamplingConfig, sample


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """Pure decode functions for one model config.

    prefill(params, input_ids [B,T], mask [B,T], state) -> (logits [B,V], state)
    step(params, state, tokens [B]) -> (logits [B,V], state)
    init_state(batch, max_len, dtype, per_layer) -> state
    check_params(params), when set, raises ValueError for params whose values the jitted
    functions cannot check (`generate_tokens` calls it on the concrete params).
    Token ids must lie in [0, config.vocab_size): prefill and step raise ValueError for
    concrete ids outside it; traced ids (inside jit) are the caller's contract.
    """

    config: ModelConfig
    prefill: Callable
    step: Callable
    init_state: Callable
    name: str = "dense"
    check_params: Callable | None = None


@functools.lru_cache(maxsize=None)
def dense_engine(config: ModelConfig) -> Engine:
    """The dense engine for `config` (cached, so jitted code is reused)."""
    return Engine(
        config=config,
        prefill=functools.partial(model.prefill_fn, config),
        step=functools.partial(model.decode_step_fn, config),
        init_state=functools.partial(model.init_state, config),
        name="dense")


def _pick(logits, key, sampling, choose):
    return sample(logits, key, sampling) if choose is None else host_chosen(choose, logits)


class NonFiniteLogits(ValueError):
    """A step's logits hold NaN or inf (non-finite weights or inputs): its token would be
    garbage."""


def _finite(logits):
    return jnp.all(jnp.isfinite(logits), axis=-1)


@functools.partial(jax.jit, static_argnums=(0, 5, 7), donate_argnums=(4,))
def _prefill_and_sample(engine, params, input_ids, mask, state, sampling, key, choose):
    logits, state = engine.prefill(params, input_ids, mask, state)
    return _pick(logits, key, sampling, choose), _finite(logits), state


@functools.partial(jax.jit, static_argnums=(0, 4, 6, 7), donate_argnums=(2,))
def _steps_and_sample(engine, params, state, tokens, sampling, key, n, choose, stop):
    """n decode steps on the device: (tokens [n, B], whether each step's logits were
    finite [n, B], last tokens, state, key). The key is split once per step exactly as a
    per-token loop would, so chunking never changes the sampled tokens; `choose` (not
    None) picks each token on the host instead. A row whose input token is one of `stop`
    [n_stop] is finished (`model.finish_rows`)."""
    def body(carry, _):
        state, tokens, key = carry
        key, sub = jax.random.split(key)
        state = model.finish_rows(state, jnp.isin(tokens, stop))
        logits, state = engine.step(params, state, tokens)
        tokens = _pick(logits, sub, sampling, choose)
        return (state, tokens, key), (tokens, _finite(logits))

    (state, tokens, key), (out, finite) = jax.lax.scan(body, (state, tokens, key), None,
                                                       length=n)
    return out, finite, tokens, state, key


def _model_params(params):
    """The ModelParams inside engine params (the params themselves, or a tuple's part)."""
    return next(p for p in jax.tree.leaves(params, is_leaf=lambda n: isinstance(n, ModelParams))
                if isinstance(p, ModelParams))


def _unstacked(params) -> bool:
    """Whether the model weights inside engine params are unstacked (per-layer tuple)."""
    return isinstance(_model_params(params).layers, tuple)


@dataclasses.dataclass
class GenerationResult:
    """Generated ids per prompt (stopping tokens included) and timings in seconds.

    first_step_seconds is the first decode call (its compile included: `chunk` steps);
    decode_seconds and timed_steps cover the calls after it (none when one call made every
    token, and tokens_per_second is then 0). chunk is the steps per call used.
    """

    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    first_step_seconds: float
    timed_steps: int = 0
    chunk: int = 1

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput per sequence, the first (compiling) call excluded."""
        if self.timed_steps > 0 and self.decode_seconds > 0:
            return self.timed_steps / self.decode_seconds
        return 0.0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0):
    """Left-pad token lists to one length: (ids [B, T] int32, mask [B, T] int32)."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    ids = np.full((len(prompts), T), pad_id, np.int32)
    mask = np.zeros((len(prompts), T), np.int32)
    for row, p in enumerate(prompts):
        ids[row, T - len(p):] = p
        mask[row, T - len(p):] = 1
    return ids, mask


def cache_length(config: ModelConfig, prompt_len: int, max_new_tokens: int,
                 bucket: int = 64) -> int:
    """KV cache slots for a run, rounded up to `bucket` so nearby lengths share compiles."""
    needed = prompt_len + max_new_tokens
    limit, what = config.max_positions, "positions of context"
    bound = model.position_limit(config)
    if bound is not None and bound[0] <= limit:
        limit, what = bound
    if needed > limit:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) = {needed} exceeds "
            f"the model's {limit} {what}")
    return -(-needed // bucket) * bucket


def _longrope_crossing(config: ModelConfig, prompt_len: int, max_new_tokens: int):
    """For a LongRoPE model whose padded sequence of `prompt_len` tokens crosses the
    original context while `max_new_tokens` are made: the tokens to make before the
    crossing (the last of them takes the sequence past it); else None. There the cache,
    computed with the short factors, is replaced by a prefill of the whole sequence with
    the long ones."""
    if config.rope_longrope is None:
        return None
    original = int(config.rope_longrope[1])
    # the step feeding generated token j sees a sequence of prompt_len + j tokens
    if prompt_len <= original < prompt_len + max_new_tokens - 1:
        return original - prompt_len + 1
    return None


def _generate_across(engine, params, prompts, before, max_new_tokens, seed, on_token,
                     options) -> "GenerationResult":
    """`generate_tokens` over a LongRoPE crossing: `before` tokens, then the rest from the
    prompts and those tokens prefilled afresh (a row that stopped keeps its tokens; it is
    extended by repeats of its last one so that the batch keeps its positions)."""
    first = generate_tokens(engine, params, prompts, before, seed=seed, on_token=on_token,
                            **options)
    stop = set(engine.config.stop_token_ids if options["stop_ids"] is None
               else options["stop_ids"])
    done = np.asarray([len(t) < before or t[-1] in stop for t in first.tokens])
    if done.all():
        return first
    longer = [list(p) + t + [t[-1]] * (before - len(t)) for p, t in zip(prompts, first.tokens)]

    def stream(tokens):
        on_token(np.where(done, -1, tokens))

    rest = generate_tokens(engine, params, longer, max_new_tokens - before, seed=seed + 1,
                           on_token=None if on_token is None else stream, **options)
    tokens = [t if d else t + r for t, r, d in zip(first.tokens, rest.tokens, done)]
    return GenerationResult(tokens, first.prefill_seconds + rest.prefill_seconds,
                            first.decode_seconds + rest.decode_seconds,
                            first.decode_steps + rest.decode_steps, first.first_step_seconds,
                            first.timed_steps + rest.timed_steps, first.chunk)


def generate_tokens(engine: Engine, params, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int = 32, sampling: SamplingConfig = SamplingConfig(),
                    seed: int = 0, stop_ids: Sequence[int] | None = None,
                    on_token: Callable[[np.ndarray], None] | None = None,
                    cache_dtype=None, chunk: int = 8,
                    choose: Chooser | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt; rows stop at any of `stop_ids`.

    chunk: decode steps per device call (a `lax.scan`; the host sees tokens once per
    chunk). Results do not depend on it; a row's tokens after its stop id are dropped.
    `on_token(tokens [B])` is called once per generated position (-1 for finished rows),
    for streaming output. `choose(logits)` (float32 numpy [B, V] -> int ids [B]) picks
    every token on the host instead of `sampling`, called from inside the device loop once
    per token (`host_choice`; pass the same function to reuse the compiled loop); an
    invalid choice raises. Raises ValueError for an empty prompt or an id outside the
    vocabulary, and `NonFiniteLogits` (a ValueError) when a step's logits hold NaN or
    inf. On a GPU, model weights in the fastest layout (`params.decode_layout`, as
    `generate` passes them) decode fastest. A LongRoPE model whose sequences cross its
    original context is decoded up to the crossing, then from the whole sequence
    prefilled again with the long factors (`_longrope_crossing`), so every token's logits
    are those of the model's forward over the sequence so far.
    """
    config = engine.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if stop_ids is not None and (isinstance(stop_ids, (str, bytes))
                                 or not isinstance(stop_ids, Iterable)):
        raise ValueError(f"stop_ids must be a sequence of token ids, got {stop_ids!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not len(prompts):
        raise ValueError("no prompts: give at least one")
    for row, p in enumerate(prompts):
        check_token_ids(p, config.vocab_size, f"prompt {row}", "[time]")
    check_fits(config, _model_params(params))
    if engine.check_params is not None:
        engine.check_params(params)
    if stop_ids is None:
        stop_ids = config.stop_token_ids
    else:
        stop_ids = list(stop_ids)
        if stop_ids:
            check_token_ids(stop_ids, config.vocab_size, "stop_ids", "[batch]")
    ids, mask = left_pad(prompts, config.padding_id)
    B, T = ids.shape
    before = _longrope_crossing(config, T, max_new_tokens)
    if before is not None:
        options = dict(sampling=sampling, stop_ids=stop_ids, cache_dtype=cache_dtype,
                       chunk=chunk, choose=choose)
        return _generate_across(engine, params, prompts, before, max_new_tokens, seed,
                                on_token, options)
    dtype = cache_dtype or jax.tree.leaves(params)[0].dtype
    chunk = min(chunk, max(max_new_tokens - 1, 1))
    calls = -(-(max_new_tokens - 1) // chunk)
    # full chunks only (one compile): room for the steps past max_new_tokens they run
    slots = max(cache_length(config, T, max_new_tokens), T + 1 + calls * chunk)
    state = engine.init_state(B, -(-slots // 64) * 64, dtype, per_layer=_unstacked(params))
    key = jax.random.key(seed)
    stop = np.asarray(stop_ids, np.int64)
    done = np.zeros(B, bool)
    out: list[list[int]] = [[] for _ in range(B)]

    def emit(host, finite) -> None:
        nonlocal done
        bad = np.flatnonzero(~np.asarray(finite) & ~done)
        if bad.size:
            raise NonFiniteLogits(
                f"the logits of row {int(bad[0])} hold NaN or inf at generated token "
                f"{len(out[int(bad[0])]) + 1}: the weights or inputs are not finite")
        for row in range(B):
            if not done[row]:
                out[row].append(int(host[row]))
        if on_token is not None:
            on_token(np.where(done, -1, host))
        done = done | np.isin(host, stop)

    t0 = time.perf_counter()
    key, sub = jax.random.split(key)
    tokens, finite, state = _prefill_and_sample(engine, params, jnp.asarray(ids),
                                                jnp.asarray(mask), state, sampling, sub, choose)
    host = np.asarray(tokens)
    prefill_seconds = time.perf_counter() - t0
    if choose is not None:
        raise_failed_choice()
    emit(host, finite)
    produced, steps, timed, first_call = 1, 0, 0, 0.0

    def launch(state, tokens, key):
        return _steps_and_sample(engine, params, state, tokens, sampling, key, chunk, choose,
                                 jnp.asarray(stop, jnp.int32))

    # One call stays queued behind the one being read, so the device never waits for the
    # host to stream tokens and dispatch; a call queued past a stop is discarded.
    t_steps = t_call = time.perf_counter()
    queued = launch(state, tokens, key) if produced < max_new_tokens and not done.all() \
        else None
    while queued is not None:
        block, finite, tokens, state, key = queued
        queued = launch(state, tokens, key) if steps + chunk < calls * chunk else None
        block, finite = np.asarray(block), np.asarray(finite)
        if choose is not None:
            raise_failed_choice(queued)
        first = steps == 0
        if first:
            first_call = time.perf_counter() - t_call
        else:
            timed += chunk
        steps += chunk
        for host, host_finite in zip(block, finite):
            if produced == max_new_tokens or done.all():
                break
            emit(host, host_finite)
            produced += 1
        if first:  # the timed span starts after the first call's tokens are out
            t_steps = time.perf_counter()
        if produced == max_new_tokens or done.all():
            break
    decode_seconds = time.perf_counter() - t_steps if timed else 0.0
    return GenerationResult(out, prefill_seconds, decode_seconds, steps, first_call, timed,
                            chunk)
