"""DeepInfer's own Prometheus series, read from the engines at scrape time.

Speculative decoding: `weir_deepinfer_spec_draft_tokens_total` counts the draft tokens the
engines verified and `weir_deepinfer_spec_accepted_tokens_total` the ones the model agreed
with, per served model (engines of one model in one process, `weir serve --workers N`, add
up); their ratio is the acceptance rate. The scheduler keeps the totals, so a step costs
nothing extra for them.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from backends.deepinfer.engine import Engine


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self._engines: weakref.WeakSet[Engine] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, engine: Engine) -> None:
        with self._lock:
            self._engines.add(engine)

    def collect(self) -> Iterator[CounterMetricFamily]:
        drafts: defaultdict[str, int] = defaultdict(int)
        accepted: defaultdict[str, int] = defaultdict(int)
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            scheduler = engine.scheduler
            if scheduler.speculating:
                drafts[engine.name] += scheduler.num_draft_tokens
                accepted[engine.name] += scheduler.num_accepted_tokens
        drafted = CounterMetricFamily(
            "weir_deepinfer_spec_draft_tokens",
            "Draft tokens verified by speculative decoding",
            labels=["model"],
        )
        agreed = CounterMetricFamily(
            "weir_deepinfer_spec_accepted_tokens", "Draft tokens the model agreed with", labels=["model"]
        )
        for name, count in drafts.items():
            drafted.add_metric([name], count)
            agreed.add_metric([name], accepted[name])
        yield drafted
        yield agreed


ENGINES = _EngineCollector()
REGISTRY.register(ENGINES)
