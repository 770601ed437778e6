"""The capacity a request takes and gives back: its KV-budget booking, the class queues, the tokenizer
lanes, slot retry hints, and the charging rule for every ending.

Modules, by their path from this folder: the capacity a request takes and gives back: `booking.py` (a
request's KV-budget entry: every change to a budget goes through it), `queueing.py` (the bounded wait for
capacity of classes that queue: `AdmissionQueue` over the core's `WaitQueue`, pumped when a lease settles,
limits or scales change, or a shared store's replica releases), `lanes.py` (fair use of the tokenizer threads:
one client's flood of large prompts delays nobody else), `hints.py` (slot retry hints from the leases open
here), `charging.py` (the charging rule for every ending), `admitted.py` (`Admitted`: what an admitted request
holds and its settlement reads), `settler.py` (`Settler`: a lease released exactly once to its charge, the KV
entry given back, the settlement counted).
"""
