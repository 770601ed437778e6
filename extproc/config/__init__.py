"""The sidecar's configuration: one YAML file, which becomes the Kubernetes ConfigMap.

Everything is validated when the file is loaded, and every error names the key path that is wrong
(`limits.models.llama.max_concurrency: must be an integer >= 0`), because the operator reading the log line
is usually editing a ConfigMap under pressure. Unknown keys are errors too: a misspelt limit that silently
falls back to a default is worse than a refused reload.

- `schema`: one pydantic class per YAML section, mirroring the file; the one place keys and defaults live.
- `build`: `parse_config`, which validates against the schema and builds the runtime types.
- `problems`, `walk`: pydantic's errors as key-path sentences; the schema's keys, and how `null` is read.
- `runtime`: `Config` and the types the packages take, and `admission_rules`, the one conversion to
  admission's own policy (extproc/admission/intake/rules.py) that each `Config` holds.
- `load`: reading a file within bounds (bytes, nesting, nodes after alias expansion), and loading it in a
  child process, off the event loop.
- `watch`: `load_config` and `ConfigWatcher`, over `load`.

Modules, by their path from this folder: the YAML config, on pydantic: `schema.py` (one class per YAML
section, its fields the section's keys), `fields.py` (the schema's scalar types, each with the error an
operator reads), `build.py` (`parse_config`: parsed YAML → validated schema → the runtime `Config`),
`runtime.py` (the runtime `Config` and its one conversion to the types the packages take: admission's rules,
the store's settings (a backend's own section read by the parser it registers), the feed subscriber's
settings), `problems.py` (validation errors as `key.path: sentence`, unknown keys with the closest known one),
`errors.py` (`ConfigError`, its quotes bounded), `warnings.py` (valid settings that work against each other),
`walk.py` (walks over the schema: the keys a file may set, how its `null`s are read), `load.py` (reading a
config file within bounds: bytes, nesting, nodes after alias expansion; reloading it in a child process, off
the event loop), `watch.py` (the polling watcher over it).
"""

from __future__ import annotations

from extproc.admission.intake.rules import DEFAULT_MODEL  # the `models`/`limits.models` entry for every name
from extproc.config.build import parse_config
from extproc.config.errors import MAX_PROBLEM_CHARS, MAX_PROBLEMS_SHOWN, MAX_SUGGESTIONS, ConfigError
from extproc.config.runtime import (
    DEFAULT_CLASS,
    DEFAULT_POLICY,
    AdmissionConfig,
    Config,
    LimitsConfig,
    ServerConfig,
)
from extproc.config.warnings import config_warnings, log_warnings
from extproc.config.watch import ConfigWatcher, ReloadResult, load_config

__all__ = [
    "DEFAULT_CLASS",
    "DEFAULT_MODEL",
    "DEFAULT_POLICY",
    "MAX_PROBLEMS_SHOWN",
    "MAX_PROBLEM_CHARS",
    "MAX_SUGGESTIONS",
    "AdmissionConfig",
    "Config",
    "ConfigError",
    "ConfigWatcher",
    "LimitsConfig",
    "ReloadResult",
    "ServerConfig",
    "config_warnings",
    "load_config",
    "log_warnings",
    "parse_config",
]
