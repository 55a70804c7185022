"""Exports written one tensor at a time: safetensors files of at most --max-shard-size bytes
with Hugging Face's index, from a live pipe (pp=2 x tp=2) and from its checkpoint.

One spawn of 4 ranks trains a tiny Llama and a tiny GPT-2 (tied head) one step, then each
rank exports the pipe (Hugging Face names and plain names, files of at most 20 KB), saves a
checkpoint of it, and exports again with a write that fails mid-way. The test process then
loads the folders with `from_pretrained` and `load_exported`, exports the checkpoint with
`hybridpar export`, and checks what the writer held.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")
pytest.importorskip("safetensors", reason="folder exports write safetensors files")

from hf_models import tiny, token_batches

import hybridpar
from hybridpar.cli import main
from hybridpar.io.weight_files import INDEX, Written, parse_size, plan_shards, shard_names

MAX = 20_000          # "20KB": the tiny models' tensors are 0.2-25 KB (GPT-2's c_attn is above)
KINDS = ("llama", "gpt2")
# the [model] table of a run of each tiny model (`hybridpar export --format hf` reads it)
OPTIONS = {
    "llama": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "gpt2": dict(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


def _measured(live_peak):
    """`consolidate.stream_state_dict`, measuring the bytes of the tensors it yielded that
    are still alive (anywhere) each time it yields one more: what the writer really holds."""
    from hybridpar.pipe import consolidate

    inner = consolidate.stream_state_dict

    def stream(*args, **kwargs):
        live = [0]

        def freed(n):
            live[0] -= n

        for t in inner(*args, **kwargs):
            if t is not None:
                n = t.numel() * t.element_size()
                live[0] += n
                live_peak[0] = max(live_peak[0], live[0])
                weakref.finalize(t, freed, n)
            yield t

    return stream


def _fail_second_write(monkeypatch_target):
    """safetensors' save_file, failing on its second call (a disk that fills up)."""
    import safetensors.torch

    calls = [0]
    real = safetensors.torch.save_file

    def save_file(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch_target.save_file = save_file
    return real


def _worker(folder):
    import safetensors.torch

    from hybridpar.hf import to_sequential
    from hybridpar.nn import CausalLMLoss
    from hybridpar.pipe import consolidate
    from hybridpar.train.checkpoints.checkpoint import save_checkpoint
    from hybridpar.train.checkpoints.shards import model_entries, tie_entries
    from hybridpar.train.export import export_pipe

    topo = hybridpar.init(pp=2, tp=2, timeout=60)
    out = {}
    for kind in KINDS:
        model = tiny(kind, seed=3)
        pipe = hybridpar.HybridPipe(to_sequential(model), [2, 3], topology=topo, chunks=2,
                                    loss_fn=CausalLMLoss(), tp_plan="auto")
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        ids = token_batches(2, 4, 8, seed=11)
        pipe.train_step(ids[0], ids[0])                 # one step: weights of their own
        opt.step()
        pipe.eval()
        logits = pipe(ids[1])                            # (B, T, V) on every rank
        result = {"logits": logits, "state": pipe.consolidated_state_dict()}
        real = consolidate.stream_state_dict
        for name, config in (("hf", model.config), ("plain", None)):
            peak = [0]
            consolidate.stream_state_dict = _measured(peak)
            try:
                written = export_pipe(pipe, f"{folder}/{kind}-{name}", config=config,
                                      max_shard_size=MAX)
            finally:
                consolidate.stream_state_dict = real
            result[name] = {"written": written._asdict(), "live_peak": peak[0]}
        # an existing folder is refused on every rank
        try:
            export_pipe(pipe, f"{folder}/{kind}-hf", config=model.config)
            result["again"] = "no error"
        except ValueError as e:
            result["again"] = str(e)
        # the second file's write fails (on rank 0): every rank raises, nothing is left
        real_save = safetensors.torch.save_file
        if dist_rank() == 0:
            _fail_second_write(safetensors.torch)
        try:
            export_pipe(pipe, f"{folder}/{kind}-failed", config=model.config, max_shard_size=MAX)
            result["failed"] = "no error"
        except ValueError as e:
            result["failed"] = f"{type(e).__name__}: {e}"
        finally:
            safetensors.torch.save_file = real_save
        # the checkpoint `hybridpar export` reads
        group = topo.tp_group if topo.tp > 1 else None
        save_checkpoint(f"{folder}/{kind}-run/checkpoints", 1,
                        {**model_entries(pipe, group, aliases=pipe.tied_aliases),
                         **tie_entries(pipe.tied_aliases)}, keep=1)
        out[kind] = result
    return out


def dist_rank():
    import torch.distributed as dist

    return dist.get_rank()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exports")
    ranks = hybridpar.spawn(_worker, 4, args=(str(folder),), timeout=300)
    return folder, ranks


def _payload(file: Path) -> int:
    """The tensor bytes of a safetensors file (its size less the header)."""
    with open(file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return file.stat().st_size - 8 - header


def _check_files(folder: Path, fields: dict, live_peak: int) -> dict:
    """The folder is Hugging Face's sharded layout; the writer held one file and one tensor."""
    from safetensors import safe_open

    written = Written(**fields)
    index = json.loads((folder / INDEX).read_text())
    files = sorted({*index["weight_map"].values()})
    count = len(files)
    assert count > 1 and files == list(written.files) == shard_names(count)
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{count:05d}\.safetensors", f) for f in files)
    assert sorted(p.name for p in folder.glob("*.safetensors")) == files
    sizes = {}
    for f in files:
        with safe_open(str(folder / f), "pt") as st:
            assert st.metadata() == {"format": "pt"}
            keys = list(st.keys())
            assert all(index["weight_map"][k] == f for k in keys)
            sizes[f] = _payload(folder / f)
            biggest = max(_bytes(st, k) for k in keys)
            # at most MAX bytes a file, unless one tensor alone is larger
            assert sizes[f] <= MAX or (len(keys) == 1 and biggest > MAX), (f, sizes[f])
    assert index["metadata"]["total_size"] == sum(sizes.values()) == written.total_size
    assert index["metadata"]["total_parameters"] == written.values
    # what the writer held at most: the fullest file (its tensors, the last one arriving) -
    # by its own count and by the tensors alive in the process, both exactly
    assert written.peak_bytes == max(sizes.values()) == live_peak
    return index


def _bytes(st, key: str) -> int:
    t = st.get_tensor(key)
    return t.numel() * t.element_size()


@pytest.mark.parametrize("kind", KINDS)
def test_a_pipe_exports_shards_that_from_pretrained_loads_with_the_pipes_logits(exported, kind):
    import transformers

    folder, ranks = exported
    rank0 = ranks[0][kind]
    index = _check_files(folder / f"{kind}-hf", rank0["hf"]["written"], rank0["hf"]["live_peak"])
    assert (folder / f"{kind}-hf" / "config.json").is_file()
    if kind == "gpt2":   # the tied head is left out, as save_pretrained leaves it out
        assert "lm_head.weight" not in index["weight_map"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder / f"{kind}-hf", output_loading_info=True, dtype=torch.float64)
    assert not any(info.values()), info                       # nothing missing or unexpected
    ids = token_batches(2, 4, 8, seed=11)[1]
    with torch.no_grad():
        logits = model(ids).logits                                            # (B, T, V)
    torch.testing.assert_close(logits, rank0["logits"], atol=1e-12, rtol=0)
    # only rank 0 wrote (the other ranks' counts are zeros), every rank knows the files
    for r in ranks[1:]:
        assert r[kind]["hf"]["written"]["files"] == rank0["hf"]["written"]["files"]
        assert r[kind]["hf"]["written"]["peak_bytes"] == 0 == r[kind]["hf"]["live_peak"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_plain_export_holds_every_name_and_loads_back(exported, kind):
    from hybridpar.train.export import load_exported

    folder, ranks = exported
    rank0 = ranks[0][kind]
    _check_files(folder / f"{kind}-plain", rank0["plain"]["written"],
                 rank0["plain"]["live_peak"])
    state = load_exported(folder / f"{kind}-plain")
    expected = rank0["state"]
    assert set(state) == set(expected)       # every name of a tie among them
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    # the folder, its index or a single file: what --init-from takes
    assert load_exported(folder / f"{kind}-plain" / INDEX).keys() == state.keys()


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_export_raises_on_every_rank_and_leaves_nothing(exported, kind):
    folder, ranks = exported
    for rank, r in enumerate(ranks):
        assert r[kind]["failed"].startswith(
            f"ValueError: cannot write {folder}/{kind}-failed: No space left on device"), rank
        assert (rank == 0) != r[kind]["failed"].endswith("(raised on rank 0)")
        assert r[kind]["again"].startswith(f"{folder}/{kind}-hf is a folder that exists")
    assert not (folder / f"{kind}-failed").exists()
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]   # no temporary


@pytest.mark.parametrize("kind", KINDS)
def test_hybridpar_export_streams_a_checkpoint_into_the_same_files(exported, kind, tmp_path,
                                                                   capsys):
    from safetensors.torch import load_file

    from hybridpar.train.export import load_exported, read_state

    folder, ranks = exported
    checkpoint = folder / f"{kind}-run" / "checkpoints" / "step-1"
    run = tmp_path / "config.json"
    run.write_text(json.dumps({"model": {"name": f"hf:{kind}", **OPTIONS[kind]}}))
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out), "--format", "hf", "--config", str(run),
                 "--max-shard-size", "20KB"]) == 0
    printed = capsys.readouterr().out
    ours, pipes = json.loads((out / INDEX).read_text()), \
        json.loads((folder / f"{kind}-hf" / INDEX).read_text())
    assert ours["metadata"] == pipes["metadata"]
    assert set(ours["weight_map"]) == set(pipes["weight_map"])
    assert f"in {len(set(ours['weight_map'].values()))} files" in printed
    for f in set(ours["weight_map"].values()):     # the layer order within a layer differs
        for key, value in load_file(str(out / f)).items():
            theirs = load_file(str(folder / f"{kind}-hf" / pipes["weight_map"][key]))[key]
            assert torch.equal(value, theirs), key
    # plain: the pipe's names and values, read back by load_exported (what --init-from uses)
    assert main(["export", str(checkpoint), str(tmp_path / "plain"),
                 "--max-shard-size", "20000"]) == 0
    state, expected = load_exported(tmp_path / "plain"), ranks[0][kind]["state"]
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    whole = read_state(checkpoint)                       # (the .pt export's reader: all at once)
    assert set(whole) == set(expected) and all(torch.equal(whole[k], v)
                                               for k, v in expected.items())


def test_a_model_that_fits_one_file_is_model_safetensors_without_an_index(exported, tmp_path):
    folder, _ = exported
    out = tmp_path / "one"
    assert main(["export", str(folder / "llama-run" / "checkpoints" / "step-1"), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_files_close_before_the_tensor_that_would_overfill_them():
    sizes = [("a", 6), ("b", 4), ("c", 5), ("d", 12), ("e", 3)]
    assert plan_shards(sizes, 10) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3)[2] == "model-00003-of-00003.safetensors"


def test_max_shard_size_reads_units_as_hugging_face_does_and_refuses_the_rest(tmp_path, capsys):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("200MB") == 200 * 10**6
    assert parse_size("20KB") == 20_000 and parse_size("20kb") == 20_000
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("123") == 123 == parse_size(123)
    for bad, says in [("5XB", "is not a size"), ("GB", "is not a size"), ("", "is not a size"),
                      ("-1GB", "is not a size"), ("0", "give a positive size"),
                      ("0.1B", "give a positive size")]:
        with pytest.raises(ValueError, match=says):
            parse_size(bad)
    for extra, says in [(["x", "--max-shard-size", "5XB"], "--max-shard-size: max shard size "
                                                           "'5XB' is not a size"),
                        (["x.pt", "--max-shard-size", "1GB"], "sizes safetensors files")]:
        assert main(["export", str(tmp_path / "step-1"), *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], lines
    assert os.listdir(tmp_path) == []
