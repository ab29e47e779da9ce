"""Record the dense model's activations over a corpus, for predictor training.

  python -m dejavu_jax.train.collect --preset opt-tiny --tokens 20000 --window 128 \\
      --out .cache/records/opt-tiny

Runs the jitted dense forward with records over fixed-length windows and writes fp16
shards (see records.py for the layout) plus manifest.json. Rerunning the same command
after an interruption skips the shards already complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dejavu_jax import cli
from dejavu_jax import config as config_lib
from dejavu_jax.config import ModelConfig
from dejavu_jax.inputs import check_token_ids
from dejavu_jax.model import sequence_forward
from dejavu_jax.params import ModelParams, init_params
from dejavu_jax.train import corpus as corpus_lib
from dejavu_jax.train import records as rec



@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the dense weights come from: a checkpoint path, or a preset + seed."""

    path: str | None = None
    preset: str | None = None
    seed: int = 0
    dtype: str = "float32"

    def load(self) -> tuple[ModelConfig, ModelParams]:
        """(config, params) for this source."""
        dtype = cli.DTYPES[self.dtype]
        if self.path:
            from dejavu_jax.loading import load_pretrained
            return load_pretrained(self.path, dtype=dtype, progress=False)
        config = config_lib.preset(self.preset)
        return config, init_params(config, jax.random.key(self.seed), dtype)

    def tokenizer(self, config: ModelConfig):
        """The tokenizer that goes with the model (None when none is found)."""
        from dejavu_jax.tokenizer import default_tokenizer_for
        return default_tokenizer_for(config, Path(self.path) if self.path else None)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _record_batch(config: ModelConfig, skip: int, params: ModelParams,
                  ids: jax.Array) -> dict[str, jax.Array]:
    """Records [L, B*(T-skip), ...] for windows ids [B, T]; mlp_act fp32, the rest fp16."""
    _, _, r = sequence_forward(config, params, ids, None, records=True)
    r = jax.tree.map(lambda a: a[:, :, skip:], r)
    L = config.n_layers

    def flat(a):
        return a.reshape(L, -1, *a.shape[3:])

    def fp16(a):
        return jnp.clip(flat(a), -rec.FP16_MAX, rec.FP16_MAX).astype(jnp.float16)

    return {"attn_in": fp16(r["attn_in"]), "mlp_in": fp16(r["mlp_in"]),
            "mlp_act": flat(r["mlp_act"]), "head_norm": fp16(r["head_norm"])}


def record_windows(config: ModelConfig, params: ModelParams, windows: np.ndarray,
                   mlp_rule: rec.LabelRule, skip_first: bool) -> dict[str, np.ndarray]:
    """Records of windows [B, T] as numpy arrays [L, B*(T-skip), ...] (see records.py)."""
    out = {k: np.asarray(v) for k, v in
           _record_batch(config, int(skip_first), params, jnp.asarray(windows)).items()}
    # labels on the host: np.partition selects the top fraction in O(F), a sort is O(F log F)
    act = out.pop("mlp_act")
    if mlp_rule.kind == "contribution":
        norms = np.linalg.norm(np.asarray(params.layers.w_out_t, np.float32), axis=-1)
        act = rec.contribution_values(mlp_rule, act, norms)
    out["mlp_label"] = rec.pack_labels(rec.apply_rule(mlp_rule, act))
    return out


def _signature(manifest: dict) -> dict:
    keys = ("config_fingerprint", "model_source", "corpus", "window", "tokens_requested",
            "label_rules", "seed", "shard_windows", "bos_token_id")
    return {k: manifest.get(k) for k in keys}


def record_bytes_per_token(config: ModelConfig) -> int:
    """Bytes one recorded token takes on disk: both residual inputs (fp16, [L, d] each),
    the packed neuron labels ([L, ceil(F/8)] bits) and the head norms (fp16, [L, H])."""
    L = config.n_layers
    return L * (2 * 2 * config.hidden + -(-config.ffn // 8) + 2 * config.n_heads)


def collect(config: ModelConfig, params: ModelParams, tokenizer, files: list[Path],
            out: Path, *, tokens: int, window: int, batch: int = 4,
            shard_tokens: int = 16384, mlp_rule: rec.LabelRule | None = None,
            seed: int = 0, source: ModelSource | None = None, progress: bool = True,
            log=print) -> dict:
    """Record `tokens` tokens of corpus windows into `out`; returns the final manifest.

    Resumes from a partial manifest written by the same settings; raises RecordsError
    when `out` holds records made with different settings, ValueError for a window longer
    than the model's positions or corpus ids outside its vocabulary.
    """
    mlp_rule = mlp_rule or rec.default_mlp_rule(config.activation)
    bos = config.bos_token_id
    per_window = window - (bos is not None)  # the BOS position is not recorded
    if per_window < 1:
        raise ValueError(f"window {window} is too short")
    if window > config.max_positions:  # OPT's learned positions end there (NaN records)
        raise ValueError(f"window {window} is longer than the model's "
                         f"{config.max_positions} positions")
    n_windows = -(-tokens // per_window)
    shard_windows = max(1, shard_tokens // per_window)
    shard_windows -= shard_windows % batch if shard_windows > batch else 0
    manifest = {
        "format_version": rec.FORMAT_VERSION,
        "model": config.name,
        "model_source": dataclasses.asdict(source or ModelSource(preset=config.name)),
        "config": dataclasses.asdict(config),
        "config_fingerprint": config.fingerprint(),
        "dims": {"n_layers": config.n_layers, "hidden": config.hidden, "ffn": config.ffn,
                 "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads},
        "corpus": corpus_lib.describe_files(files),
        "window": window,
        "bos_token_id": bos,
        "tokens_per_window": per_window,
        "tokens_requested": tokens,
        "seed": seed,
        "shard_windows": shard_windows,
        "label_rules": {"mlp": str(mlp_rule), "mlp_basis": "mlp_act (after nonlinearity and "
                        "gate)", "heads": "stored as norms; rule chosen at training"},
        "records": {"attn_in": "fp16 [L,n,d]", "mlp_in": "fp16 [L,n,d]",
                    "mlp_label": "uint8 [L,n,ceil(F/8)] packbits little",
                    "head_norm": "fp16 [L,n,H]"},
        "shards": [],
        "complete": False,
    }
    out.mkdir(parents=True, exist_ok=True)
    old = rec.read_manifest(out)
    if old is not None:
        if _signature(old) != _signature(manifest):
            diff = [k for k in _signature(manifest)
                    if _signature(old)[k] != _signature(manifest)[k]]
            raise rec.RecordsError(f"{out} holds records made with different settings "
                                   f"({', '.join(diff)}); use another --out or --overwrite")
        manifest["shards"] = [s for s in old["shards"] if (out / s["name"]).is_dir()]
        if old.get("complete"):
            log(f"{out}: already complete ({old['tokens']} tokens)")
            return old
    done = len(manifest["shards"])
    if done:
        log(f"resuming: {done} complete shards found in {out}")

    stream = corpus_lib.token_windows(tokenizer, files, window, seed, bos)
    bar = tqdm(total=n_windows * per_window, unit="tok", disable=not progress,
               desc="collect", initial=done * shard_windows * per_window)
    start = None
    recorded = 0
    index = 0
    while index * shard_windows < n_windows:
        want = min(shard_windows, n_windows - index * shard_windows)
        wins = [w for _, w in zip(range(want), stream)]
        if not wins:
            break
        if index < done:
            index += 1
            continue
        parts = []
        for b in range(0, len(wins), batch):
            chunk = np.stack(wins[b:b + batch])
            try:  # ids past the embedding would be clamped into other tokens' rows
                check_token_ids(chunk, config.vocab_size, "the tokenized corpus")
            except ValueError as e:
                raise ValueError(f"{e}: the tokenizer does not fit the model") from None
            real = len(chunk)
            if real < batch:  # keep one compiled shape: pad with copies, drop their records
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, 0)])
            if recorded == 0 and start is None:  # the first call compiles: time from after it
                record_windows(config, params, chunk, mlp_rule, bos is not None)
                start = time.perf_counter()
            r = record_windows(config, params, chunk, mlp_rule, bos is not None)
            parts.append({k: v[:, :real * per_window] for k, v in r.items()})
            bar.update(real * per_window)
            recorded += real * per_window
        arrays = {k: np.concatenate([p[k] for p in parts], axis=1) for k in rec.RECORD_NAMES}
        manifest["shards"].append(rec.write_shard(out, index, arrays))
        manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
        rec.write_manifest(out, manifest)
        index += 1
        if len(wins) < want:
            break
    bar.close()
    elapsed = time.perf_counter() - start if start is not None else 0.0
    manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
    if manifest["tokens"] < tokens:
        log(f"warning: the corpus ran out after {manifest['tokens']} of {tokens} tokens")
    if manifest["tokens"] == 0:
        raise corpus_lib.CorpusError("the corpus yielded no window; use a shorter --window")
    manifest["complete"] = True
    manifest["throughput"] = {"tokens": recorded, "note": "after the first (compiling) call; "
                              "includes tokenising and writing shards", "seconds": round(elapsed, 2),
                              "tokens_per_s": round(recorded / max(elapsed, 1e-9), 1),
                              "backend": jax.default_backend(), "batch": batch}
    rec.write_manifest(out, manifest)
    return manifest


def checkpoint_or_name(text: str) -> str:
    """An argparse type for --model: a checkpoint that exists or a fetchable model's name
    (`dejavu_jax.models_registry.MODELS`)."""
    from dejavu_jax.models_registry import MODELS
    if not Path(text).expanduser().exists() and text not in MODELS:
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory (nor a model "
                                         f"name: {', '.join(MODELS)})")
    return text


def label_rule(text: str) -> "rec.LabelRule":
    """An argparse type for --mlp-rule."""
    try:
        return rec.LabelRule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.train.collect", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=checkpoint_or_name,
                     help="checkpoint directory, .gguf file or a fetchable model's name "
                          "(python -m dejavu_jax.fetch_model --list)")
    src.add_argument("--preset", choices=config_lib.PRESETS, metavar="NAME",
                     help=f"random weights of a preset: {', '.join(config_lib.PRESETS)}")
    p.add_argument("--seed", type=cli.seed, default=0, help="weights seed (presets) and window "
                   "order")
    p.add_argument("--dtype", choices=sorted(cli.DTYPES), default="float32")
    p.add_argument("--corpus", action="append", help="text file, folder or glob (repeat); "
                   "default: <data root>/corpus/*.txt, the data root being $DEJAVU_DATA")
    p.add_argument("--dataset", help="Hugging Face dataset NAME[:CONFIG[:SPLIT]] instead of "
                   "--corpus (needs a reachable hub; cached as a text file)")
    p.add_argument("--tokenizer", type=cli.existing_path,
                   help="tokenizer folder or .gguf (default: the model's)")
    p.add_argument("--tokens", type=cli.positive_int, default=100_000,
                   help="tokens to record (default: %(default)s)")
    p.add_argument("--window", type=cli.positive_int, default=256,
                   help="tokens per window (with BOS; at least 2; default: %(default)s)")
    p.add_argument("--batch", type=cli.positive_int, default=4,
                   help="windows per forward call (default: %(default)s)")
    p.add_argument("--shard-tokens", type=cli.positive_int, default=16384,
                   help="tokens per shard (default: %(default)s)")
    p.add_argument("--mlp-rule", type=label_rule, help="neuron label rule: 'positive' "
                   "(act > 0), 'top:FRACTION' by |act|, 'contribution:FRACTION' by |act| times "
                   "the norm of the neuron's down-projection row, 'threshold:VALUE'; default: "
                   "positive for ReLU models, top:0.3 otherwise")
    p.add_argument("--out", required=True, help="records folder")
    p.add_argument("--overwrite", action="store_true", help="discard records already in --out")
    p.add_argument("--no-progress", action="store_true")
    return p


def corpus_files(args) -> list[Path]:
    """The corpus files of --dataset / --corpus / the data folder's corpus."""
    if args.dataset:
        return [corpus_lib.dataset_to_file(args.dataset)]
    if args.corpus:
        return corpus_lib.resolve_files(args.corpus)
    try:
        return corpus_lib.resolve_files(corpus_lib.default_corpus())
    except corpus_lib.CorpusError:
        from dejavu_jax.paths import data_file
        data_file("corpus", "the default corpus", ", or pass --corpus FILE|DIR|GLOB or "
                  "--dataset NAME")
        raise


def load_source(args) -> tuple[ModelSource, ModelConfig, ModelParams, object]:
    """(source, config, params, tokenizer) of --model / --preset (with --seed, --dtype) and
    --tokenizer, else the model's own tokenizer; exits with one `error:` line when there is
    none. A bad checkpoint raises CheckpointError."""
    from dejavu_jax.fetch_model import FetchError, resolve_model
    try:
        path = Path(resolve_model(args.model)).expanduser().resolve() if args.model else None
    except FetchError as e:
        cli.fail(cli.first_line(e))
    source = ModelSource(path=str(path) if path else None,
                         preset=args.preset, seed=args.seed, dtype=args.dtype)
    config, params = source.load()
    if args.tokenizer:
        from dejavu_jax.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        tokenizer = source.tokenizer(config)
    if tokenizer is None:
        cli.fail("no tokenizer found for this model; pass --tokenizer")
    return source, config, params, tokenizer


def check_out(out: Path, overwrite: bool) -> None:
    """One `error:` line unless `out` can take records: not a file, and with --overwrite
    (which deletes the folder) a folder that holds records only."""
    if out.exists() and not out.is_dir():
        cli.fail(f"--out {out}: is a file; give a folder for the records")
    if overwrite and out.is_dir():
        foreign = rec.foreign_entries(out)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            cli.fail(f"--out {out} holds {len(foreign)} entries that are not records "
                     f"({shown}); --overwrite deletes only a records folder")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (2 with one `error:` line for bad
    arguments, files or data)."""
    from dejavu_jax.checkpoint_files import CheckpointError
    args = build_parser().parse_args(argv)
    if args.window < 2:
        cli.fail(f"--window {args.window}: a window needs BOS and at least one text token")
    if args.dataset and args.corpus:
        cli.fail("give --corpus or --dataset, not both")
    out = Path(args.out).expanduser()
    check_out(out, args.overwrite)
    try:
        files = corpus_files(args)
        corpus_lib.corpus_chunks(files, args.window)  # fail fast, before loading weights
        source, config, params, tokenizer = load_source(args)
        if args.overwrite and out.exists():
            rec._remove_tree(out)
        print(f"model {config.name} ({config.family}, {config.n_layers} layers, "
              f"d={config.hidden}, F={config.ffn}) on {jax.default_backend()}; "
              f"{len(files)} corpus files; the records take about "
              f"{args.tokens * record_bytes_per_token(config) / 1e9:.2f} GB in {out} "
              "(delete them after training)", file=sys.stderr)
        m = collect(config, params, tokenizer, files, out, tokens=args.tokens,
                    window=args.window, batch=args.batch, shard_tokens=args.shard_tokens,
                    mlp_rule=args.mlp_rule, seed=args.seed, source=source,
                    progress=not args.no_progress,
                    log=lambda s: print(s, file=sys.stderr))
    except (corpus_lib.CorpusError, rec.RecordsError, CheckpointError, OSError,
            ValueError) as e:
        cli.fail(str(e))
    t = m.get("throughput", {})
    print(f"{m['tokens']} tokens in {len(m['shards'])} shards -> {out}"
          + (f"; {t['tokens_per_s']} tokens/s" if t else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
