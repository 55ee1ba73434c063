"""Runtime tests run on asyncio's own loop; the request-plane tests also on uvloop, which the
frontend and workers use in production and whose transports differ from asyncio's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

import pytest
import uvloop

from orchestrator.runtime.discovery import Discovery, make_discovery
from orchestrator.runtime.events import EventPlane, make_event_plane


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name == "test_request_plane.py":
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
async def planes() -> AsyncIterator[tuple[Discovery, EventPlane]]:
    """In-process discovery and event planes."""
    discovery, events = make_discovery(None, "test"), make_event_plane(None)
    yield discovery, events
    await events.close()
    await discovery.close()
