"""Peer credentials of a real Unix socket: SO_PEERCRED and SO_PEERGROUPS."""

from __future__ import annotations

import os
import socket

from gpuwatchd.control.peercred import peer_credentials, peer_groups, read_supplementary_groups


def test_peer_credentials_of_a_real_socket_pair_are_our_own() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        peer = peer_credentials(left)
        assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
        # The kernel's record (SO_PEERGROUPS) and /proc agree for a live process.
        assert peer_groups(left) == frozenset(os.getgroups()) == peer.groups
        assert read_supplementary_groups(os.getpid()) == peer.groups


def test_groups_of_a_vanished_process_are_empty() -> None:
    assert read_supplementary_groups(2**22 + 12345) == frozenset()


def test_admin_gid_names_the_group_and_warns_about_a_missing_one() -> None:
    import grp

    from gpuwatchd.control.peercred import admin_gid

    class Log:
        def __init__(self) -> None:
            self.warnings: list[tuple[str, dict[str, object]]] = []

        def warning(self, event: str, **fields: object) -> None:
            self.warnings.append((event, fields))

    log = Log()
    group = grp.getgrgid(0).gr_name
    assert admin_gid(None, log) is None
    assert admin_gid(group, log) == 0
    assert admin_gid("no-such-group-gpuwatchd", log) is None
    assert [event for event, _ in log.warnings] == ["control.admin_group_missing"]
