"""Argument types and the parser of the `moekit` command: a user's mistake is one line on stderr and
exit status 2, before any check or benchmark runs (never a traceback, never rows of FAILED)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import presets


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (``moekit verify: error: ...``) and exit status 2."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def preset_name(value: str) -> str:
    if value not in presets.names():
        raise argparse.ArgumentTypeError(f"unknown preset {value!r}; known presets: {', '.join(presets.names())}")
    return value


def _whole(value: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} are whole numbers, got {value!r}") from None


def token_count(value: str) -> int:
    tokens = _whole(value, "token counts")
    if tokens < 0:
        raise argparse.ArgumentTypeError(f"token counts must be >= 0, got {tokens}")
    return tokens


def positive_token_count(value: str) -> int:
    tokens = _whole(value, "token counts")
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1 here, got {tokens}")
    return tokens


def positive_int(value: str) -> int:
    """A count of something other than tokens (layers, repetitions): a whole number >= 1."""
    number = _whole(value, "counts")
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def new_file(value: str) -> Path:
    """A file this run can write: its folder exists and is writable (checked before the run)."""
    path = Path(value)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory; give a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {value}: no directory {folder}")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {value}: permission denied")
    return path


def fail(prog: str, message: str) -> int:
    """A mistake found after parsing: the same one line, exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
