"""Regressions, each with its story: what broke, why, and what fixed it."""

import torch
from torch import nn
from torchgpipe.skip import Namespace

import hybridpar
from hybridpar.pipeline.skip import skip_routes
from hybridpar.pipeline.step import grad_or_zeros as _grad_or_zeros

from pipe_harness import PopLong, StashLong


def test_gradient_of_a_sharded_boundary_keeps_its_tag():
    # A stage boundary inside a column -> row pair carries a column shard (tagged -1). Its
    # gradient was sent back untagged, so comm took it for a replicated tensor and sent 1/tp
    # slices, and the receiver rebuilt it from slices of *different* ranks' gradients: losses
    # drifted by 7e-4 from step 2 on (found by the tp_plan tests). _grad_or_zeros now tags the
    # gradient like the received tensor.
    x = torch.ones(2, 4, requires_grad=True)
    hybridpar.register_parallel_dim(x, -1)
    assert hybridpar.get_parallel_dim(_grad_or_zeros(x)) == -1
    (x * 3).sum().backward()
    assert hybridpar.get_parallel_dim(_grad_or_zeros(x)) == -1


def test_skip_routes_are_ordered_the_same_in_every_process():
    # torchgpipe sorts skip routes by (stage, namespace, name) and orders namespaces by a random
    # uuid4: two processes building the same model could order two skips between the same pair
    # of stages differently and silently swap same-shaped tensors. Routes are ordered by
    # (stash layer, pop layer, name), which every process computes alike.
    def model():
        a, b = Namespace(), Namespace()
        return nn.Sequential(StashLong(4).isolate(b), StashLong(4).isolate(a),
                             PopLong(4).isolate(a), PopLong(4).isolate(b))

    orders = {tuple((r.stash_layer, r.pop_layer) for r in skip_routes(model(), [2, 2]))
              for _ in range(20)}
    assert orders == {((0, 3), (1, 2))}


def test_pipe_output_is_gathered_over_tp_although_cat_drops_the_tag():
    # HybridPipe.forward concatenated the micro-batch outputs and then looked for the tag on
    # the result; torch.cat returns a new tensor without the Python attribute, so class-sharded
    # logits came back as the (B, V / tp) shard. The tag is now read from a part before the cat
    # (covered end to end by test_models.test_generate_from_a_pipe_forward_matches_one_device).
    part = torch.ones(2, 3)
    hybridpar.register_parallel_dim(part, -1)
    assert hybridpar.get_parallel_dim(torch.cat([part, part])) is None


def test_profiling_a_sharded_layer_repeats_it_the_same_number_of_times_on_every_rank():
    # balance_by_time repeats each layer until its time budget runs out. A layer sharded over
    # a real tp group runs collectives, and two ranks that stopped after different numbers of
    # repeats left one waiting in an all-reduce the other never joined ("Connection closed by
    # peer" once the other exited). The ranks now agree on every repeat (an all-reduce MAX of
    # "I want more"); tests/test_balance_tp.py runs it on two ranks.
    from hybridpar.balance.tp import collective_group

    assert collective_group(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None
