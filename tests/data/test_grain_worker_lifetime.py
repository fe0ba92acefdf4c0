"""grain worker processes die with the trainer that started them, even when it is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from composerjax.data import GrainLoader

    def children():
        pids = set()
        for task in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                pids |= {int(pid) for pid in f.read().split()}
        return sorted(pids)

    if __name__ == "__main__":
        loader = GrainLoader(np.arange(4000, dtype=np.int64), batch_size=4, worker_count=2)
        batches = iter(loader)
        first = next(batches)
        print(" ".join(map(str, children())), flush=True)
        time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_of_a_sigkilled_trainer_exit(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, JAX_PLATFORMS="cpu"), start_new_session=True)
    try:
        workers = [int(pid) for pid in process.stdout.readline().split()]
        assert len(workers) >= 2 and all(alive(pid) for pid in workers)  # the 2 workers (and grain's helpers)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 120  # a hang guard: the workers exit when they notice their parent is gone
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if alive(pid)]
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever is left, so a failure leaks nothing
        except ProcessLookupError:
            pass
