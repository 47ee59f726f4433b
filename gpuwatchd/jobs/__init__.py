"""Managed jobs: the one home of a job's workers, their processes, crashes and trials.

:class:`Supervisor` (:mod:`.supervisor`) runs each job's worker slots (:mod:`.worker`:
the state and exit tables; :mod:`.launch`/:mod:`.unit_launch`: the process or unit). It
calls nothing back: a death is a :class:`~.records.WorkerCrash` event, written into the
crash ledger (:mod:`.ledger`, the one crash memory) and left in its outbox for the
daemon's tick to take. Its collaborators handle what a death leaves: :mod:`.crashes` (the
event for the tick's policies), :mod:`.actions` (the managed-job actions),
:mod:`.attribution` (which trials a worker held), :mod:`.orphans` (no trial left
RUNNING), :mod:`.storage`, :mod:`.study_setup` and :mod:`.study` (the daemon's only
importers of Optuna, inside their functions). Config:
``jobs:`` (:class:`gpuwatchd.config.JobConfig`). Behaviour: docs/managed-jobs.md and
docs/supervisor-internals.md.

The package imports nothing itself (``gpuwatchd.config`` reads :mod:`.storage` and
:mod:`.transient_unit`): import what you use from its modules.
"""
