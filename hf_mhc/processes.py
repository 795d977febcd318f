"""Owners of files that outlive a process: ``pid@host`` tags, as hf-mhc's output locks and private build folders carry
them, and whether the process a tag names is gone."""

from __future__ import annotations

import os
import socket


def owner_tag() -> str:
    """``pid@host`` of this process."""
    return f"{os.getpid()}@{socket.gethostname()}"


def owner_is_dead(owner: str) -> bool:
    """Whether ``owner`` (``pid@host``) names a process of this host that no longer exists; ``False`` for another
    host's, whose state this host cannot see."""
    pid, _, host = owner.partition("@")
    return host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts)."""
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT there: never take a Windows process for dead
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
