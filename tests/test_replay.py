"""The NCCL replay: matching by order, sizes, counts, bad ops and rendezvous deadlocks."""

from __future__ import annotations

import pytest

from hybridpar.pipeline.schedules.replay import NCCLOrderError, P2POp, ReplayResult, replay

F32 = "torch.float32"


def send(peer: int, label: str, numel: int = 8, dtype: str = F32) -> P2POp:
    return P2POp("send", peer, numel, dtype, label)


def recv(peer: int, label: str, numel: int = 8, dtype: str = F32) -> P2POp:
    return P2POp("recv", peer, numel, dtype, label)


def chain(ranks: int, microbatches: int) -> dict[int, list[list[P2POp]]]:
    """A forward-only chain: each middle rank's group = [send previous output, recv next
    input]; rank 0 only sends, the last rank only receives."""
    out: dict[int, list[list[P2POp]]] = {}
    for r in range(ranks):
        groups: list[list[P2POp]] = []
        for i in range(microbatches + 1):
            group = []
            if r + 1 < ranks and ((r == 0 and i < microbatches) or (r > 0 and i > 0)):
                j = i if r == 0 else i - 1          # rank 0 sends each input as it is made
                group.append(send(r + 1, f"FWD mb {j}"))
            if r > 0 and i < microbatches:
                group.append(recv(r - 1, f"FWD mb {i}"))
            if group:
                groups.append(group)
        out[r] = groups
    return out


def test_a_two_stage_megatron_1f1b_with_send_forward_recv_backward_groups_passes() -> None:
    # Megatron's 1F1B for pp=2, 3 micro-batches: stage 0 warms up with one forward, then
    # send_forward_recv_backward; stage 1 uses send_backward_recv_forward.
    stage0 = [[send(1, "FWD mb 0")],
              [send(1, "FWD mb 1"), recv(1, "BWD mb 0")],
              [send(1, "FWD mb 2"), recv(1, "BWD mb 1")],
              [recv(1, "BWD mb 2")]]
    stage1 = [[recv(0, "FWD mb 0")],
              [send(0, "BWD mb 0"), recv(0, "FWD mb 1")],
              [send(0, "BWD mb 1"), recv(0, "FWD mb 2")],
              [send(0, "BWD mb 2")]]
    result = replay({0: stage0, 1: stage1}, check_labels=True)
    assert result == ReplayResult(groups={0: 4, 1: 4}, ops={0: 6, 1: 6}, pairs=6, rounds=4)


def test_a_four_rank_gpipe_chain_of_send_previous_recv_next_groups_passes() -> None:
    result = replay(chain(4, 3), check_labels=True)
    assert result.groups == {0: 3, 1: 4, 2: 4, 3: 3}
    assert result.ops == {0: 3, 1: 6, 2: 6, 3: 3}
    assert result.pairs == 9
    assert result.rounds == 3 + 4 - 2      # micro-batches + ranks - 2 waves: the pipe fills


def test_two_ranks_that_each_receive_first_deadlock() -> None:
    groups = {0: [[recv(1, "b->a")], [send(1, "a->b")]],
              1: [[recv(0, "a->b")], [send(0, "b->a")]]}
    with pytest.raises(NCCLOrderError, match=r"deadlock: ranks \[0, 1\]") as err:
        replay(groups)
    text = str(err.value)
    assert "rank 0 group 0 waits for: recv 'b->a' from rank 1" in text
    assert "rank 1 group 0 waits for: recv 'a->b' from rank 0" in text
    assert "one batch_isend_irecv" in text


def test_two_ranks_that_each_send_first_in_separate_groups_deadlock() -> None:
    groups = {0: [[send(1, "a->b")], [recv(1, "b->a")]],
              1: [[send(0, "b->a")], [recv(0, "a->b")]]}
    with pytest.raises(NCCLOrderError,
                       match=r"(?s)deadlock.*rank 0 group 0 waits for: send 'a->b' to rank 1 "
                             r"\(issued there in group 1, rank 1 is blocked at group 0\)"):
        replay(groups)


def test_the_same_ops_in_one_group_on_each_rank_pass() -> None:
    groups = {0: [[recv(1, "b->a"), send(1, "a->b")]],
              1: [[send(0, "b->a"), recv(0, "a->b")]]}
    assert replay(groups, check_labels=True) == ReplayResult({0: 1, 1: 1}, {0: 2, 1: 2}, 2, 1)


def test_a_size_mismatch_names_both_labels_and_sizes() -> None:
    groups = {0: [[send(1, "FWD mb 0", numel=8)]], 1: [[recv(0, "FWD mb 0 [0]", numel=6)]]}
    with pytest.raises(NCCLOrderError, match=r"size mismatch: message #0 from rank 0 to rank 1 "
                                             r"is sent as 'FWD mb 0' \(8 x torch.float32.*"
                                             r"received as 'FWD mb 0 \[0\]' \(6 x"):
        replay(groups)


def test_a_dtype_mismatch_is_a_size_mismatch_naming_the_labels() -> None:
    groups = {0: [[send(1, "grad", dtype="torch.bfloat16")]], 1: [[recv(0, "grad")]]}
    with pytest.raises(NCCLOrderError, match=r"size mismatch.*'grad' \(8 x torch.bfloat16.*"
                                             r"'grad' \(8 x torch.float32"):
        replay(groups)


def test_swapped_equal_size_messages_pass_by_default_but_fail_when_labels_are_checked() -> None:
    groups = {0: [[send(1, "FWD mb 3")], [send(1, "FWD mb 4")]],
              1: [[recv(0, "FWD mb 4")], [recv(0, "FWD mb 3")]]}
    assert replay(groups).pairs == 2
    with pytest.raises(NCCLOrderError, match=r"label mismatch: message #0 from rank 0 to rank 1 "
                                             r"is sent as 'FWD mb 3'.*received as 'FWD mb 4'"):
        replay(groups, check_labels=True)


def test_a_send_without_a_recv_is_unmatched() -> None:
    groups = {0: [[send(1, "x")], [send(1, "extra")]], 1: [[recv(0, "x")]]}
    with pytest.raises(NCCLOrderError, match=r"unmatched: rank 0 group 1: send 'extra' to rank 1 "
                                             r"is message #1 .* only 1 recv"):
        replay(groups)


def test_a_recv_without_a_send_is_unmatched() -> None:
    groups = {0: [], 1: [[recv(0, "ghost")]]}
    with pytest.raises(NCCLOrderError, match=r"unmatched: rank 1 group 0: recv 'ghost' from "
                                             r"rank 0 .* only 0 send"):
        replay(groups)


def test_a_send_to_its_own_rank_is_an_error() -> None:
    with pytest.raises(NCCLOrderError, match=r"rank 0 group 0: send 'loop' to rank 0 names its "
                                             r"own rank"):
        replay({0: [[send(0, "loop")]], 1: []})


def test_a_peer_with_no_entry_is_an_error() -> None:
    with pytest.raises(NCCLOrderError, match=r"rank 0 group 1: recv 'far' from rank 5 names a "
                                             r"rank with no entry.*\[0, 1\]"):
        replay({0: [[], [recv(5, "far")]], 1: []})


def test_a_bad_kind_or_negative_numel_is_an_error() -> None:
    with pytest.raises(NCCLOrderError, match=r"op 'b' has kind 'bcast'"):
        replay({0: [[P2POp("bcast", 1, 1, F32, "b")]], 1: []})
    with pytest.raises(NCCLOrderError, match=r"send 'n' to rank 1 has numel -1 < 0"):
        replay({0: [[send(1, "n", numel=-1)]], 1: [[recv(0, "n", numel=-1)]]})


def test_a_three_rank_cycle_deadlocks_naming_every_rank() -> None:
    # 0 waits on 1, 1 waits on 2, 2 waits on 0: each receives before it sends
    groups = {0: [[recv(1, "1->0")], [send(2, "0->2")]],
              1: [[recv(2, "2->1")], [send(0, "1->0")]],
              2: [[recv(0, "0->2")], [send(1, "2->1")]]}
    with pytest.raises(NCCLOrderError, match=r"deadlock: ranks \[0, 1, 2\]") as err:
        replay(groups)
    for line in ("rank 0 group 0 waits for: recv '1->0' from rank 1",
                 "rank 1 group 0 waits for: recv '2->1' from rank 2",
                 "rank 2 group 0 waits for: recv '0->2' from rank 0"):
        assert line in str(err.value)


def test_a_deadlock_after_progress_names_the_group_each_rank_is_stuck_at() -> None:
    groups = {0: [[send(1, "ok")], [], [recv(1, "late")], [send(1, "early")]],
              1: [[recv(0, "ok")], [send(0, "late")]]}
    with pytest.raises(NCCLOrderError, match=r"unmatched: rank 0 group 3"):   # 'early' unread
        replay(groups)
    # rank 1 now receives 'early' before sending 'late', while rank 0 waits for 'late' first
    groups[1].insert(1, [recv(0, "early")])
    with pytest.raises(NCCLOrderError, match=r"(?s)rank 0 group 2 waits for: recv 'late'.*"
                                             r"rank 1 group 1 waits for: recv 'early'"):
        replay(groups)


def test_empty_groups_complete_at_once_and_a_rank_with_no_groups_is_done() -> None:
    result = replay({0: [[], [send(1, "x")], []], 1: [[recv(0, "x")]], 2: []})
    assert result == ReplayResult({0: 3, 1: 1, 2: 0}, {0: 1, 1: 1, 2: 0}, 1, 3)


def test_sixty_four_ranks_of_two_hundred_groups_replay() -> None:
    groups = chain(64, 199)
    result = replay(groups, check_labels=True)
    assert result.pairs == 63 * 199
    assert result.groups[1] == 200 and sum(result.ops.values()) == 2 * 63 * 199
    assert result.rounds == 199 + 64 - 2
