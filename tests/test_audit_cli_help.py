"""``bpclip-audit <subcommand> --help`` shows every option's default (issue 26, the newcomer's path)."""

import argparse
import re

import pytest

from bpclip_fast.audit import cli


def subparsers():
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def option_blocks(help_text):
    """{option string: its help entry, whitespace collapsed} from a parser's --help."""
    blocks, current = {}, None
    for line in help_text.splitlines():
        m = re.match(r"^  (-[-\w]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def test_every_subcommand_is_checked():
    assert set(subparsers()) == {"sensitivity", "one-run", "many-run"}


@pytest.mark.parametrize("name", ["sensitivity", "one-run", "many-run"])
def test_help_shows_every_default(name):
    sub = subparsers()[name]
    blocks = option_blocks(sub.format_help())
    options = [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        block = blocks.get(action.option_strings[0])
        assert block is not None, f"{name}: {action.option_strings[0]} missing from --help"
        if action.default is None:  # the help says in words what happens without the option
            assert "(default: " in block, f"{name} --help: {block!r} does not say its default"
        else:
            assert f"(default: {action.default})" in block, (
                f"{name} --help: {block!r} does not show its default {action.default!r}")
