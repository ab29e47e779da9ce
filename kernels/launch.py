"""Several independent kernels in one Pallas launch.

A decode step is a chain of small launches; each costs a ramp-up and a tail in which
part of the GPU idles. Work that does not depend on its neighbour can ride in the same
launch instead: a :class:`LaunchPart` is one kernel's body, grid, inputs and outputs, and
:func:`launch` runs several parts as one ``pallas_call`` over a flat grid, each program
running the part its id falls in. Parts come first-scheduled in the order given, so a
latency-bound part (a selection) placed first runs beside a bandwidth-bound one.

Every ref is a whole array in HBM (the kernels here load with masks and no BlockSpecs),
so parts compose without any block mapping.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable, Sequence

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

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


_INTERPRETING = contextvars.ContextVar("pallas_interpreting", default=False)


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
    inputs, out_shape, aliases, spans = [], [], {}, []
    for part in parts:
        for i, o in part.aliases.items():
            aliases[len(inputs) + i] = len(out_shape) + o
        spans.append((len(inputs), len(part.inputs), len(out_shape), len(part.out_shape)))
        inputs += list(part.inputs)
        out_shape += list(part.out_shape)
    n_in = len(inputs)

    def refs_of(refs, k):
        i0, ni, o0, no = spans[k]
        return refs[i0:i0 + ni] + refs[n_in + o0:n_in + o0 + no]

    if len(parts) == 1:
        grid = parts[0].grid

        def kernel(*refs):
            pids = tuple(pl.program_id(a) for a in range(len(grid)))
            parts[0].body(pids, *refs_of(refs, 0))
    else:
        grid = (sum(p.programs for p in parts),)

        def kernel(*refs):
            p = pl.program_id(0)
            start = 0
            for k, part in enumerate(parts):
                stop = start + part.programs

                @pl.when((p >= start) & (p < stop))
                def _(k=k, part=part, start=start):
                    part.body(_unravel(p - start, part.grid), *refs_of(refs, k))
                start = stop

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
    result, o = [], 0
    for part in parts:
        result.append(tuple(outs[o:o + len(part.out_shape)]))
        o += len(part.out_shape)
    return result

