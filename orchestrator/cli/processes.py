"""`weir frontend --processes N`: N whole frontends on one port, watched by a supervisor.

One Python process serves what one core can, so the frontend scales out by processes, as
vLLM's `--api-server-count` and gunicorn do. Each child is a complete frontend: its own
discovery follower and router replica (the replicas share in-flight load over the event
plane, `router/subscriber.py`), its own listening socket on the shared port
(`frontend/shared_port.py`), its own drain on SIGTERM. What ties them together is here:

- The supervisor reserves the port (and the probe port) before any child starts, so
  `--port 0` resolves once, and prints the ready line only when every child is serving.
- Children record metrics into one prometheus multiprocess directory, so any child's
  /metrics answers for all (`frontend/metrics.py`). The directory is named for the
  supervisor's pid: a supervisor that was SIGKILLed cannot remove its own, so the next one
  to start removes every directory whose supervisor no longer runs.
- SIGINT or SIGTERM to the supervisor becomes one SIGTERM to each child, which drains; the
  children run in their own process group so a terminal's Ctrl-C reaches them only that way.
  A child dies with its supervisor (PR_SET_PDEATHSIG), even when the supervisor is killed.
- A child that exits on its own after start-up is restarted, with a delay that doubles from
  `RESTART_DELAY_S` to `MAX_RESTART_DELAY_S` while restarts keep failing; one that fails
  before it ever served stops the lot, since its siblings would fail the same way.

A child is started as `python -c <bootstrap>`, and reads what it runs from its stdin as a
pickle: `target(payload, ready)`, a module-level function, where `ready()` tells the
supervisor it listens.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("weir.frontend")

MAX_DEFAULT_PROCESSES = 4
RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0
# A child that served this long before it exited had not been failing: its next restart
# starts again from RESTART_DELAY_S.
HEALTHY_RUN_S = 60.0
# Beyond the children's drain timeout: how long they may take to close before SIGKILL.
EXIT_GRACE_S = 10.0

_PR_SET_PDEATHSIG = 1
_METRICS_DIR_PREFIX = "weir-frontend-metrics-"
_BOOTSTRAP = (
    "import sys; from orchestrator.cli.processes import child_main; "
    "child_main(int(sys.argv[1]), int(sys.argv[2]))"
)

Target = Callable[[Any, Callable[[], None]], None]


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota
    (a container's CPU limit), which the affinity does not show."""
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores


def default_processes() -> int:
    return min(MAX_DEFAULT_PROCESSES, usable_cores())


def child_main(parent: int, ready_fd: int) -> None:
    """The bootstrap's entry: die with the supervisor, then run what it sent."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        sys.exit(1)
    target, payload = pickle.load(sys.stdin.buffer)
    ready = os.fdopen(ready_fd, "wb", buffering=0)

    def signal_ready() -> None:
        ready.write(b"\n")

    target(payload, signal_ready)


@dataclass
class _Child:
    slot: int
    process: subprocess.Popen[bytes]
    exited: int  # a pidfd: readable once the process has exited
    ready: int | None  # the read end of its ready pipe, until it has said so or closed it
    serving: bool = False
    started: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        for fd in (self.exited, self.ready):
            if fd is not None:
                os.close(fd)
        self.ready = None


def remove_orphaned_metrics_dirs() -> None:
    """Remove the metrics directories of supervisors that died without removing their own."""
    for directory in Path(tempfile.gettempdir()).glob(f"{_METRICS_DIR_PREFIX}*-*"):
        pid = directory.name.removeprefix(_METRICS_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


class Supervisor:
    """Runs `processes` children of `target(payload, ready)` until SIGINT/SIGTERM."""

    def __init__(self, target: Target, payload: Any, processes: int, drain_timeout_s: float) -> None:
        self.target = target
        self.payload = payload
        self.processes = processes
        self.stop_timeout_s = drain_timeout_s + EXIT_GRACE_S
        remove_orphaned_metrics_dirs()
        self.metrics_dir = Path(tempfile.mkdtemp(prefix=f"{_METRICS_DIR_PREFIX}{os.getpid()}-"))
        self._children: dict[int, _Child] = {}
        self._restart_at: dict[int, float] = {}
        self._delay = dict.fromkeys(range(processes), RESTART_DELAY_S)
        self._signals: list[int] = []
        self._wake_read, self._wake_write = socket.socketpair()

    def run(self, on_ready: Callable[[], None]) -> int:
        """Start every child, call `on_ready` once all serve, and keep them running; the exit
        code is 0 after a signal, else that of the child that failed at start-up."""
        for sock in (self._wake_read, self._wake_write):
            sock.setblocking(False)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        old_wakeup = signal.set_wakeup_fd(self._wake_write.fileno())
        try:
            for slot in range(self.processes):
                self._start(slot)
            return self._watch(on_ready)
        finally:
            self._stop_children()
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._wake_read.close()
            self._wake_write.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _start(self, slot: int) -> None:
        ready_read, ready_write = os.pipe()
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), str(ready_write)],
                stdin=subprocess.PIPE,
                pass_fds=(ready_write,),
                process_group=0,
                env=env,
            )
        finally:
            os.close(ready_write)
        assert process.stdin is not None
        with process.stdin:
            pickle.dump((self.target, self.payload), process.stdin)
        self._children[slot] = _Child(slot, process, os.pidfd_open(process.pid), ready_read)

    def _watch(self, on_ready: Callable[[], None]) -> int:
        announced = False
        while not self._signals:
            now = time.monotonic()
            for slot, due in list(self._restart_at.items()):
                if due <= now:
                    del self._restart_at[slot]
                    self._start(slot)
            serving = [c for c in self._children.values() if c.serving]
            if not announced and len(serving) == self.processes:
                on_ready()
                announced = True
            waiting: list[socket.socket | int] = [self._wake_read]
            for child in self._children.values():
                waiting.append(child.exited)
                if child.ready is not None:
                    waiting.append(child.ready)
            timeout = max(0.0, min(self._restart_at.values()) - now) if self._restart_at else None
            for fd in wait(waiting, timeout):
                if not isinstance(fd, int):  # the signal wake-up: the loop's test sees why
                    with contextlib.suppress(BlockingIOError):
                        self._wake_read.recv(64)
                    continue
                failed = self._on_event(fd, announced)
                if failed is not None:
                    return failed
        return 0

    def _on_event(self, fd: int, announced: bool) -> int | None:
        """A child said it is ready, or exited; an exit code if the supervisor must stop."""
        child = next(c for c in self._children.values() if fd in (c.exited, c.ready))
        if fd == child.ready:
            # A word, or EOF from a child on its way out, which its pidfd will tell.
            child.serving = os.read(fd, 1) == b"\n"
            os.close(fd)
            child.ready = None
            return None
        code = child.process.wait()
        child.close()
        del self._children[child.slot]
        _mark_dead(child.process.pid, self.metrics_dir)
        if not announced:
            log.error("frontend process %d exited with %s before it served; stopping", child.slot, code)
            return code or 1
        ran = time.monotonic() - child.started
        delay = RESTART_DELAY_S if ran >= HEALTHY_RUN_S else self._delay[child.slot]
        self._delay[child.slot] = min(MAX_RESTART_DELAY_S, delay * 2)
        log.warning("frontend process %d exited with %s; restarting in %.1f s", child.slot, code, delay)
        self._restart_at[child.slot] = time.monotonic() + delay
        return None

    def _stop_children(self) -> None:
        for child in self._children.values():
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for child in self._children.values():
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("frontend process %d did not stop in time; killing it", child.slot)
                child.process.kill()
                child.process.wait()
            child.close()
        self._children.clear()


def _mark_dead(pid: int, directory: Path) -> None:
    """Drop a dead child's live gauges (in-flight, queued) from the shared metrics."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(directory))
