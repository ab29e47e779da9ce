"""Decode speed of `python -m dejavu_jax.generate` on each fetchable model, as a user runs
it: one process per model, greedy, the tokens/s line `generate` prints (compiling calls
excluded).

  python -m dejavu_jax.eval.generate_speed --out eval/results/cpu/generate-speed
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from dejavu_jax import cli

PROMPTS = {"gemma3-270m": "Question: What is the capital of France?\nAnswer:"}
DEFAULT_PROMPT = "Give me three tips for a good night's sleep."
SPEED = re.compile(r"^decode: ([0-9.]+) tokens/s", re.M)


def measure(model: str, tokens: int, extra: list[str]) -> dict:
    """One `generate` run of `model`: its decode tokens/s, wall seconds and output."""
    cmd = [sys.executable, "-m", "dejavu_jax.generate", "--model", model, "--prompt",
           PROMPTS.get(model, DEFAULT_PROMPT), "--greedy", "--max-new-tokens", str(tokens),
           *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = SPEED.search(proc.stdout)
    return dict(model=model, args=extra, returncode=proc.returncode,
                tokens_per_s=float(found.group(1)) if found else None,
                wall_s=round(time.perf_counter() - start, 1),
                command="python -m dejavu_jax.generate " + " ".join(cmd[3:]),
                stdout=proc.stdout[-3000:], stderr=proc.stderr[-1500:])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; writes generate_speed.json into --out."""
    from dejavu_jax.eval.provenance import run_meta
    from dejavu_jax.models_registry import MODELS
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.generate_speed",
                           description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", type=cli.positive_int, default=48,
                   help="new tokens per run (default 48)")
    p.add_argument("--sparse", action="store_true",
                   help="also each model with --sparse (its shipped profile), where it has one")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown --models {unknown}; known: {', '.join(MODELS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(command="python -m dejavu_jax.eval.generate_speed " + " ".join(
        sys.argv[1:] if argv is None else argv), **run_meta())
    rows = []
    for model in models:
        for extra in ([], ["--sparse"]) if args.sparse else ([],):
            rows.append(measure(model, args.tokens, extra))
            r = rows[-1]
            print(f"{model} {' '.join(extra)}: {r['tokens_per_s']} tokens/s "
                  f"(exit {r['returncode']}, {r['wall_s']} s)", flush=True)
            (args.out / "generate_speed.json").write_text(
                json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
