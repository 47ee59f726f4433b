"""Policies: the YAML schema (:mod:`.schema`) and the engine that turns findings into decisions
(:mod:`.engine`). Import from the submodules; nothing is imported here eagerly."""
