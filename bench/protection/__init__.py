"""KV-cache protection on replayed Azure LLM inference traces (Patel et al., "Splitwise", ISCA 2024)."""
