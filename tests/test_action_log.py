"""The ``log`` action (gpuwatchd/policy/actions/log.py): one decision per firing for the
subjects not cooling down; logged, nothing carried out."""

from __future__ import annotations

from action_fakes import NOW, carry, finding, firing, gpu_group
from gpuwatchd.policy.actions import log


def test_log_names_the_subjects_not_cooling_down_and_is_logged_at_once() -> None:
    earlier, _ = firing("log: {level: warning}")
    cooling = earlier.decision("log", {"subjects": ["gpu:GPU-0000"]}, [finding(gpu_index=0)])
    fired, params = firing("log: {level: warning}", decided=(cooling,))
    groups = [gpu_group(0), gpu_group(1, finding(gpu_index=1, message="GPU 1 idle"))]

    (decision,) = log.decide(fired, params, groups)

    assert decision.params == {
        "message": "GPU idle; GPU 1 idle",  # the firing's findings, all of them
        "level": "warning",
        "subjects": ["gpu:GPU-0001"],
    }
    assert (decision.gpu_uuid, decision.timestamp_s) == (None, NOW)  # two GPUs: none named
    record = carry(decision)
    assert (record.outcome, record.detail) == ("logged", "")


def test_log_decides_nothing_when_every_subject_cools_down() -> None:
    earlier, _ = firing("log: {message: idle}")
    cooling = earlier.decision("log", {"subjects": ["gpu:GPU-0000"]}, [finding(gpu_index=0)])
    fired, params = firing("log: {message: idle}", decided=(cooling,))
    assert log.decide(fired, params, [gpu_group(0)]) == []
