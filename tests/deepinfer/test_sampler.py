"""The sampler, row by row against the definitions it implements (vLLM v1's order of stages)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from backends.deepinfer.sampler import Sampler, validate_request
from backends.deepinfer.sequence import Sequence
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest

VOCAB = 8
EOS = 7


def make_seq(
    rid: str = "r",
    prompt: list[int] | None = None,
    generated: list[int] | None = None,
    *,
    logprobs: int | None = None,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    **sampling: Any,
) -> Sequence:
    request = WorkerRequest(
        request_id=rid,
        token_ids=prompt if prompt is not None else [0, 1],
        max_tokens=16,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids or [],
        logprobs=logprobs,
        sampling=SamplingOptions(**sampling),
    )
    seq = Sequence(request)
    seq.token_ids.extend(generated or [])
    return seq


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)


def frequencies(sampler: Sampler, row: torch.Tensor, n: int, **sampling: Any) -> torch.Tensor:
    seqs = [make_seq(f"r{i}", **sampling) for i in range(n)]
    tokens = [t.token_id for t in sampler(row.expand(n, -1).clone(), seqs)]
    return torch.bincount(torch.tensor(tokens), minlength=row.shape[-1]).float() / n


PROBS = [0.5, 0.3, 0.15, 0.05, 0.0, 0.0, 0.0, 0.0]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [make_seq(f"r{i}", temperature=0.0) for i in range(5)]
    assert [t.token_id for t in Sampler(VOCAB, [EOS])(logits, seqs)] == logits.argmax(-1).tolist()


def test_temperature_one_follows_softmax() -> None:
    freq = frequencies(Sampler(VOCAB, [EOS]), logits_of(PROBS), 20000, temperature=1.0)
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.015)


def test_high_temperature_flattens_and_low_sharpens() -> None:
    hot = frequencies(Sampler(VOCAB, [EOS]), logits_of(PROBS[:4] + [1e-9] * 4), 8000, temperature=100.0)
    assert hot.min() > 0.08  # close to uniform over 8
    cold = frequencies(Sampler(VOCAB, [EOS]), logits_of(PROBS), 2000, temperature=0.05)
    assert cold[0] == 1.0


def test_top_k_top_p_min_p_truncate() -> None:
    sampler = Sampler(VOCAB, [EOS])
    row = logits_of(PROBS)
    assert set(frequencies(sampler, row, 3000, top_k=2).nonzero().flatten().tolist()) == {0, 1}
    assert frequencies(sampler, row, 500, top_k=1)[0] == 1.0
    # Smallest set reaching 0.7 is {0, 1}; reaching 0.85 needs the third token as well.
    assert set(frequencies(sampler, row, 3000, top_p=0.7).nonzero().flatten().tolist()) == {0, 1}
    assert set(frequencies(sampler, row, 3000, top_p=0.85).nonzero().flatten().tolist()) == {0, 1, 2}
    # min_p 0.5: keep tokens with p >= 0.5 * 0.5.
    assert set(frequencies(sampler, row, 3000, min_p=0.5).nonzero().flatten().tolist()) == {0, 1}
    # Renormalised after truncation: {0, 1} share 0.5 / 0.8 and 0.3 / 0.8.
    freq = frequencies(sampler, row, 20000, top_k=2)
    assert abs(freq[0].item() - 0.625) < 0.02


def test_mixed_batch_keeps_each_rows_parameters() -> None:
    row = logits_of(PROBS)
    seqs = [make_seq("g", temperature=0.0), make_seq("k", top_k=1), make_seq("t", temperature=1.0, top_p=0.7)]
    for _ in range(50):
        tokens = [t.token_id for t in Sampler(VOCAB, [EOS])(row.expand(3, -1).clone(), seqs)]
        assert tokens[0] == 0 and tokens[1] == 0 and tokens[2] in (0, 1)


def test_repetition_penalty_covers_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.2, -5.0, -5.0, -5.0, -5.0]])
    sampler = Sampler(VOCAB, [EOS])
    # Token 0 seen in the prompt: 2.0 / 1.5 < 1.9.
    assert sampler(logits, [make_seq(prompt=[0], temperature=0.0, repetition_penalty=1.5)])[0].token_id == 1
    # Token 0 and 1 both seen (prompt and output): 2.0/1.5 > 1.9/1.5, token 0 wins again.
    seq = make_seq(prompt=[0], generated=[1], temperature=0.0, repetition_penalty=1.5)
    assert sampler(logits, [seq])[0].token_id == 0
    # Negative logits move away from zero: -1.0 * 2 < -1.2, so token 3 beats token 2.
    neg = torch.tensor([[-9.0, -9.0, -1.0, -1.2, -9.0, -9.0, -9.0, -9.0]])
    assert sampler(neg, [make_seq(prompt=[2], temperature=0.0, repetition_penalty=2.0)])[0].token_id == 3


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0, -9.0, -9.0, -9.0, -9.0]])
    sampler = Sampler(VOCAB, [EOS])
    # In the prompt only: no effect.
    assert sampler(logits, [make_seq(prompt=[0, 0], temperature=0.0, frequency_penalty=2.0)])[0].token_id == 0
    # Generated once: 3 - 0.6 > 2; twice: 3 - 1.2 < 2.
    once = make_seq(generated=[0], temperature=0.0, frequency_penalty=0.6)
    twice = make_seq(generated=[0, 0], temperature=0.0, frequency_penalty=0.6)
    assert [t.token_id for t in sampler(logits.expand(2, -1), [once, twice])] == [0, 1]
    # Presence ignores the count.
    both = [make_seq(generated=[0] * n, temperature=0.0, presence_penalty=0.6) for n in (1, 3)]
    assert [t.token_id for t in sampler(logits.expand(2, -1), both)] == [0, 0]


def test_logit_bias_and_min_tokens() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 9.0]])
    sampler = Sampler(VOCAB, [EOS])
    assert sampler(logits, [make_seq(temperature=0.0, logit_bias={2: 100.0})])[0].token_id == 2
    # EOS (7) and the stop token 6 are masked until two tokens exist.
    early = make_seq(generated=[1], min_tokens=2, stop_token_ids=[6], temperature=0.0)
    done = make_seq(generated=[1, 1], min_tokens=2, stop_token_ids=[6], temperature=0.0)
    assert [t.token_id for t in sampler(logits.expand(2, -1), [early, done])] == [0, 7]


def test_seeded_rows_ignore_their_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=gen)

    def run(rows: list[int], seqs_for: dict[int, Sequence], steps: int) -> list[list[int]]:
        sampler = Sampler(VOCAB, [EOS], seed=123)
        seqs = [seqs_for[r] for r in rows]
        out: list[list[int]] = []
        for _ in range(steps):
            step = [t.token_id for t in sampler(logits[rows], seqs)]
            for seq, token_id in zip(seqs, step, strict=True):  # the next draw is for the next position
                seq.token_ids.append(token_id)
            out.append(step)
        return out

    def fresh() -> dict[int, Sequence]:
        return {r: make_seq(f"r{r}", temperature=1.0, seed=r if r == 0 else None) for r in range(6)}

    alone = [step[0] for step in run([0], fresh(), 30)]
    batched = [step[0] for step in run([0, 1, 2, 3, 4, 5], fresh(), 30)]
    assert alone == batched
    assert len(set(alone)) > 1  # it is actually sampling
    other_seed = [step[0] for step in run([0], {0: make_seq("r0", temperature=1.0, seed=99)}, 30)]
    assert other_seed != alone


def test_logprobs_are_raw_and_sorted() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    seqs = [make_seq("a", logprobs=3, temperature=0.3, top_k=2), make_seq("b", logprobs=0, temperature=0.0)]
    out = Sampler(VOCAB, [EOS])(logits, seqs)
    expected = torch.log_softmax(logits, -1)
    assert out[0].logprob == pytest.approx(expected[0, out[0].token_id].item(), abs=1e-6)
    assert out[0].top is not None and [t for t, _ in out[0].top] == expected[0].topk(3).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(out[0].top, out[0].top[1:], strict=False))
    assert out[1].top == [] and out[1].logprob == pytest.approx(expected[1].max().item(), abs=1e-6)
    assert math.isclose(sum(math.exp(lp) for lp in expected[0].tolist()), 1.0, rel_tol=1e-5)


def test_deterministic_mode_matches_row_by_row() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    seqs = [make_seq(f"r{i}", temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
    batched = Sampler(VOCAB, [EOS], deterministic=True)(logits, seqs)
    alone = [Sampler(VOCAB, [EOS], deterministic=True)(logits[i : i + 1], [seqs[i]])[0] for i in range(4)]
    assert [t.token_id for t in batched] == [t.token_id for t in alone]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("logit_bias", {VOCAB: 1.0}),
    ],
)
def test_validate_rejects_bad_sampling(field: str, value: Any) -> None:
    request = WorkerRequest(
        request_id="x", token_ids=[1], max_tokens=4, sampling=SamplingOptions(**{field: value})
    )
    with pytest.raises(ValueError, match=field):
        validate_request(request, VOCAB)


def test_validate_rejects_bad_request_fields() -> None:
    with pytest.raises(ValueError, match="token_ids"):
        validate_request(WorkerRequest(request_id="x", token_ids=[VOCAB], max_tokens=4), VOCAB)
    with pytest.raises(ValueError, match="min_tokens"):
        validate_request(WorkerRequest(request_id="x", token_ids=[1], max_tokens=4, min_tokens=5), VOCAB)
    with pytest.raises(ValueError, match="max_tokens"):
        validate_request(WorkerRequest(request_id="x", token_ids=[1], max_tokens=0), VOCAB)


def reference_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's sort-based definition, row by row."""
    sorted_logits, order = logits.sort(dim=-1)
    kth = sorted_logits.gather(1, (logits.shape[-1] - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat (nucleus wider than the window) to peaked
def test_top_k_top_p_match_the_sort_definition(scale: float) -> None:
    from backends.deepinfer.sampler import _apply_top_k_top_p

    gen = torch.Generator().manual_seed(11)
    vocab, rows = 3000, 12
    logits = scale * torch.randn(rows, vocab, generator=gen)
    k = torch.tensor([vocab, 1, 5, 50, 2999, vocab, vocab, 40, vocab, 100, vocab, 7])
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.99, 1.0, 0.3, 1.0, 0.999, 0.8, 0.6, 0.9])
    got = torch.isfinite(_apply_top_k_top_p(logits, k, p))
    expected = torch.isfinite(reference_top_k_top_p(logits, k, p))
    assert torch.equal(got, expected)


def test_penalties_match_the_dense_definition() -> None:
    from backends.deepinfer.sampler import _apply_penalties

    gen = torch.Generator().manual_seed(12)
    vocab = 50
    logits = 3 * torch.randn(5, vocab, generator=gen)
    rows = [
        make_seq(
            "a", prompt=[1, 2, 2, 3], generated=[3, 4, 4, 4], repetition_penalty=1.7, frequency_penalty=0.4
        ),
        make_seq(
            "b", prompt=[5], generated=[], presence_penalty=0.9, frequency_penalty=0.3
        ),  # nothing generated
        make_seq("c", prompt=[7, 8], generated=[9, 9, 7], presence_penalty=-0.5),  # negative: encourages
        make_seq("d", prompt=[10, 11], generated=[12]),  # no penalty at all
        make_seq("e", prompt=[0, 0, 1], generated=[0, 2], repetition_penalty=0.8, presence_penalty=0.2),
    ]
    expected = logits.clone()
    for i, seq in enumerate(rows):
        p = seq.request.sampling
        prompt, output = seq.token_ids[: seq.num_prompt_tokens], seq.token_ids[seq.num_prompt_tokens :]
        for t in set(prompt) | set(output):
            x = expected[i, t]
            expected[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output):
            expected[i, t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    assert torch.allclose(_apply_penalties(logits, rows), expected, atol=1e-5)
