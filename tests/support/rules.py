"""Admission's rules from a config mapping, as the sidecar builds them: parsed, then converted once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.intake.rules import AdmissionRules
from extproc.config import parse_config


def admission_rules(data: Mapping[str, Any] | None = None) -> AdmissionRules:
    """The `AdmissionRules` a config file of `data` gives (the empty file's without it)."""
    return parse_config(data or {}).admission_rules
