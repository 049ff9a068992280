"""README.md's code: every ```python block runs, every ```bash command names what exists.

The python blocks run in order in one namespace, as the README is written: the sensitivity
example audits the private model and last batch of the training example before it. The README's
training example (20 epochs on the 8x8 digits) takes about 10 s of one CPU core.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang):
    return [body for kind, body in FENCE.findall(README.read_text()) if kind == lang]


def opening_fences(lang):
    return sum(1 for line in README.read_text().splitlines() if line.strip() == f"```{lang}")


def test_every_python_block_runs():
    code = blocks("python")
    # The fence parser must see every block the file opens: a malformed fence would drop one unseen.
    assert len(code) == opening_fences("python") > 0
    ns = {"__name__": "readme"}
    out = io.StringIO()
    ran = 0
    for i, body in enumerate(code, 1):
        with contextlib.redirect_stdout(out):
            exec(compile(body, f"README.md python block {i}", "exec"), ns)
        ran += 1
    assert ran == len(code)
    printed = out.getvalue()
    # The ε the first example quotes is deterministic (σ, q and the step count fix it).
    claimed = re.search(r'print\(f"epsilon = .*#\s*([0-9.]+);', code[0]).group(1)
    assert f"epsilon = {claimed} at delta = 1e-5" in printed, printed
    # The sensitivity example audits a correctly private model: every bound holds.
    audit = [line for line in printed.splitlines() if line.startswith("sensitivity: ")]
    assert len(audit) == 1 and audit[0].endswith("OK"), printed


def _commands():
    for body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                yield shlex.split(line)


def test_bash_blocks_name_what_exists():
    from bpclip_fast.audit import cli

    root = README.parent
    targets = set(re.findall(r"^([\w-]+):", (root / "Makefile").read_text(), re.M))
    scripts = set(re.findall(r"^([\w-]+) = \"bpclip_fast", (root / "pyproject.toml").read_text(), re.M))
    commands = list(_commands())
    assert len(blocks("bash")) == opening_fences("bash") > 0 and commands
    for argv in commands:
        if argv[0] == "make":
            assert set(argv[1:]) <= targets, f"README: `{' '.join(argv)}`: no such Makefile target"
        elif argv[0] == "bpclip-audit":
            assert "bpclip-audit" in scripts
            cli.build_parser().parse_args(argv[1:])  # an unknown subcommand or flag exits 2
        else:
            pytest.fail(f"README runs `{' '.join(argv)}`, which this test does not know how to check")
