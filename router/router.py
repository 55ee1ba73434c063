"""The `Router` facade: keeps the worker set and their load, and asks the policy to pick.

The frontend calls `select` before dispatching and `on_finish` when a request ends, so the
router counts its own in-flight requests between workers' load reports."""

from __future__ import annotations

from router.policies.base import Policy
from router.policies.direct import DirectPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.random import RandomPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.protocols import Decision, NoWorkerAvailable, RouteRequest, WorkerLoad

MODES = ("kv", "round-robin", "random", "least-loaded", "direct")


def make_policy(mode: str) -> Policy:
    if mode == "round-robin":
        return RoundRobinPolicy()
    if mode == "random":
        return RandomPolicy()
    if mode == "least-loaded":
        return LeastLoadedPolicy()
    if mode == "direct":
        return DirectPolicy()
    raise ValueError(f"unknown router mode {mode!r}; choose one of {', '.join(MODES)}")


class Router:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.workers: dict[str, WorkerLoad] = {}

    def add_worker(self, worker_id: str, total_blocks: int = 0) -> None:
        self.workers.setdefault(worker_id, WorkerLoad(total_blocks=total_blocks))

    def remove_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def set_draining(self, worker_id: str, draining: bool) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].draining = draining

    def select(self, request: RouteRequest) -> Decision:
        candidates = {w: load for w, load in self.workers.items() if not load.draining}
        if not candidates:
            raise NoWorkerAvailable("no worker is available for this model")
        decision = self.policy.select(request, candidates)
        self.workers[decision.worker_id].active_requests += 1
        return decision

    def on_finish(self, worker_id: str) -> None:
        load = self.workers.get(worker_id)
        if load is not None and load.active_requests > 0:
            load.active_requests -= 1
