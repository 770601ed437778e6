"""Waiting for capacity: the order of the wait queue, when a slot frees,
how late capacity comes against the forecast, how fast the queue has lately drained."""
