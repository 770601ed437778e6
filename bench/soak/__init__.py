"""Soak and chaos benchmark: several sidecar replicas, one Redis, faults injected under load."""
