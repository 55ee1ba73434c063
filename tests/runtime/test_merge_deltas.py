"""`merge_deltas`: consecutive deltas of one request as one."""

from __future__ import annotations

from orchestrator.runtime.protocol import TokenDelta, TokenLogprob, TopLogprob, Usage, merge_deltas


def test_tokens_and_logprobs_concatenate_first_cached_last_finish() -> None:
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=4)
    deltas = [
        TokenDelta(token_ids=[1], logprobs=[TokenLogprob(1, -0.5, [TopLogprob(1, -0.5)])], cached_tokens=4),
        TokenDelta(token_ids=[2, 3], logprobs=[TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)]),
        TokenDelta(finish_reason="stop", usage=usage),
    ]
    merged = merge_deltas(deltas)
    assert merged.token_ids == [1, 2, 3]
    assert merged.logprobs is not None and [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
    assert merged.logprobs[0].top == [TopLogprob(1, -0.5)]
    assert (merged.finish_reason, merged.usage, merged.cached_tokens) == ("stop", usage, 4)


def test_no_logprobs_stay_none_and_one_delta_is_itself() -> None:
    merged = merge_deltas([TokenDelta(token_ids=[1]), TokenDelta(token_ids=[2])])
    assert merged.logprobs is None and merged.cached_tokens is None and merged.finish_reason is None
    only = TokenDelta(token_ids=[7])
    assert merge_deltas([only]) is only
