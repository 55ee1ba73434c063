"""The discovery key layout, relative to a namespace root (`weir/<namespace>/` in etcd)."""

from __future__ import annotations


def namespace_root(namespace: str) -> str:
    return f"weir/{namespace}/"


def instances_prefix(component: str | None = None) -> str:
    return "instances/" if component is None else f"instances/{component}/"


def instance_key(component: str, instance_id: str) -> str:
    return f"instances/{component}/{instance_id}"


def drain_key(instance_id: str) -> str:
    """Present: the instance should drain (finish in-flight work, take no new work)."""
    return f"drain/{instance_id}"


def drained_key(instance_id: str) -> str:
    """Present (leased): the instance has drained and can be stopped."""
    return f"drained/{instance_id}"
