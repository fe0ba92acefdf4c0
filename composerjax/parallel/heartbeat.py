"""The heartbeat of a process started by ``composerjax launch``: how it tells the launcher it is making progress.

``composerjax launch`` gives each process its own heartbeat file (named by ``COMPOSERJAX_HEARTBEAT_FILE``);
:func:`heartbeat` touches it, at most once per :data:`HEARTBEAT_INTERVAL_S`. Once any rank has beaten, the
launcher stops a job whose rank stays silent for ``--heartbeat-timeout`` seconds and exits with
:data:`HUNG_STATUS`. Outside the launcher :func:`heartbeat` does nothing.

Example:
    >>> from composerjax.parallel.heartbeat import heartbeat
    >>> heartbeat()  # not started by `composerjax launch`: no file to touch
    False
"""

from __future__ import annotations

import os
import time

__all__ = ["HEARTBEAT_FILE_ENV", "HEARTBEAT_INTERVAL_S", "HUNG_STATUS", "heartbeat"]

#: The variable naming this process's heartbeat file (set by the launcher, one file per rank).
HEARTBEAT_FILE_ENV = "COMPOSERJAX_HEARTBEAT_FILE"
#: :func:`heartbeat` touches its file at most once per this many seconds.
HEARTBEAT_INTERVAL_S = 1.0
#: The launcher's exit status when a rank made no progress for the heartbeat timeout (as ``timeout(1)``).
HUNG_STATUS = 124

# time.monotonic() before which heartbeat() only reads the clock.
_next_beat = 0.0


def heartbeat() -> bool:
    """Tell ``composerjax launch`` that this process is making progress; a no-op outside the launcher.

    Touches the file named by ``COMPOSERJAX_HEARTBEAT_FILE`` at most once per
    :data:`HEARTBEAT_INTERVAL_S` (calls in between only read the clock, about 0.1 µs), so it can be
    called after every step. The Trainer calls it after each batch and during evaluation; a custom
    training loop under ``composerjax launch --heartbeat-timeout`` should call it as often (once any
    rank has beaten, a rank silent for the timeout stops the job). Errors (a removed file) are ignored.

    Returns:
        True when this call touched the heartbeat file.

    Example:
        A custom training loop beats once per step:

        >>> from composerjax.parallel.heartbeat import heartbeat
        >>> for step in range(3):
        ...     loss = 0.5 * step  # one training step
        ...     _ = heartbeat()
        >>> heartbeat()  # not started by `composerjax launch`: nothing to touch
        False
    """
    global _next_beat
    now = time.monotonic()
    if now < _next_beat:
        return False
    _next_beat = now + HEARTBEAT_INTERVAL_S
    path = os.environ.get(HEARTBEAT_FILE_ENV)
    if not path:
        return False
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            open(path, "ab").close()
        except OSError:
            return False
    except OSError:
        return False
    return True
