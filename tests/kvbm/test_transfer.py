"""TransferEngine: a pool of threads that runs up to `workers` jobs at once, refuses work
beyond `max_pending` (queued or running) instead of queueing it, survives a failing job, and
on close runs what was queued and refuses the rest."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvbm.transfer import TransferEngine
from tests.kvbm.threads import WAIT_S


def blocking(started: threading.Event, release: threading.Event) -> Callable[[], None]:
    """A job that says it started, then holds its thread until `release`."""

    def job() -> None:
        started.set()
        release.wait(WAIT_S)

    return job


def test_jobs_run_at_once_up_to_the_pool_size() -> None:
    transfer = TransferEngine(workers=2)
    release = threading.Event()
    started = [threading.Event() for _ in range(3)]
    try:
        for event in started:
            assert transfer.submit(blocking(event, release))
        # Both first jobs are running while neither has been released: they overlap.
        assert started[0].wait(WAIT_S) and started[1].wait(WAIT_S)
        assert not started[2].is_set()  # both threads are held: the third job waits for one
        release.set()
        assert started[2].wait(WAIT_S) and transfer.wait_idle(WAIT_S)
    finally:
        release.set()
        transfer.close()


def test_a_full_queue_refuses_jobs_until_one_ends() -> None:
    transfer = TransferEngine(max_pending=2, workers=1)
    release, started = threading.Event(), threading.Event()
    ran = threading.Event()
    try:
        assert transfer.submit(blocking(started, release))
        assert started.wait(WAIT_S)
        assert transfer.submit(ran.set)  # queued behind the running job: two pending
        assert not transfer.submit(ran.set)
        assert not transfer.wait_idle(0)
        release.set()
        assert ran.wait(WAIT_S) and transfer.wait_idle(WAIT_S)
        assert transfer.submit(ran.set)
    finally:
        release.set()
        transfer.close()


def test_a_failing_job_is_logged_and_the_pool_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    transfer = TransferEngine(workers=1)

    def broken() -> None:
        raise RuntimeError("a store bug")

    ran = threading.Event()
    try:
        assert transfer.submit(broken) and transfer.submit(ran.set)
        assert ran.wait(WAIT_S) and transfer.wait_idle(WAIT_S)
        assert "KV transfer failed" in caplog.text
    finally:
        transfer.close()


def test_close_runs_what_is_queued_then_refuses_jobs() -> None:
    transfer = TransferEngine(workers=3)
    done: list[int] = []
    lock = threading.Lock()

    def record(i: int) -> Callable[[], None]:
        def job() -> None:
            with lock:
                done.append(i)

        return job

    for i in range(50):
        assert transfer.submit(record(i))
    transfer.close()
    assert sorted(done) == list(range(50))
    assert not transfer.submit(record(50)) and transfer.wait_idle(0)


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError):
        TransferEngine(workers=0)


def test_close_ends_every_thread_of_the_pool() -> None:
    def pool_threads() -> int:
        return sum(t.name.startswith("weir-kv-transfers") for t in threading.enumerate())

    before = pool_threads()
    transfer = TransferEngine(workers=4)
    assert pool_threads() == before + 4
    transfer.close()
    assert pool_threads() == before
