"""Does a weighted ranking keep quality better than magnitudes alone?

    python -m dejavu_jax.eval.weighting_study --model smollm2-135m --out DIR
    python -m dejavu_jax.eval.weighting_study --gate --model smollm2-135m --out DIR

Input sites: channels by |x_i| · ||W[:, i]|| (WINA's criterion, `channel_weighting`)
against |x_i| (TEAL's), one site at a time and the four TEAL sites together. `--gate`:
the gate site's neurons by |act(gate_i)| times the gate weights (E|up_i| · ||down_i||,
`train.thresholds.gate_weights`) against |act(gate_i)| (CATS'). For both criteria the
same calibration windows of the corpus give each site's magnitude quantiles, then every
layer drops the same fraction of a site's channels (`--levels`); perplexity on the same
WikiText-2 test tokens. Uniform levels measure the criterion itself, apart from any
per-layer allocation. Rows go to OUT/weighting.jsonl.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli

TEAL = ("qkv", "o", "gate_up", "down")


def main(argv: list[str] | None = None) -> int:
    """Run the study; returns the exit status."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.eval.weighting_study",
                           description=__doc__.split("\n")[0])
    p.add_argument("--model", type=cli.model_source, help="default: smollm2-135m")
    p.add_argument("--tokens", type=cli.positive_int, default=8192)
    p.add_argument("--levels", type=cli.fractions, default=[0.3, 0.5])
    p.add_argument("--calibration-windows", type=cli.positive_int, default=16)
    p.add_argument("--gate", action="store_true",
                   help="the gate site, by gate weights (a gated MLP's model)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from dejavu_jax.activation_sparsity import SITES
    from dejavu_jax.channel_weighting import weight_informed
    from dejavu_jax.eval import common, provenance
    from dejavu_jax.eval.perplexity import load_text, perplexity
    from dejavu_jax.eval.sparse_scoring import make_mode
    from dejavu_jax.fetch_model import resolve_model
    from dejavu_jax.loading import load_pretrained
    from dejavu_jax.tokenizer import leading_special_ids
    from dejavu_jax.train import profile as profile_mod
    from dejavu_jax.train.corpus import default_corpus, resolve_files
    from dejavu_jax.train.thresholds import thresholds_at
    source = resolve_model(args.model or "smollm2-135m")
    config, params = load_pretrained(source, dtype=jnp.float32)
    args.tokenizer = None
    tok = common.load_tokenizer_for(args, config, Path(source))
    ids = np.asarray(tok(load_text(None), add_special_tokens=False)["input_ids"][:args.tokens],
                     np.int32)
    lead = leading_special_ids(tok)
    windows = profile_mod.text_windows(tok, resolve_files(default_corpus()), 256,
                                       args.calibration_windows, 0, config.bos_token_id)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**provenance.run_meta(), "model": config.name, "command": " ".join(sys.argv)}
    (args.out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    out = open(args.out / "weighting.jsonl", "a")
    if args.gate:
        if not config.gated_mlp:
            cli.fail(f"--gate: {config.name} has no gated MLP")
        site_sets = [("gate",)]
        criteria = (("magnitude", params), ("gate-weights", profile_mod.gate_weighted(
            config, params, windows, 4, ("gate",))))
    else:
        site_sets = [TEAL] + [(s,) for s in TEAL]
        criteria = (("magnitude", params), ("weight-norm", weight_informed(config, params)))
    for criterion, p_ in criteria:
        quantiles = profile_mod.calibrate(config, p_, windows, (), 4, progress=False)["quantiles"]
        start = time.perf_counter()
        dense = perplexity(config, make_mode(config, "dense"), p_, None, ids, window=1024,
                           stride=1024, lead=lead)
        rows = [{"criterion": criterion, "sites": "dense", "level": 0.0,
                 "perplexity": dense["perplexity"], "bytes_skipped": 0.0,
                 "seconds": round(time.perf_counter() - start, 1)}]
        for sites in site_sets:
            for level in args.levels:
                lv = np.zeros((config.n_layers, len(SITES)))
                for s in sites:
                    lv[:, SITES.index(s)] = level
                th = jnp.asarray(thresholds_at(quantiles, lv))
                start = time.perf_counter()
                r = perplexity(config, make_mode(config, "threshold", sites=sites), p_, th, ids,
                               window=1024, stride=1024, lead=lead)
                rows.append({"criterion": criterion, "sites": "+".join(sites), "level": level,
                             "perplexity": r["perplexity"],
                             "ppl_cost": r["perplexity"] / dense["perplexity"] - 1,
                             "bytes_skipped": r["bytes_skipped"],
                             "seconds": round(time.perf_counter() - start, 1)})
        for row in rows:
            row["tokens"] = int(dense["tokens"])
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
