"""Running NVIDIA aiperf 0.13.0 (`aiperf profile`) against an OpenAI-compatible server, as an
independent yardstick for `weir bench`: one closed-loop run on the streaming **completions**
endpoint, synthetic prompts, forced output lengths, summary figures back as a dict.

aiperf lives in its own virtual environment (its dependency set clashes with ours); point
`WEIR_AIPERF` at its console script, e.g. `WEIR_AIPERF=/work/aiperf-venv/bin/aiperf`.

The command line `aiperf_command` builds (values from its arguments)::

    aiperf profile --model MODEL --url URL --endpoint-type ENDPOINT --streaming
        --tokenizer TOKENIZER_DIR --use-server-token-count
        --isl INPUT_TOKENS --isl-stddev 0 --osl OUTPUT_TOKENS --osl-stddev OUTPUT_STDDEV
        --extra-inputs '{"ignore_eos": true, "min_tokens": N, "max_tokens": N}'  (N only if fixed)
        --concurrency C --request-count R --num-dataset-entries R+W --warmup-request-count W
        --workers-max 1 --record-processors 1 [--random-seed SEED]
        --ui-type none --no-server-metrics --no-gpu-telemetry --artifact-dir ARTIFACTS

Offline. aiperf 0.13.0 cannot load a tokenizer from a local directory in HF offline mode: with
`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE` set (any non-empty value), `Tokenizer._load_from_hub`
(aiperf/common/tokenizer.py) sends every name through `snapshot_download(local_files_only=True)`,
which rejects a path ("HFValidationError: Repo id must be in the form 'repo_name' ..."). Without
them a local directory loads straight through `AutoTokenizer.from_pretrained(path)`. So the child
runs with those two variables removed and `HF_ENDPOINT` pointed at a closed loopback port, so any
hub request fails at once instead of reaching (or hanging on) the network.

How aiperf 0.13.0 defines what `run_aiperf` returns (paths under site-packages/aiperf/):

Timestamps. A request's start (`start_perf_ns`) is taken just before `session.request(...)` in
transports/aiohttp_client.py, so it includes taking a pooled connection and sending the body.
Every SSE message is stamped with the `perf_counter_ns()` of the socket read (`iter_any()` chunk)
that delivered it (transports/sse_utils.py), so messages arriving in one read share a stamp. A
"content response" is a message whose parsed data is non-empty (`ParsedResponseRecord.
content_responses`, common/models/record_models.py); for completions that means a choice with
non-empty `text` (endpoints/openai_completions.py, `make_text_response_data` in
endpoints/base_endpoint.py): the usage-only chunk, `[DONE]` and chunks whose text is "" (e.g. a
token that ends mid UTF-8 sequence) do not count.

- `ttft_p50_ms`, `ttft_p99_ms` -- `time_to_first_token` (metrics/types/ttft_metric.py): first
  content response's stamp minus request start, one value per successful request.
- `request_latency_p50_ms` -- `request_latency` (metrics/types/request_latency_metric.py): the
  *last content response's* stamp minus request start (not the usage chunk or `[DONE]`).
- `itl_p50_ms`, `itl_mean_ms` -- `inter_token_latency` (metrics/types/inter_token_latency_metric.py):
  per request `(request_latency - ttft) / (osl - 1)` (the `- 1` is the first chunk's token count
  when `--per-chunk-usage` reports it, which we do not use), requests with osl < 2 left out. One
  value per request; p50 is over requests and the mean is the unweighted mean of the per-request
  values (not total decode time / total decode tokens). The window runs from the first to the last
  *content* chunk, so a token whose text is empty at either end narrows it while osl still counts
  the token.
- `inter_chunk_p50_ms`, `inter_chunk_mean_ms` -- `inter_chunk_latency`
  (metrics/types/inter_chunk_latency_metric.py): the gaps between consecutive content responses of
  a request, all requests' gaps pooled into one sample (exact, the default "ragged" backend in
  metrics/column_store.py), so long requests weigh more. Gaps of 0 occur when two SSE events
  arrive in one socket read.
- osl (output sequence length, metrics/types/output_sequence_length_metric.py): output plus
  reasoning tokens. By default aiperf re-tokenizes the concatenated response text on the client
  (`_compute_client_side_token_counts`, records/inference_result_parser.py), which for the mocker's
  random token ids gives 64..74 for 64 generated tokens; `--use-server-token-count` makes it the
  last non-empty `usage.completion_tokens` of the stream (`_compute_server_token_counts`), which is
  exact. aiperf asks for the usage chunk itself (`stream_options.include_usage`, set by
  endpoints/openai_completions.py for every streaming run).
- `output_token_throughput` (metrics/types/output_token_throughput_metrics.py): total osl of the
  successful profiling requests / benchmark duration, where `benchmark_duration`
  (metrics/types/benchmark_duration_metric.py) runs from the earliest request start to the latest
  `start + request_latency` (last content chunk) of the profiling phase; warm-up requests are a
  separate phase (phases/warmup/ in the artifacts) and count nowhere here.
- `request_throughput` (metrics/types/request_throughput_metric.py): `request_count` (successful
  requests) / the same benchmark duration, in requests/s.
- `requests_completed` -- `request_count` (metrics/types/request_count_metric.py): successful
  profiling requests. `requests_failed` is `error_request_count` (0 when aiperf omits it).

Percentiles (all of the above) are numpy-style linear interpolation over the successful requests'
values (`metric_result_from_array`, metrics/metric_dicts.py); failed requests appear only in the
separate `adj_*` percentiles (as +inf, `MetricFlags.PERCENTILE_INCLUDES_FAILED_REQUESTS`).
Results come from `profile_export_aiperf.json` at the top of the artifact directory (the profiling
phase; `phases/profiling/profile_export_aiperf.json` holds the same figures, `phases/warmup/` the warm-up).

Prompts: `--isl N --isl-stddev 0` gives prompts of exactly N tokens by the given tokenizer (the
server's `usage.prompt_tokens` agreed, 128 of 128, for SmolLM2's tokenizer, which adds no BOS).
aiperf draws them from its own text corpus with `--random-seed`; the same seed gives the same
prompts on every run, so a second run against a server that kept its prefix cache reads most of
each prompt from that cache (seen: 12160 of 25600 prompt tokens cached) and its TTFT is flattered.
`seed` therefore defaults to None (a fresh random seed each run). aiperf's default dataset is 100
prompts reused in shuffled order; `--num-dataset-entries R+W` makes every request's prompt distinct.

Cost: aiperf runs as seven processes (system controller, dataset manager, timing manager, worker
manager, records manager, one record processor, one worker). Left alone it sizes workers as
min(concurrency, 0.75 * CPUs - 1), capped at 32, so the worker and record-processor counts are
pinned (one each by default; one asyncio worker kept 8 streams in flight with ITL equal to the
mocker's step time). On two cores start-up and shut-down add about 8 s to each run (200 requests
of 128 + 64 tokens at concurrency 8 with 10 warm-up requests: 20 s wall, 11.4 s benchmarked).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

EXPORT_FILE = "profile_export_aiperf.json"
_OFFLINE_ENV = {
    "HF_ENDPOINT": "http://127.0.0.1:9",  # closed port: any hub request fails at once
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "NO_COLOR": "1",
    "COLUMNS": "160",
}
# Truthy values of these make aiperf 0.13.0 refuse a local tokenizer directory (see above).
_UNSET_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class AiperfError(RuntimeError):
    """aiperf exited non-zero, timed out, or left no usable results."""


def aiperf_executable() -> str | None:
    """The aiperf console script named by `WEIR_AIPERF`, or None when unset or empty."""
    return os.environ.get("WEIR_AIPERF") or None


def aiperf_command(
    executable: str,
    url: str,
    model: str,
    tokenizer_dir: str,
    *,
    input_tokens: int,
    output_tokens: int,
    concurrency: int,
    requests: int,
    warmup: int,
    artifacts: Path,
    output_stddev: float = 0.0,
    workers: int = 1,
    record_processors: int = 1,
    seed: int | None = None,
    endpoint: str = "completions",
) -> list[str]:
    """The `aiperf profile` argv for one run (see the module docstring); `endpoint` is aiperf's
    endpoint type (`completions` or `chat`)."""
    # Drawn output lengths reach the server as each request's max_tokens, which ignore_eos makes
    # exact; a fixed length is also pinned by min_tokens and max_tokens.
    extra: dict[str, object] = {"ignore_eos": True}
    if not output_stddev:
        extra |= {"min_tokens": output_tokens, "max_tokens": output_tokens}
    args = [
        executable,
        "profile",
        *("--model", model, "--url", url),
        *("--endpoint-type", endpoint, "--streaming"),
        *("--tokenizer", tokenizer_dir, "--use-server-token-count"),
        *("--isl", str(input_tokens), "--isl-stddev", "0"),
        *("--osl", str(output_tokens), "--osl-stddev", f"{output_stddev:g}"),
        *("--extra-inputs", json.dumps(extra)),
        *("--concurrency", str(concurrency), "--request-count", str(requests)),
        *("--num-dataset-entries", str(requests + max(warmup, 0))),
        *("--workers-max", str(workers), "--record-processors", str(record_processors)),
        *("--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"),
        *("--artifact-dir", str(artifacts)),
    ]
    if warmup > 0:
        args += ["--warmup-request-count", str(warmup)]
    if seed is not None:
        args += ["--random-seed", str(seed)]
    return args


def aiperf_env() -> dict[str, str]:
    """The environment aiperf runs in: ours, offline for the Hugging Face hub (see above)."""
    env = {k: v for k, v in os.environ.items() if k not in _UNSET_ENV}
    env.update(_OFFLINE_ENV)
    return env


def run_aiperf(argv: list[str], artifacts: Path, timeout: float = 900.0) -> dict[str, float]:
    """Run `aiperf_command`'s argv (writing into `artifacts`); its summary figures (times in
    ms, throughputs per second). Raises AiperfError with the tail of aiperf's output if it
    fails. aiperf's console output is kept in `artifacts`/aiperf.log."""
    artifacts.mkdir(parents=True, exist_ok=True)
    log = artifacts / "aiperf.log"
    with log.open("wb") as out:
        try:
            proc = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=artifacts,
                env=aiperf_env(),
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise AiperfError(f"aiperf timed out after {timeout:g} s{_tail(log)}") from e
    if proc.returncode != 0:
        raise AiperfError(f"aiperf exited with {proc.returncode}{_tail(log)}")
    export = artifacts / EXPORT_FILE
    if not export.is_file():
        raise AiperfError(f"aiperf wrote no {export}{_tail(log)}")
    try:
        return parse_export(json.loads(export.read_text()))
    except (KeyError, TypeError, ValueError) as e:
        raise AiperfError(f"cannot read {export}: {e!r}{_tail(log)}") from e


def parse_export(data: dict[str, Any]) -> dict[str, float]:
    """The figures `run_aiperf` returns, from profile_export_aiperf.json's contents."""
    if data.get("was_cancelled"):
        raise ValueError("the run was cancelled")

    def stat(tag: str, key: str) -> float:
        return float(data[tag][key])

    figures = {
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "ttft_mean_ms": stat("time_to_first_token", "avg"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "itl_mean_ms": stat("inter_token_latency", "avg"),
        "request_latency_p50_ms": stat("request_latency", "p50"),
        "request_throughput": stat("request_throughput", "avg"),
        "output_token_throughput": stat("output_token_throughput", "avg"),
        "output_tokens_mean": stat("output_sequence_length", "avg"),
        "benchmark_duration_s": stat("benchmark_duration", "avg"),
        "requests_completed": stat("request_count", "avg"),
        "requests_failed": float(data.get("error_request_count", {}).get("avg", 0.0)),
    }
    if "inter_chunk_latency" in data:
        figures["inter_chunk_p50_ms"] = stat("inter_chunk_latency", "p50")
        figures["inter_chunk_mean_ms"] = stat("inter_chunk_latency", "avg")
    units = {
        "time_to_first_token": "ms",
        "inter_token_latency": "ms",
        "request_latency": "ms",
        "request_throughput": "requests/sec",
        "output_token_throughput": "tokens/sec",
        "benchmark_duration": "sec",
    }
    for tag, unit in units.items():
        if data[tag].get("unit") != unit:
            raise ValueError(f"{tag} is in {data[tag].get('unit')!r}, expected {unit!r}")
    return figures


def _tail(log: Path, chars: int = 4000) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return f"; the end of its output ({log}):\n{text[-chars:]}"


def request_ttfts_ms(artifacts: Path) -> list[float]:
    """Every profiled request's TTFT (ms) from the run's per-request export (profile_export.jsonl)."""
    ttfts = []
    for line in (artifacts / "profile_export.jsonl").read_text().splitlines():
        record = json.loads(line)
        if (
            record["metadata"]["benchmark_phase"] == "profiling"
            and "time_to_first_token" in record["metrics"]
        ):
            ttfts.append(float(record["metrics"]["time_to_first_token"]["value"]))
    return ttfts
