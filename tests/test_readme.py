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


def test_accountant_comparison_numbers():
    """The numbers of "The default accountant, "rdp", is not Opacus' default": ours through our RDP
    and PLD accountants, Opacus' through its own RDP and (default) PRV accountants."""
    opacus = pytest.importorskip("opacus.accountants")
    import warnings

    from bpclip_fast.accounting import PLDAccountant, RDPAccountant, get_noise_multiplier
    from opacus.accountants.utils import get_noise_multiplier as opacus_noise_multiplier

    text = " ".join(README.read_text().split())
    start = text.index('**The default accountant, `"rdp"`, is not Opacus\' default**')
    claim = text[start:start + 1500]  # the paragraph (whitespace collapsed)

    def ours(cls, sigma, q, n):
        acc = cls()
        acc._append(sigma, q, n)
        return acc.get_epsilon(1e-5)

    def theirs(cls, sigma, q, n):
        acc = cls()
        acc.history = [(sigma, q, n)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return acc.get_epsilon(1e-5)

    digits, mnist = (2.0, 128 / 1437, 220), (1.1, 256 / 60000, 14063)
    rdp, pld = ours(RDPAccountant, *digits), ours(PLDAccountant, *digits)
    assert f"{rdp:.2f}" == f"{theirs(opacus.RDPAccountant, *digits):.2f}"
    prv = theirs(opacus.PRVAccountant, *digits)
    assert f"ε = {rdp:.2f} with RDP (ours and Opacus'), {pld:.2f} with `PrivacyEngine(accountant=\"pld\")` " \
           f"and {prv:.2f} with Opacus' PRV" in claim, claim
    m = [ours(RDPAccountant, *mnist), ours(PLDAccountant, *mnist), theirs(opacus.PRVAccountant, *mnist)]
    assert f"{m[0]:.2f}, {m[1]:.2f} and {m[2]:.2f}" in claim, claim
    kw = dict(target_epsilon=3.0, target_delta=1e-5, sample_rate=128 / 1437, steps=220)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prv_sigma = opacus_noise_multiplier(**kw, accountant="prv")
    pld_sigma, rdp_sigma = get_noise_multiplier(**kw, accountant="pld"), get_noise_multiplier(**kw, accountant="rdp")
    assert f"{pld_sigma:.2f}" == f"{prv_sigma:.2f}"
    assert f"σ = {pld_sigma:.2f} with PLD and with Opacus' PRV, {rdp_sigma:.2f} with RDP" in claim, claim


def test_readme_opens_with_the_two_commands_then_says_what_the_library_is():
    text = README.read_text()
    first = FENCE.search(text)
    assert text[:first.start()].strip() == "# bpclip_fast"  # the two commands come first (project rule)
    assert first.group(1) == "bash"
    assert [line.split()[:2] for line in first.group(2).splitlines()] == [["make", "demo"], ["make", "test"]]
    intro = " ".join(text[first.end():text.index("```python")].split())
    assert intro.count(". ") <= 3  # two or three sentences, before any code
    for term in ("differentially private training for PyTorch", "Opacus", "make_private", "DP-SGD",
                 "backpropagation clipping", "fused C++/CUDA kernels"):
        assert term in intro, f"the README's opening does not say {term!r}"


def test_readme_points_only_to_what_a_user_has():
    text = README.read_text()
    assert "../" not in text, "the README points outside the repository (a user has only the repository)"
    assert not re.search(r"issue \d+", text), "the README speaks of the project's issues; say what is true now"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (README.parent / target).exists(), f"README links to {target}, which does not exist"
