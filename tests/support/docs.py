"""Reading the project's Markdown as an operator reads it: its links and their anchors, the commands in its
shell blocks and code spans. Used by the docs tests and by the kustomize test (which builds what the docs tell
an operator to apply)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
OPERATOR_GUIDE = REPO / "docs" / "operator-guide.md"
DEPLOY_DOCS = (README, OPERATOR_GUIDE)
"""The pages whose commands an operator runs as written from a fresh clone."""

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_SPAN = re.compile(r"`([^`\n]+)`")


def without_fences(text: str) -> str:
    """The text with its fenced blocks blanked out (a `#` comment in a shell block is no heading)."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped (code marks,
    dots, slashes, commas, parentheses), each space a `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, a repeated heading numbered as GitHub numbers it."""
    seen: dict[str, int] = {}
    found = set()
    for line in without_fences(path.read_text()).splitlines():
        heading = re.match(r"^#{1,6} (.+)$", line)
        if not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file outside its code (images excluded)."""
    return _LINK.findall(_SPAN.sub("", without_fences(path.read_text())))


def code_spans(path: Path) -> list[str]:
    """The inline code spans of a Markdown file, outside its fenced blocks."""
    return _SPAN.findall(without_fences(path.read_text()))


def shell_lines(path: Path) -> list[str]:
    """The command lines of the file's `bash` / `sh` blocks, continuation lines joined and comments cut."""
    lines: list[str] = []
    for lang, body in _FENCE.findall(path.read_text()):
        if lang not in ("bash", "sh"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


@dataclass(frozen=True)
class Command:
    """A command the docs show: the file it is in, its words, and whether it sits in a shell block (a line
    the reader pastes) or in a code span of the prose."""

    doc: Path
    words: tuple[str, ...]
    pasted: bool

    def __str__(self) -> str:
        return f"{self.doc.relative_to(REPO)}: {shlex.join(self.words)}"


def commands(path: Path) -> Iterator[Command]:
    """Every command of a file: each shell-block line (a trailing `&` dropped) and each code span that
    starts as a command does (`make `, `.venv/bin/`, `python -m `, `kubectl `) and is one, not a notation
    for many (`.venv/bin/python -m …`, `kubectl apply -k <your directory>`)."""
    for line in shell_lines(path):
        yield Command(path, tuple(shlex.split(line.removesuffix("&").strip())), pasted=True)
    for span in code_spans(path):
        if re.match(r"(make |\.venv/bin/|python -m |kubectl )", span) and not re.search(r"…|<[^>]*>", span):
            yield Command(path, tuple(shlex.split(span)), pasted=False)
