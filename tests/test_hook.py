"""Tests of gpuwatchd.hook: a real Unix socket, a real PyTorch DataLoader, real subprocesses.

The daemon side is a small stand-in (``FakeDaemon``) that listens on a real Unix
socket, records every line the hook sends, answers ``hello``/``report`` with ok
replies and can send ``set_knob``/``drain``/``stop`` like gpuwatchd does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from gpuwatchd.errors import KnobError
from gpuwatchd.hook import (
    Watch,
    attach,
    batch_samples,
    cuda_devices_from_env,
    cuda_memory,
    find_dataloaders,
    is_cuda_oom,
    parse_knobs,
    slice_batch,
)

REPO = Path(__file__).resolve().parents[1]
Message = dict[str, Any]


class FakeDaemon:
    """A daemon stand-in on a real Unix socket (one reader thread per connection)."""

    def __init__(self, path: str, *, reply: bool = True) -> None:
        self.path = path
        self.reply = reply
        self.messages: list[tuple[int, float, Message]] = []
        self.closed: set[int] = set()
        self._cond = threading.Condition()
        self._conns: list[socket.socket] = []
        self._send_lock = threading.Lock()
        self._running = True
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(8)
        self._listener.settimeout(0.05)
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    def _accept(self) -> None:
        while self._running:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._cond:
                index = len(self._conns)
                self._conns.append(conn)
            threading.Thread(target=self._read, args=(index, conn), daemon=True).start()

    def _read(self, index: int, conn: socket.socket) -> None:
        buffer = b""
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._cond:
                    self.closed.add(index)
                    self._cond.notify_all()
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                with self._cond:
                    self.messages.append((index, time.monotonic(), message))
                    self._cond.notify_all()
                if self.reply and message.get("op") in ("hello", "report"):
                    # the job may have closed its end already; EOF comes next
                    with contextlib.suppress(OSError):
                        self.send({"id": message["id"], "ok": True, "result": {}}, index)

    def send(self, message: Message, index: int = -1) -> None:
        """Send one line on connection ``index`` (default: the latest)."""
        with self._cond:
            conn = self._conns[index]
        with self._send_lock:
            conn.sendall(json.dumps(message).encode() + b"\n")

    def send_raw(self, data: bytes, index: int = -1) -> None:
        with self._cond:
            conn = self._conns[index]
        with self._send_lock:
            conn.sendall(data)

    def wait_for(self, match: Callable[[Message], bool], timeout_s: float = 3.0) -> Message:
        """The first message (in arrival order) for which ``match`` holds; fails after timeout."""
        found: list[Message] = []

        def ready() -> bool:
            found[:] = [m for _, _, m in self.messages if match(m)][:1]
            return bool(found)

        with self._cond:
            if not self._cond.wait_for(ready, timeout_s):
                seen = [m for _, _, m in self.messages]
                raise AssertionError(f"no matching message within {timeout_s} s; got {seen}")
        return found[0]

    def wait_closed(self, index: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: index in self.closed, timeout_s)

    def requests(self, op: str) -> list[Message]:
        with self._cond:
            return [m for _, _, m in self.messages if m.get("op") == op]

    def arrivals(self, op: str) -> list[float]:
        with self._cond:
            return [t for _, t, m in self.messages if m.get("op") == op]

    def reply_to(self, request_id: str, timeout_s: float = 3.0) -> Message:
        return self.wait_for(lambda m: "ok" in m and m.get("id") == request_id, timeout_s)

    def has_reply(self, request_id: str) -> bool:
        with self._cond:
            return any("ok" in m and m.get("id") == request_id for _, _, m in self.messages)

    def stop(self) -> None:
        """Go away like a killed daemon: close the listener and every connection (idempotent)."""
        if not self._running:
            return
        self._running = False
        self._accepter.join(1.0)
        self._listener.close()
        with self._cond:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


@pytest.fixture
def sock_path() -> Iterator[str]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    directory = tempfile.mkdtemp(prefix="gwhook-", dir="/tmp")
    yield os.path.join(directory, "control.sock")
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def daemon(sock_path: str) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(sock_path)
    yield fake
    fake.stop()


def set_knob(request_id: str, knob: str, value: object) -> Message:
    return {"id": request_id, "op": "set_knob", "knob": knob, "value": value}


def list_factory(batches: int = 4) -> Callable[[dict[str, Any]], list[tuple[list[int], int]]]:
    """A loader factory without torch: ``batches`` batches of 8 samples tagged with the knobs."""

    def factory(knobs: dict[str, Any]) -> list[tuple[list[int], int]]:
        return [([0] * 8, knobs.get("num_workers", 0)) for _ in range(batches)]

    return factory


def wait_until(condition: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


class PidDataset(Dataset[torch.Tensor]):
    """Each sample is the pid of the process that loaded it (a worker or the main process)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(os.getpid())


def pid_loader(knobs: dict[str, Any]) -> DataLoader[torch.Tensor]:
    return DataLoader(
        PidDataset(),
        batch_size=4,
        num_workers=knobs["num_workers"],
        persistent_workers=bool(knobs.get("persistent_workers", False)),
    )


# -- hello ------------------------------------------------------------------------------


def test_hello_carries_pid_knobs_with_bounds_devices_and_trial(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1, GPU-8f6e2c1a")
    trial = SimpleNamespace(
        number=7,
        params={"lr": 0.01, "optimizer": "adam"},
        study=SimpleNamespace(study_name="criteria"),
    )
    knobs = {
        "num_workers": 4,
        "prefetch_factor": 2,
        "persistent_workers": False,
        "grad_accum": {"value": 2, "min": 1, "max": 8},
    }
    with attach(job="digits", knobs=knobs, trial=trial, socket=daemon.path) as watch:
        assert watch.connected  # entering waits for the first connect attempt
        hello = daemon.wait_for(lambda m: m.get("op") == "hello")
        time.sleep(1.1)  # two report periods without a single step
        assert daemon.requests("report") == []
    assert hello["role"] == "job"
    assert hello["job"] == "digits"
    assert hello["pid"] == os.getpid()
    assert hello["cuda_devices"] == ["1", "GPU-8f6e2c1a"]
    assert hello["knobs"] == {
        "num_workers": {"value": 4, "min": 0, "max": 64},
        "prefetch_factor": {"value": 2, "min": 1, "max": 64},
        "persistent_workers": {"value": False, "min": None, "max": None},
        "grad_accum": {"value": 2, "min": 1, "max": 8},
    }
    assert hello["study"] == "criteria"
    assert hello["trial"] == {"number": 7, "params": {"lr": 0.01, "optimizer": "adam"}}


def test_a_knob_the_daemon_drops_is_warned_once_and_left_out_of_reports(
    sock_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon attaches the job with the knobs it accepts and names the ones it
    dropped in the hello reply (``dropped_knobs``, docs/protocol.md): the hook says so in
    one warning, sends no second hello, leaves the knob out of its reports (the daemon
    would refuse them) and refuses a ``set_knob`` of it."""
    daemon = FakeDaemon(sock_path, reply=False)
    knobs = {"num_workers": 2, "lr_scale": 2.0}
    try:
        with (
            caplog.at_level(logging.WARNING, logger="gpuwatchd.hook"),
            attach(job="digits", knobs=knobs, socket=daemon.path) as watch,
        ):
            first = daemon.wait_for(lambda m: m.get("op") == "hello")
            dropped = [{"knob": "lr_scale", "reason": "knob 'lr_scale' has min > max"}]
            daemon.send({"id": first["id"], "ok": True, "result": {"dropped_knobs": dropped}})
            run_steps(watch, 0.7, wait_s=0.001, compute_s=0.001)
            report = daemon.wait_for(lambda m: m.get("op") == "report")
            daemon.send({"id": "d-1", "op": "set_knob", "knob": "lr_scale", "value": 1.0})
            refused = daemon.reply_to("d-1")
    finally:
        daemon.stop()
    assert daemon.requests("hello") == [first]
    assert report["report"]["knobs"] == {"num_workers": 2}
    assert refused["error"]["code"] == "bad_request"
    assert "declares num_workers" in refused["error"]["message"]
    warnings = [r.getMessage() for r in caplog.records if "dropped knob" in r.getMessage()]
    assert warnings == [
        "gpuwatchd: the daemon dropped knob 'lr_scale' (knob 'lr_scale' has min > max); "
        "attached without it"
    ]


def test_job_and_socket_come_from_the_environment(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWATCHD_JOB", "criteria-hpo")
    monkeypatch.setenv("GPUWATCHD_SOCKET", daemon.path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with attach() as watch:
        hello = daemon.wait_for(lambda m: m.get("op") == "hello")
        assert watch.socket_path == daemon.path
    assert hello["job"] == "criteria-hpo"
    assert hello["cuda_devices"] == []
    assert hello["knobs"] == {}
    assert hello["study"] is None and hello["trial"] is None


# -- reports ----------------------------------------------------------------------------


class SlowBatches:
    """An iterable whose ``next()`` takes ``wait_s`` (a loader starving the step)."""

    def __init__(self, wait_s: float, batches: int) -> None:
        self.wait_s = wait_s
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[list[int], list[int]]]:
        for _ in range(self.batches):
            time.sleep(self.wait_s)
            yield [0] * 8, [0] * 8


def run_steps(watch: Watch, duration_s: float, wait_s: float, compute_s: float) -> None:
    loader = watch.loader(lambda knobs: SlowBatches(wait_s, 10))
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        for _batch in loader:
            time.sleep(compute_s)


def test_reports_are_aggregated_over_the_period(daemon: FakeDaemon) -> None:
    with attach(job="digits", socket=daemon.path) as watch:
        started = time.monotonic()
        run_steps(watch, 1.6, wait_s=0.004, compute_s=0.004)
        elapsed = time.monotonic() - started
    assert daemon.wait_closed(0, 1.0)  # everything the hook sent has been read
    reports = [m["report"] for m in daemon.requests("report")]
    # default period 0.5 s: about 3 in 1.6 s plus the last one flushed on exit (fewer
    # when a loaded machine starves the thread; never more: that is the rate limit)
    assert 1 <= len(reports) <= 5, reports
    steps = [r["steps"] for r in reports]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert steps[-1] == watch.steps  # the last report, flushed when the block ended
    assert watch.steps > len(reports) * 10  # many steps per report: aggregated
    for report in reports:
        assert set(report) == {
            "steps",
            "epoch",
            "step_time_s",
            "data_wait_s",
            "data_wait_fraction",
            "samples_per_s",
            "oom_events",
            "cuda_memory",
        }
        assert report["oom_events"] == 0
        assert report["cuda_memory"] == []  # a CPU job: CUDA never initialised
        assert 0.006 < report["step_time_s"] < 0.5  # two sleeps of 4 ms, stretched under load
        assert 0.15 < report["data_wait_fraction"] < 0.85  # about half the step is waiting
        assert report["data_wait_s"] == pytest.approx(
            report["data_wait_fraction"] * report["step_time_s"], rel=1e-6
        )
        assert report["samples_per_s"] == pytest.approx(8 / report["step_time_s"], rel=1e-6)
    assert reports[-1]["epoch"] == watch.epoch > 0
    assert elapsed >= 1.6


def test_reports_are_limited_to_four_per_second(daemon: FakeDaemon) -> None:
    with attach(job="digits", socket=daemon.path, report_interval_s=0.01) as watch:
        run_steps(watch, 2.0, wait_s=0.001, compute_s=0.001)
        count_while_running = len(daemon.requests("report"))
    # 2 s at most 4 per second (the first one after 0.25 s), never one per step
    assert 1 <= count_while_running <= 9, count_while_running


# -- set_knob ---------------------------------------------------------------------------


def test_a_look_at_one_batch_is_not_an_epoch(daemon: FakeDaemon) -> None:
    """``next(iter(train_loader))`` (the PyTorch DDP tutorial's look at a batch before
    training) neither counts as an epoch nor ends one."""
    ended: list[int] = []
    with attach(job="j", knobs={"num_workers": 0}, socket=daemon.path) as watch:
        loader = watch.loader(list_factory(batches=4))
        sample, _ = next(iter(loader))
        assert len(sample) == 8 and watch.epoch == 0
        for _epoch in range(2):
            for _batch in loader:
                pass
            ended.append(watch.epoch)
        peek_mid_training = next(iter(loader))
        assert peek_mid_training is not None
        for _batch in loader:
            pass
        assert watch.epoch == 2  # epochs 0, 1, 2: the two looks counted for none
        assert watch.steps == 12
    assert ended == [0, 1]


def test_set_knob_is_applied_at_the_next_epoch_with_a_real_dataloader(
    daemon: FakeDaemon,
) -> None:
    main_pid = os.getpid()
    with attach(job="digits", knobs={"num_workers": 2}, socket=daemon.path) as watch:
        loader = watch.loader(pid_loader)
        daemon.wait_for(lambda m: m.get("op") == "hello")
        epoch0: list[int] = []
        for index, pids in enumerate(loader):
            epoch0 += pids.tolist()
            if index == 0:
                daemon.send(set_knob("d-1", "num_workers", 0))
                assert wait_until(lambda: watch.pending_knobs == {"num_workers": 0})
                time.sleep(0.3)
                assert not daemon.has_reply("d-1")  # not applied yet: no ack
        assert watch.knobs == {"num_workers": 2}
        assert not daemon.has_reply("d-1")
        epoch1_started = time.monotonic()
        epoch1 = [pid for pids in loader for pid in pids.tolist()]
        reply = daemon.reply_to("d-1")
        assert watch.knobs == {"num_workers": 0}
        assert watch.epoch == 1
    assert len(epoch0) == len(epoch1) == 16
    assert main_pid not in epoch0  # two worker processes loaded epoch 0
    assert set(epoch1) == {main_pid}  # epoch 1 was loaded in the main process
    assert reply == {
        "id": "d-1",
        "ok": True,
        "result": {"knob": "num_workers", "value": 0, "previous": 2, "applied": True},
    }
    arrived = next(t for _, t, m in daemon.messages if m.get("id") == "d-1")
    assert arrived >= epoch1_started
    assert loader.rebuilds == 1
    assert isinstance(loader.loader, DataLoader) and loader.loader.num_workers == 0


@pytest.mark.parametrize(
    ("knob", "value", "reason"),
    [
        ("num_workers", 65, "above its maximum 64"),
        ("num_workers", -1, "below its minimum 0"),
        ("prefetch_factor", 0, "below its minimum 1"),
        ("num_workers", 2.5, "takes an integer"),
        ("num_workers", True, "takes a number"),
        ("num_workers", "4", "takes a number"),
        ("persistent_workers", 1, "takes true or false"),
        ("learning_rate", 0.1, "unknown knob 'learning_rate'"),
    ],
)
def test_bad_set_knob_is_refused_at_once_with_a_reason(
    daemon: FakeDaemon, knob: str, value: object, reason: str
) -> None:
    knobs = {"num_workers": 4, "prefetch_factor": 2, "persistent_workers": False}
    with attach(job="digits", knobs=knobs, socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send(set_knob("d-9", knob, value))
        reply = daemon.reply_to("d-9", timeout_s=1.0)  # no epoch needed
        assert watch.pending_knobs == {}
        assert watch.knobs == knobs
    assert reply["ok"] is False
    assert reply["error"]["code"] == "bad_request"
    assert reason in reply["error"]["message"]


def test_unknown_ops_and_bad_lines_get_answers(daemon: FakeDaemon) -> None:
    with attach(job="digits", knobs={"num_workers": 4}, socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send({"id": "d-1", "op": "reticulate"})
        daemon.send({"id": "d-2", "op": "set_knob", "knob": "num_workers"})
        daemon.send_raw(b"this is not json\n")
        unknown = daemon.reply_to("d-1")
        missing = daemon.reply_to("d-2")
        garbage = daemon.wait_for(lambda m: "ok" in m and m.get("id") is None)
        assert watch.connected  # none of it broke the connection
    assert unknown["error"]["code"] == "unknown_op"
    assert "reticulate" in unknown["error"]["message"]
    assert missing["error"]["code"] == "bad_request" and "value" in missing["error"]["message"]
    assert garbage["ok"] is False and garbage["error"]["code"] == "bad_request"


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("policy host-oversubscribed", "policy host-oversubscribed (num_workers=2)"),
        ("operator", "operator (num_workers=2)"),
        (None, "request 'd-3' (num_workers=2)"),  # a daemon that sends no source
        ("x" * 201, "request 'd-3' (num_workers=2)"),  # too long: ignored
        ("policy a\nb", "request 'd-3' (num_workers=2)"),  # a control character: ignored
    ],
)
def test_a_superseded_change_names_who_superseded_it(
    daemon: FakeDaemon, source: str | None, named: str
) -> None:
    with attach(job="digits", knobs={"num_workers": 4}, socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send(set_knob("d-2", "num_workers", 1))
        assert wait_until(lambda: watch.pending_knobs == {"num_workers": 1})
        newer = set_knob("d-3", "num_workers", 2)
        if source is not None:
            newer["source"] = source
        daemon.send(newer)
        superseded = daemon.reply_to("d-2", timeout_s=1.0)
    assert superseded["error"] == {
        "code": "conflict",
        "message": f"superseded by {named} before it was applied",
    }


def test_set_knob_to_current_value_acks_at_once_and_a_newer_change_supersedes(
    daemon: FakeDaemon,
) -> None:
    with attach(job="digits", knobs={"num_workers": 4}, socket=daemon.path) as watch:
        loader = watch.loader(list_factory())
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send(set_knob("d-1", "num_workers", 4))
        same = daemon.reply_to("d-1", timeout_s=1.0)
        daemon.send(set_knob("d-2", "num_workers", 1))
        assert wait_until(lambda: watch.pending_knobs == {"num_workers": 1})
        daemon.send(set_knob("d-3", "num_workers", 2))
        superseded = daemon.reply_to("d-2", timeout_s=1.0)
        workers_seen = [workers for _, workers in loader]
        applied = daemon.reply_to("d-3")
    assert same["result"] == {"knob": "num_workers", "value": 4, "previous": 4, "applied": True}
    assert superseded["ok"] is False and superseded["error"]["code"] == "conflict"
    assert applied["result"] == {
        "knob": "num_workers",
        "value": 2,
        "previous": 4,
        "applied": True,
    }
    assert workers_seen == [2, 2, 2, 2]
    assert loader.rebuilds == 1


def test_a_failing_rebuild_keeps_the_old_loader_and_refuses_the_change(
    daemon: FakeDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    def factory(knobs: dict[str, Any]) -> list[tuple[list[int], int]]:
        if knobs["num_workers"] == 3:
            raise ValueError("three workers are not allowed here")
        return [([0] * 8, knobs["num_workers"])] * 2

    with attach(job="digits", knobs={"num_workers": 4}, socket=daemon.path) as watch:
        loader = watch.loader(factory)
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send(set_knob("d-1", "num_workers", 3))
        assert wait_until(lambda: watch.pending_knobs == {"num_workers": 3})
        workers_seen = [workers for _, workers in loader]
        reply = daemon.reply_to("d-1")
    assert workers_seen == [4, 4]
    assert watch.knobs == {"num_workers": 4}
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert "three workers are not allowed here" in reply["error"]["message"]
    assert "kept num_workers=4" in reply["error"]["message"]


# -- no daemon, late daemon, restarted daemon -------------------------------------------------


def test_without_a_daemon_training_completes_with_exactly_one_warning(
    sock_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuwatchd.hook")
    with attach(job="digits", knobs={"num_workers": 0}, socket=sock_path) as watch:
        assert not watch.connected
        loader = watch.loader(pid_loader)
        deadline = time.monotonic() + 1.7  # long enough for three connect attempts
        epochs = 0
        while time.monotonic() < deadline:
            assert sum(len(batch) for batch in loader) == 16
            epochs += 1
        exit_started = time.monotonic()
    exit_s = time.monotonic() - exit_started
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    attempts = [r for r in caplog.records if "connect to" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].name == "gpuwatchd.hook"
    assert sock_path in warnings[0].getMessage()
    assert len(attempts) >= 1  # it kept trying, quietly (debug)
    assert watch.steps == epochs * 4
    assert exit_s < 2.0  # prompt (about 0.1 s when the machine is idle)


def test_a_daemon_that_appears_later_gets_the_job(sock_path: str) -> None:
    with attach(job="digits", knobs={"num_workers": 4}, socket=sock_path) as watch:
        assert not watch.connected
        time.sleep(0.3)
        late = FakeDaemon(sock_path)
        try:
            hello = late.wait_for(lambda m: m.get("op") == "hello", timeout_s=3.0)
            assert wait_until(lambda: watch.connected)
            run_steps(watch, 0.6, wait_s=0.001, compute_s=0.001)
            late.wait_for(lambda m: m.get("op") == "report", timeout_s=2.0)
        finally:
            late.stop()
    assert hello["knobs"]["num_workers"]["value"] == 4


def test_after_a_daemon_restart_the_hook_says_hello_again_with_current_knobs(
    sock_path: str,
) -> None:
    first = FakeDaemon(sock_path)
    second: FakeDaemon | None = None
    try:
        with attach(job="digits", knobs={"num_workers": 2}, socket=sock_path) as watch:
            loader = watch.loader(list_factory())
            first.wait_for(lambda m: m.get("op") == "hello")
            first.send(set_knob("d-1", "num_workers", 1))
            assert wait_until(lambda: watch.pending_knobs == {"num_workers": 1})
            assert [w for _, w in loader] == [1] * 4
            first.reply_to("d-1")
            first.send(set_knob("d-2", "num_workers", 5))  # pending when the daemon dies
            assert wait_until(lambda: watch.pending_knobs == {"num_workers": 5})
            first.stop()
            assert wait_until(lambda: not watch.connected, 2.0)
            second = FakeDaemon(sock_path)
            hello = second.wait_for(lambda m: m.get("op") == "hello", timeout_s=3.0)
            assert watch.pending_knobs == {}  # the change died with the daemon that asked
            assert [w for _, w in loader] == [1] * 4
            report = second.wait_for(lambda m: m.get("op") == "report", timeout_s=2.0)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert hello["knobs"]["num_workers"] == {"value": 1, "min": 0, "max": 64}
    assert hello["pid"] == os.getpid()
    assert report["report"]["steps"] == 8


# -- leaving the with block --------------------------------------------------------------------


def test_leaving_the_block_is_fast_and_stops_the_thread(daemon: FakeDaemon) -> None:
    watch = attach(job="digits", socket=daemon.path)
    with watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        run_steps(watch, 0.2, wait_s=0.001, compute_s=0.001)
        exit_started = time.monotonic()
    exit_s = time.monotonic() - exit_started
    assert exit_s < 2.0  # prompt (about 0.1 s when the machine is idle)
    assert not watch._connection.alive
    assert not watch.connected
    assert daemon.wait_closed(0, 1.0)  # the socket is closed: the daemon sees the job leave
    assert daemon.requests("report")[-1]["report"]["steps"] == watch.steps  # last report flushed


def test_dataloader_workers_do_not_keep_the_connection_open(daemon: FakeDaemon) -> None:
    knobs = {"num_workers": 1, "persistent_workers": True}
    with attach(job="digits", knobs=knobs, socket=daemon.path) as watch:
        loader = watch.loader(pid_loader)
        daemon.wait_for(lambda m: m.get("op") == "hello")
        assert len([batch for batch in loader]) == 4  # the persistent worker is now forked
    # the worker process still lives (persistent_workers), yet the daemon sees EOF
    assert daemon.wait_closed(0, 1.5)
    del loader


# -- without torch, and the example job --------------------------------------------------------


def test_the_hook_imports_and_runs_without_torch(sock_path: str) -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any `import torch` now fails
        "from gpuwatchd.hook import attach\n"
        f"with attach(job='x', knobs={{'num_workers': 2}}, socket={sock_path!r}) as w:\n"
        "    loader = w.loader(lambda k: [[1, 2], [3, 4], [5, 6]])\n"
        "    print(sum(len(b) for b in loader), w.steps)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6", "3"]
    assert done.stderr.count("no daemon at") == 1


def _run_example(
    args: list[str], socket_path: str, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUWATCHD_SOCKET=socket_path, PYTHONUNBUFFERED="1")
    env.pop("GPUWATCHD_JOB", None)
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_digits.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def _epoch_lines(stdout: str) -> list[dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("epoch=")]
    return [dict(field.split("=", 1) for field in line.split()) for line in lines]


def test_train_digits_runs_without_a_daemon(sock_path: str) -> None:
    done = _run_example(
        ["--num-workers", "2", "--duration-s", "2", "--epochs", "0", "--views", "1"],
        sock_path,
        timeout_s=60,
    )
    assert done.returncode == 0, done.stderr
    epochs = _epoch_lines(done.stdout)
    assert len(epochs) >= 1, done.stdout
    assert all(e["num_workers"] == "2" and e["connected"] == "False" for e in epochs)
    assert int(epochs[0]["steps"]) > 0 and float(epochs[0]["samples_per_s"]) > 0
    assert done.stderr.count("no daemon at") == 1


def test_train_digits_follows_a_set_knob_from_the_daemon(daemon: FakeDaemon) -> None:
    result: dict[str, Any] = {}

    def steer() -> None:
        hello = daemon.wait_for(lambda m: m.get("op") == "hello", timeout_s=30.0)
        result["hello"] = hello
        daemon.wait_for(lambda m: m.get("op") == "report", timeout_s=30.0)
        daemon.send(set_knob("d-1", "num_workers", 0))
        result["reply"] = daemon.reply_to("d-1", timeout_s=30.0)

    steering = threading.Thread(target=steer, daemon=True)
    steering.start()
    done = _run_example(
        ["--job", "digits", "--num-workers", "2", "--epochs", "4", "--views", "1"],
        daemon.path,
        timeout_s=90,
    )
    steering.join(5.0)
    assert done.returncode == 0, done.stderr
    epochs = _epoch_lines(done.stdout)
    workers = [e["num_workers"] for e in epochs]
    assert workers[0] == "2" and workers[-1] == "0", done.stdout
    assert result["hello"]["job"] == "digits"
    assert result["hello"]["knobs"]["num_workers"] == {"value": 2, "min": 0, "max": 64}
    assert result["reply"]["result"] == {
        "knob": "num_workers",
        "value": 0,
        "previous": 2,
        "applied": True,
    }
    assert "no daemon" not in done.stderr


# -- pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"num_workers": "4"}, "must be an int, a float or a bool"),
        ({"num_workers": 65}, "above its maximum 64"),
        ({"prefetch_factor": 0}, "below its minimum 1"),
        ({"batch_size": {"value": 64, "min": 128, "max": 32}}, "min 128 is above max 32"),
        ({"batch_size": {"value": 64, "step": 8}}, "unknown keys ['step']"),
        ({"batch_size": {"min": 8}}, "missing 'value'"),
        ({"lr": float("nan")}, "not finite"),
    ],
)
def test_bad_knob_declarations_raise_knob_error(knobs: dict[str, object], message: str) -> None:
    with pytest.raises(KnobError) as caught:
        attach(job="digits", knobs=knobs, socket="/nonexistent/control.sock")
    assert message in str(caught.value)


def test_knob_declarations_get_kinds_and_bounds() -> None:
    specs = parse_knobs(
        {"num_workers": 8, "lr": {"value": 0.1, "min": 0, "max": 1}, "batch_size": 64}
    )
    assert (specs["num_workers"].kind, specs["num_workers"].min, specs["num_workers"].max) == (
        "int",
        0,
        64,
    )
    assert (specs["lr"].kind, specs["lr"].min, specs["lr"].max) == ("float", 0.0, 1.0)
    assert (specs["batch_size"].min, specs["batch_size"].max) == (None, None)


def test_batch_samples_counts_the_first_tensor_of_a_batch() -> None:
    assert batch_samples((torch.zeros(32, 3), torch.zeros(32))) == 32
    assert batch_samples([[1, 2, 3], [4, 5, 6]]) == 3
    assert batch_samples({"input_ids": torch.zeros(16, 128)}) == 16
    assert batch_samples(torch.zeros(8, 4)) == 8
    assert batch_samples(42) == 1


def test_cuda_devices_come_from_cuda_visible_devices() -> None:
    assert cuda_devices_from_env({"CUDA_VISIBLE_DEVICES": "0,2"}) == ["0", "2"]
    assert cuda_devices_from_env({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert cuda_devices_from_env({}) == []


# -- drain and stop: acknowledged when applied --------------------------------------------------


def run_epochs(loader: Any, epochs: int, on_batch: Callable[[int, int], None]) -> list[int]:
    """Iterate ``epochs`` epochs like a training loop; returns the batches seen per epoch."""
    seen = []
    for epoch in range(epochs):
        count = 0
        for _batch in loader:
            on_batch(epoch, count)
            count += 1
        seen.append(count)
    return seen


def test_drain_finishes_the_epoch_then_acks_and_ends_training(daemon: FakeDaemon) -> None:
    with attach(job="digits", knobs={"num_workers": 0}, socket=daemon.path) as watch:
        loader = watch.loader(list_factory(batches=4))
        daemon.wait_for(lambda m: m.get("op") == "hello")
        acked_mid_epoch: list[bool] = []

        def on_batch(epoch: int, index: int) -> None:
            if (epoch, index) == (1, 0):
                daemon.send({"id": "d-1", "op": "drain"})
                assert wait_until(lambda: watch.drain_requested)
            if (epoch, index) == (1, 3):
                time.sleep(0.2)
                acked_mid_epoch.append(daemon.has_reply("d-1"))

        seen = run_epochs(loader, 5, on_batch)
        reply = daemon.reply_to("d-1")
        assert watch.should_stop
        daemon.send({"id": "d-2", "op": "drain"})  # already applied: acked at once
        again = daemon.reply_to("d-2")
    assert seen == [4, 4, 0, 0, 0]  # epoch 1 ran to its end, no epoch after it
    assert acked_mid_epoch == [False]  # not acknowledged before it was applied
    assert reply == {
        "id": "d-1",
        "ok": True,
        "result": {"drained": True, "at": "epoch_end", "epoch": 1},
    }
    assert again["result"] == {"drained": True, "at": "before"}


def test_stop_runs_on_stop_on_the_training_thread_then_acks_at_the_next_step(
    daemon: FakeDaemon,
) -> None:
    calls: list[tuple[str | None, int]] = []
    with attach(
        job="digits",
        socket=daemon.path,
        on_stop=lambda reason: calls.append((reason, threading.get_ident())),
    ) as watch:
        loader = watch.loader(list_factory(batches=4))
        daemon.wait_for(lambda m: m.get("op") == "hello")

        def on_batch(epoch: int, index: int) -> None:
            if (epoch, index) == (0, 1):
                daemon.send({"id": "d-1", "op": "stop", "reason": "gpu needed elsewhere"})
                assert wait_until(lambda: watch.stop_requested)
                time.sleep(0.2)
                assert not daemon.has_reply("d-1")  # the callback has not run yet

        seen = run_epochs(loader, 3, on_batch)
        reply = daemon.reply_to("d-1")
    assert seen == [2, 0, 0]  # the batch after the request was never started
    assert calls == [("gpu needed elsewhere", threading.get_ident())]
    assert reply["result"] == {"stopped": True, "at": "step", "reason": "gpu needed elsewhere"}
    assert watch.stop_reason == "gpu needed elsewhere"


def test_a_failing_on_stop_is_logged_and_training_stops_all_the_same(
    daemon: FakeDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    def on_stop(reason: str | None) -> None:
        raise OSError("disk full")

    with attach(job="digits", socket=daemon.path, on_stop=on_stop) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send({"id": "d-1", "op": "stop"})
        assert wait_until(lambda: watch.stop_requested)
        assert watch.safe_point() is True  # a custom loop's safe point
        reply = daemon.reply_to("d-1")
        assert watch.safe_point() is True
    assert reply["result"]["stopped"] is True
    assert reply["result"]["callback_error"] == "OSError: disk full"
    assert "on_stop callback failed" in caplog.text


def test_commands_not_applied_before_the_job_ends_are_acked_on_exit(daemon: FakeDaemon) -> None:
    with attach(job="digits", socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send({"id": "d-1", "op": "drain"})
        daemon.send({"id": "d-2", "op": "stop", "reason": "bye"})
        assert wait_until(lambda: watch.drain_requested and watch.stop_requested)
    assert daemon.reply_to("d-1")["result"]["at"] == "exit"
    assert daemon.reply_to("d-2")["result"] == {"stopped": True, "at": "exit", "reason": "bye"}


def test_an_adapter_of_another_framework_drives_the_watch_through_its_public_api(
    daemon: FakeDaemon,
) -> None:
    """What the Lightning/transformers callbacks and WatchedLoader do, written as a third
    framework's adapter would: knob changes taken at an epoch start, then applied or
    refused; the epoch counter set; a drain applied once per finished epoch; a stop seen
    pending, applied at a safe point."""
    with attach(job="digits", knobs={"num_workers": 0}, socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send(set_knob("d-1", "num_workers", 2))
        assert wait_until(lambda: watch.pending_knobs == {"num_workers": 2})
        taken = watch.take_pending_knobs()
        assert taken is not None
        knobs, changes = taken
        assert knobs == {"num_workers": 2}
        watch.commit_knobs(knobs, changes)  # the framework's loader now runs with them
        applied = daemon.reply_to("d-1")
        assert watch.take_pending_knobs() is None
        daemon.send(set_knob("d-2", "num_workers", 3))
        assert wait_until(lambda: watch.pending_knobs == {"num_workers": 3})
        taken = watch.take_pending_knobs()
        assert taken is not None
        watch.reject_knobs(taken[1], "the framework cannot rebuild its loader")
        refused = daemon.reply_to("d-2")
        assert watch.knobs == {"num_workers": 2}

        watch.set_epoch(3)
        assert watch.epoch == 3
        daemon.send({"id": "d-3", "op": "drain"})
        assert wait_until(lambda: watch.drain_requested)
        watch.epoch_finished()
        watch.epoch_finished()  # a second end of the same epoch is not a second one
        drained = daemon.reply_to("d-3")
        assert watch.should_stop

    with attach(job="digits", socket=daemon.path) as watch:
        assert wait_until(lambda: len(daemon.requests("hello")) == 2)
        daemon.send({"id": "d-4", "op": "stop", "reason": "node drained"})
        assert wait_until(lambda: watch.stop_pending)
        assert watch.stop_exception() is None  # outside a trial: nothing to raise
        assert watch.safe_point() is True
        assert not watch.stop_pending
        stopped = daemon.reply_to("d-4")
    assert applied["result"] == {
        "knob": "num_workers",
        "value": 2,
        "previous": 0,
        "applied": True,
    }
    assert refused["error"]["code"] == "bad_request"
    assert "the framework cannot rebuild its loader" in refused["error"]["message"]
    assert drained["result"] == {"drained": True, "at": "epoch_end", "epoch": 3}
    assert stopped["result"] == {"stopped": True, "at": "step", "reason": "node drained"}


# -- gradient accumulation, OOM ---------------------------------------------------------------


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def tiny_data(samples: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(samples, 6, generator=generator), torch.randint(
        0, 3, (samples,), generator=generator
    )


def reference_params(steps: int, batch: int) -> list[torch.Tensor]:
    """Plain SGD with full batches of ``batch`` samples, no hook."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = tiny_data()
    for i in range(steps):
        xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_step_accumulates_micro_batches_to_the_effective_batch(sock_path: str) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = tiny_data()

    def loss_of(micro: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(micro[0]), micro[1])

    knobs = {"batch_size": 8}
    with attach(job="j", knobs=knobs, effective_batch_size=32, socket=sock_path) as watch:
        assert (watch.batch_size, watch.accumulation_steps) == (8, 4)
        loader = watch.loader(
            lambda k: [
                (x[i : i + k["batch_size"]], y[i : i + k["batch_size"]])
                for i in range(0, 64, k["batch_size"])
            ]
        )
        syncs = []
        for batch in loader:
            watch.step(loss_of, batch, optimizer)
            syncs.append(watch.sync_gradients)
    assert syncs == [False, False, False, True] * 2
    for got, want in zip(model.parameters(), reference_params(2, 32), strict=True):
        torch.testing.assert_close(got.detach(), want)


def test_oom_halves_the_batch_keeps_the_effective_batch_and_reports_it(
    daemon: FakeDaemon,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = tiny_data()
    sizes: list[int] = []

    def loss_of(micro: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        sizes.append(len(micro[0]))
        if len(micro[0]) > 4:  # what a too-large batch does on a GPU
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total)"
            )
        return torch.nn.functional.cross_entropy(model(micro[0]), micro[1])

    built_with: list[int] = []

    def factory(k: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = k["batch_size"]
        built_with.append(size)
        return [(x[i : i + size], y[i : i + size]) for i in range(0, 32, size)]

    knobs = {"batch_size": 16, "num_workers": 0}
    with attach(
        job="j", knobs=knobs, effective_batch_size=32, oom="halve", socket=daemon.path
    ) as watch:
        loader = watch.loader(factory)
        daemon.wait_for(lambda m: m.get("op") == "hello")
        for _epoch in range(2):
            for batch in loader:
                watch.step(loss_of, batch, optimizer)
        assert (watch.batch_size, watch.accumulation_steps, watch.oom_events) == (4, 8, 2)
    assert daemon.wait_closed(0, 2.0)  # all the hook sent has been read
    reports = [m["report"] for m in daemon.requests("report")]
    events = [m["event"] for m in daemon.requests("event")]
    assert sizes[:3] == [16, 8, 4]  # 16 failed, 8 failed, then micro-batches of 4
    assert built_with == [16, 4]  # the loader was rebuilt with the halved batch_size
    assert [e["kind"] for e in events] == ["oom", "oom", "detach"]
    assert "halved to batch_size=8 with 4 accumulation steps" in events[0]["message"]
    assert "halved to batch_size=4 with 8 accumulation steps" in events[1]["message"]
    assert reports[-1]["oom_events"] == 2
    assert reports[-1]["knobs"] == {"batch_size": 4, "num_workers": 0}
    # two epochs of 32 samples = two optimizer steps of 32 samples, as without the OOMs
    for got, want in zip(model.parameters(), reference_params(1, 32), strict=True):
        assert not torch.equal(got.detach(), want)  # a second step happened
    reference = tiny_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x[:32]), y[:32]).backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach())


def test_oom_without_halving_is_reported_and_raised(daemon: FakeDaemon) -> None:
    def boom(micro: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    with pytest.raises(torch.cuda.OutOfMemoryError):  # noqa: SIM117
        with attach(job="j", knobs={"batch_size": 2}, oom="halve", socket=daemon.path) as watch:
            daemon.wait_for(lambda m: m.get("op") == "hello")
            watch.step(boom, [[1, 2]])  # 2 -> 1 -> no smaller size: raised
    assert daemon.wait_closed(0, 2.0)
    events = [m["event"] for m in daemon.requests("event")]
    assert [e["kind"] for e in events] == ["oom", "oom", "crash"]
    assert "at batch_size=1" in events[1]["message"]
    assert events[2]["crash_kind"] == "cuda_oom"
    with attach(job="j", socket=daemon.path) as plain:  # oom="raise": no batch_size needed
        with pytest.raises(torch.cuda.OutOfMemoryError):
            plain.step(boom, [[1]])
        assert plain.oom_events == 1
        with pytest.raises(ValueError, match="not an OOM"):
            plain.step(lambda m: (_ for _ in ()).throw(ValueError("not an OOM")), [[1]])
        assert plain.oom_events == 1


def test_a_batch_size_change_must_keep_the_effective_batch(daemon: FakeDaemon) -> None:
    knobs = {"batch_size": 16}
    with attach(job="j", knobs=knobs, effective_batch_size=48, socket=daemon.path) as watch:
        loader = watch.loader(lambda k: [([0] * k["batch_size"], 0)])
        daemon.wait_for(lambda m: m.get("op") == "hello")
        assert daemon.wait_for(lambda m: m.get("op") == "hello")["knobs"]["batch_size"] == {
            "value": 16,
            "min": 1,
            "max": 48,
        }
        daemon.send(set_knob("d-1", "batch_size", 20))
        refused = daemon.reply_to("d-1")
        daemon.send(set_knob("d-2", "batch_size", 24))
        assert wait_until(lambda: watch.pending_knobs == {"batch_size": 24})
        sizes = [len(b) for b, _ in loader]
        applied = daemon.reply_to("d-2")
        assert (watch.batch_size, watch.accumulation_steps) == (24, 2)
    assert "does not divide the effective batch size 48" in refused["error"]["message"]
    assert "nearest that do: 16 and 24" in refused["error"]["message"]
    assert sizes == [24]
    assert applied["result"]["value"] == 24


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"knobs": {"batch_size": 16}, "effective_batch_size": 40}, "dividing the effective"),
        ({"knobs": {"num_workers": 2}, "effective_batch_size": 40}, "needs a batch_size knob"),
        ({"knobs": {"num_workers": 2}, "oom": "halve"}, "needs a batch_size knob"),
        ({"knobs": {"batch_size": 8}, "oom": "retry"}, "'raise' or 'halve'"),
        ({"knobs": {"batch_size": 8.0}}, "must be an integer"),
    ],
)
def test_bad_batch_size_setups_raise_knob_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(KnobError, match=message):
        attach(job="j", socket="/nonexistent/control.sock", **kwargs)


def test_slice_batch_keeps_the_structure() -> None:
    x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    assert [t.tolist() for t in slice_batch((x, y), 1, 3)] == [[[2, 3], [4, 5]], [1, 2]]
    sliced = slice_batch({"input_ids": x, "labels": y, "n": 5}, 3, 5)
    assert sliced["labels"].tolist() == [3, 4] and sliced["n"] == 5
    assert slice_batch([[1, 2, 3], [4, 5, 6]], 0, 2) == [[1, 2], [4, 5]]


# -- events, crash, CUDA memory, trials ------------------------------------------------------


def test_an_exception_leaving_the_block_sends_a_crash_event(daemon: FakeDaemon) -> None:
    with pytest.raises(RuntimeError):  # noqa: SIM117
        with attach(job="j", socket=daemon.path):
            daemon.wait_for(lambda m: m.get("op") == "hello")
            raise RuntimeError("CUDA error: device-side assert triggered")
    with pytest.raises(KeyboardInterrupt):  # noqa: SIM117
        with attach(job="j", socket=daemon.path):
            daemon.wait_for(lambda m: len(daemon.requests("hello")) == 2)
            raise KeyboardInterrupt
    assert daemon.wait_closed(0, 2.0) and daemon.wait_closed(1, 2.0)
    events = [m["event"] for m in daemon.requests("event")]
    assert events == [
        {
            "kind": "crash",
            "crash_kind": "cuda_assert",
            "message": "RuntimeError: CUDA error: device-side assert triggered",
        }
    ]


def test_a_clean_end_of_the_block_sends_detach_as_the_last_word(daemon: FakeDaemon) -> None:
    """A daemon that adopted this process cannot read its exit status: ``detach`` says
    the process ends cleanly (an exception leaving the block never sends it, above)."""
    with attach(job="j", socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        watch.report_event("oom", message="CUDA out of memory")
    assert daemon.wait_closed(0, 2.0)
    events = [m["event"]["kind"] for m in daemon.requests("event")]
    assert events == ["oom", "detach"]
    watch.close()  # closing again sends nothing more
    assert [m["event"]["kind"] for m in daemon.requests("event")] == ["oom", "detach"]


def test_events_queued_without_a_daemon_are_sent_once_it_appears(sock_path: str) -> None:
    with attach(job="j", socket=sock_path) as watch:
        watch.report_oom(RuntimeError("CUDA out of memory."))
        watch.report_trial(3, "COMPLETE")
        watch.report_trial(4, "RUNNING")  # not a final state: nothing sent
        late = FakeDaemon(sock_path)
        try:
            late.wait_for(lambda m: len(late.requests("event")) == 2, timeout_s=5.0)
        finally:
            late.stop()
    events = [m["event"] for m in late.requests("event")]
    assert events == [
        {"kind": "oom", "message": "CUDA out of memory."},
        {"kind": "trial", "message": "", "trial_number": 3, "trial_state": "COMPLETE"},
    ]


def test_cuda_memory_is_empty_on_the_cpu_and_never_initialises_cuda() -> None:
    assert not torch.cuda.is_initialized()
    assert cuda_memory() == []
    assert not torch.cuda.is_initialized()
    assert is_cuda_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_cuda_oom(RuntimeError("CUDA out of memory. Tried to allocate 1 GiB"))
    assert not is_cuda_oom(RuntimeError("shape mismatch"))


def test_trial_scope_reports_the_trial_and_sends_its_final_state(daemon: FakeDaemon) -> None:
    study = SimpleNamespace(study_name="s", stopped=0)
    study.stop = lambda: setattr(study, "stopped", study.stopped + 1)
    with attach(job="hpo", socket=daemon.path, study="s") as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        first = SimpleNamespace(number=0, params={"lr": 0.1}, study=study)
        with watch.trial(first):
            loader = watch.loader(list_factory(batches=40))
            for _batch in loader:
                time.sleep(0.02)  # 0.8 s: at least one report inside the trial
        with pytest.raises(ZeroDivisionError), watch.trial(SimpleNamespace(number=1, params={})):
            raise ZeroDivisionError
        run_steps(watch, 0.6, wait_s=0.001, compute_s=0.001)
    assert daemon.wait_closed(0, 2.0)
    trials = [m["report"]["trial"] for m in daemon.requests("report") if "trial" in m["report"]]
    events = [m["event"] for m in daemon.requests("event") if m["event"]["kind"] == "trial"]
    assert trials[0] == {"number": 0, "params": {"lr": 0.1}}
    assert trials[-1] is None  # no trial runs any more
    assert [(e["trial_number"], e["trial_state"]) for e in events] == [(0, "COMPLETE"), (1, "FAIL")]
    assert study.stopped == 0  # neither drain nor stop: the study goes on


def test_live_dataloader_knobs_change_in_place(daemon: FakeDaemon) -> None:
    knobs = {"num_workers": 0, "prefetch_factor": 2, "persistent_workers": False}
    live = DataLoader(PidDataset(), batch_size=4, num_workers=0)
    with attach(job="j", knobs=knobs, socket=daemon.path) as watch:
        daemon.wait_for(lambda m: m.get("op") == "hello")
        daemon.send(set_knob("d-1", "num_workers", 1))
        daemon.send(set_knob("d-2", "persistent_workers", True))
        assert wait_until(lambda: len(watch.pending_knobs) == 2)
        watch.apply_knobs(find_dataloaders({"train": [live, live]}))
        ok = daemon.reply_to("d-1")
        refused = daemon.reply_to("d-2")
        pids = {pid for batch in live for pid in batch.tolist()}
    assert ok["result"]["value"] == 1 and live.num_workers == 1 and live.prefetch_factor == 2
    assert pids and os.getpid() not in pids  # the next iteration used a worker process
    assert refused["error"]["code"] == "bad_request"
    assert "persistent_workers cannot be changed" in refused["error"]["message"]
    assert watch.knobs == {"num_workers": 1, "prefetch_factor": 2, "persistent_workers": False}


def test_train_digits_saves_a_checkpoint_on_stop_and_acks_it(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    result: dict[str, Any] = {}

    def steer() -> None:
        daemon.wait_for(lambda m: m.get("op") == "report", timeout_s=30.0)
        daemon.send({"id": "d-1", "op": "stop", "reason": "preempted"})
        result["reply"] = daemon.reply_to("d-1", timeout_s=30.0)

    steering = threading.Thread(target=steer, daemon=True)
    steering.start()
    checkpoint = tmp_path / "model.pt"
    done = _run_example(
        ["--num-workers", "0", "--epochs", "50", "--views", "1", "--checkpoint", str(checkpoint)],
        daemon.path,
        timeout_s=90,
    )
    steering.join(5.0)
    assert done.returncode == 0, done.stderr
    assert "stop requested by gpuwatchd" in done.stdout
    assert f"checkpoint saved to {checkpoint} (preempted)" in done.stdout
    assert checkpoint.stat().st_size > 0
    assert result["reply"]["result"] == {"stopped": True, "at": "step", "reason": "preempted"}
    assert len(_epoch_lines(done.stdout)) < 50


# -- what importing the hook loads --------------------------------------------------------------


def test_importing_the_hook_loads_no_daemon_code_and_no_torch_or_optuna() -> None:
    """A training job imports gpuwatchd.hook: none of the daemon's layers come with it."""
    code = "import sys, json, gpuwatchd.hook\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(done.stdout)
    assert "gpuwatchd.hook" in loaded
    forbidden_prefixes = (
        "gpuwatchd.daemon",
        "gpuwatchd.jobs",
        "gpuwatchd.policy",
        "gpuwatchd.jobs",
        "gpuwatchd.control.server",
        "gpuwatchd.journal",
        "gpuwatchd.detectors",
        "torch",
        "optuna",
    )
    forbidden_names = {"gpuwatchd.actuators"}
    heavy = [
        name
        for name in loaded
        if name in forbidden_names
        or any(name == p or name.startswith(p + ".") for p in forbidden_prefixes)
    ]
    assert heavy == []


def test_the_loader_depends_on_the_host_protocol_not_on_the_watch() -> None:
    """No import of gpuwatchd.hook._watch in _loader.py, not even for type checking."""
    import ast

    import gpuwatchd.hook._loader as loader_module

    tree = ast.parse(Path(loader_module.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert "gpuwatchd.hook._watch" not in imported
    assert "gpuwatchd.hook._host" in imported
