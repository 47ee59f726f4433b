"""The ``do:`` vocabulary of policies: one module per action, registered here (pure).

Each action module (``log``, ``set_knob``, ...) holds its :class:`~.spec.ActionSpec`
``SPEC``: its params and checks, its pure ``decide`` and its ``carry_out`` (collaborators
passed in). :data:`MODULES` lists them explicitly, in the order of the reference; adding an
action is one module and one line there. docs/policies.md, "Adding an action";
reference: docs/policy-reference.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import Final

from gpuwatchd.policy.actions import (
    cordon_gpu,
    drain_node,
    exec,
    log,
    lower_parallelism,
    notify,
    place_on_idle_gpu,
    raise_parallelism,
    requeue_task,
    restart_study,
    restart_worker,
    set_knob,
    tune_loader,
    uncordon_gpu,
)
from gpuwatchd.policy.actions.params import LADDER_MODES, LOG_LEVELS
from gpuwatchd.policy.actions.spec import ActionSpec

__all__ = [
    "ACTIONS",
    "LADDER_ACTIONS",
    "LADDER_MODES",
    "LOG_LEVELS",
    "MODULES",
    "ActionSpec",
    "public_params",
]

MODULES: Final[tuple[ModuleType, ...]] = (
    log,
    set_knob,
    tune_loader,
    lower_parallelism,
    raise_parallelism,
    place_on_idle_gpu,
    cordon_gpu,
    uncordon_gpu,
    drain_node,
    restart_worker,
    restart_study,
    requeue_task,
    notify,
    exec,
)
"""The action modules, one per action (each has ``SPEC``); the registry is built from them."""

ACTIONS: Final[Mapping[str, ActionSpec]] = MappingProxyType({m.SPEC.name: m.SPEC for m in MODULES})
"""Every action a policy's ``do:`` may name, by name."""

LADDER_ACTIONS: Final = tuple(name for name, spec in ACTIONS.items() if spec.moves_ladder)
"""Actions that move a managed job's parallelism ladder (``params["to"]``)."""


def public_params(action: str, params: Mapping[str, object]) -> dict[str, object]:
    """``params`` of an ``action`` decision as logs, the journal and ``status`` show them
    (the action's ``public``, e.g. a ``notify`` action's URLs cut to their scheme)."""
    spec = ACTIONS.get(action)
    if spec is None or spec.public is None:
        return dict(params)
    return spec.public(params)
