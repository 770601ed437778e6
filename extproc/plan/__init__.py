"""`extproc plan`: a limit planner that sizes a deployment and its sidecar limits before it exists.

`planner` turns a model, a GPU and a traffic sample into limits with the arithmetic shown, `rehearse`
replays the traffic through those limits against the simulator's scheduler on virtual time, `render`
prints text, YAML or JSON, `cli` wires the subcommand. The geometry is `extproc.geometry`, shared with
the simulator. See docs/planning.md.
"""
