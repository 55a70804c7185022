"""A Hugging Face checkpoint loaded per rank: its stage's keys, of a tp shard only its slice.

Each case builds a tiny model on `meta` at pp=2 x tp=2 (balance [2, 3]: embedding + block |
block + norm + head, so a tie crosses the stages), materializes the rank's stage with
``hybridpar.hf.init_fn`` and loads a ``save_pretrained`` checkpoint with
``hybridpar.hf.load_hf_shards``, counting the bytes each rank reads (`counting_reads` wraps
``safe_open``). Every local tensor must equal, bit for bit, the slice `shard_of` cuts from the
whole file's tensor, and a rank must read exactly those slices' bytes (+ its replicated
tensors), never a whole sharded tensor. Bad checkpoints are refused on every rank.

All multi-rank cases run in one spawn of 4 ranks (starting the ranks and importing the model
families costs more than a case).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import tiny, token_batches
from safetensors_counting import counting_reads
from spawn_cases import spawn_cases

import hybridpar
from hybridpar.hf import init_fn, load_hf_checkpoint, load_hf_shards, to_sequential
from hybridpar.hf import tp_plan as hf_tp_plan
from hybridpar.tensor_parallel.state import shard_of

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need "
                                                          "transformers (pip install .[hf])")

BALANCE = [2, 3]
ROOT = Path(__file__).resolve().parent.parent


# in the ranks ---------------------------------------------------------------------------------

def _meta_pipe(topo, directory, plan, dtype):
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    seq = to_sequential(model)
    if plan == "own+vocab":   # the model's own plan, the embedding sharded on the vocab
        plan = {**hf_tp_plan(seq), "0": "vocab", f"{len(seq) - 1}": "replicate"}
    return hybridpar.HybridPipe(seq, BALANCE, topology=topo, tp_plan=plan,
                                init_fn=init_fn(model))


def _load_case(directory, plan="auto", dtype=torch.float64):
    """Load `directory` into a meta-built pp2 x tp2 pipe: what differs from `shard_of` of the
    whole file's tensors, and the bytes read."""
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    pipe = _meta_pipe(topo, directory, plan, dtype)
    with counting_reads() as counter:
        report = load_hf_shards(pipe, directory)
    full = load_hf_checkpoint(directory)
    group = topo.tp_group
    params = dict(pipe.named_parameters(remove_duplicate=False))
    differ, dtypes, expected, seen = [], set(), 0, set()
    for key, value in pipe.state_dict(keep_vars=True).items():
        if key not in params:
            continue          # the rotary buffers: not in the files
        want = shard_of(full[key], value, group).to(value.dtype)
        if not torch.equal(value.detach(), want):
            differ.append(key)
        dtypes.add(value.dtype)
        if id(value) not in seen:
            seen.add(id(value))
            expected += value.numel() * full[key].element_size()
    whole = _file_bytes(directory)
    sharded = sum(1 for _, p in pipe.named_parameters() if getattr(p, "parallel_dim", None)
                  is not None)
    return {"differ": differ, "read": counter[0], "reported": report.bytes_read,
            "expected": expected, "whole": whole, "dtypes": dtypes, "sharded": sharded,
            "stage": topo.pp_rank, "files": len(report.files),
            "embedding": tuple(params["0.weight"].shape) if "0.weight" in params else None}


def _file_bytes(directory):
    """The bytes of every tensor in the checkpoint's files."""
    from safetensors import safe_open

    total = 0
    for file in Path(directory).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    return total


def _error_case(directory):
    """The error `load_hf_shards` raises on this rank (type name, message), or None."""
    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    pipe = _meta_pipe(topo, directory, "auto", torch.float64)
    try:
        load_hf_shards(pipe, directory)
    except (ValueError, OSError) as e:
        return type(e).__name__, str(e)
    return None


def _run_case(config, ids):
    """`build_pipe` with ``model.pretrained`` against the pipe built as before (the whole
    model built and loaded on every rank, then split): equal tensors, equal first step."""
    from hybridpar.models.hf import next_token_loss
    from hybridpar.pipe import HybridPipe
    from hybridpar.tensor_parallel.random import model_parallel_manual_seed
    from hybridpar.train.trainer import build_pipe

    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    new = build_pipe(config, topo)
    par, directory = config.parallel, config.model.args["pretrained"]
    torch.manual_seed(config.train.seed)   # as build_pipe did before: the whole model, loaded
    model_parallel_manual_seed(config.train.seed, group=topo.tp_group)
    whole = to_sequential(transformers.LlamaForCausalLM(
        transformers.AutoConfig.from_pretrained(directory)))
    whole.load_state_dict(load_hf_checkpoint(directory), strict=True)
    old = HybridPipe(whole, par.balance, chunks=par.chunks, topology=topo,
                     schedule=par.schedule, checkpoint=par.checkpoint, loss_fn=next_token_loss,
                     tp_plan=par.tp_plan)
    assert new.balance == old.balance
    new_state, old_state = new.state_dict(), old.state_dict()
    differ = [k for k in old_state if not torch.equal(new_state[k], old_state[k])]
    buffers = dict(old.named_buffers())                  # rotary inv_freq: not in the files
    differ += [k for k, b in new.named_buffers() if not torch.equal(b, buffers[k])]
    losses = [float(p.train_step(ids, ids)) for p in (new, old)]
    grads = [k for (k, a), (_, b) in zip(new.named_parameters(), old.named_parameters())
             if not torch.equal(a.grad, b.grad)]
    new.close()
    old.close()
    return {"keys": sorted(new_state) == sorted(old_state), "differ": differ,
            "losses": losses, "grads": grads}


# checkpoints ----------------------------------------------------------------------------------

def _small_llama(vocab=64, dtype=torch.float64, seed=11):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _poison(directory: Path, name: str, change) -> None:
    """Rewrite the file of `directory` that holds `name` with ``change(tensor)`` in its place."""
    from safetensors.torch import load_file, save_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = directory / index["weight_map"][name]
    tensors = load_file(str(file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})


def _nan_row(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[20, 0] = float("nan")   # row 20 of 32: tp rank 1's half of a column-parallel weight
    return t


def _rewrite(file: Path, drop: str) -> None:
    """Write `file` (one safetensors file) again without tensor `drop`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    del tensors[drop]
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("llama", "qwen3", "gpt2"):                      # sharded, float64
        tiny(kind, seed=11).save_pretrained(root / kind, max_shard_size="20KB")
        out[kind] = root / kind
    _small_llama(vocab=65).save_pretrained(root / "vocab65", max_shard_size="20KB")
    out["vocab65"] = root / "vocab65"
    tiny("llama", seed=11, dtype=torch.bfloat16).save_pretrained(root / "bf16")
    out["bf16"] = root / "bf16"

    tiny("llama", seed=11).save_pretrained(root / "missing")     # one file, a key less
    _rewrite(root / "missing" / "model.safetensors", "model.layers.1.mlp.up_proj.weight")
    out["missing"] = root / "missing"

    tiny("llama", seed=11).save_pretrained(root / "heads")       # config: 4 kv heads, file 2
    config = json.loads((root / "heads" / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (root / "heads" / "config.json").write_text(json.dumps(config))
    out["heads"] = root / "heads"

    tiny("llama", seed=11).save_pretrained(root / "garbage", max_shard_size="20KB")
    shards = sorted((root / "garbage").glob("*.safetensors"))
    shards[-1].write_bytes(b"PK\x03\x04 a zip file, not safetensors" * 8)
    out["garbage"] = (root / "garbage", shards[-1].name)

    tiny("llama", seed=11).save_pretrained(root / "truncated")
    file = root / "truncated" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    out["truncated"] = root / "truncated"

    for case, name, change in (                                  # issue 40, points 4 and 8
            ("nan", "model.layers.1.self_attn.q_proj.weight", _nan_row),    # stage 1, tp 1
            ("int32", "model.layers.0.self_attn.k_proj.weight", lambda t: t.to(torch.int32)),
            ("bool", "model.embed_tokens.weight", lambda t: t > 0)):
        tiny("llama", seed=11).save_pretrained(root / case, max_shard_size="20KB")
        _poison(root / case, name, change)
        out[case] = (root / case, name)

    run = root / "run"                                           # float32, bytes
    _small_llama(vocab=256, dtype=torch.float32, seed=5).save_pretrained(
        run, max_shard_size="20KB")
    out["run"] = run
    return out


@pytest.fixture(scope="module")
def runs(checkpoints):
    """Every case by name, each rank's result, from one spawn of 4 ranks."""
    from hybridpar.train import load_config

    c = checkpoints
    cfg = load_config(ROOT / "configs" / "llama_tiny.toml",
                      [f"model.pretrained={c['run']}", "parallel.balance=[2, 3]",
                       "train.seed=3", "parallel.chunks=2"])
    ids = token_batches(1, 4, 8, vocab=256, seed=2)[0]
    cases = {
        "llama": (_load_case, (str(c["llama"]),)),
        "qwen3": (_load_case, (str(c["qwen3"]),)),
        "gpt2": (_load_case, (str(c["gpt2"]),)),
        "uneven vocab": (_load_case, (str(c["vocab65"]), "own+vocab")),
        "bf16 into float32": (_load_case, (str(c["bf16"]), "auto", torch.float32)),
        "missing": (_error_case, (str(c["missing"]),)),
        "heads": (_error_case, (str(c["heads"]),)),
        "garbage": (_error_case, (str(c["garbage"][0]),)),
        "truncated": (_error_case, (str(c["truncated"]),)),
        "nan": (_error_case, (str(c["nan"][0]),)),
        "int32": (_error_case, (str(c["int32"][0]),)),
        "bool": (_error_case, (str(c["bool"][0]),)),
        "run": (_run_case, (cfg, ids)),
    }
    return spawn_cases(_dispatch, 4, {k: (fn, args) for k, (fn, args) in cases.items()},
                       timeout=240)


def _dispatch(fn, args):
    return fn(*args)


# tests ----------------------------------------------------------------------------------------

def _assert_loaded_as_shard_of(results):
    for rank, r in enumerate(results):
        assert r["differ"] == [], f"rank {rank}"
        # exactly the rank's slices (and its replicated tensors): no whole sharded tensor
        assert r["read"] == r["expected"] == r["reported"], f"rank {rank}"
        assert r["read"] < r["whole"] * 0.6, f"rank {rank}"
    assert all(r["sharded"] > 0 for r in results)
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
def test_pp2_tp2_ranks_read_their_slices_of_a_sharded_checkpoint(kind, runs):
    _assert_loaded_as_shard_of(runs[kind])
    assert all(r["files"] > 1 for r in runs[kind])     # the index's shards, several a rank


def test_uneven_vocabulary_shards_read_their_rows(runs):
    # vocab 65 over tp=2: rank 0 holds 33 rows of the embedding, rank 1 32
    results = runs["uneven vocab"]
    _assert_loaded_as_shard_of(results)
    assert sorted(r["embedding"] for r in results if r["stage"] == 0) == [(32, 32), (33, 32)]


def test_a_bf16_checkpoint_loads_into_float32_parameters(runs):
    results = runs["bf16 into float32"]
    _assert_loaded_as_shard_of(results)                 # bytes counted in bf16: 2 a value
    assert all(r["dtypes"] == {torch.float32} for r in results)


def _messages(results):
    assert all(r is not None for r in results), "every rank raises"
    return [message for _, message in results]


def test_a_missing_key_is_named_with_the_file_on_every_rank(runs, checkpoints):
    for message in _messages(runs["missing"]):
        assert "model.layers.1.mlp.up_proj.weight" in message
        assert str(checkpoints["missing"] / "model.safetensors") in message


def test_a_head_count_that_does_not_fit_the_weights_is_named_on_every_rank(runs):
    for message in _messages(runs["heads"]):
        assert "k_proj.weight" in message and "has shape (16, 32)" in message
        assert "expects (32, 32)" in message


def test_a_file_that_is_not_safetensors_is_named_on_every_rank(runs, checkpoints):
    directory, name = checkpoints["garbage"]
    for message in _messages(runs["garbage"]):
        assert str(directory / name) in message and "not a whole safetensors file" in message


def test_a_truncated_file_is_named_on_every_rank(runs, checkpoints):
    for message in _messages(runs["truncated"]):
        assert str(checkpoints["truncated"] / "model.safetensors") in message
        assert "not a whole safetensors file" in message


@pytest.mark.parametrize("case, says", [("nan", " holds 1 NaN of its 512 values"),
                                         ("int32", " is I32, but the model's tensor is "),
                                         ("bool", " is BOOL, but the model's tensor is ")])
def test_a_nan_or_integer_weight_is_named_with_its_file_on_every_rank(runs, checkpoints, case,
                                                                     says):
    # issue 40: model.pretrained with a NaN (only tp rank 1 of stage 1 reads it), an int32
    # k_proj or a bool embedding of the right shape loaded silently (cast to float)
    directory, name = checkpoints[case]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    for message in _messages(runs[case]):
        assert message.startswith(f"{name} in {directory / index['weight_map'][name]}"), message
        assert says in message, message


def test_a_pretrained_run_builds_and_steps_as_the_whole_model_did(runs):
    for rank, r in enumerate(runs["run"]):
        assert r["keys"] and r["differ"] == [], f"rank {rank}"
        assert r["losses"][0] == r["losses"][1] and r["grads"] == [], f"rank {rank}"


# one process ----------------------------------------------------------------------------------

def test_a_plain_sequential_loads_every_tensor_once(checkpoints):
    model = tiny("gpt2")                                   # tied: wte and lm_head one tensor
    seq = to_sequential(model)
    report = load_hf_shards(seq, checkpoints["gpt2"])
    full = load_hf_checkpoint(checkpoints["gpt2"])
    for key, value in seq.state_dict().items():
        if key in full:
            assert torch.equal(value, full[key]), key
    assert report.bytes_read == _file_bytes(checkpoints["gpt2"])   # the tied head: once


def test_a_key_the_model_does_not_have_is_refused(checkpoints, tmp_path):
    small = transformers.LlamaConfig(**{**json.loads(
        (checkpoints["llama"] / "config.json").read_text()), "num_hidden_layers": 1})
    seq = to_sequential(transformers.LlamaForCausalLM(small).double())
    with pytest.raises(ValueError, match=r"model\.layers\.1\..* config\.json disagree"):
        load_hf_shards(seq, checkpoints["llama"], config=small.to_dict())
