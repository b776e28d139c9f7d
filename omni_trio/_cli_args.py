"""argparse pieces shared by the ``omni-trio`` subcommands: the parser class every
subcommand's parser is made of (:class:`CliParser`), its help formatter, and the argument
types (``type=`` callables)."""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._cli_render import parse_size, strip_rest

__all__ = [
    "CliParser",
    "HelpFormatter",
    "accept_verbose_everywhere",
    "finite_float",
    "image_path",
    "nonneg_int",
    "positive_float",
    "positive_int",
    "size_arg",
]


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` as a terminal should show it: docstring markup stripped from descriptions
    and option help (``strip_rest``), and every option's default shown (``(default: X)``)
    unless its help already names it or there is none to show (None, False, a flag)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(strip_rest(text))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None:
            return None
        text = strip_rest(text)
        default = action.default
        if (
            action.option_strings
            and action.nargs != 0
            and default is not None
            and default is not argparse.SUPPRESS
            and default is not False
            and default != []
            and "%(default)" not in text
            and "default" not in text.lower()
        ):
            text += " (default: %(default)s)"
        return text


class CliParser(argparse.ArgumentParser):
    """The parser of ``omni-trio`` and of every subcommand (argparse makes subparsers of the
    parent's class): :class:`HelpFormatter` by default, and an unknown argument is reported
    by the parser that met it, with that parser's usage (``omni-trio generate --stepz 3``
    shows ``generate``'s usage), with the closest known option suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            message = f"unrecognized arguments: {' '.join(extras)}"
            known = sorted(o for o in self._option_string_actions if o.startswith("--"))
            for extra in extras:
                if extra.startswith("--"):
                    close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1)
                    if close:
                        message += f" (did you mean {close[0]}?)"
                        break
            self.error(message)
        return parsed, extras


def _subparsers_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.extend(dict.fromkeys(action.choices.values()))
    return found


def accept_verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """Let ``-v``/``--verbose`` (``dest="verbose"``, a count) come after any subcommand too,
    with the meaning it has before it.  A subcommand's own ``-v`` is never replaced; not
    given after the subcommand, the value from before it stands (the default is SUPPRESS)."""
    for sub in _subparsers_of(parser):
        taken = sub._option_string_actions
        if "-v" not in taken and "--verbose" not in taken:
            sub.add_argument(
                "-v",
                "--verbose",
                action="count",
                default=argparse.SUPPRESS,
                help="log more (-v info, -vv debug); also accepted before the command",
            )
        accept_verbose_everywhere(sub)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def size_arg(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def image_path(text: str) -> str:
    """An output image path whose extension Pillow can write (none: PNG); checked before
    anything renders, so a typo costs no generation."""
    suffix = Path(text).suffix.lower()
    if not suffix:
        return text
    from PIL import Image

    fmt = Image.registered_extensions().get(suffix)
    if fmt is None or fmt not in Image.SAVE:
        writable = sorted(
            ext for ext, f in Image.registered_extensions().items() if f in _COMMON_FORMATS
        )
        raise argparse.ArgumentTypeError(
            f"cannot write images as {suffix!r}; use one of {', '.join(writable)} "
            "(or no extension for PNG)"
        )
    return text


# The formats an error lists (Pillow writes more).
_COMMON_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF"})


def lora_use_arg(text: str) -> tuple[str, float]:
    """``NAME[:SCALE]`` of ``generate --use-lora``: a registered adapter and its scale."""
    name, sep, scale = text.rpartition(":")
    if not sep:
        name, scale = text, "1"
    try:
        value = float(scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NAME[:SCALE] with SCALE a number, got {text!r}"
        ) from None
    if not name or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected NAME[:SCALE], got {text!r}")
    return name, value
