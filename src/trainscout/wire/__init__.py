"""Typed, authenticated messages between agents, the run supervisor and the coordinator."""
