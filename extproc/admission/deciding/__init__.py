"""The decision on one request body: `Decision` (grant, refusal or shadow) and the admission on the
prompt's byte bound with its one correction to the exact count.

Modules, by their path from this folder: the decision on one request body: `decision.py` (request facts and
body → `Granted`, `Refusal` or `Shadowed`, under the rules read once per decision; the prompt's exact count
awaited in `Decision.run`, or, where the byte bound decides, a grant on the bound with its `Correction` to
follow), `resolving.py` (`resolve`: the body parsed and its model resolved to its policy and pools, one
`Resolved` value; `check`: what needs no count refused), `provisional.py` (admission on the prompt's byte
bound and the one correction to the exact count after the verdict), `candidate.py` (`RequestFacts`, what the
request line and headers settled, and `Candidate`: one try to admit a request, on the prompt's bound or its
exact count, the value `Decision.admit` walks; `Candidate.grant`: the try and its lease made the `Admitted`
and the `Forward` in one call), `acquiring.py` (`Acquisition`: a try's way to a lease, taken at once or waited
for in the class's queue, its deadline checked first).
"""
