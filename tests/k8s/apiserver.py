"""A real kube-apiserver on 127.0.0.1 for tests, envtest-style: its own etcd, a self-signed
certificate, a static admin token and RBAC, but no kubelet and no controllers. Objects are
stored and validated and subresources work; `status` changes only when a test writes it."""

from __future__ import annotations

import functools
import gzip
import os
import secrets
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.servers import etcd_server, free_port, stop_process
from tests.waiting import wait_until


@dataclass(frozen=True)
class ApiServer:
    url: str
    token: str
    ca_file: Path
    kubeconfig: Path

    def write_kubeconfig(self, path: Path, user: str, token: str) -> Path:
        """A kubeconfig for another identity (to test what RBAC refuses)."""
        _write_kubeconfig(path, self.url, self.ca_file, user, token)
        return path


def unpack(binary: Path, workdir: Path) -> Path:
    """The env var may name the .gz as shipped or an unpacked binary."""
    if binary.suffix != ".gz":
        return binary
    target = workdir / "kube-apiserver"
    with gzip.open(binary, "rb") as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    target.chmod(0o755)
    return target


def _service_account_keys(workdir: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = workdir / "sa.key", workdir / "sa.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def _write_kubeconfig(path: Path, url: str, ca_file: Path, user: str, token: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": url, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "test", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))


def _ready(url: str, token: str, ca_file: Path) -> bool:
    if not ca_file.exists():
        return False
    try:
        context = ssl.create_default_context(cafile=str(ca_file))
        request = urllib.request.Request(f"{url}/readyz", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, context=context, timeout=2) as response:
            return bool(response.status == 200)
    except Exception:  # not up yet: refused, 500 while post-start hooks run, ...
        return False


@contextmanager
def kube_apiserver(
    binary: Path, workdir: Path, *, extra_tokens: dict[str, str] | None = None
) -> Iterator[ApiServer]:
    """Starts etcd and kube-apiserver; `extra_tokens` maps user name -> token (no groups)."""
    executable = unpack(binary, workdir)
    token = secrets.token_hex(16)
    lines = [f"{token},admin,admin,system:masters"]
    lines += [f"{tok},{user},{user}" for user, tok in (extra_tokens or {}).items()]
    (workdir / "tokens.csv").write_text("\n".join(lines) + "\n")
    sa_key, sa_pub = _service_account_keys(workdir)
    port = free_port()
    certs = workdir / "certs"
    with etcd_server(workdir) as etcd_url:
        args = [
            str(executable),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            "--insecure-port=0",
            f"--cert-dir={certs}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}",
            f"--token-auth-file={workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--disable-admission-plugins=ServiceAccount",
            "--allow-privileged=true",
        ]
        url = f"https://127.0.0.1:{port}"
        ca_file = certs / "apiserver.crt"
        log = workdir / "kube-apiserver.log"
        with log.open("wb") as out:
            # GOMAXPROCS: the apiserver would otherwise spin a thread per core; 2 is plenty here.
            env = {**os.environ, "GOMAXPROCS": "2"}
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            ready = functools.partial(_ready, url, token, ca_file)
            wait_until(ready, "kube-apiserver to be ready", 60, proc=proc, log=log, interval=0.2)
            kubeconfig = workdir / "kubeconfig"
            _write_kubeconfig(kubeconfig, url, ca_file, "admin", token)
            yield ApiServer(url=url, token=token, ca_file=ca_file, kubeconfig=kubeconfig)
        finally:
            stop_process(proc)
