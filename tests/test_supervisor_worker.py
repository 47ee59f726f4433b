"""The worker exit-transition table (gpuwatchd.jobs.worker), every phase x event
pair, without processes: each row is checked against a reference written the way the
supervisor's rules read in docs/supervisor-internals.md, and against the invariants a
user of ``gpuwatchctl jobs`` relies on."""

from __future__ import annotations

import itertools

import pytest

from gpuwatchd.jobs.worker import (
    EXIT_LINE_NOTE,
    TABLE,
    Action,
    Event,
    Intent,
    Phase,
    Step,
    event_of,
    is_intentional,
    phase_of,
    transition,
)

A = Action
INTENTS: tuple[Intent | None, ...] = (None, "drain", "kill", "restart")
PAIRS = list(itertools.product(Phase, Event))


def _intent(phase: Phase) -> Intent | None:
    for intent, leaving in itertools.product(INTENTS, (False, True)):
        if phase_of(intent, leaving) is phase:
            return intent
    raise AssertionError(phase)


def _leaving(phase: Phase) -> bool:
    return phase.name.endswith("_LEAVING")


def _reference(phase: Phase, event: Event) -> Step:
    """The rules, one at a time, as the supervisor documents them."""
    intent, leaving = _intent(phase), _leaving(phase)
    shutdown = event.name.endswith("_SHUTDOWN")
    by_hook = event.name.startswith("EXITED_CLEAN_BY_HOOK")
    if event.name.startswith("EXITED"):  # a clean exit is never a crash, whoever asked
        if leaving:
            return Step(None, (A.REMOVE_SLOT, A.PERSIST), None)
        if intent == "restart" and not shutdown:
            return Step(None, (A.LOG_EXITED, A.LAUNCH), None)
        note = {
            None: EXIT_LINE_NOTE if by_hook else "exited with status 0",
            "drain": "drained",
            "kill": "stopped by gpuwatchd",
            "restart": "stopped by gpuwatchd",
        }[intent]
        return Step("stopped", (A.LOG_EXITED, A.PERSIST), note)
    actions = [A.LOG_CRASHED]
    state: str | None = None
    note: str | None = None
    if leaving:
        actions.append(A.REMOVE_SLOT)
    elif intent in ("kill", "drain"):
        state, note = "stopped", "stopped by gpuwatchd"
    elif intent == "restart":
        state = "stopping"
    else:
        actions.append(A.APPLY_RESTART_POLICY)
    actions += [A.PERSIST, A.EMIT_CRASH]
    if intent == "restart" and not leaving:
        actions.append(A.MARK_STOPPED if shutdown else A.LAUNCH)
    elif intent is None and not leaving:
        actions.append(A.SCHEDULE_BACKOFF)
    return Step(state, tuple(actions), note)


def test_the_table_has_exactly_one_row_per_phase_and_event() -> None:
    assert set(TABLE) == set(PAIRS)
    assert len(TABLE) == len(Phase) * len(Event) == 48


@pytest.mark.parametrize(("phase", "event"), PAIRS, ids=lambda x: x.name)
def test_each_row_follows_the_rules(phase: Phase, event: Event) -> None:
    assert transition(phase, event) == _reference(phase, event)


@pytest.mark.parametrize(("phase", "event"), PAIRS, ids=lambda x: x.name)
def test_each_row_keeps_the_invariants(phase: Phase, event: Event) -> None:
    step = transition(phase, event)
    acts = step.actions
    assert len(set(acts)) == len(acts), "no action twice"
    crashed = event.name.startswith("CRASHED")
    assert (A.EMIT_CRASH in acts) == crashed == (A.LOG_CRASHED in acts)
    if crashed:
        # workers.json is written before the crash event: a daemon crash must not repeat it
        assert acts.index(A.LOG_CRASHED) < acts.index(A.PERSIST) < acts.index(A.EMIT_CRASH)
    assert (A.REMOVE_SLOT in acts) == _leaving(phase)
    if A.REMOVE_SLOT in acts:  # a removed slot is never started again
        assert not {A.LAUNCH, A.SCHEDULE_BACKOFF, A.APPLY_RESTART_POLICY} & set(acts)
    if event.name.endswith("_SHUTDOWN"):  # nothing starts while the supervisor stops
        assert A.LAUNCH not in acts
    # only a crash nobody asked for meets the restart policy (backoff, budget, crash loop)
    assert (A.APPLY_RESTART_POLICY in acts) == (crashed and phase is Phase.RUNNING)
    if A.SCHEDULE_BACKOFF in acts:
        assert acts.index(A.APPLY_RESTART_POLICY) < acts.index(A.SCHEDULE_BACKOFF)
    assert (A.LAUNCH in acts) == (
        phase is Phase.RESTARTING and not event.name.endswith("_SHUTDOWN")
    )
    assert step.new_state in (None, "stopped", "stopping")
    assert A.PERSIST in acts or A.LAUNCH in acts  # LAUNCH writes workers.json itself


def test_phase_of_covers_every_intent_and_removal() -> None:
    phases = {phase_of(i, leaving) for i in INTENTS for leaving in (False, True)}
    assert phases == set(Phase)


@pytest.mark.parametrize("shutting_down", [False, True])
def test_event_of_reads_the_status(shutting_down: bool) -> None:
    suffix = "_SHUTDOWN" if shutting_down else ""

    def ev(rc: int | None, exit_line: bool = False) -> str:
        return event_of(rc, exit_line=exit_line, shutting_down=shutting_down).name

    assert ev(0) == "EXITED_CLEAN" + suffix
    assert ev(0, exit_line=True) == "EXITED_CLEAN" + suffix  # a status read wins
    assert ev(None, exit_line=True) == "EXITED_CLEAN_BY_HOOK" + suffix
    assert ev(3, exit_line=True) == "CRASHED" + suffix
    for rc in (1, 2, -9, -15, None):  # a status, a signal, or an adopted worker's unknown end
        assert ev(rc) == "CRASHED" + suffix
    # Result=oom-kill: OOMPolicy=stop's SIGTERM may end the main process with status 0.
    oom = event_of(0, exit_line=False, shutting_down=shutting_down, oom_killed=True)
    assert oom.name == "CRASHED" + suffix


def test_only_gpuwatchd_stopping_a_worker_is_intentional() -> None:
    intentional = {p for p in Phase if is_intentional(p)}
    assert intentional == {
        phase_of(i, leaving) for i in ("kill", "restart") for leaving in (False, True)
    }


def test_the_state_table_is_the_only_writer_of_worker_state() -> None:
    """Every change of a worker slot's state goes through ``Worker.to`` and its
    table (issue 20): assigning ``state`` raises, an unlisted change raises, and no
    module of the package assigns ``.state`` (the grep a reviewer would run)."""
    import ast

    from conftest import REPO
    from gpuwatchd.errors import SupervisorError
    from gpuwatchd.jobs.worker import STATE_TRANSITIONS, Worker

    slot = Worker(number=0)
    with pytest.raises(AttributeError, match="only through"):
        slot.state = "running"  # type: ignore[misc]
    slot.to("running", "")
    slot.to("draining")
    with pytest.raises(SupervisorError, match="no transition draining -> failed"):
        slot.to("failed")
    assert slot.state == "draining"
    assert set(STATE_TRANSITIONS) == {
        "running",
        "backoff",
        "draining",
        "stopping",
        "stopped",
        "failed",
    }

    def state_targets(tree: ast.AST) -> list[int]:
        lines = []
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets += target.elts
                elif isinstance(target, ast.Starred):
                    targets.append(target.value)
                elif isinstance(target, ast.Attribute) and target.attr == "state":
                    lines.append(target.lineno)
        return lines

    offenders = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "gpuwatchd").rglob("*.py"))
        for n in state_targets(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert offenders == []


def test_the_exit_line_counts_only_for_the_launchs_own_process() -> None:
    """The hook's exit line names the launch and the pid that wrote it: a child that
    inherited the launch id (a spawned DDP rank, a DataLoader process that attached) does
    not make the launch's main process clean; a traceback after it undoes it."""
    from gpuwatchd.control.protocol import exit_line_of, worker_exit_line

    line = worker_exit_line("hpo.0.abc", 4242)
    assert line == "gpuwatchd-hook: worker exit hpo.0.abc pid 4242 clean\n"
    assert exit_line_of("trial 3 done\n" + line, "hpo.0.abc", 4242)
    assert exit_line_of(line + "Exception ignored in: <function _after_fork>\n", "hpo.0.abc", 4242)
    assert not exit_line_of(line, "hpo.0.abc", 4343)  # a child's line
    assert not exit_line_of(line, "hpo.0.other", 4242)  # another launch's
    assert not exit_line_of(line + "Traceback (most recent call last):\n", "hpo.0.abc", 4242)
    assert not exit_line_of(line, None, 4242) and not exit_line_of(line, "hpo.0.abc", None)


@pytest.mark.parametrize(
    ("start", "to"),
    [
        ("failed", "failed"),  # job start while the environment is still broken
        ("stopping", "failed"),  # restart_worker's relaunch could not exec
        ("stopping", "backoff"),
    ],
)
def test_a_failed_start_from_any_state_it_can_happen_in_is_in_the_table(
    start: str, to: str
) -> None:
    """Review findings: a start that cannot exec goes through the restart policy from the
    state the slot had; the table must allow it (else the slot is stuck, its task dead)."""
    from gpuwatchd.jobs.worker import STATE_TRANSITIONS

    assert to in STATE_TRANSITIONS[start]  # type: ignore[index]
