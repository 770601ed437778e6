"""`extproc plan`: a limit planner that sizes a deployment and its sidecar limits before it exists.

`planner` turns a model, a GPU and a traffic sample into limits with the arithmetic shown, `rehearse`
replays the traffic through those limits against the simulator's scheduler on virtual time, `render`
prints text, YAML or JSON, `cli` wires the subcommand. The geometry is `extproc.geometry`, shared with
the simulator. See docs/planning.md.

Modules, by their path from this folder: `extproc plan` ([planning.md](planning.md)): `cli.py` (its command
line), `traffic.py` (traffic samples: an Azure trace, or mean lengths and a rate), `planner.py` (KV capacity,
suggested limits with the arithmetic), `timing.py` (step timing scaled from the simulator's calibrated model),
`rehearse.py` (virtual-time rehearsal on the simulator's scheduler and the core limiter), `render.py` (the
plan as JSON, YAML or a text report).
"""
