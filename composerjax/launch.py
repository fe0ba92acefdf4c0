"""Moved to :mod:`composerjax.parallel.launch` (the launcher), :mod:`composerjax.parallel.heartbeat` (the
heartbeat a launched process sends) and :mod:`composerjax.parallel.supervisor` (watching the processes);
this module keeps the old import path working.

Example:
    >>> from composerjax.launch import heartbeat, launch
    >>> from composerjax.parallel import heartbeat as beats, launch as launcher
    >>> heartbeat is beats.heartbeat and launch is launcher.launch
    True
"""

from composerjax.parallel.heartbeat import HEARTBEAT_FILE_ENV, HEARTBEAT_INTERVAL_S, HUNG_STATUS, heartbeat
from composerjax.parallel.launch import child_environment, free_port, launch
from composerjax.parallel.supervisor import LAST_LINES

__all__ = [
    "HEARTBEAT_FILE_ENV",
    "HEARTBEAT_INTERVAL_S",
    "HUNG_STATUS",
    "LAST_LINES",
    "child_environment",
    "free_port",
    "heartbeat",
    "launch",
]
