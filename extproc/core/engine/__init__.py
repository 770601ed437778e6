"""What the engine's feed says, as numbers the limits use:
pressure (watermarks), decode pace, generation counts, finished runs."""
