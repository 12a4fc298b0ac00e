"""``python -m usp.train CONFIG [flags]``: the same as ``usp train CONFIG [flags]``."""

import sys

from usp.cli import main as usp_main


def main(argv: list[str] | None = None) -> int:
    return usp_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
