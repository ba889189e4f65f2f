"""The multi-host test's hosts: without root it says why it cannot run (and skips with that)."""

from __future__ import annotations

import os

import pytest

from tests.support import netns


def test_without_root_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.unavailable() == (
        "needs root: network namespaces (ip netns) and iptables rules are root's"
    )


def test_without_iptables_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "iptables" else tool)
    assert netns.unavailable() == "needs iptables (Debian: apt-get install iproute2 iptables)"
