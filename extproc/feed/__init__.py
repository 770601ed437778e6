"""Types, wire format and scraping shared by the KV-feed exporter and the sidecar's feed subscriber.

Both `extproc.exporter` (node side) and `extproc.feedback` (sidecar side) import this package; it imports
neither, so the two sides never import each other.
"""
