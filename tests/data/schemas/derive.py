"""Derive one of the schemas here from a published CRD and the objects we ship of its kind.

    python tests/data/schemas/derive.py CRD_YAML KIND VERSION SOURCE KUSTOMIZATION... > OUT.yaml

The output keeps, at every object level the shipped objects use, each property name the CRD allows there
and refuses any other (additionalProperties: false), with the CRD's types, enums, patterns, bounds, required
lists, list-set uniqueness and list-map keys; levels the objects do not use become `type: object` /
`type: array` without detail. The CEL rules (x-kubernetes-validations) are not translated, and the header
says so. SOURCE is the header's provenance line (repository,
release tag, commit, path).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import yaml

COPIED = (
    "type",
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "minItems",
    "maxItems",
    "required",
    "maxProperties",
)


def stub(node: dict[str, Any]) -> dict[str, Any]:
    """An unused level: its type only."""
    if node.get("x-kubernetes-int-or-string"):
        return {"type": ["integer", "string"]}
    return {"type": node["type"]} if "type" in node else {}


def derive(node: dict[str, Any], used: list[Any]) -> dict[str, Any]:
    """The schema of `node` for the values `used` (what the shipped objects hold at this place)."""
    out: dict[str, Any] = {k: node[k] for k in COPIED if k in node}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if node.get("x-kubernetes-list-type") == "map" and "x-kubernetes-list-map-keys" in node:
        out["x-kubernetes-list-map-keys"] = node["x-kubernetes-list-map-keys"]
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return out
    if "properties" in node:
        out["additionalProperties"] = False
        out["properties"] = {}
        for name, sub in sorted(node["properties"].items()):
            values = [v[name] for v in used if isinstance(v, dict) and name in v]
            out["properties"][name] = derive(sub, values) if values else stub(sub)
    elif isinstance(node.get("additionalProperties"), dict):
        values = [x for v in used if isinstance(v, dict) for x in v.values()]
        out["additionalProperties"] = derive(node["additionalProperties"], values)
    if "items" in node:
        values = [x for v in used if isinstance(v, list) for x in v]
        out["items"] = derive(node["items"], values) if values else stub(node["items"])
    return out


def shipped(kind: str, directories: list[str]) -> list[dict[str, Any]]:
    found = []
    for directory in directories:
        text = subprocess.run(["kubectl", "kustomize", directory], check=True, capture_output=True).stdout
        found += [d for d in yaml.safe_load_all(text) if d and d["kind"] == kind]
    return found


def main(crd_file: str, kind: str, version: str, source: str, directories: list[str]) -> None:
    with open(crd_file) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    crd = next(c for c in crds if c["spec"]["names"]["kind"] == kind)
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    root = served["schema"]["openAPIV3Schema"]
    group = crd["spec"]["group"]
    objects = shipped(kind, directories)
    assert objects, f"no {kind} in {directories}"
    spec = derive(root["properties"]["spec"], [o["spec"] for o in objects])
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["apiVersion", "kind", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": f"{group}/{version}"},
            "kind": {"const": kind},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": {"type": "object"},
        },
    }
    header = (
        f"{kind} {group}/{version}, as a JSON Schema (draft 2020-12) for tests/unit/k8s/test_manifests.py. "
        f"Derived from the CRD's openAPIV3Schema ({version}) in {source}, by tests/data/schemas/derive.py "
        f"for the objects of `kubectl kustomize {' '.join(directories)}`. "
        "The CRD's CEL rules are not restated."
    )
    print("\n".join(f"# {line}" for line in textwrap.wrap(header, 106)))
    print(yaml.safe_dump(schema, sort_keys=False, width=110), end="")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
