"""Logits to tokens for a batch whose rows each carry their own sampling parameters.

The order follows vLLM v1's sampler, so a request behaves the same on either engine:

1. raw logprobs (``log_softmax`` of the logits as they arrive: the model's distribution with
   any grammar mask already applied, before penalties, bias or temperature; vLLM's default
   ``logprobs_mode="raw_logprobs"``),
2. ``min_tokens`` (EOS and stop token ids masked until reached; not for guided requests,
   whose grammar decides when they end), ``logit_bias``,
3. penalties: repetition over prompt + generated tokens, frequency and presence over
   generated tokens only,
4. greedy rows (temperature 0) take the argmax here,
5. temperature, then min-p, then top-k / top-p,
6. sampling by inverse CDF: one uniform draw per row. A seeded request's draw for output
   position i is a function of (seed, i) (`draws.position_uniform`), so its tokens depend
   neither on what else is in the batch nor on the worker: a request migrated after i tokens
   continues exactly as it would have.

Each stage runs only when some row in the batch needs it, so an all-greedy batch costs one
argmax. In deterministic mode rows are processed one at a time, which makes every reduction
(softmax, sort, cumsum) see the same shape whether the request runs alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from backends.deepinfer.draws import position_uniform
from backends.deepinfer.outputs import SampledToken, ScheduledChunk
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest

_GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
_TOP_P_WINDOW = 1024  # candidates examined for top-p before falling back to a full sort


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equal ones). On the CPU numpy's
    vectorised argmax does it, with the same indices: with torch's, sampling a SmolLM2 decode
    step of 32 rows took 1.58 ms, with numpy's 0.38 (`benchmarks/step_phases.py`)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def validate_request(request: WorkerRequest, vocab_size: int) -> None:
    """Reject sampling parameters the sampler cannot honour (raises ValueError)."""
    s = request.sampling
    if s.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p}")
    if not 0 <= s.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {s.min_p}")
    if s.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {s.repetition_penalty}")
    if request.max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {request.max_tokens}")
    if request.min_tokens < 0 or request.min_tokens > request.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens], got {request.min_tokens}")
    if request.logprobs is not None and not 0 <= request.logprobs <= 20:
        raise ValueError(f"logprobs must be in [0, 20], got {request.logprobs}")
    for name, ids in (
        ("token_ids", request.token_ids),
        ("generated_token_ids", request.generated_token_ids),
        ("stop_token_ids", request.stop_token_ids),
        ("logit_bias", list(s.logit_bias or ())),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


class SampleRow(Protocol):
    """What sampling one row reads of its sequence (a `Sequence` is one)."""

    @property
    def request(self) -> WorkerRequest: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_completion_tokens(self) -> int: ...


@dataclass(slots=True)
class DraftedRow:
    """A sequence as it will stand if the draft tokens before this row are accepted, so a
    draft's row samples exactly as the decode step after them would: penalties over those
    tokens, `min_tokens` counted with them, the seeded draw of that output position."""

    request: WorkerRequest
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def sample_rows(chunk: ScheduledChunk) -> list[SampleRow]:
    """The rows a sampled chunk's logits have: its sequence, then one per draft token."""
    seq = chunk.seq
    rows: list[SampleRow] = [seq]
    for j in range(1, len(chunk.draft) + 1):
        rows.append(DraftedRow(seq.request, [*seq.token_ids, *chunk.draft[:j]], seq.num_prompt_tokens))
    return rows


def _is_greedy(s: SamplingOptions) -> bool:
    return s.temperature < _GREEDY_EPS


class Sampler:
    def __init__(
        self, vocab_size: int, eos_token_ids: Iterable[int], seed: int = 0, deterministic: bool = False
    ):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.deterministic = deterministic
        self._seed = seed
        self._generator: torch.Generator | None = None  # unseeded rows, created on the logits' device

    def __call__(self, logits: torch.Tensor, seqs: list[SampleRow]) -> list[SampledToken]:
        """Sample one token per row; row i belongs to `seqs[i]`. `logits` is (len(seqs), vocab)."""
        if self.deterministic and len(seqs) > 1:
            return [t for i, seq in enumerate(seqs) for t in self._sample(logits[i : i + 1], [seq])]
        return self._sample(logits, seqs)

    # ------------------------------------------------------------------ the pipeline

    def _sample(self, logits: torch.Tensor, seqs: list[SampleRow]) -> list[SampledToken]:
        params = [seq.request.sampling for seq in seqs]
        logits = logits.float()
        num_logprobs = [seq.request.logprobs for seq in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in num_logprobs) else None
        logits = self._apply_min_tokens(logits, seqs)
        logits = self._apply_logit_bias(logits, params)
        logits = _apply_penalties(logits, seqs)

        greedy = [_is_greedy(p) for p in params]
        if all(greedy):
            sampled = argmax(logits)
        else:
            random = self._sample_random(logits, seqs, params, greedy)
            if any(greedy):
                mask = torch.tensor(greedy, device=logits.device)
                sampled = torch.where(mask, argmax(logits), random)
            else:
                sampled = random
        token_ids: list[int] = sampled.tolist()
        if raw_logprobs is None:
            return [SampledToken(t) for t in token_ids]
        return _with_logprobs(raw_logprobs, sampled, token_ids, num_logprobs)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[SampleRow]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            req = seq.request
            # A grammar decides by itself when its output may end; masking its stop token
            # could leave a row with nothing allowed.
            if seq.num_completion_tokens >= req.min_tokens or req.guided is not None:
                continue
            stop_ids = req.stop_token_ids if req.ignore_eos else [*self.eos_token_ids, *req.stop_token_ids]
            rows.extend([i] * len(stop_ids))
            cols.extend(stop_ids)
        if rows:
            logits = logits.clone()
            logits[rows, cols] = float("-inf")
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingOptions]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
        if rows:
            logits = logits.clone()
            logits[rows, cols] += torch.tensor(values, device=logits.device)
        return logits

    def _sample_random(
        self, logits: torch.Tensor, seqs: list[SampleRow], params: list[SamplingOptions], greedy: list[bool]
    ) -> torch.Tensor:
        device = logits.device
        # Greedy rows ride along with temperature 1; their draw is discarded by the caller.
        temps = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device=device
        )
        logits = logits / temps.unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            logits = _apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        if any(0 < p.top_k < self.vocab_size or p.top_p < 1 for p in params):
            k = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params]
            logits = _apply_top_k_top_p(
                logits, torch.tensor(k, device=device), torch.tensor([p.top_p for p in params], device=device)
            )
        # Inverse-CDF sampling: one uniform draw per row. A seeded row's draw is a function of
        # (seed, output position), so its tokens depend on neither its neighbours nor the
        # worker. (vLLM's exponential race needs a draw per vocabulary entry, ~30x slower on CPU
        # at a 49k vocabulary.)
        u = torch.empty(len(params), 1, device=device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            draws = torch.rand(len(unseeded), 1, device=device, generator=self._default_generator(device))
            u[unseeded] = draws
        seeded = [
            (i, position_uniform(p.seed, seq.num_completion_tokens))
            for i, (seq, p) in enumerate(zip(seqs, params, strict=True))
            if p.seed is not None
        ]
        if seeded:
            u[[i for i, _ in seeded]] = torch.tensor([[v] for _, v in seeded], device=device)
        cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)
        # right=True: the first index whose cumulative mass exceeds the draw, so a token of
        # probability zero is never chosen.
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        return picked.squeeze(1).clamp_(max=logits.shape[-1] - 1)

    def _default_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self._seed)
        return self._generator


# ---------------------------------------------------------------------- stages as pure functions


def _padded_ids(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids as one (len(rows), width) tensor, each padded with its own first id
    (so a scatter of per-id values writes the same value twice, never a conflicting one), an
    empty row with 0; and which rows are non-empty."""
    width = max(1, max(len(r) for r in rows))
    padded = [r + [r[0] if r else 0] * (width - len(r)) for r in rows]
    nonempty = torch.tensor([bool(r) for r in rows], device=device).unsqueeze(1)
    return torch.tensor(padded, device=device), nonempty


def _apply_penalties(logits: torch.Tensor, seqs: list[SampleRow]) -> torch.Tensor:
    """Penalties touch only the ids a row has seen: gathers and scatters over (rows, tokens
    seen), not passes over the whole vocabulary."""
    params = [seq.request.sampling for seq in seqs]
    rep_rows = [p.repetition_penalty != 1.0 for p in params]
    out_rows = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not (any(rep_rows) or any(out_rows)):
        return logits
    device = logits.device
    logits = logits.clone()
    if any(rep_rows):
        ids, nonempty = _padded_ids(
            [seq.token_ids if r else [] for seq, r in zip(seqs, rep_rows, strict=True)], device
        )
        rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        seen = logits.gather(1, ids)
        # Shrink seen tokens' logits towards "less likely" whatever their sign (CTRL / vLLM).
        penalized = torch.where(seen > 0, seen / rep, seen * rep)
        logits.scatter_(1, ids, torch.where(nonempty, penalized, seen))
    if any(out_rows):
        outputs = [
            seq.token_ids[seq.num_prompt_tokens :] if o else [] for seq, o in zip(seqs, out_rows, strict=True)
        ]
        ids, nonempty = _padded_ids(outputs, device)
        pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        seen = logits.gather(1, ids)
        logits.scatter_(1, ids, torch.where(nonempty, seen - pres, seen))  # once per distinct id
        freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        lengths = torch.tensor([len(o) for o in outputs], device=device).unsqueeze(1)
        real = torch.arange(ids.shape[1], device=device).unsqueeze(0) < lengths
        logits.scatter_add_(1, ids, -freq * real)  # once per occurrence
    return logits


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep each row's k best tokens, then its smallest set whose probability reaches p.

    Both cut-offs are read off the best `width` tokens of each row (`topk`, not a full sort of
    the vocabulary, which costs ~100x more on CPU); a row whose nucleus is wider than that
    window falls back to a full sort."""
    vocab = logits.shape[-1]
    k_rows, p_rows = k < vocab, p < 1
    width = min(
        vocab,
        max(int(k[k_rows].max()) if bool(k_rows.any()) else 0, _TOP_P_WINDOW if bool(p_rows.any()) else 0),
    )
    values, _ = logits.topk(width, dim=-1)
    floor = torch.full_like(values[:, :1], float("-inf"))
    if bool(k_rows.any()):
        kth = values.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
        floor = torch.where(k_rows.unsqueeze(1), kth, floor)
    if bool(p_rows.any()):
        # Probabilities after the top-k cut, as the nucleus is taken among the survivors.
        survivors = logits.masked_fill(logits < floor, float("-inf")) if bool(k_rows.any()) else logits
        lse = torch.logsumexp(survivors, dim=-1, keepdim=True)
        mass = (values.masked_fill(values < floor, float("-inf")) - lse).exp().cumsum(dim=-1)
        # Keep a token while the mass of the better ones is below p.
        keep = (mass < p.unsqueeze(1)).sum(dim=-1, keepdim=True) + 1
        nucleus = values.gather(1, keep.clamp(max=width) - 1)
        floor = torch.where(p_rows.unsqueeze(1), torch.maximum(floor, nucleus), floor)
        wide = (p_rows.unsqueeze(1) & (keep > width)).squeeze(1)
        if bool(wide.any()):
            floor[wide] = _nucleus_floor_by_sort(
                logits[wide].masked_fill(logits[wide] < floor[wide], float("-inf")), p[wide]
            )
    return logits.masked_fill(logits < floor, float("-inf"))


def _nucleus_floor_by_sort(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The smallest logit each row keeps under top-p, from a full descending sort."""
    ordered, _ = logits.sort(dim=-1, descending=True)
    mass = ordered.softmax(dim=-1).cumsum(dim=-1)
    keep = (mass < p.unsqueeze(1)).sum(dim=-1, keepdim=True) + 1
    return ordered.gather(1, keep.clamp(max=logits.shape[-1]) - 1)


def _with_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, token_ids: list[int], num_logprobs: list[int | None]
) -> list[SampledToken]:
    chosen: list[float] = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    max_top = max((n or 0) for n in num_logprobs)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_top:
        values, ids = raw_logprobs.topk(max_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out: list[SampledToken] = []
    for i, (token_id, n) in enumerate(zip(token_ids, num_logprobs, strict=True)):
        if n is None:
            out.append(SampledToken(token_id))
            continue
        top = list(zip(top_ids[i][:n], top_values[i][:n], strict=True)) if n else []
        out.append(SampledToken(token_id, chosen[i], top))
    return out
