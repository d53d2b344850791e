"""`trainscout run`: wraps the launcher, starts the agent (and on node 0 the coordinator), tidies up."""
