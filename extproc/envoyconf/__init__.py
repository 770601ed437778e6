"""The Envoy configs the sidecar ships with: editing a static bootstrap (bootstrap.py), the lean profile's
rendering of the inline config (lean.py) and its Lua response reader (response.lua), and the two profiles
(profiles.py).

Modules, by their path from this folder: the Envoy configs the sidecar ships with: `bootstrap.py` (finding and
editing the HTTP connection managers and the header-mutation filter of a static bootstrap, for the lean
renderer and the local stack), `lean.py` (the lean profile's config, rendered from the inline one and the path
table: `python -m extproc envoy-config --profile lean`), `response.lua` (the lean profile's Lua response
reader), `profiles.py` (the two profiles and the inline template), `upstream.py` (the engine cluster the
Kubernetes gateway's Envoy loads from the `extproc-upstream` ConfigMap: `python -m extproc envoy-upstream
URL`).
"""
