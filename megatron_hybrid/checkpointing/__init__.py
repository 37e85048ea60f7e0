"""Checkpoint keys of hybrid stacks (pure key rules; sharded-state-dict wiring in ``sharded``)."""
