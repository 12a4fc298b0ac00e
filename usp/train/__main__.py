"""``python -m usp.train CONFIG [flags]``: the same as ``usp train CONFIG [flags]``."""

import sys

from usp.train.cli import build_parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
