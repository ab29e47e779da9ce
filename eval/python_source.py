"""Python source text for the coder models: the standard library's own modules, in fixed
lists, one for calibration and one for evaluation, with no file in both.

The files are read from the running interpreter's standard library, so the text is that
of its Python version (the results record it).
"""

from __future__ import annotations

import platform
import sysconfig
from pathlib import Path

CALIBRATION_FILES = ("argparse.py", "dataclasses.py", "functools.py", "contextlib.py",
                     "tempfile.py", "shutil.py", "random.py", "tokenize.py",
                     "configparser.py", "glob.py", "copy.py", "queue.py")
TEST_FILES = ("textwrap.py", "fractions.py", "heapq.py", "calendar.py", "shlex.py",
              "statistics.py", "csv.py", "graphlib.py", "pprint.py", "json/decoder.py",
              "json/encoder.py")
SPLITS = {"calibration": CALIBRATION_FILES, "test": TEST_FILES}


def stdlib_files(split: str) -> list[Path]:
    """The files of `split` ("calibration" or "test"); FileNotFoundError naming a file the
    interpreter's standard library lacks."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / name for name in SPLITS[split]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"Python source for {split}: missing {', '.join(missing)}")
    return files


def python_text(split: str) -> str:
    """The files of `split` joined in list order, each headed by a comment naming it."""
    return "\n\n".join(f"# {f.name}\n{f.read_text(encoding='utf-8')}" for f in stdlib_files(split))


def describe(split: str) -> dict:
    """What a result records about the text: the Python version and the file list."""
    return {"python": platform.python_version(), "files": list(SPLITS[split])}
