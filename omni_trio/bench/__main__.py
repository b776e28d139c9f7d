"""``python -m omni_trio.bench <experiment> [options]``: the bench subcommand, standalone."""

from __future__ import annotations

import argparse
import sys

from ._cli import configure_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_trio.bench", description="omni_trio benchmarks"
    )
    configure_parser(parser)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
