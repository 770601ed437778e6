"""The Envoy configs the sidecar ships with: editing a static bootstrap (bootstrap.py), the lean profile's
rendering of the inline config (lean.py) and its Lua response reader (response.lua), and the two profiles
(profiles.py)."""
