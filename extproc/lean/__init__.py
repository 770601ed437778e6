"""The lean profile's Envoy side: the Lua response reader and the config renderer."""
