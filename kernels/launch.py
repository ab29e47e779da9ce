"""Several independent kernels in one Pallas launch.

A decode step is a chain of small launches; each costs a ramp-up and a tail in which
part of the GPU idles. Work that does not depend on its neighbour can ride in the same
launch instead: a :class:`LaunchPart` is one kernel's body, grid, inputs and outputs, and
:func:`launch` runs several parts as one ``pallas_call`` over a flat grid, each program
running the part its id falls in. Parts come first-scheduled in the order given, so a
latency-bound part (a selection) placed first runs beside a bandwidth-bound one.

Every ref is a whole array in HBM (the kernels here load with masks and no BlockSpecs),
so parts compose without any block mapping.

:func:`chained_launch` runs two dependent launches as one: the second stage's programs
are resident while the first stage's run, read their inputs (:class:`Pending` outputs of
the first stage) only once a counter says every first-stage program has stored its
results, and may read what does not depend on them (their weights) before that
(:func:`await_inputs`). The GPU starts a grid's programs in id order, so first-stage
programs never wait behind second-stage ones.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class LaunchPart:
    """One kernel: ``body(pids, *input_refs, *output_refs)`` over ``grid``.

    pids: one int32 program id per grid axis. aliases: input position -> output position
    (within this part) for outputs written in place. name: the kernel's name in profiles.
    """
    body: Callable
    grid: tuple[int, ...]
    inputs: tuple
    out_shape: tuple
    aliases: dict = dataclasses.field(default_factory=dict)
    name: str = "kernel"
    awaits: bool = False  # in a chained launch's second stage: the body calls await_inputs

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A first-stage output of a :func:`chained_launch`, standing as a second-stage part's
    input (shape and dtype only; the program reads it in place once it is written)."""
    part: int
    output: int
    shape: tuple
    dtype: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)


_INTERPRETING = contextvars.ContextVar("pallas_interpreting", default=False)
_AWAIT = contextvars.ContextVar("pallas_await_inputs", default=None)


def awaiting() -> bool:
    """Whether the body now being traced must call :func:`await_inputs` before reading
    its pending inputs (a chained launch's second-stage part declared ``awaits``)."""
    return _AWAIT.get() is not None


def await_inputs() -> None:
    """Inside a chained launch's second-stage part declared ``awaits``: wait until the
    first stage's outputs are written (reads before this may not touch them). Elsewhere
    nothing."""
    wait = _AWAIT.get()
    if wait is not None:
        wait()


def interpreting() -> bool:
    """Whether the kernel bodies now being traced run in Pallas' interpreter (which has no
    masked atomics), so that a body can pick a path both can run."""
    return _INTERPRETING.get()


@contextlib.contextmanager
def _tracing_for(interpret: bool):
    token = _INTERPRETING.set(bool(interpret))
    try:
        yield
    finally:
        _INTERPRETING.reset(token)


def _unravel(p, grid: tuple[int, ...]) -> tuple:
    """Program ids per axis from a flat id, axis 0 fastest (the order of a GPU grid)."""
    pids = []
    for n in grid:
        pids.append(p % n)
        p = p // n
    return tuple(pids)


def launch(parts: Sequence[LaunchPart], *, num_warps: int = 4, num_stages: int = 2,
           interpret: bool = False, name: str | None = None) -> list[tuple]:
    """Run the parts in one ``pallas_call``; returns each part's outputs as a tuple.

    A single part keeps its own grid; several share a flat grid of their programs' sum
    and the launch's warps and pipeline stages. name: the launch's name in profiles
    (default: the parts' names joined by "_").
    """
    parts = list(parts)
    if not parts:
        raise ValueError("launch needs at least one part")
    return _launch(parts, [0], num_warps=num_warps, num_stages=num_stages,
                   interpret=interpret, name=name)


def chained_launch(first: Sequence[LaunchPart], *then_ofs: Callable, num_warps: int = 4,
                   num_stages: int = 2, interpret: bool = False,
                   name: str | None = None) -> list[list[tuple]]:
    """Dependent launches as one ``pallas_call``, in stages: ``first``'s parts, then for
    each ``then_of`` the parts it builds from the stage before's outputs, given as
    :class:`Pending` placeholders (a list of tuples, as :func:`launch` returns; a later
    stage may also read any earlier stage's, kept by the caller). Returns each stage's
    outputs as :func:`launch` returns them.

    Each program of a stage but the last adds one to its stage's counter after its stores;
    a later stage's program waits for the count of every program of the stage before
    (which had waited for the one before it) before its body, or where the part is
    declared ``awaits``, where its body calls :func:`await_inputs`.
    """
    stages = [list(first)]
    if not stages[0] or not then_ofs:
        raise ValueError("chained_launch needs a first-stage part and at least one "
                         "second-stage part builder")
    for then_of in then_ofs:
        base = sum(len(s) for s in stages[:-1])
        pending = [tuple(Pending(base + k, o, tuple(s.shape), s.dtype)
                         for o, s in enumerate(p.out_shape))
                   for k, p in enumerate(stages[-1])]
        stage = list(then_of(pending))
        if not stage:
            raise ValueError("chained_launch needs at least one second-stage part")
        stages.append(stage)
    starts = [sum(len(s) for s in stages[:i]) for i in range(len(stages))]
    outs = _launch([p for s in stages for p in s], starts, num_warps=num_warps,
                   num_stages=num_stages, interpret=interpret, name=name)
    return [outs[a:a + len(s)] for a, s in zip(starts, stages)]


def _launch(parts, starts: list[int], *, num_warps, num_stages, interpret, name):
    """One ``pallas_call`` of the parts; ``starts``: the first part of each stage (see
    :func:`chained_launch`; ``[0]``: one stage, nothing waits)."""
    stage_of = [sum(k >= s for s in starts) - 1 for k in range(len(parts))]
    inputs, out_shape, aliases, spans = [], [], {}, []
    out_starts = []
    for k, part in enumerate(parts):
        out_starts.append(len(out_shape))
        where = []   # per input: ("in", global index) or ("out", global output index)
        for i, a in enumerate(part.inputs):
            if isinstance(a, Pending):
                if not 0 <= a.part < len(parts) or stage_of[a.part] >= stage_of[k]:
                    raise ValueError("a pending input must be an earlier stage's output "
                                     "read by a later stage's part")
                where.append(("out", out_starts[a.part] + a.output))
            else:
                where.append(("in", len(inputs)))
                inputs.append(a)
        for i, o in part.aliases.items():
            kind, at = where[i]
            if kind != "in":
                raise ValueError("a pending input cannot be aliased to an output")
            aliases[at] = len(out_shape) + o
        spans.append((where, len(out_shape), len(part.out_shape)))
        out_shape += list(part.out_shape)
    n_stages = len(starts)
    if n_stages > 1:   # a counter per stage but the last, zeroed, written in place
        aliases[len(inputs)] = len(out_shape)
        inputs.append(jnp.zeros((n_stages - 1,), jnp.int32))
        out_shape.append(jax.ShapeDtypeStruct((n_stages - 1,), jnp.int32))
    n_in = len(inputs)

    def refs_of(refs, k):
        where, o0, no = spans[k]
        ins = [refs[at] if kind == "in" else refs[n_in + at] for kind, at in where]
        return tuple(ins) + tuple(refs[n_in + o0:n_in + o0 + no])

    grid = parts[0].grid if len(parts) == 1 else (sum(p.programs for p in parts),)
    first_program = [sum(p.programs for p in parts[:k]) for k in range(len(parts) + 1)]
    stage_span = [(first_program[starts[s]],
                   first_program[starts[s + 1] if s + 1 < n_stages else len(parts)])
                  for s in range(n_stages)]

    def kernel(*refs):
        if len(parts) == 1:
            pids = tuple(pl.program_id(a) for a in range(len(grid)))
            parts[0].body(pids, *refs_of(refs, 0))
            return
        p = pl.program_id(0)
        count_ref = refs[-1] if n_stages > 1 else None
        for k, part in enumerate(parts):
            start, stop = first_program[k], first_program[k + 1]
            s = stage_of[k]
            if s > 0 and k == starts[s]:   # the stage before is done: count it
                lo, hi = stage_span[s - 1]

                @pl.when((p >= lo) & (p < hi))
                def _(s=s):
                    _signal_done(count_ref, s - 1, interpret)

            @pl.when((p >= start) & (p < stop))
            def _(k=k, part=part, start=start, s=s):
                run = lambda: part.body(_unravel(p - start, part.grid), *refs_of(refs, k))
                if s == 0:
                    return run()
                lo, hi = stage_span[s - 1]
                wait = lambda: _wait_for(count_ref, s - 1, hi - lo, interpret)
                if not part.awaits:
                    wait()
                    return run()
                called = []
                token = _AWAIT.set(lambda: (called.append(1), wait()))
                try:
                    run()
                finally:
                    _AWAIT.reset(token)
                if not called:
                    raise ValueError(f"part {part.name} is declared awaits but its body "
                                     "never calls await_inputs()")

    with _tracing_for(interpret):
        outs = pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=tuple(out_shape),
            input_output_aliases=aliases,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                                 num_stages=num_stages),
            interpret=interpret,
            name=name or "_".join(p.name for p in parts),
        )(*inputs)
    result = []
    for part, (_, o0, no) in zip(parts, spans):
        result.append(tuple(outs[o0:o0 + no]))
    return result


def _signal_done(count_ref, stage: int, interpret: bool) -> None:
    """A stage's program's end: every thread's stores done (a block barrier), then one
    release add to the stage's counter."""
    if not interpret:   # the interpreter runs one program at a time and has no barrier
        plgpu.debug_barrier()
    plgpu.atomic_add(count_ref, (jnp.int32(stage),), jnp.int32(1))


def _wait_for(count_ref, stage: int, n: int, interpret: bool) -> None:
    """Spin until the stage's counter reaches n, then one acquire (an atomic add of 0) and
    a block barrier, so that no thread's later read comes before that stage's stores."""
    if interpret:   # the interpreter runs the programs one at a time, in order
        return
    read = lambda _: plgpu.load(count_ref.at[stage], volatile=True)
    seen = lax.while_loop(lambda c: c < n, read, read(None))
    # The add is of 0 once the loop ends; taking it from the loop's result keeps the loop
    # (an unused loop of loads is dead code to JAX, and would be dropped).
    plgpu.atomic_add(count_ref, (jnp.int32(stage),), (seen < n).astype(jnp.int32))
    plgpu.debug_barrier()
