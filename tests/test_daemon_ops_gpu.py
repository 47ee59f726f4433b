"""The ``gpu.cordon``/``gpu.uncordon`` ops (gpuwatchd.daemon.ops.gpu) against a fake daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_daemon import ADMIN, FakeDaemon, call, policy_file
from gpuwatchd.errors import ProtocolError


def test_cordon_and_uncordon_say_the_state_and_who_asked(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    reply = call(daemon, "gpu.cordon", {"gpu": 1})
    assert reply == {"gpu": 1, "cordoned": True, "detail": "GPU 1 cordoned"}
    again = call(daemon, "gpu.cordon", {"gpu": 1})
    assert again["detail"] == "GPU 1 was cordoned already"  # idempotent
    (cordon,) = daemon.cordons.cordons.all()
    assert (cordon.index, cordon.by) == (1, f"operator uid {ADMIN.uid}")
    reply = call(daemon, "gpu.uncordon", {"gpu": 1})
    assert reply["cordoned"] is False
    assert reply["detail"].startswith("GPU 1 uncordoned (cordoned by operator uid")
    assert daemon.cordons.cordons.all() == []


def test_uncordon_of_a_gpu_not_cordoned_is_a_conflict(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    with pytest.raises(ProtocolError) as info:
        call(daemon, "gpu.uncordon", {"gpu": 0})
    assert info.value.code == "conflict"
    assert "not cordoned" in info.value.message


@pytest.mark.parametrize("gpu", [None, -1, 1024, "0", True, 1.0])
def test_bad_gpu_is_a_bad_request(tmp_path: Path, gpu: object) -> None:
    daemon = FakeDaemon(policy_file(tmp_path))
    with pytest.raises(ProtocolError) as info:
        call(daemon, "gpu.cordon", {"gpu": gpu} if gpu is not None else {})
    assert info.value.code == "bad_request"
