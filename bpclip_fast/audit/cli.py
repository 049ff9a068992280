"""``bpclip-audit``: check the guarantee of a set-up (``bpclip-audit --help``).

Subcommands: ``sensitivity`` (:mod:`.sensitivity`), ``one-run`` and ``many-run`` (:mod:`.empirical`).
Each prints one line and, with ``--json PATH``, writes the full report as JSON.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bpclip-audit", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    _sensitivity_parser(sub)
    _one_run_parser(sub)
    _many_run_parser(sub)
    return p


# ---------------------------------------------------------------------------------------- sensitivity
def _sensitivity_parser(sub) -> None:
    pass  # filled by the sensitivity audit


# ---------------------------------------------------------------------------------------- empirical
def _one_run_parser(sub) -> None:
    pass  # filled by the empirical audit


def _many_run_parser(sub) -> None:
    pass  # filled by the empirical audit


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
