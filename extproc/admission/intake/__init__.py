"""Where a request enters admission: the path table (metered, free, refused), the metered request whatever
its API, and the rules admission reads of the config.

Modules, by their path from this folder: where a request enters admission: `paths.py` (deny by default: the
metered / free / refused path table), `request.py` (a metered request whatever its API: its body decoded by
the API's format and validated by its adapter, body edits), `reservation.py` (what it costs: its prompt's
bounds and count, the `Reservation` it holds), `deadline.py` (a client's deadline for its first token, from
its headers), `endpoint.py` (the engine an inference pool's picker named, from its headers, where trusted),
`rules.py` (`AdmissionRules`, `TenantSource`: what admission reads of the config, built by the
config package once per load and swapped whole on reload; admission imports no config class).
"""
