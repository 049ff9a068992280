"""The CUDA architecture list of the build: its default and its one parser.

setup.py imports this file; CMakeLists.txt runs it (``python tools/cuda_archs.py --cmake SPEC``).
Plain Python, no torch import, so CMake's call costs a few milliseconds.

Syntax (TORCH_CUDA_ARCH_LIST's numeric subset): entries separated by ';', ',' or spaces, each
``MAJOR.MINOR`` with an optional ``a``/``f`` suffix and an optional ``+PTX`` (also embed PTX for
that arch), e.g. ``8.0;9.0``, ``8.0 8.6 9.0+PTX``, ``9.0a``. Named archs (``Ampere``) are refused.
"""

from __future__ import annotations

import os
import re
import sys

ENV = "TORCH_CUDA_ARCH_LIST"
DEFAULT = "8.0;9.0"


class ArchError(ValueError):
    """An unparseable or empty arch list (the message names TORCH_CUDA_ARCH_LIST)."""


def resolve(spec: str | None = None) -> str:
    """``spec`` if given and non-empty, else $TORCH_CUDA_ARCH_LIST if non-empty, else DEFAULT."""
    return spec or os.environ.get(ENV) or DEFAULT


def _entries(spec: str) -> list[str]:
    return [item for item in re.split(r"[;, ]+", spec.strip()) if item]


def parse(spec: str) -> list[tuple[str, bool]]:
    """'8.0;9.0+PTX' -> [('80', False), ('90', True)]: (number with suffix, +PTX)."""
    archs = []
    for item in _entries(spec):
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", item)
        if not m:
            raise ArchError(
                f"cannot parse {ENV} entry {item!r}; "
                "use numeric capabilities such as '8.0;9.0' or '9.0+PTX'")
        archs.append((f"{m.group(1)}{m.group(2)}{m.group(3)}", bool(m.group(4))))
    if not archs:
        raise ArchError(f"{ENV} is empty")
    return archs


def names(archs: list[tuple[str, bool]]) -> list[str]:
    """What the library reports (build_info()['cuda_archs']): sm_XX, plus compute_XX for +PTX."""
    return [n for num, ptx in archs for n in [f"sm_{num}"] + ([f"compute_{num}"] if ptx else [])]


def gencode_flags(archs: list[tuple[str, bool]]) -> list[str]:
    """nvcc flags (setup.py): SASS for each arch, PTX too for +PTX."""
    return [f for num, ptx in archs
            for f in [f"-gencode=arch=compute_{num},code=sm_{num}"]
            + ([f"-gencode=arch=compute_{num},code=compute_{num}"] if ptx else [])]


def cmake_archs(archs: list[tuple[str, bool]]) -> list[str]:
    """CMake's CUDA_ARCHITECTURES with the same meaning: 'XX-real' is SASS only, 'XX' SASS + PTX."""
    return [num if ptx else f"{num}-real" for num, ptx in archs]


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] != "--cmake":
        print(f"usage: {os.path.basename(sys.argv[0])} --cmake [SPEC]  "
              f"(no or empty SPEC: ${ENV}, else {DEFAULT})", file=sys.stderr)
        return 2
    spec = resolve(argv[1] if len(argv) == 2 else None)
    try:
        archs = parse(spec)
    except ArchError as e:
        print(e, file=sys.stderr)
        return 1
    # One 'key=value' per line; the values are CMake lists (';'-separated). `spec` is the resolved
    # list for torch's own CMake code (TORCH_CUDA_ARCH_LIST), the others are parsed here.
    print(f"spec={';'.join(_entries(spec))}")
    print(f"names={';'.join(names(archs))}")
    print(f"cmake={';'.join(cmake_archs(archs))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
