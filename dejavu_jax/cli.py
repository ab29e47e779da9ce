"""What the command-line tools share: one-line errors, checked argument types, dtypes.

Every CLI reports a bad argument or a bad input file as one line, `error: ...`, on stderr
and exits with status 2 (argparse's convention for usage errors), never with a traceback.
The arguments are checked before any model is loaded; what can only be checked against
the model (token ids against its vocabulary, per-layer lists against its layers) is
checked right after its config is read, still before its weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def fail(message: str) -> NoReturn:
    """Print `error: message` on stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one `error: ...` line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        """Report a usage error as one line and exit with status 2."""
        fail(message)


def interruptible(main) -> int:
    """main()'s exit status, or 130 with one line on stderr when the user interrupts it
    (Ctrl-C) instead of a traceback."""
    try:
        return main()
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr)
        return 130


def first_line(error: BaseException) -> str:
    """The first line of an error's message: a library's multi-line message (retries,
    hints) shortened to fit a one-line `error: ...`."""
    return (str(error).strip().splitlines() or [""])[0]


def _number(text: str, kind, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} expected, got {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _number(text, int, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _number(text, int, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _number(text, float, "a number >= 0")
    if not 0 <= value < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _number(text, float, "a number > 0")
    if not 0 < value < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


def seed(text: str) -> int:
    """An argparse type: a random seed, an integer in [0, 2**63)."""
    value = non_negative_int(text)
    if value >= 1 << 63:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {value}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1] (a density, a probability mass)."""
    value = _number(text, float, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def comma_items(text: str, unique: bool = True) -> list[str]:
    """The items of a comma list, spaces around each dropped; an empty item in the middle
    (``a,,b``), or with `unique` a name given twice, is an argparse error; a trailing
    comma is not."""
    items = [t.strip() for t in text.split(",")]
    if items and not items[-1]:
        items.pop()
    if any(not t for t in items):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
    twice = sorted({t for t in items if items.count(t) > 1}) if unique else []
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice in {text!r}")
    return items


def presets(text: str) -> list[str]:
    """An argparse type: a comma list of preset names (`config.PRESETS`)."""
    from dejavu_jax.config import PRESETS
    names = comma_items(text)
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown presets {unknown or text!r}; known: "
                                         f"{', '.join(PRESETS)}")
    return names


def choice_list(choices):
    """An argparse type: a comma list of names from `choices`."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(comma_items(text))
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from "
                                             f"{', '.join(choices)}")
        return names
    return parse


def fractions(text: str) -> list[float]:
    """An argparse type: one fraction, a comma list of them, or @FILE with one per line."""
    if text.startswith("@"):
        try:
            items = [line for line in Path(text[1:]).read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {e}") from None
    else:
        items = comma_items(text, unique=False)
    if not items:
        raise argparse.ArgumentTypeError(f"no values in {text!r}")
    return [fraction(t.strip()) for t in items]


def utf8_text(text: str) -> str:
    """An argparse type: text that encodes as UTF-8 (bytes of a command line that do not
    decode arrive as lone surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(
            f"not UTF-8 text (byte 0x{ord(text[e.start]) & 0xff:02x} at character "
            f"{e.start})") from None
    return text


def output_dir(text: str) -> Path:
    """An argparse type: a folder to write into (made if missing), not an existing file."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return path


def existing_path(text: str) -> Path:
    """An argparse type: a file or folder that exists."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return path


def existing_dir(text: str) -> Path:
    """An argparse type: a folder that exists."""
    path = existing_path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    return path


def model_source(text: str) -> str:
    """An argparse type: a checkpoint folder or .gguf file that exists, the name of a
    fetchable model (`dejavu_jax.models_registry.MODELS`), or a Hugging Face hub id
    ('org/name', tried when the path does not exist)."""
    from dejavu_jax.loading import hub_id
    from dejavu_jax.models_registry import MODELS
    if (not Path(text).expanduser().exists() and text not in MODELS
            and hub_id(text) is None):
        raise argparse.ArgumentTypeError(
            f"{text}: no such file or directory (nor a model name: {', '.join(MODELS)}; "
            f"nor a hub id of the form org/name)")
    return text

