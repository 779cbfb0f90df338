"""Worker processes of the deployment search stop promptly and completely on Ctrl-C or a
failed task (jkernel.search._Runner): Ctrl-C on ``jkernel plan --workers 2`` once left the
parent and its workers running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jkernel import search

ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> dict[int, int]:
    """Every process whose parent is ``pid``: {pid: ppid} (psutil when installed, else
    /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return {c.pid: pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            return {}
    out, frontier = {}, {pid}
    while frontier:
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid in frontier and int(entry) not in out:
                found[int(entry)] = ppid
        out.update(found)
        frontier = set(found)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie left for its reaper does not count: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_gone(pids, seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = [p for p in left if _alive(p)]
    return left


def test_ctrl_c_stops_plan_and_its_workers_with_nothing_left_running():
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-search: the
    command exits with 130 and none of its processes is left."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JKERNEL_CACHE_DIR="0")
    p = subprocess.Popen(
        [sys.executable, "-m", "jkernel", "plan", "llama-3.1-8b-instruct", "--chip", "h100",
         "--gpus", "8", "--isl", "1024", "--osl", "64", "--rate", "4", "--workers", "2",
         "--requests", "200", "--mode", "colocated"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        seen: dict[int, int] = {}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            seen.update(_children(p.pid))
            if len([c for c in seen if _alive(c)]) >= 2:      # the workers are up
                break
            time.sleep(0.2)
        assert p.poll() is None, "the search ended before it could be interrupted"
        time.sleep(1.0)                                        # mid-task
        seen.update(_children(p.pid))
        os.killpg(p.pid, signal.SIGINT)
        # it exits (within seconds on a quiet machine; a compile under way finishes first,
        # which a loaded machine can stretch past a minute: the bound is a hang guard only)
        _, err = p.communicate(timeout=240)
        assert p.returncode == 130, err
        assert "interrupted" in err and "Traceback" not in err
        assert _wait_gone(seen, 10) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _task(x: int) -> int:
    """A task for the runner's workers: 0 fails at once, the others run for a minute."""
    if x == 0:
        raise RuntimeError("task 0 failed")
    time.sleep(60)
    return x


def test_a_failed_task_stops_the_other_workers_at_once():
    """A failure in one worker ends the map promptly (not after the other tasks finish),
    with every worker process stopped by the time the runner returns. (Defect: on a loaded
    machine a worker read as alive after the runner returned: the executor's own thread had
    reaped it and not yet recorded its exit; the runner now waits for that thread.)"""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="task 0 failed"):
        with search._Runner(workers=2) as run:
            procs_before = None
            try:
                run.map(_task, [1, 0, 2])
            finally:
                procs_before = list(run._pool._processes.values())
    assert time.monotonic() - t0 < 40
    assert procs_before and all(not proc.is_alive() for proc in procs_before)


def test_a_ctrl_c_while_workers_start_is_held_and_raised_not_lost():
    """While the runner spawns its workers, Ctrl-C is held: raised in the parent once the
    spawning is done, and blocked in a process started meanwhile. (Defect: it was ignored
    there, so a search interrupted while its workers started ran to the end and exited 0.)"""
    from jkernel.search import _sigint_held

    with pytest.raises(KeyboardInterrupt):
        with _sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)                  # not raised here, mid-spawn
            child = subprocess.run(
                [sys.executable, "-c", "import signal; print(signal.SIGINT in "
                 "signal.pthread_sigmask(signal.SIG_BLOCK, set()))"],
                capture_output=True, text=True, timeout=60)
            assert child.stdout.strip() == "True"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
