"""Text written by the model itself, as extra corpus for predictor training.

  python -m dejavu_jax.train.self_text --model "$(python -m dejavu_jax.fetch_model)" \\
      --tokens 60000 --out .cache/selfgen/smollm2-135m.txt

Each prompt is the start of a random corpus window (`--prompt-tokens` tokens, after the
model's BOS token); the dense model continues it for up to `--new-tokens` tokens, sampled
at `--temperature`. Only the continuations are written, one per paragraph (a blank line
between them, none inside), so the file is a corpus that `train.collect --corpus FILE`
reads like any other. Rows stop early at the model's end-of-sequence token; generation
goes on until `--tokens` continuation tokens are written (the last continuation is cut
to that total).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from tqdm.auto import tqdm

from dejavu_jax import cli
from dejavu_jax import config as config_lib
from dejavu_jax.config import ModelConfig
from dejavu_jax.generation import dense_engine, generate_tokens
from dejavu_jax.params import ModelParams, decode_layout, fuse_qkv
from dejavu_jax.sampling import SamplingConfig
from dejavu_jax.train import corpus as corpus_lib

DEFAULT_TEMPERATURE = 0.8
MAX_IDLE_CALLS = 8  # generate calls in a row without any usable text before giving up


def prompt_stream(tokenizer, files: Sequence[Path], prompt_tokens: int, seed: int,
                  bos_id: int | None) -> Iterator[list[int]]:
    """Prompts as token id lists: the first `prompt_tokens` tokens of corpus windows in a
    seeded random order (after `bos_id` when given); the order is reshuffled with the next
    seed whenever the corpus runs out. Raises CorpusError when the corpus yields none."""
    window = prompt_tokens + (bos_id is not None)
    for round_ in range(1 << 30):
        found = False
        for ids in corpus_lib.token_windows(tokenizer, list(files), window, seed + round_,
                                            bos_id):
            found = True
            yield [int(t) for t in ids]
        if not found:
            raise corpus_lib.CorpusError(f"the corpus yields no {prompt_tokens}-token prompt")


def paragraph(text: str) -> str:
    """`text` as one paragraph: trailing spaces removed from each line and blank lines
    dropped, so the written file keeps exactly one blank line between continuations."""
    lines = [line.rstrip() for line in text.replace("\r", "\n").split("\n")]
    return "\n".join(line for line in lines if line.strip()).strip()


def generate_continuations(config: ModelConfig, params: ModelParams, tokenizer,
                           files: Sequence[Path], *, tokens: int, prompt_tokens: int = 32,
                           new_tokens: int = 256, batch: int = 8,
                           sampling: SamplingConfig = SamplingConfig(DEFAULT_TEMPERATURE),
                           seed: int = 0, chunk: int = 8,
                           stop_ids: Sequence[int] | None = None, progress: bool = True,
                           log=print) -> tuple[list[str], dict]:
    """Continue corpus prompts with the dense model until `tokens` tokens are generated.

    Returns (continuations, stats): each continuation is the decoded text of one row, as
    one paragraph (`paragraph`); rows whose text is empty are dropped and not counted.
    Every generate call runs `batch` rows (one compiled shape); the rows beyond the
    total are discarded and the last kept row is cut so the counted tokens equal
    `tokens`. stop_ids default to the model's EOS token. Raises ValueError for a bad
    setting, CorpusError when the corpus has no prompt, RuntimeError when the model
    keeps producing no text.
    """
    for name, value in (("tokens", tokens), ("prompt_tokens", prompt_tokens),
                        ("new_tokens", new_tokens), ("batch", batch), ("chunk", chunk)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    stop = list(config.stop_token_ids if stop_ids is None else stop_ids)
    engine = dense_engine(config)
    prompts = prompt_stream(tokenizer, files, prompt_tokens, seed, config.bos_token_id)
    texts: list[str] = []
    produced = calls = idle = 0
    bar = tqdm(total=tokens, unit="tok", desc="self text", disable=not progress)
    start = time.perf_counter()
    timed_from, timed_tokens = None, 0
    while produced < tokens:
        rows = [next(prompts) for _ in range(batch)]
        result = generate_tokens(engine, params, rows, new_tokens, sampling,
                                 seed=seed * 1_000_003 + calls, stop_ids=stop, chunk=chunk)
        calls += 1
        before = produced
        for ids in result.tokens:
            if produced >= tokens:
                break
            ids = [t for t in ids if t not in stop]
            ids = ids[:tokens - produced]
            text = paragraph(tokenizer.decode(ids, skip_special_tokens=True))
            if not ids or not text:
                continue
            texts.append(text)
            produced += len(ids)
        bar.update(produced - before)
        if timed_from is None:  # the first call compiles: time the calls after it
            timed_from = time.perf_counter()
        else:
            timed_tokens += sum(len(r) for r in result.tokens)
        idle = 0 if produced > before else idle + 1
        if idle >= MAX_IDLE_CALLS:
            raise RuntimeError(f"{idle} generate calls in a row gave no text (after "
                               f"{produced} of {tokens} tokens)")
    bar.close()
    now = time.perf_counter()
    timed = now - timed_from if timed_from is not None else 0.0
    stats = {"continuations": len(texts), "tokens": produced, "generate_calls": calls,
             "seconds": round(now - start, 2),
             "tokens_per_s": round(timed_tokens / timed, 1) if timed_tokens else None}
    log(f"{len(texts)} continuations, {produced} tokens in {stats['seconds']} s"
        + (f" ({stats['tokens_per_s']} tokens/s after the first, compiling call)"
           if stats["tokens_per_s"] else ""))
    return texts, stats


def write_paragraphs(texts: Sequence[str], out: Path) -> None:
    """Write the texts as paragraphs separated by one blank line (via a temporary file,
    so an interrupted run leaves no partial `out`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    part.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    part.replace(out)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (its errors: one `error:` line, exit status 2)."""
    p = cli.ArgumentParser(prog="python -m dejavu_jax.train.self_text", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=cli.existing_path,
                     help="checkpoint directory or .gguf file")
    src.add_argument("--preset", choices=config_lib.PRESETS, metavar="NAME",
                     help="random weights of a preset (needs --tokenizer unless OPT)")
    p.add_argument("--tokenizer", type=cli.existing_path,
                   help="tokenizer folder or .gguf (default: the model's)")
    p.add_argument("--corpus", action="append", help="text file, folder or glob (repeat) "
                   "to cut prompts from; default: <data root>/corpus/*.txt")
    p.add_argument("--tokens", type=cli.positive_int, required=True,
                   help="generated tokens in all (prompts not counted)")
    p.add_argument("--prompt-tokens", type=cli.positive_int, default=32,
                   help="corpus tokens per prompt (default 32)")
    p.add_argument("--new-tokens", type=cli.positive_int, default=256,
                   help="tokens generated per prompt at most (default 256)")
    p.add_argument("--batch", type=cli.positive_int, default=8,
                   help="prompts per generate call (default 8)")
    p.add_argument("--chunk", type=cli.positive_int, default=8,
                   help="decode steps per device call (default 8)")
    p.add_argument("--temperature", type=cli.non_negative_float,
                   default=DEFAULT_TEMPERATURE,
                   help=f"sampling temperature (default {DEFAULT_TEMPERATURE}; 0: greedy)")
    p.add_argument("--top-k", type=cli.non_negative_int, default=0,
                   help="sample from the K most likely tokens only (default 0: all)")
    p.add_argument("--top-p", type=cli.fraction, default=1.0,
                   help="nucleus mass (default 1.0: the whole distribution)")
    p.add_argument("--seed", type=cli.seed, default=0, help="prompt order, sampling and the "
                   "weights of --preset (default 0)")
    p.add_argument("--dtype", choices=sorted(cli.DTYPES), default="float32")
    p.add_argument("--out", required=True, help="text file to write")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (2 with one `error:` line for bad
    arguments, files or data)."""
    from dejavu_jax.checkpoint_files import CheckpointError
    from dejavu_jax.train.collect import corpus_files, load_source
    args = build_parser().parse_args(argv)
    out = Path(args.out).expanduser()
    if out.is_dir():
        cli.fail(f"--out {out} is a folder; give a file name")
    try:
        files = corpus_files(argparse.Namespace(corpus=args.corpus, dataset=None))
        corpus_lib.corpus_chunks(files, args.prompt_tokens + 1)  # fail before the weights
        _, config, params, tokenizer = load_source(args)
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        import jax
        print(f"model {config.name} on {jax.default_backend()}; {len(files)} corpus files; "
              f"{args.tokens} tokens, {args.new_tokens} per prompt of {args.prompt_tokens}, "
              f"batch {args.batch}, temperature {args.temperature}", file=sys.stderr)
        params = decode_layout(fuse_qkv(params, free_originals=True), free_stacked=True)
        texts, stats = generate_continuations(
            config, params, tokenizer, files, tokens=args.tokens,
            prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, batch=args.batch,
            sampling=sampling, seed=args.seed, chunk=args.chunk,
            progress=not args.no_progress, log=lambda s: print(s, file=sys.stderr))
        write_paragraphs(texts, out)
    except (corpus_lib.CorpusError, CheckpointError, OSError, ValueError,
            RuntimeError) as e:
        cli.fail(str(e))
    print(f"{stats['continuations']} continuations, {stats['tokens']} tokens -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
