"""`extproc plan --help` states each default once, and only defaults that mean something."""

from __future__ import annotations

import argparse
import re

import pytest

from extproc.plan.cli import add_plan_parser


def plan_help(capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="extproc")
    add_plan_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--help"])
    return capsys.readouterr().out


def option_helps(text: str) -> dict[str, str]:
    """Each option's help text, joined across wrapped lines."""
    helps: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        option = re.match(r"\s{2}(--[\w-]+)", line)
        if option:
            current = option.group(1)
            helps[current] = line[len(option.group(0)) :]
        elif current and line.startswith(" " * 10):
            helps[current] += " " + line.strip()
        else:
            current = ""
    return helps


def test_every_default_is_stated_at_most_once(capsys: pytest.CaptureFixture[str]) -> None:
    helps = option_helps(plan_help(capsys))
    assert len(helps) > 20
    for option, text in helps.items():
        assert text.count("default") <= 1, (option, text)
        assert "(default: None)" not in text and "(default: False)" not in text, (option, text)


def test_meaningful_defaults_are_still_shown(capsys: pytest.CaptureFixture[str]) -> None:
    helps = option_helps(plan_help(capsys))
    assert "(default: 0.9)" in helps["--gpu-memory-utilization"]
    assert "(default: 16)" in helps["--block-size"]
    assert "llama-3-8b" in helps["--model-config"]
