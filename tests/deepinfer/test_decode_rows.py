"""assign_rows: which decode workspace row each sequence of a step takes, and what moves.

The model tests check that the rows read the right K/V (test_models.py, test_decode_graphs.py);
these check the assignment itself: a batch that changes moves as few rows as it can."""

from __future__ import annotations

from backends.deepinfer.forward_batch import DecodeRows, assign_rows
from backends.deepinfer.sequence import Sequence
from orchestrator.runtime.protocol import WorkerRequest


def seqs(n: int) -> list[Sequence]:
    return [Sequence(WorkerRequest(request_id=f"r{i}", token_ids=[1, 2, 3], max_tokens=8)) for i in range(n)]


def decoding(n: int) -> tuple[DecodeRows, list[Sequence]]:
    """Rows after a first step of `n` sequences with 10-token contexts, in order."""
    rows, batch = DecodeRows(), seqs(n)
    plan = assign_rows(rows, batch, [10] * n)
    assert plan.fresh == list(range(n)) and plan.order == list(range(n))
    return rows, batch


def test_a_stable_batch_keeps_every_row() -> None:
    rows, batch = decoding(4)
    plan = assign_rows(rows, batch, [11] * 4)
    assert (plan.move_from, plan.fresh, plan.kept, plan.order) == ([], [], [0, 1, 2, 3], [0, 1, 2, 3])


def test_a_sequence_leaving_moves_only_the_last_row_into_its_place() -> None:
    rows, batch = decoding(5)
    plan = assign_rows(rows, [batch[0], batch[2], batch[3], batch[4]], [11] * 4)
    assert (plan.move_from, plan.move_to, plan.fresh) == ([4], [1], [])
    assert rows.seqs == [batch[0], batch[4], batch[2], batch[3]]
    assert plan.order == [0, 3, 1, 2]  # row r runs the step's sequence order[r]


def test_a_sequence_joining_takes_the_row_one_that_left_freed() -> None:
    rows, batch = decoding(4)
    joining = seqs(1)[0]
    plan = assign_rows(rows, [batch[0], batch[2], batch[3], joining], [11, 11, 11, 7])
    assert (plan.move_from, plan.fresh, plan.kept) == ([], [1], [0, 2, 3])
    assert rows.seqs == [batch[0], joining, batch[2], batch[3]]
    assert rows.lengths == [11, 7, 11, 11]


def test_new_sequences_take_rows_past_the_batch() -> None:
    rows, batch = decoding(2)
    new = seqs(2)
    plan = assign_rows(rows, [new[0], batch[1], batch[0], new[1]], [5, 11, 11, 6])
    assert (plan.move_from, plan.fresh, plan.kept) == ([], [2, 3], [0, 1])
    assert rows.seqs == [batch[0], batch[1], new[0], new[1]]


def test_a_sequence_not_one_token_further_on_is_rebuilt() -> None:
    """Preempted and resumed, or its tokens rewritten: its row no longer holds its context."""
    rows, batch = decoding(3)
    plan = assign_rows(rows, batch, [11, 13, 11])
    assert (plan.move_from, plan.fresh, plan.kept) == ([], [1], [0, 2])


def test_continuing_rows_past_a_shrunken_batch_fill_the_holes_first() -> None:
    """Three of six leave and one joins: the two continuing rows past the new batch of four
    move into the lowest holes, the new sequence takes the last one."""
    rows, batch = decoding(6)
    joining = seqs(1)[0]
    plan = assign_rows(rows, [batch[1], batch[4], batch[5], joining], [11, 11, 11, 3])
    assert (plan.move_from, plan.move_to, plan.fresh) == ([4, 5], [0, 2], [3])
    assert rows.seqs == [batch[4], batch[1], batch[5], joining]
