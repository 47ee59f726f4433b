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
