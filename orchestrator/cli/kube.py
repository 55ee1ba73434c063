"""What the operator commands share about the Kubernetes API: flags, the client, and errors.

Every failure becomes an `OperatorError` carrying a sentence for the user and an exit code,
so `weir scale`, `weir status` and `weir drain` fail the same way and scripts can tell a
missing pool from a missing permission from an unreachable server.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from orchestrator.cli.options import env_default

# Exit codes.
EXIT_FAILED = 1  # the operation ran and failed (e.g. a drain timed out)
EXIT_USAGE = 2  # what argparse uses for bad arguments; also an ambiguous pool
EXIT_NOT_FOUND = 3  # no such pool, release or worker
EXIT_FORBIDDEN = 4  # the credentials were refused (401) or lack a permission (403)
EXIT_UNREACHABLE = 5  # the API server (or etcd) did not answer, or no cluster is configured

# (connect, read) seconds per API call: an operator command should fail fast, not hang.
REQUEST_TIMEOUT = (5.0, 30.0)
_IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def meta(obj: Any) -> client.V1ObjectMeta:
    """An API object's metadata: always present on objects read back, Optional in the types."""
    return obj.metadata or client.V1ObjectMeta()


class OperatorError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Kubernetes")
    group.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config; inside a pod: the service account)",
    )
    group.add_argument("--context", help="kubeconfig context (default: the current one)")
    group.add_argument(
        "-n",
        "--namespace",
        # Not WEIR_NAMESPACE: that is the weir namespace (--weir-namespace), which the chart's pods get.
        default=env_default("WEIR_KUBE_NAMESPACE"),
        help="Kubernetes namespace of the release (env WEIR_KUBE_NAMESPACE; default: the context's "
        "namespace, else 'default')",
    )
    group.add_argument(
        "--release", help="Helm release name (needed only when several releases share the namespace)"
    )


def _in_cluster(args: argparse.Namespace) -> bool:
    # Explicit kubeconfig flags win; otherwise a pod uses its service account.
    return not (args.kubeconfig or args.context) and "KUBERNETES_SERVICE_HOST" in os.environ


def kubernetes_configured(args: argparse.Namespace) -> bool:
    """Whether there is any Kubernetes configuration to use: --kubeconfig or --context, a pod's
    service account, or a kubeconfig file where the client looks ($KUBECONFIG's paths, else
    ~/.kube/config). False means "not set up here", not "set up and failing"."""
    if args.kubeconfig or args.context or _in_cluster(args):
        return True
    paths = os.environ.get("KUBECONFIG") or "~/.kube/config"
    return any(Path(p).expanduser().is_file() for p in paths.split(os.pathsep) if p)


def api_client(args: argparse.Namespace) -> client.ApiClient:
    configuration = client.Configuration()
    try:
        if _in_cluster(args):
            config.load_incluster_config(client_configuration=configuration)
        else:
            if args.kubeconfig and not Path(args.kubeconfig).is_file():
                raise OperatorError(f"kubeconfig {args.kubeconfig} does not exist", EXIT_UNREACHABLE)
            config.load_kube_config(
                config_file=args.kubeconfig, context=args.context, client_configuration=configuration
            )
    except ConfigException as exc:
        raise OperatorError(f"no usable Kubernetes configuration: {exc}", EXIT_UNREACHABLE) from exc
    # One quick try: urllib3's default of three retries turns "server down" into a long hang.
    configuration.retries = 1
    return client.ApiClient(configuration)


def namespace(args: argparse.Namespace) -> str:
    if args.namespace:
        return str(args.namespace)
    if _in_cluster(args):
        return _IN_CLUSTER_NAMESPACE.read_text().strip() if _IN_CLUSTER_NAMESPACE.exists() else "default"
    try:
        contexts, current = config.list_kube_config_contexts(config_file=args.kubeconfig)
    except ConfigException:
        return "default"
    chosen = next((c for c in contexts if c["name"] == args.context), current) if args.context else current
    return str((chosen or {}).get("context", {}).get("namespace") or "default")


@contextmanager
def api_errors(api: client.ApiClient, doing: str) -> Iterator[None]:
    """Turns the client's exceptions into one-line `OperatorError`s; `doing` completes
    "cannot ..." (e.g. "list Deployments in namespace prod")."""
    server = api.configuration.host
    try:
        yield
    except ApiException as exc:
        if exc.status == 401:
            raise OperatorError(
                f"cannot {doing}: {server} refused the credentials (401 Unauthorized)", EXIT_FORBIDDEN
            ) from exc
        if exc.status == 403:
            raise OperatorError(
                f"cannot {doing}: permission denied (403). {_reason(exc)} Bind the chart's "
                "'<release>-weir-operator' Role to this user (values: operatorRole.subjects).",
                EXIT_FORBIDDEN,
            ) from exc
        if exc.status == 404:
            raise OperatorError(f"cannot {doing}: not found (404). {_reason(exc)}", EXIT_NOT_FOUND) from exc
        raise OperatorError(f"cannot {doing}: API error {exc.status} {exc.reason}. {_reason(exc)}") from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise OperatorError(
            f"cannot {doing}: the Kubernetes API server at {server} is unreachable ({_root_cause(exc)})",
            EXIT_UNREACHABLE,
        ) from exc


def _reason(exc: ApiException) -> str:
    """The server's own message from a Status body, when there is one."""
    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except ValueError:
        message = ""
    return f"{message}." if message and not message.endswith(".") else str(message)


def _root_cause(exc: BaseException) -> str:
    while isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    return str(exc) or type(exc).__name__
