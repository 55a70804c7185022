"""A meta-built Hugging Face model at pp=2 x tp=2: init_fn, a checkpoint, the same logits.

Each case builds the tiny model on `meta` on every rank, lets `HybridPipe` apply a tp plan
(which puts `ParallelLinear` / `ParallelEmbedding` / `ParallelConv1D` in, layers Hugging
Face's ``_init_weights`` does not know), materializes this rank's stage with
``hybridpar.hf.init_fn``, loads the ``save_pretrained`` checkpoint with
``load_consolidated_state_dict`` and returns ``pipe(ids)``: the full logits, on every rank,
which must equal ``from_pretrained(directory)(ids).logits`` in float64.

All cases run in one spawn of 4 ranks (starting the ranks and importing the model families
costs more than a case); the refusal of an uninitialized shard in one spawn of 2.
"""

import pytest
import torch
from hf_models import tiny, token_batches
from spawn_cases import spawn_cases
from torch import nn

import hybridpar
from hybridpar.hf import init_fn, load_hf_checkpoint, to_sequential
from hybridpar.hf import tp_plan as hf_tp_plan
from hybridpar.tensor_parallel.base import ParallelLayer

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need "
                                                          "transformers (pip install .[hf])")

BALANCE = [2, 3]            # embedding + block | block + norm + head: the tie crosses stages
KINDS = ("llama", "qwen3", "gpt2")
# any decoder (`hf.structure`): glue layers, a scaled embedding sharded with its scale under
# its own (tied) plan, other trunk names, per-head norms cut by head (drawn whole by init_fn)
NEW = {"gemma2": "hf", "granite": "auto", "gpt_neox": "auto", "cohere": "hf"}


def _meta_pipe_logits(kind, directory, plan, ids):
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    with torch.device("meta"):
        model = tiny(kind)
    seq = to_sequential(model)
    if plan == "own":                   # the model's own plan, given as a dict
        plan = hf_tp_plan(seq)
    pipe = hybridpar.HybridPipe(seq, BALANCE, topology=topo, tp_plan=plan,
                                init_fn=init_fn(model))
    # as Hugging Face draws them: normal(0, initializer_range = 0.02) (GPT-2's c_proj less)
    stds = {f"{name}.weight": m.weight.std().item() for name, m in pipe.named_modules()
            if isinstance(m, ParallelLayer)}
    pipe.load_consolidated_state_dict(load_hf_checkpoint(directory))
    with torch.no_grad():
        logits = pipe(ids)
    return {"logits": logits, "decisions": pipe.tp_plan_decisions, "stds": stds}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{kind: (directory, from_pretrained logits)}`` and the token ids."""
    ids = token_batches(1, 2, 6, seed=3)[0]
    out = {}
    for kind in (*KINDS, *NEW):
        directory = tmp_path_factory.mktemp(kind)
        tiny(kind, seed=11).save_pretrained(directory)
        ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
        with torch.no_grad():
            out[kind] = (str(directory), ref.eval()(ids).logits)
    return out, ids


@pytest.fixture(scope="module")
def runs(checkpoints):
    """Every pp=2 x tp=2 case by name, each rank's result."""
    dirs, ids = checkpoints
    cases = {f"{kind} auto": (kind, dirs[kind][0], "auto", ids) for kind in KINDS}
    cases["llama own plan"] = ("llama", dirs["llama"][0], "own", ids)
    cases["llama 'hf'"] = ("llama", dirs["llama"][0], "hf", ids)
    cases.update({f"{kind} {plan}": (kind, dirs[kind][0], plan, ids) for kind, plan in NEW.items()})
    return spawn_cases(_meta_pipe_logits, 4, cases, timeout=180)


def _assert_logits(results, ref):
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["logits"], ref, atol=1e-12, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_meta_build_at_pp2_tp2_auto_gives_the_from_pretrained_logits(kind, checkpoints, runs):
    dirs, _ = checkpoints
    results = runs[f"{kind} auto"]
    _assert_logits(results, dirs[kind][1])
    # the plan did shard: the materialized layers are tp layers, drawn as HF draws a layer
    assert any(": column" in d for d in results[0]["decisions"])
    for r in results:
        assert r["stds"] and all(0.005 < std < 0.03 for std in r["stds"].values()), r["stds"]


@pytest.mark.parametrize("kind", NEW)
def test_any_decoder_meta_built_at_pp2_tp2_gives_the_from_pretrained_logits(kind, checkpoints,
                                                                            runs):
    dirs, _ = checkpoints
    results = runs[f"{kind} {NEW[kind]}"]
    _assert_logits(results, dirs[kind][1])
    assert any(": column" in d for d in results[0]["decisions"])
    if kind == "gemma2":        # its tied embedding and head: one vocab-sharded Parameter
        assert any(d.startswith("0 (Embedding") and ": vocab" in d
                   for d in results[0]["decisions"]), results[0]["decisions"]


def test_meta_build_with_llamas_own_plan_gives_the_from_pretrained_logits(checkpoints, runs):
    dirs, _ = checkpoints
    _assert_logits(runs["llama own plan"], dirs["llama"][1])


def test_tp_plan_hf_is_the_models_own_plan(checkpoints, runs):
    dirs, _ = checkpoints
    _assert_logits(runs["llama 'hf'"], dirs["llama"][1])
    for own, hf in zip(runs["llama own plan"], runs["llama 'hf'"], strict=True):
        assert hf["decisions"] == own["decisions"]


# -- what init_fn leaves uninitialized is still reported ----------------------------------

def _uninitialized_shard_worker():
    topo = hybridpar.init(tp=2, timeout=60)
    problems = {}

    def weights_only(module):               # a custom init_fn that forgets the biases
        if isinstance(getattr(module, "weight", None), nn.Parameter):
            nn.init.normal_(module.weight)

    def nothing(module):                    # knows no layer: the tp layers draw their own
        pass

    for name, fn in (("weights_only", weights_only), ("nothing", nothing)):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        try:
            pipe = hybridpar.HybridPipe(model, [3], topology=topo, tp_plan="auto", init_fn=fn)
        except ValueError as e:
            problems[name] = str(e)
        else:
            problems[name] = [n for n, p in pipe.named_parameters() if p.isnan().any()]
    return problems


def test_a_shard_the_init_fn_left_half_done_is_reported_as_uninitialized():
    results = hybridpar.spawn(_uninitialized_shard_worker, 2, timeout=120)
    for r in results:
        # the column-parallel bias of '0' is a shard init_fn did not draw: NaN, reported
        assert "'0.bias' is not initialized" in r["weights_only"]
        # a tp layer init_fn never touched is drawn by its own reset_parameters
        assert r["nothing"] == []


def test_tp_plan_hf_on_a_model_without_a_hugging_face_config_says_what_to_do():
    from hybridpar.pipe.build import apply_plan

    with pytest.raises(ValueError, match=r"hybridpar\.hf\.tp_plan\(model\)"):
        apply_plan(nn.Sequential(nn.Linear(4, 4)), "hf", group=None)


def test_the_own_plan_names_the_head_at_index_layers_plus_two():
    seq = to_sequential(tiny("llama"))                    # 0 embedding, 1..L blocks, L+1 norm
    layers = seq[1].config.num_hidden_layers
    assert type(seq[layers + 2]).__name__ == "Linear"
    assert hf_tp_plan(seq)[str(layers + 2)] == "colwise_gather_output"
