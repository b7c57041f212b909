"""The mesh and its plans: membership, the pipelines in force and the router over them, the planner driver, re-planning, the operator's commands, the mesh state, joins, weights served to nodes."""
