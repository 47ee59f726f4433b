"""The ``policy.show``/``policy.reload`` op (gpuwatchd.daemon.ops.policy) against a fake
daemon with real policy files."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_daemon import POLICY, ROOT, FakeDaemon, call, policy_file
from gpuwatchd.control.protocol import ErrorCode
from gpuwatchd.errors import ProtocolError


def _names(reply: dict[str, object]) -> list[str]:
    return [p["name"] for p in reply["policies"]]  # type: ignore[attr-defined]


def test_show_gives_the_running_policies(tmp_path: Path) -> None:
    assert _names(call(FakeDaemon(policy_file(tmp_path)), "policy.show")) == ["gpu-idle"]


def test_reload_without_path_rereads_the_configured_files(tmp_path: Path) -> None:
    path = policy_file(tmp_path)
    daemon = FakeDaemon(path)
    path.write_text(POLICY.replace("gpu-idle", "gpu-idle-v2"), encoding="utf-8")
    assert _names(call(daemon, "policy.reload")) == ["gpu-idle-v2"]
    assert daemon.reloads == [None]


def test_only_root_may_name_a_path(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    other = tmp_path / "other.yaml"
    other.write_text(POLICY.replace("gpu-idle", "from-path"), encoding="utf-8")
    with pytest.raises(ProtocolError) as info:
        call(daemon, "policy.reload", {"path": str(other)})
    assert info.value.code == ErrorCode.FORBIDDEN and daemon.reloads == []
    assert _names(call(daemon, "policy.reload", {"path": str(other)}, peer=ROOT)) == ["from-path"]


def test_a_broken_file_is_bad_request_and_keeps_the_running_policies(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    broken = tmp_path / "broken.yaml"
    broken.write_text("policies:\n  - name: x\n    when: {nope: {}}\n", encoding="utf-8")
    with pytest.raises(ProtocolError) as info:
        call(daemon, "policy.reload", {"path": str(broken)}, peer=ROOT)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "broken.yaml" in info.value.message
    assert _names(call(daemon, "policy.show")) == ["gpu-idle"]


def test_a_path_that_is_not_a_string_is_bad_request(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError) as info:
        call(FakeDaemon(policy_file(tmp_path)), "policy.reload", {"path": 3}, peer=ROOT)
    assert info.value.code == ErrorCode.BAD_REQUEST
