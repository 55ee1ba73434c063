"""A simulated engine, stepped in virtual time.

`MockerCore` runs DeepInfer's real scheduler and block manager (continuous batching,
chunked prefill, prefix caching, preemption, KV events) and replaces the model with a
timing model and a deterministic token generator, which ends each request with EOS after a
length drawn from its seed. It never sleeps and never touches an
event loop: `step()` returns how long the step would have taken, and the caller decides
what to do with that, either wait it out (`MockerEngine`) or advance a virtual clock
(offline trace replay, driving many cores at once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from statistics import NormalDist

import xxhash

from backends.deepinfer import transfers
from backends.deepinfer.config import EngineConfig
from backends.deepinfer.draws import position_bits
from backends.deepinfer.outputs import SampledToken
from backends.deepinfer.scheduler import Scheduler
from backends.deepinfer.sequence import Sequence
from backends.mocker.config import MockerConfig
from kvbm import records
from kvbm.records import Payload
from kvbm.stores import HostStore, RemoteStore
from kvbm.tiered import TieredStore
from orchestrator.runtime.protocol import (
    FinishReason,
    KvEventBatch,
    KvSnapshot,
    KvTransfer,
    LoadReport,
    Usage,
    WorkerRequest,
)

_STANDARD_NORMAL = NormalDist()


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. `usage` comes with the last output only."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    kv_transfer: KvTransfer | None = None  # a finished prefill-only request's held KV


@dataclass(slots=True)
class StepResult:
    duration_ms: float  # simulated, before any speedup
    outputs: list[RequestOutput]


class MockerCore:
    def __init__(self, config: MockerConfig, shared: RemoteStore | None = None) -> None:
        """`shared`: a remote tier (G4) shared with other cores, as one Redis is by a model's
        workers; it needs `host_cache_blocks` (the host tier above it)."""
        self.config = config
        engine_config = EngineConfig(
            block_size=config.block_size,
            num_kv_blocks=config.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.context_length,
            enable_prefix_caching=config.enable_prefix_caching,
            kv_eviction=config.kv_eviction,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.tiers = _tiers(config, shared)
        # The scheduler applies EOS as DeepInfer's does (min_tokens, ignore_eos, finish "stop").
        self.scheduler = Scheduler(engine_config, config.num_blocks, config.eos_token_ids, tiers=self.tiers)
        self.kv_cache = self.scheduler.kv_cache
        self.timing = config.timing
        self._curves = self.timing.curves()
        self.block_bytes = config.kv_bytes_per_token * config.block_size
        self._load_ms: dict[str, float] = {
            "host": self.block_bytes / (config.host_bandwidth_gbps * 1e6),
            "disk": self.block_bytes / (config.disk_bandwidth_gbps * 1e6),
            "remote": self.block_bytes / (config.remote_bandwidth_gbps * 1e6),
            "transfer": 0.0,  # already in the device: the wait was before admission
        }
        # Prefill and decode mockers of one model exchange blocks under this id; the records
        # carry no payload (the mocker moves no bytes), their time is simulated from block_bytes.
        self.layout = records.layout_id(
            config.model_name, "mocker", config.block_size, config.kv_bytes_per_token
        )
        self.clock_ms = 0.0  # simulated time spent in steps so far
        self._eos = config.eos_token_ids[0]
        self._eos_ids = frozenset(config.eos_token_ids)
        # request id -> (token seed, the output length that ends with EOS; 0 for none)
        self._requests: dict[str, tuple[int, int]] = {}

    # ------------------------------------------------------------------ requests

    def add(self, request: WorkerRequest, arriving: bool = False) -> Sequence:
        """Queue a request and return its sequence; ValueError with a client-facing message if
        it can never run. `arriving`: its prompt KV is on its way from a prefill worker, and
        it runs after `arrive`."""
        seq = self.scheduler.add(request, arriving)
        seed = request.sampling.seed
        if seed is None:
            seed = xxhash.xxh3_64_intdigest(request.request_id.encode())
        eos_at = 0 if request.ignore_eos else max(self.output_length(seed), request.min_tokens)
        self._requests[request.request_id] = (seed, eos_at)
        return seq

    def output_length(self, seed: int) -> int:
        """How many tokens a request with this seed generates, EOS included, when nothing
        (max_tokens, the context length) cuts it short."""
        config = self.config
        mean = config.output_length_mean
        if config.output_length_distribution == "fixed":
            return max(1, round(mean))
        # Position -1 of the seed's token stream, which no token uses, so the length does not
        # follow from any token; mapped into (0, 1).
        u = (position_bits(seed, -1) + 0.5) / 2.0**64
        if config.output_length_distribution == "geometric":
            # Every token is EOS with probability 1/mean: memoryless, many short answers.
            if mean <= 1:
                return 1
            return 1 + int(math.log(u) / math.log1p(-1.0 / mean))
        sigma = config.output_length_sigma
        mu = math.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
        return max(1, round(math.exp(mu + sigma * _STANDARD_NORMAL.inv_cdf(u))))

    def arrive(self, request_id: str, arrived: dict[int, Payload]) -> None:
        """An arriving request's prompt blocks (`check_arrived`): it runs from the next step."""
        self.scheduler.arrive(request_id, arrived)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its blocks; its final output, or None if unknown."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        del self._requests[request_id]
        return RequestOutput(request_id, [], "abort", _usage(seq))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ disaggregation

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        held = self.scheduler.held.get(transfer_id)
        if held is None or not held.blocks:
            return None
        return transfers.to_records(held.blocks, [b""] * len(held.blocks), self.layout)

    def release_transfer(self, transfer_id: str) -> None:
        self.scheduler.release(transfer_id)

    def check_arrived(self, transfer: KvTransfer, arrived_kv: Seq[bytes | memoryview]) -> dict[int, Payload]:
        return transfers.arrived_blocks(transfer, arrived_kv, self.layout, 0)

    def transfer_ms(self, num_blocks: int) -> float:
        """Simulated time for `num_blocks` of KV to come from a prefill worker."""
        return num_blocks * self.block_bytes / (self.config.transfer_bandwidth_gbps * 1e6)

    # ------------------------------------------------------------------ one step

    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        if out.is_empty:
            return StepResult(0.0, [])
        sampled: list[SampledToken] = []
        requests = self._requests
        for chunk in out.chunks:
            seq = chunk.seq
            length = len(seq.token_ids)
            if chunk.sample:
                seed, eos_at = requests[seq.request_id]
                if length - seq.num_prompt_tokens + 1 == eos_at:
                    token = self._eos
                else:
                    token = self._draw(seed, length)
                sampled.append(SampledToken(token))
        prefill_tokens, decoding = out.shape()
        duration = self.timing.with_loads(
            self.timing.step_ms(prefill_tokens, decoding, self.kv_cache.usage),
            sum(self._load_ms[load.source] for load in out.loads),
            self.config.num_layers,
        )
        self.clock_ms += duration
        outputs: list[RequestOutput] = []
        results = self.scheduler.postprocess(out, sampled)
        if self.tiers is not None:
            self.tiers.offload((seq_hash, b"") for _, seq_hash in self.kv_cache.take_saves())
        for result in results:
            seq = result.seq
            token_ids = seq.token_ids[-len(result.new_tokens) :]
            if result.finished:
                del self._requests[seq.request_id]
                reason: FinishReason = "stop" if seq.finish_reason == "stop" else "length"
                held = self.scheduler.held.get(seq.request_id)
                transfer = transfers.describe(seq.request_id, held, self.layout, self.block_bytes)
                outputs.append(RequestOutput(seq.request_id, token_ids, reason, _usage(seq), transfer))
            else:
                outputs.append(RequestOutput(seq.request_id, token_ids))
        return StepResult(duration, outputs)

    def _draw(self, seed: int, position: int) -> int:
        token = _token(seed, position, self.config.vocab_size)
        while token in self._eos_ids:  # only the drawn length ends a request
            token = (token + 1) % self.config.vocab_size
        return token

    # ------------------------------------------------------------------ decode stretches

    def decode_stretch(self) -> tuple[int, float]:
        """(steps, ms each): how many of the next steps are the same decode step, which a
        simulation in virtual time may take at once (`advance`); (0, 0.0) when the next step
        is not one. The scheduler rules out every change but EOS, which falls here at the
        length drawn for each request; a request with stop ids ends on tokens nobody has
        drawn yet, so it steps one at a time."""
        steps = self.scheduler.decode_stretch()
        if steps < 2:
            return 0, 0.0
        for seq in self.scheduler.running:
            if seq.request.stop_token_ids:
                return 0, 0.0
            eos_at = self._requests[seq.request_id][1]
            if eos_at:
                steps = min(steps, eos_at - seq.num_completion_tokens - 1)
        if steps < 2:
            return 0, 0.0
        return steps, self.timing.step_ms(0, True, self.kv_cache.usage)

    def advance(self, steps: int, step_ms: float) -> StepResult:
        """Take `steps` steps of `step_ms` that `decode_stretch` found alike: one output per
        running sequence with its `steps` tokens, as that many calls of `step` would give."""
        running = self.scheduler.running
        requests, draw = self._requests, self._draw
        tokens = []
        for seq in running:
            seed, length = requests[seq.request_id][0], len(seq.token_ids)
            tokens.append([draw(seed, position) for position in range(length, length + steps)])
        self.scheduler.advance(steps, tokens)
        for _ in range(steps):
            self.clock_ms += step_ms
        outputs = [RequestOutput(seq.request_id, new) for seq, new in zip(running, tokens, strict=True)]
        return StepResult(steps * step_ms, outputs)

    # ------------------------------------------------------------------ observability

    def load(self) -> LoadReport:
        report = self.scheduler.load()
        report.step_time = self._curves  # the curve it simulates: the router predicts with it
        return report

    def take_kv_events(self) -> list[KvEventBatch]:
        return self.kv_cache.take_events()

    def kv_snapshot(self) -> KvSnapshot:
        return self.kv_cache.snapshot()


def _tiers(config: MockerConfig, shared: RemoteStore | None) -> TieredStore | None:
    """Simulated tiers: the real policy (kvbm.TieredStore) over stores that keep hashes only."""
    if not config.host_cache_blocks:
        if shared is not None:
            raise ValueError("a shared tier needs a host tier above it (host_cache_blocks)")
        return None
    disk = HostStore(config.disk_cache_blocks, 0, tier="disk") if config.disk_cache_blocks else None
    return TieredStore(
        HostStore(config.host_cache_blocks, 0),
        disk=disk,
        remote=shared,
        name=config.model_name,
        worker_id=config.worker_id,
    )


def _token(seed: int, position: int, vocab_size: int) -> int:
    """The token at `position`: a function of (seed, position) only, so the same seed gives
    the same tokens whatever else runs, a preempted sequence regenerates nothing, and a
    migrated one (resumed after its generated tokens) continues exactly."""
    return position_bits(seed, position) % vocab_size


def _usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_completion_tokens,
        cached_tokens=seq.num_cached_tokens,
    )
