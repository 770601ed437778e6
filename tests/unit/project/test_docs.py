"""The docs an operator follows hold as written: the README stays a short page of quickstarts, the operator
guide walks its path in order, every link and anchor resolves, every command the README and the guide show
names a make target, a module, an option and a file that exist (the cheap ones run as written, the others in
their `--help` form, which parses every word before it), the pages an operator reads carry no project
history, and docs/ stays a reference within a word budget. The commands that need a running stack are run
elsewhere: the README's `make run UPSTREAM=` by the real-engine tier (tests/engine/test_quickstart_engine.py),
`make run`'s load loop by tests/e2e/test_make_run_e2e.py, the `kubectl apply -k` builds by
test_kustomize.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.docs import (
    DEPLOY_DOCS,
    OPERATOR_GUIDE,
    README,
    REPO,
    Command,
    anchors,
    code_spans,
    commands,
    links,
)

README_WORDS = 1500
DOCS_WORDS = 25_000
"""The whole of docs/ (README.md aside), in words split on whitespace: under half of what the lab-notebook
pages held, the size of the references this project follows (envoyproxy/ratelimit's one 8,100-word README)."""
PAGE_WORDS = 5_000
"""One page of docs/: past it a page is two topics."""
OPERATOR_PATH = ("Install", "Point it at your engine", "Size the limits", "Watch", "Tune", "Troubleshoot")
ALL_DOCS = (README, *sorted((REPO / "docs").rglob("*.md")), REPO / "bench" / "RESULTS.md")
USER_DOCS = (
    README,
    OPERATOR_GUIDE,
    *(REPO / "docs" / f"{n}.md" for n in ("configuration", "tenants", "gateways", "monitoring", "planning")),
)
HISTORY = re.compile(
    r"\bissue \d+|before this change|the old code|\bthen had\b|\(was \d|\bwas \d[\d.,]* ?(s|ms|MB)\b"
    r"|\bcommit [0-9a-f]{7,}\b",
    re.IGNORECASE,
)
"""The project speaking of its own past: an issue number, "before this change", a figure the code "was"."""
SHELL_TOOLS = {"curl", "watch", "for", "docker", "kubectl", "make"}
"""What a pasted line may start with besides the venv's programs: a bare `python` or `extproc` runs outside
the venv and stops at `No module named 'tiktoken'`."""
RUN_AS_WRITTEN = {("extproc", "check-config"), ("extproc", "plan")}
"""Project commands quick and self-contained enough to run exactly as shown (the others start servers)."""
PLACEHOLDER = re.compile(r"^(PATH|URL|FILE|HOST:PORT)$")
"""A word the reader replaces: such a command runs in its `--help` form."""


def doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def command_id(command: Command) -> str:
    return str(command)


def all_commands() -> list[Command]:
    return [command for doc in DEPLOY_DOCS for command in commands(doc)]


def test_the_readme_is_a_short_page_of_quickstarts() -> None:
    text = README.read_text()
    assert len(text.split()) <= README_WORDS, f"README.md: {len(text.split())} words, over {README_WORDS}"
    for quickstart in (
        "Quickstart: the local stack",
        "Quickstart: in front of your own vLLM",
        "Quickstart: Kubernetes",
    ):
        assert f"\n## {quickstart}\n" in text


def test_the_docs_stay_within_their_word_budget() -> None:
    words = {doc_id(path): len(path.read_text().split()) for path in sorted((REPO / "docs").rglob("*.md"))}
    largest = sorted(words.items(), key=lambda item: -item[1])[:5]
    total = sum(words.values())
    assert total <= DOCS_WORDS, f"docs/: {total} words, over {DOCS_WORDS}; the largest pages: {largest}"
    over = {doc: count for doc, count in words.items() if count > PAGE_WORDS}
    assert not over, f"pages over {PAGE_WORDS} words: {over}"


def test_the_operator_guide_walks_the_path_in_order() -> None:
    headings = re.findall(r"^## (\d+)\. (.+)$", OPERATOR_GUIDE.read_text(), re.MULTILINE)
    assert headings == [(str(n), title) for n, title in enumerate(OPERATOR_PATH, 1)]


@pytest.mark.parametrize("doc", ALL_DOCS, ids=doc_id)
def test_every_link_and_anchor_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, f"{doc_id(doc)}: {broken}"


@pytest.mark.parametrize("doc", USER_DOCS, ids=doc_id)
def test_the_operator_pages_carry_no_project_history(doc: Path) -> None:
    """Figures belong in docs/internals/measurements.md and bench/RESULTS.md; sources of other projects cited
    at a commit (vLLM, Grafana, llm-d) are sources, not history."""
    found = [m.group(0) for line in doc.read_text().splitlines() for m in [HISTORY.search(line)] if m]
    assert not found, f"{doc_id(doc)}: {found}"


@pytest.mark.parametrize("command", [c for c in all_commands() if c.pasted], ids=command_id)
def test_pasted_lines_run_from_the_venv_or_make(command: Command) -> None:
    first = command.words[0]
    assert first in SHELL_TOOLS or first.startswith(".venv/bin/"), str(command)


def project_argv(command: Command) -> tuple[str, list[str]] | None:
    """(program, its arguments) for a command of this project's Python: the venv's `python -m M` (or a bare
    `python -m M` named in prose) and the venv's `extproc` script; None for any other command."""
    words = list(command.words)
    if words[0] == ".venv/bin/extproc":
        return "extproc", words[1:]
    if words[0] in (".venv/bin/python", "python") and words[1:2] == ["-m"]:
        return words[2], words[3:]
    return None


@pytest.mark.parametrize("command", [c for c in all_commands() if project_argv(c)], ids=command_id)
def test_each_project_command_parses(command: Command) -> None:
    found = project_argv(command)
    assert found is not None
    module, args = found
    subcommand = (module, args[0]) if args else (module, "")
    dry = subcommand not in RUN_AS_WRITTEN or any(PLACEHOLDER.search(word) for word in args)
    argv = [sys.executable, "-m", module, *args, *(["--help"] if dry else [])]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-2000:]}"
    if dry:
        unknown = [w.split("=")[0] for w in args if w.startswith("--") and w.split("=")[0] not in done.stdout]
        assert not unknown, f"{command}: {unknown} not in its --help"
    elif subcommand == ("extproc", "check-config"):
        assert done.stdout.strip() == "config ok", f"{command}: {done.stdout}"


@pytest.mark.parametrize("command", [c for c in all_commands() if c.words[0] == "make"], ids=command_id)
def test_each_make_command_names_a_target(command: Command) -> None:
    """`make -n` parses the Makefile and resolves the target and its prerequisites without running them."""
    done = subprocess.run(
        ["make", "-n", *command.words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"{command}: {done.stderr}"


@pytest.mark.parametrize(
    "command", [c for c in all_commands() if c.words[0] in ("kubectl", "docker")], ids=command_id
)
def test_each_kubectl_or_docker_command_names_what_exists(command: Command) -> None:
    words = command.words
    if words[:3] == ("kubectl", "apply", "-k") or words[:2] == ("kubectl", "kustomize"):
        # A Kustomization, which test_kustomize.py builds, not a Component, which cannot be applied alone.
        kustomization = REPO / words[-1] / "kustomization.yaml"
        assert kustomization.is_file(), str(command)
        assert yaml.safe_load(kustomization.read_text()).get("kind", "Kustomization") == "Kustomization"
    elif words[:2] == ("docker", "build"):
        assert (REPO / words[-1] / "Dockerfile").is_file(), str(command)


def repo_paths(doc: Path) -> list[str]:
    """The code spans of a page that name a file or folder of the repository (their first part is one of
    its top-level entries; `run/`, which `make run` creates, aside)."""
    top = {entry.name for entry in REPO.iterdir()} - {"run"}
    spans = (span.split()[0] for span in code_spans(doc) if span.strip())
    return [s for s in spans if "/" in s and s.split("/")[0] in top and not s.startswith(".venv")]


@pytest.mark.parametrize("doc", DEPLOY_DOCS, ids=doc_id)
def test_every_file_the_pages_name_exists(doc: Path) -> None:
    missing = [path for path in repo_paths(doc) if not list(REPO.glob(path.rstrip("/")))]
    assert repo_paths(doc), f"{doc_id(doc)} names no file"
    assert not missing, f"{doc_id(doc)}: {missing}"
