"""The ``notify`` action as deployed: a real daemon replaying the real 8-GPU H100 trace
(its first ~105 s leave every GPU idle), a policy that notifies a generic JSON webhook
(apprise's ``json://``) served by a local HTTP receiver on 127.0.0.1; the outcome is read
back from the journal with ``gpuwatchctl events``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from conftest import TRACES, RunningDaemon
from gpuwatchd.errors import PolicyError
from gpuwatchd.policy.schema import parse_policies

H100 = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"
TOKEN = "T0KEN-in-the-url-path"


@dataclass
class Receiver:
    """A webhook receiver: records every POST; answers ``status``; holds each request
    until ``release`` is set (set by default)."""

    port: int = 0
    status: int = 200
    posts: list[dict[str, Any]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    holding: threading.Event = field(default_factory=threading.Event)

    def url(self) -> str:
        return f"json://127.0.0.1:{self.port}/hook/{TOKEN}"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()
    state.release.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            state.posts.append({"path": self.path, "body": json.loads(body or b"{}")})
            state.holding.set()
            state.release.wait(30)
            self.send_response(state.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    state.release.set()
    server.shutdown()
    server.server_close()


def policy_file(tmp_path: Path, url: str, timeout: str = "5s") -> Path:
    path = tmp_path / "notify.yaml"
    path.write_text(
        f"""\
policies:
  - name: idle-notify
    description: tell the on-call channel about idle GPUs
    when:
      low_utilization: {{percent: 20, for: 2s}}
    do:
      - notify:
          urls: ["{url}"]
          title: idle GPUs
          timeout: {timeout}
    cooldown: 1h
"""
    )
    return path


def notify_outcomes(daemon: RunningDaemon) -> list[dict[str, Any]]:
    result = daemon.ctl("--json", "events")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line]
    ids = {e["decision_id"] for e in events if e["kind"] == "decision" and e["action"] == "notify"}
    return [e for e in events if e["kind"] == "outcome" and e.get("decision_id") in ids]


def start(run_daemon: Callable[..., RunningDaemon], policies: Path) -> RunningDaemon:
    return run_daemon(
        script={"devices": []},
        args=["--devices", f"replay:{H100}", "--replay-speed", "5", "--policies", str(policies)],
    )


def test_notify_posts_to_a_json_webhook_and_journals_applied(
    run_daemon: Callable[..., RunningDaemon], receiver: Receiver, tmp_path: Path
) -> None:
    daemon = start(run_daemon, policy_file(tmp_path, receiver.url()))
    outcomes = daemon.wait_until(
        lambda: notify_outcomes(daemon), timeout_s=60, what="a notify outcome"
    )
    assert outcomes[0]["outcome"] == "applied", outcomes
    post = receiver.posts[0]
    assert post["path"] == f"/hook/{TOKEN}"
    assert post["body"]["title"] == "idle GPUs"
    assert "utilization" in post["body"]["message"]
    # One cooldown (1h) per subject: the idle start notifies each GPU once, not per tick.
    status = daemon.status()
    ticks = status["ticks"]
    daemon.wait_until(lambda: daemon.status()["ticks"] >= ticks + 10, what="10 more ticks")
    assert len(receiver.posts) <= 8  # at most one per GPU subject
    # The URL (its token) stays out of the journal, status and the log.
    assert TOKEN not in daemon.ctl("--json", "events").stdout
    assert TOKEN not in json.dumps(daemon.status())
    assert TOKEN not in daemon.log_path.read_text()
    decision = next(
        json.loads(line)
        for line in daemon.ctl("--json", "events").stdout.splitlines()
        if '"notify"' in line and '"decision"' in line
    )
    assert decision["params"]["urls"] == ["json://…"]


def test_a_failing_or_hanging_receiver_is_journaled_and_never_stops_the_tick(
    run_daemon: Callable[..., RunningDaemon], receiver: Receiver, tmp_path: Path
) -> None:
    receiver.release.clear()  # hold the request: the service hangs
    receiver.status = 500
    daemon = start(run_daemon, policy_file(tmp_path, receiver.url(), timeout="2s"))
    assert receiver.holding.wait(60), daemon.log_tail()
    # While the webhook hangs, the daemon goes on ticking and answering.
    ticks = daemon.status()["ticks"]
    daemon.wait_until(
        lambda: daemon.status()["ticks"] >= ticks + 5, what="ticks while the webhook hangs"
    )
    outcome = daemon.wait_until(lambda: notify_outcomes(daemon), timeout_s=30, what="outcome")[0]
    assert outcome["outcome"] == "failed", outcome
    assert outcome["detail"] and TOKEN not in outcome["detail"]
    receiver.release.set()  # now it answers 500: the next notification fails too
    assert daemon.process.poll() is None


def test_notify_urls_are_checked_when_the_policy_is_loaded() -> None:
    def load(urls: str) -> None:
        parse_policies(
            "policies:\n  - name: n\n    when: {low_utilization: {percent: 20, for: 2s}}\n"
            f"    do: [{{notify: {{urls: {urls}}}}}]\n",
            "notify.yaml",
        )

    load('["json://127.0.0.1:9/x", "slack://a/b/c"]')
    for bad in ("[]", '["not a url"]', '["json://"]', "[" + ", ".join(['"json://h/x"'] * 17) + "]"):
        with pytest.raises(PolicyError, match=r"notify\.yaml:\d+: .*urls"):
            load(bad)
