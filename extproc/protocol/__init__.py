"""Envoy's protocols, translated to and from the admission core: the ext_proc servicer and its two
translators (inline.py, lean.py), the replies they build (messages.py), the lean profile's end reports
(accesslog.py) and their relay between replicas (relay.py)."""
