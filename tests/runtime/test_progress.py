"""Progress bars show on a terminal only."""

from __future__ import annotations

import io

import pytest

from orchestrator.runtime.progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr", [io.StringIO(), _Terminal()], ids=["pipe", "terminal"])
def test_a_bar_draws_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch, stderr: io.StringIO) -> None:
    monkeypatch.setattr("sys.stderr", stderr)
    with progress_bar(3, "work", "step") as bar:
        for _ in range(3):
            bar.update()
    # Silent into a pipe or a log; on a terminal it drew something (what is tqdm's business).
    assert bool(stderr.getvalue()) is stderr.isatty()
