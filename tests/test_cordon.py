"""Cordoned GPUs (gpuwatchd.cordon): the store survives a restart, the actions' contract."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gpuwatchd.cordon import Cordon, CordonActions, Cordons
from gpuwatchd.errors import ActionRefused
from gpuwatchd.jobs.records import WorkerInfo
from gpuwatchd.logs import get_logger
from gpuwatchd.model import Decision, GpuSample
from gpuwatchd.policy.actions import uncordon_gpu
from gpuwatchd.policy.actions.spec import Effects

LOG = get_logger("test.cordon")


def gpu(index: int) -> GpuSample:
    return GpuSample(uuid=f"GPU-{index:04d}", index=index, name="H100", timestamp_s=0.0)


class Mover:
    """A supervisor with two workers on GPU 0 and one on GPU 1."""

    def __init__(self) -> None:
        self.restarted: list[tuple[str, int]] = []
        self.cordoned: list[frozenset[int]] = []
        """What the cordon actions told it, in order (each GPU inventory, each change)."""

    def workers(self, job: str | None = None) -> list[WorkerInfo]:
        return [
            WorkerInfo("hpo", 0, 100, 0, "running", 0, None, 0.0),
            WorkerInfo("hpo", 1, 101, 1, "running", 0, None, 0.0),
            WorkerInfo("hpo", 2, None, 0, "failed", 0, None, None),
            WorkerInfo("hpo", 3, 103, 0, "backoff", 0, None, None),
        ]

    async def restart_worker(self, job: str, worker: int, gpu: int | None = None) -> None:
        # the supervisor must know the GPU is cordoned before it places the worker anew
        assert self.cordoned and 0 in self.cordoned[-1]
        self.restarted.append((job, worker))

    def note_cordoned(self, indexes: frozenset[int]) -> None:
        self.cordoned.append(indexes)


def test_cordons_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "cordons.json"
    store = Cordons(path, LOG)
    assert store.add(Cordon("GPU-0001", 1, 5.0, "policy gpu-hardware-fault", "Xid 79"))
    assert not store.add(Cordon("GPU-0001", 1, 6.0, "operator uid 0"))  # kept, not replaced
    again = Cordons(path, LOG)
    again.load()
    (cordon,) = again.all()
    assert (cordon.uuid, cordon.index, cordon.by, cordon.reason) == (
        "GPU-0001",
        1,
        "policy gpu-hardware-fault",
        "Xid 79",
    )
    # matched by UUID: the GPU renumbered to index 3 is still the cordoned one
    assert again.indexes([gpu(0), GpuSample("GPU-0001", 3, "H100", 0.0)]) == {3}
    assert again.indexes([]) == {1}


def test_a_broken_file_restores_nothing_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "cordons.json"
    path.write_text("{not json", encoding="utf-8")
    store = Cordons(path, LOG)
    store.load()
    assert store.all() == []
    path.write_text(json.dumps({"cordons": [{"uuid": 1}]}), encoding="utf-8")
    store.load()
    assert store.all() == []


def test_cordon_moves_running_and_waiting_workers_off_the_gpu() -> None:
    mover = Mover()
    actions = CordonActions(Cordons(None, LOG), mover, lambda: 1.0, LOG)
    actions.note_gpus((gpu(0), gpu(1)))
    detail = asyncio.run(actions.cordon(0, None, "policy p", "Xid 48"))
    assert mover.restarted == [("hpo", 0), ("hpo", 3)]
    assert detail == (
        "GPU 0 cordoned; relaunched elsewhere: hpo worker 0, hpo worker 3 (their trials retried)"
    )
    assert actions.cordons.all()[0].uuid == "GPU-0000"
    assert actions.is_cordoned(0) and not actions.is_cordoned(1)
    assert mover.cordoned == [frozenset(), frozenset({0})]  # the inventory, then the cordon
    quiet = CordonActions(Cordons(None, LOG), Mover(), lambda: 1.0, LOG)
    assert asyncio.run(quiet.cordon(1, None, "operator uid 0", "", relaunch=False)) == (
        "GPU 1 cordoned"
    )


def test_a_policy_lifts_only_a_policys_cordon() -> None:
    actions = CordonActions(Cordons(None, LOG), None, lambda: 1.0, LOG)
    actions.note_gpus((gpu(0), gpu(1)))
    asyncio.run(actions.cordon(0, None, "operator uid 0", "by hand"))
    asyncio.run(actions.cordon(1, None, "policy gpu-hardware-fault", "remap pending"))

    def uncordon(index: int) -> Decision:
        uuid = f"GPU-{index:04d}"
        return Decision("gpu-recovered", "uncordon_gpu", {"gpu_index": index}, 2.0, (), None, uuid)

    def carry_out(decision: Decision) -> str:
        outcome, detail = asyncio.run(uncordon_gpu.carry_out(decision, Effects(gpus=actions)))
        assert outcome == "applied"
        return detail

    with pytest.raises(ActionRefused, match="only an operator lifts it"):
        carry_out(uncordon(0))
    assert carry_out(uncordon(1)).startswith("GPU 1 uncordoned")
    assert carry_out(uncordon(1)) == "GPU 1 was not cordoned; nothing to lift"
    assert actions.uncordon(0, None, by="operator uid 0", operator=True).startswith("GPU 0")


class NoCommander:
    async def send_command(self, *args: object, **kwargs: object) -> list[object]:
        raise AssertionError("no job command expected")


def test_actuator_carries_out_cordon_decisions_and_refuses_placement_there() -> None:
    from gpuwatchd.actuators import Actuator

    class Managed:
        def __init__(self) -> None:
            self.placed: list[tuple[str, int]] = []

        async def place_next(self, job: str, gpu_index: int) -> str:
            self.placed.append((job, gpu_index))
            return "placed"

    async def scenario() -> list[tuple[str, str]]:
        actions = CordonActions(Cordons(None, LOG), None, lambda: 1.0, LOG)
        actions.note_gpus((gpu(0),))
        actuator = Actuator(
            NoCommander(),  # type: ignore[arg-type]
            LOG,
            lambda: 1.0,
            managed=Managed(),  # type: ignore[arg-type]
            gpus=actions,
        )
        cordon = Decision(
            "gpu-fault", "cordon_gpu", {"gpu_index": 0, "relaunch": True}, 1.0, (), None, "GPU-0000"
        )
        place = Decision(
            "idle", "place_on_idle_gpu", {"job": "hpo", "gpu_index": 0}, 1.0, (), "hpo"
        )
        dry = Decision("gpu-fault", "cordon_gpu", {"gpu_index": 0}, 1.0, (), None, "GPU-0000", True)
        records = [actuator.apply(cordon), actuator.apply(place), actuator.apply(dry)]
        for _ in range(20):
            await asyncio.sleep(0)
        await actuator.close()
        return [(r.outcome, r.detail) for r in records]

    outcomes = asyncio.run(scenario())
    assert outcomes[0] == ("applied", "GPU 0 cordoned")
    assert outcomes[1] == ("refused", "GPU 0 is cordoned; no worker is placed on it")
    assert outcomes[2][0] == "dry-run"
    no_store = Actuator(NoCommander(), LOG, lambda: 1.0)  # type: ignore[arg-type]
    record = no_store.plan(Decision("p", "uncordon_gpu", {"gpu_index": 0}, 1.0, ()))
    assert (record.outcome, record.detail) == ("failed", "no GPU cordons here")


def test_an_operator_names_the_gpu_as_status_shows_it() -> None:
    # cordoned as GPU-0001 at index 1; now index 1 is another GPU and GPU-0001 is gone
    inventory = [gpu(0), GpuSample("GPU-9999", 1, "H100", 0.0)]
    store = Cordons(None, LOG)
    store.add(Cordon("GPU-0001", 1, 1.0, "policy p"))
    assert [r["index"] for r in store.report(inventory)] == [1]
    actions = CordonActions(store, None, lambda: 2.0, LOG)
    actions.note_gpus(inventory)
    assert actions.is_cordoned(1)
    assert asyncio.run(actions.cordon(1, None, "operator uid 0", "")) == (
        "GPU 1 was cordoned already"
    )
    assert actions.uncordon(1, None, by="operator uid 0", operator=True).startswith("GPU 1")
    assert store.all() == []
    # renumbered: GPU-0001 is now index 3, and status and the operator say 3
    store.add(Cordon("GPU-0001", 1, 1.0, "policy p"))
    moved = [gpu(0), GpuSample("GPU-0001", 3, "H100", 0.0)]
    assert [r["index"] for r in store.report(moved)] == [3]
    renumbered = CordonActions(store, None, lambda: 2.0, LOG)
    renumbered.note_gpus(moved)
    with pytest.raises(ActionRefused):
        renumbered.uncordon(1, None, by="operator uid 0", operator=True)
    assert renumbered.uncordon(3, None, by="operator uid 0", operator=True).startswith("GPU 3")


def test_a_cordon_interrupted_by_a_kill_is_carried_out_at_the_next_start(tmp_path: Path) -> None:
    from gpuwatchd.cordon import resume_cordons
    from gpuwatchd.journal import Journal

    path = tmp_path / "journal.sqlite3"
    cordon = Decision(
        "gpu-hardware-xid", "cordon_gpu", {"gpu_index": 1}, 10.0, (), None, "GPU-0001"
    )
    dry = Decision(
        "gpu-hardware-xid", "cordon_gpu", {"gpu_index": 0}, 10.0, (), None, "GPU-0000", True
    )
    with Journal.open(path) as journal:
        journal.record_decision(cordon)  # journaled pending, then the daemon was killed
        journal.record_decision(dry)
    with Journal.open(path) as journal:
        journal.recover(20.0)
        actions = CordonActions(Cordons(None, LOG), None, lambda: 20.0, LOG)
        actions.note_gpus((gpu(0), gpu(1)))
        assert asyncio.run(resume_cordons(journal, actions, 20.0, LOG)) == 1
        assert [c.index for c in actions.cordons.all()] == [1]
        entries = {e.decision.gpu_uuid: e for e in journal.journaled_since(0.0)}
        assert entries["GPU-0001"].outcome == "applied"
        assert entries["GPU-0000"].outcome == "unknown"
        assert asyncio.run(resume_cordons(journal, actions, 21.0, LOG)) == 0  # once
