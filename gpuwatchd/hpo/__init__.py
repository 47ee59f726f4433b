"""Optuna HPO under managed jobs: the crash ledger, trial attribution, crash recovery, jobs.

See docs/managed-jobs.md for what a user sees; the daemon wires these together.
"""
