"""The path table: every engine path has a kind and a reason, the docs say the same, prefixes are safe."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

from extproc.admission import apis
from extproc.admission.apis import REGISTRY, dialect_for, spec_of
from extproc.admission.intake.paths import (
    BACKEND_CONTROL_HEADERS,
    DEFAULT_RULES,
    DEFAULT_TABLE,
    KNOWN_REFUSED,
    PathRule,
    PathTable,
    RouteKind,
)
from extproc.config import ConfigError, parse_config

DOC = Path(__file__).resolve().parents[4] / "docs" / "admission.md"
KIND_WORDS = {RouteKind.METERED: "metered", RouteKind.FREE: "free", RouteKind.DENIED: "refused"}
ALL_ROWS = (*DEFAULT_RULES, *KNOWN_REFUSED)


def concrete(path: str) -> str:
    """A request path for a table path: parameters filled in, a prefix given a tail."""
    path = re.sub(r"\{[^}]+\}", "x-1", path)
    return path[:-1] + "meta-llama/Llama-3-8B" if path.endswith("/*") else path


@pytest.mark.parametrize("rule", ALL_ROWS, ids=lambda r: f"{sorted(r.methods)[0]} {r.path}")
def test_every_row_routes_as_it_says(rule: PathRule) -> None:
    for method in rule.methods:
        got = DEFAULT_TABLE.route(method, concrete(rule.path))
        if rule.kind is RouteKind.DENIED:
            assert got is None, f"{method} {rule.path} must be refused"
        else:
            assert got is rule, f"{method} {rule.path}"
            assert (got.api is not None) == (rule.kind is RouteKind.METERED)


def test_rows_are_unique_documented_and_refused_rows_never_route() -> None:
    paths = [rule.path for rule in ALL_ROWS]
    assert len(paths) == len(set(paths))
    assert all(rule.reason and rule.engines for rule in ALL_ROWS)
    assert all(rule.kind is not RouteKind.DENIED for rule in DEFAULT_RULES)
    assert all(rule.kind is RouteKind.DENIED for rule in KNOWN_REFUSED)


def test_other_methods_on_metered_paths_are_refused_but_preflight_is_free() -> None:
    assert DEFAULT_TABLE.route("GET", "/v1/responses") is None
    assert DEFAULT_TABLE.route("PUT", "/v1/responses") is None
    assert DEFAULT_TABLE.route("put", "/generate/") is not None  # SGLang takes PUT there
    preflight = DEFAULT_TABLE.route("OPTIONS", "/v1/messages")
    assert preflight is not None and preflight.kind is RouteKind.FREE


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/models/meta-llama/Llama-3-8B", RouteKind.FREE),
        ("/v1/models/", RouteKind.FREE),  # the exact row (trailing slash removed)
        ("/v1/models/a/../../../metrics", None),  # resolves to /metrics
        ("/v1/models/%2e%2e/%2e%2e/collective_rpc", None),
        ("/v1/modelsX", None),
        ("/v1/models/x?y=1", RouteKind.FREE),
    ],
)
def test_the_models_prefix_only_matches_below_it(path: str, kind: RouteKind | None) -> None:
    got = DEFAULT_TABLE.route("GET", path)
    assert (got.kind if got else None) is kind
    assert DEFAULT_TABLE.route("POST", "/v1/models/x") is None


def test_the_longest_prefix_wins() -> None:
    table = PathTable.build(
        [
            PathRule("/a/*", frozenset({"GET"}), RouteKind.FREE, reason="outer"),
            PathRule("/a/b/*", frozenset({"GET"}), RouteKind.DENIED, reason="inner"),
        ]
    )
    assert table.route("GET", "/a/x") is not None
    assert table.route("GET", "/a/b/c") is None


def test_every_metered_api_has_an_adapter_and_a_dialect() -> None:
    apis = [spec.api for spec in REGISTRY]
    assert len(apis) == len(set(apis))
    for rule in DEFAULT_RULES:
        if rule.api is not None:
            assert spec_of(rule.api).adapter.api == rule.api
            assert dialect_for(rule.api) is not None


def specs_written() -> dict[str, list[str]]:
    """Each module of `extproc/admission/apis/` -> the names it assigns an `ApiSpec(...)` to."""
    found: dict[str, list[str]] = {}
    for module in pkgutil.iter_modules(apis.__path__, f"{apis.__name__}."):
        source = Path(importlib.import_module(module.name).__file__ or "").read_text(encoding="utf-8")
        found[module.name] = [
            target.id
            for node in ast.parse(source).body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "ApiSpec"
            for target in node.targets
            if isinstance(target, ast.Name)
        ]
    return found


def test_every_api_module_writes_one_spec_and_the_registry_lists_each() -> None:
    """One API, one module: a spec written but left out of the registry would serve none of its paths."""
    written = specs_written()
    assert all(len(names) <= 1 for names in written.values()), written
    expected = {getattr(importlib.import_module(m), names[0]) for m, names in written.items() if names}
    assert len(REGISTRY) == len(expected)
    assert set(REGISTRY) == expected


WRITE_SPEC = """
from extproc.admission.apis.chat import ChatAdapter
from extproc.admission.apis.openai import OPENAI_DIALECT, OPENAI_SPEC
from extproc.admission.apis.spec import GENERATES, ApiSpec, path, shared
from extproc.admission.vocabulary.parsed import Api


class Adapter(ChatAdapter):
    api = Api({name!r})


SPEC = ApiSpec(Adapter(), shared(OPENAI_DIALECT), OPENAI_SPEC, (path({path!r}, GENERATES),))
"""


def write_package(root: Path, name: str, modules: dict[str, str]) -> None:
    folder = root / name
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for module, source in modules.items():
        (folder / f"{module}.py").write_text(source)


def test_the_registry_finds_each_module_spec_in_name_order_and_skips_shared_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adding an API is adding its module: nothing lists it."""
    write_package(
        tmp_path,
        "found_apis",
        {
            "zeta": WRITE_SPEC.format(name="zeta", path="/z"),
            "alpha": WRITE_SPEC.format(name="alpha", path="/a"),
            "rules": "SHARED = 1\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = apis.discover("found_apis", [str(tmp_path / "found_apis")])
    assert [spec.api for spec in found] == ["alpha", "zeta"]


@pytest.mark.parametrize(
    ("modules", "error"),
    [
        ({"a": WRITE_SPEC.format(name="x", path="/a"), "b": WRITE_SPEC.format(name="x", path="/b")}, "x"),
        ({"a": WRITE_SPEC.format(name="a", path="/p"), "b": WRITE_SPEC.format(name="b", path="/p")}, "/p"),
        ({"a": "SPEC = 'chat'\n"}, "not an ApiSpec"),
    ],
    ids=["one name twice", "one path twice", "not a spec"],
)
def test_the_registry_refuses_a_name_or_path_declared_twice_or_a_spec_that_is_not_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modules: dict[str, str], error: str
) -> None:
    package = f"apis_{tmp_path.name}"  # one package per case: importlib caches modules by name
    write_package(tmp_path, package, modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises((TypeError, ValueError), match=error):
        apis.discover(package, [str(tmp_path / package)])


def test_backend_control_headers_are_lower_case_and_cited() -> None:
    assert all(h == h.lower() and h.isascii() for h in BACKEND_CONTROL_HEADERS)
    assert len(set(BACKEND_CONTROL_HEADERS)) == len(BACKEND_CONTROL_HEADERS)
    assert {"x-vllm-priority", "x-data-parallel-rank", "x-override-priority"} <= set(BACKEND_CONTROL_HEADERS)


def doc_rows() -> list[tuple[str, ...]]:
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- path-table:start -->")[1].split("<!-- path-table:end -->")[0]
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
        rows.append(cells)
    return rows


def test_the_docs_table_is_the_code_table() -> None:
    expected = [
        (
            f"`{rule.path}`",
            ", ".join(sorted(rule.methods)),
            rule.engines,
            KIND_WORDS[rule.kind],
            rule.api or "",
            rule.reason,
        )
        for rule in ALL_ROWS
    ]
    assert doc_rows() == expected


def test_config_can_deny_the_prefix_row_and_add_free_prefixes() -> None:
    config = parse_config({"paths": {"deny": ["/v1/models/*"], "free": ["GET /dashboard/*"]}})
    assert config.paths.route("GET", "/v1/models/x") is None
    assert config.paths.route("GET", "/dashboard/a/b") is not None
    with pytest.raises(ConfigError):
        parse_config({"paths": {"deny": ["/v1/models/nope"]}})
