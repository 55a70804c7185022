"""Dropout RNG: tracker streams, seeding across tp ranks, and masks equal to one device's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.sharded import attrs, mappings
from hybridpar.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    ParallelDropout,
    RNGStatesTracker,
    get_rng_state_all,
    get_rng_tracker,
    model_parallel_manual_seed,
    set_rng_state_all,
)

SEED = 1234
CLASSES = 10          # uneven over 4 ranks: 3, 3, 2, 2
SHAPE = (3, 5)        # the leading dims of the sharded activation (*, C / tp)


def _sharded(full):
    """This rank's tagged slice of the last dim of `full` (what a column-parallel layer gives)."""
    topo = hybridpar.current_topology()
    start, stop = mappings.shard_range(full.shape[-1], topo.tp, topo.tp_rank)
    x = full[..., start:stop].clone()
    attrs.register_parallel_dim(x, -1)
    return x


def _worker(tp):
    hybridpar.init(tp=tp)
    model_parallel_manual_seed(SEED)
    out = {"default": torch.rand(4)}
    with get_rng_tracker().fork():
        out["tracker"] = torch.rand(4)

    # parity: the mask of the full tensor from the default stream, this rank's slice
    full = torch.randn(*SHAPE, CLASSES, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(77)
    y = ParallelDropout(0.3)(_sharded(full))
    out["parity"] = y
    out["parity_tag"] = attrs.get_parallel_dim(y)
    out["after_parity"] = torch.rand(3)  # the default stream stays in step with one device
    torch.manual_seed(77)
    x = _sharded(full)
    z = ParallelDropout(0.3, inplace=True)(x)
    out["inplace_same_object"] = z is x
    out["inplace"] = z

    # replicated: the same mask on every rank
    torch.manual_seed(5)
    out["replicated"] = ParallelDropout(0.5)(torch.ones(4, 6))

    # parity=False: a local mask from the rank's own stream; the default stream is untouched
    before = torch.get_rng_state()
    local = ParallelDropout(0.5, parity=False)(_sharded(torch.ones(64, CLASSES)))
    out["local"] = local
    out["local_tag"] = attrs.get_parallel_dim(local)
    out["default_untouched"] = torch.equal(torch.get_rng_state(), before)

    # replay: the saved state draws the same masks again, in both modes
    x = _sharded(torch.ones(*SHAPE, CLASSES))
    drops = [ParallelDropout(0.4), ParallelDropout(0.4, parity=False)]
    state = get_rng_state_all()
    first = [d(x) for d in drops]
    set_rng_state_all(state)
    again = [d(x) for d in drops]
    out["replay"] = all(torch.equal(a, b) for a, b in zip(first, again))
    out["replay_differs_otherwise"] = not torch.equal(first[0], drops[0](x))

    # eval mode: identity, tag kept (the same tensor)
    drop = ParallelDropout(0.4).eval()
    out["eval_identity"] = drop(x) is x
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dropout_masks_and_streams_across_tp_ranks(tp):
    out = hybridpar.spawn(_worker, tp, args=(tp,), timeout=60)

    # the default stream is the same on every rank, the tracker streams are not
    torch.manual_seed(SEED)
    default = torch.rand(4)
    assert all(torch.equal(o["default"], default) for o in out)
    for rank, o in enumerate(out):
        expect = torch.rand(4, generator=torch.Generator().manual_seed(SEED + 2718 + rank))
        assert torch.equal(o["tracker"], expect)

    # parity masks: the slices of F.dropout on the full tensor under the same seed, bit for bit
    full = torch.randn(*SHAPE, CLASSES, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(77)
    ref = F.dropout(full, 0.3)
    after = torch.rand(3)
    assert torch.equal(torch.cat([o["parity"] for o in out], dim=-1), ref)
    assert torch.equal(torch.cat([o["inplace"] for o in out], dim=-1), ref)
    assert all(o["inplace_same_object"] for o in out)
    assert all(torch.equal(o["after_parity"], after) for o in out)
    assert all(o["parity_tag"] == -1 for o in out)

    torch.manual_seed(5)
    ref = F.dropout(torch.ones(4, 6), 0.5)
    assert all(torch.equal(o["replicated"], ref) for o in out)

    assert all(o["default_untouched"] and o["local_tag"] == -1 for o in out)
    if tp > 1:  # ranks 0 and 1 hold slices of the same width: their masks differ
        assert not torch.equal(out[0]["local"] != 0, out[1]["local"] != 0)
    assert all(o["replay"] and o["replay_differs_otherwise"] for o in out)
    assert all(o["eval_identity"] for o in out)


def test_tracker_stream_is_seeded_like_manual_seed_and_leaves_default_alone():
    tracker = RNGStatesTracker()
    tracker.add("a", 123)
    torch.manual_seed(0)
    with tracker.fork("a"):
        drawn = torch.rand(5)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))            # default stream untouched
    gen = torch.Generator().manual_seed(123)
    assert torch.equal(drawn, torch.rand(5, generator=gen))
    with tracker.fork("a"):                             # the named stream advanced
        assert torch.equal(torch.rand(5), torch.rand(5, generator=gen))


def test_tracker_states_round_trip():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    saved = tracker.get_states()
    assert set(saved) == {"a", "b"} and set(saved["a"]) >= {"cpu"}
    with tracker.fork("a"):
        first = torch.rand(4)
    with tracker.fork("b"):
        torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)
    tracker.reset()
    assert tracker.names() == []


def test_tracker_rejects_duplicate_and_unknown_streams():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_manual_seed"):
        with tracker.fork(MODEL_PARALLEL_RNG):
            pass


def test_rng_state_all_replays_default_and_tracker_streams():
    tracker = get_rng_tracker()
    saved_tracker = tracker.get_states()
    try:
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG, 9)
        state = get_rng_state_all()
        a = torch.rand(3)
        with tracker.fork():
            b = torch.rand(3)
        set_rng_state_all(state)
        assert torch.equal(torch.rand(3), a)
        with tracker.fork():
            assert torch.equal(torch.rand(3), b)
    finally:
        tracker.set_states(saved_tracker)


def test_replicated_dropout_is_f_dropout_without_init():
    x = torch.randn(4, 8)
    drop = ParallelDropout(0.25)
    assert isinstance(drop, nn.Dropout)
    torch.manual_seed(3)
    y = drop(x)
    torch.manual_seed(3)
    assert torch.equal(y, F.dropout(x, 0.25))
    assert ParallelDropout(0.0)(x) is x
    assert drop.eval()(x) is x
    assert "parity=True" in repr(drop)
    with pytest.raises(ValueError):
        ParallelDropout(1.5)


def test_sharded_dropout_and_seeding_before_init_tell_to_call_init():
    x = torch.ones(4, 8)
    attrs.register_parallel_dim(x, -1)
    with pytest.raises(RuntimeError, match=r"hybridpar\.init"):
        ParallelDropout(0.5)(x)
    with pytest.raises(RuntimeError, match=r"hybridpar\.init"):
        model_parallel_manual_seed(0)
