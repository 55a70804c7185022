"""``data.source = "tokens"``: a `hybridpar tokenize` folder trains, through its memmaps.

Two folders are made here: a small byte-level BPE (320 ids, trained by `tokenizers` on this
package's sources) and bytes, each of this package's data sources as documents. The windows
are compared with a reference cut from the shards directly; runs are a tiny GPT on gloo ranks
(pp2, pp1 x dp2, pp3), resumed exactly and under another dp; every bad input is one error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from spawn_cases import spawn_cases

import hybridpar
from hybridpar.data import open_tokens, tokenize_corpus
from hybridpar.data.windows import TokenWindows, check_folder
from hybridpar.train import load_config
from hybridpar.train.configs.config import ConfigError
from hybridpar.train.data import make_batches
from hybridpar.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.toml"
SOURCES = sorted((ROOT / "hybridpar" / "data").glob("*.py"))
TIMEOUT = 90
STEPS = 6


def _bpe(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.read_text() for p in SOURCES], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"bpe": folder, "bytes": folder, "other": a bpe folder of other documents}."""
    root = tmp_path_factory.mktemp("tokens")
    bpe = _bpe(root / "tokenizer.json")
    out = {}
    for name, tokenizer, files in (("bpe", bpe, SOURCES), ("bytes", "bytes", SOURCES),
                                   ("other", bpe, SOURCES[1:])):
        out[name] = root / name
        tokenize_corpus([str(p) for p in files], out[name], tokenizer=str(tokenizer),
                        format="txt", val_fraction=0.25, shard_tokens=3000, workers=1)
    return out


def config(folder, *overrides, vocab=320):
    return load_config(QUICKSTART, [
        f"model.vocab_size={vocab}", "model.block_size=16", "model.n_embd=32",
        "model.n_layer=3", "model.n_head=4", "model.dropout=0.0",
        "data.source=tokens", f"data.path={folder}", "data.seed=3",
        "parallel.pp=2", "parallel.tp=1", "parallel.dp=1", "parallel.chunks=2",
        "parallel.timeout=60", f"train.steps={STEPS}", "train.batch_size=4",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=3",
        "train.eval_batches=1", "train.sample_tokens=6", "checkpoint.every=2",
        "checkpoint.keep=5", *overrides])


# workers (module level: the children import them by name) -----------------------------------

def _train(cfg, run_dir, stop_at=None):
    return train(cfg, run_dir, stop_at=stop_at, progress=False)


def _train_counting_maps(cfg, run_dir):
    """Train, counting the memmaps this rank opened of the token folder."""
    real, opened = np.memmap, []

    class Counting(real):   # np.memmap is a class: open_tokens calls it
        def __new__(cls, filename, *args, **kwargs):
            opened.append(str(filename))
            return real.__new__(real, filename, *args, **kwargs)

    np.memmap = Counting
    try:
        result = train(cfg, run_dir, progress=False)
    finally:
        np.memmap = real
    token_files = [f for f in opened if str(cfg.data.path) in f]
    return {**result, "rank": hybridpar.current_topology().pp_rank, "maps": len(token_files)}


def _resume_errors(cases):
    """Each (config, run_dir) trained in turn; what each raised, as "Type: message"."""
    out = []
    for cfg, run_dir in cases:
        try:
            result = train(cfg, run_dir, progress=False)
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
        else:
            out.append(result)
    return out


def run(cfg, run_dir, *, stop_at=None, fn=_train):
    par = cfg.parallel
    args = (cfg, str(run_dir)) if fn is not _train else (cfg, str(run_dir), stop_at)
    return hybridpar.spawn(fn, par.pp * par.tp * (par.dp or 1), args=args, timeout=TIMEOUT)


def same_on_every_rank(results, key):
    values = [r[key] for r in results]
    assert all(v == values[0] for v in values), f"{key} differs between ranks: {values}"
    return values[0]


def copy_checkpoint(src: Path, run_dir: Path) -> None:
    shutil.copytree(src, run_dir / "checkpoints" / src.name)


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    """The 2-rank runs on the bpe folder, in turn on one spawn: {case: (run dir, results)}.
    "ref": pp2, uninterrupted: eval at 3 and 6, a sample, checkpoints 2 4 6; "dp2": pp1 x dp2;
    "first": pp2 stopped after step 3, then "second": a new run in its folder, which resumes."""
    root = tmp_path_factory.mktemp("two_ranks")
    pp2, dp2 = config(folders["bpe"]), config(folders["bpe"], "parallel.pp=1", "parallel.dp=2")
    cases = {"ref": (pp2, root / "ref", None), "dp2": (dp2, root / "dp2", None),
             "first": (pp2, root / "same", 3), "second": (pp2, root / "same", None)}
    out = spawn_cases(_train, 2, {name: (cfg, str(run_dir), stop_at)
                                  for name, (cfg, run_dir, stop_at) in cases.items()},
                      timeout=2 * TIMEOUT)
    return {name: (run_dir, out[name]) for name, (_, run_dir, _) in cases.items()}


@pytest.fixture(scope="module")
def ref_run(two_ranks):
    return two_ranks["ref"]


# windows ----------------------------------------------------------------------------------

def reference_windows(folder, split, seq_len):
    """Every window of a split cut from its shards directly: (windows, seq_len + 1)."""
    out = []
    for shard in open_tokens(folder).splits[split]:
        t = np.asarray(shard.tokens)
        out += [t[j * seq_len:j * seq_len + seq_len + 1] for j in range((len(t) - 1) // seq_len)]
    return np.stack(out).astype(np.int64)


def test_windows_are_the_shards_cut_in_seq_len_steps_in_the_seeded_order(folders):
    folder = check_folder(folders["bpe"])
    ref = reference_windows(folders["bpe"], "train", 16)
    assert len(folder.meta["splits"]["train"]["shards"]) > 1     # windows over several shards
    windows = TokenWindows(folder, seq_len=16, batch_size=4, seed=3)
    assert windows.windows == len(ref)
    order = torch.randperm(len(ref), generator=torch.Generator().manual_seed(3))
    for step in range(3):
        x, y = windows.next_batch()
        rows = ref[order[step * 4:(step + 1) * 4].numpy()]
        assert torch.equal(x, torch.from_numpy(rows[:, :-1]))
        assert torch.equal(y, torch.from_numpy(rows[:, 1:]))
    assert windows.state_dict() == {"epoch": 0, "index": 12}


def test_dp_replicas_read_disjoint_rows_of_the_one_replica_batch(folders):
    folder = check_folder(folders["bpe"])
    one = TokenWindows(folder, seq_len=16, batch_size=4, seed=3)
    two = [TokenWindows(folder, seq_len=16, batch_size=4, seed=3, dp_rank=r, dp=2)
           for r in range(2)]
    for _ in range(3):
        x, y = one.next_batch()
        parts = [w.next_batch() for w in two]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert two[0].state_dict() == two[1].state_dict() == one.state_dict()


def test_a_rank_that_reads_nothing_maps_nothing_and_gets_zeros(folders):
    windows = TokenWindows(check_folder(folders["bpe"]), seq_len=16, batch_size=4, seed=3,
                           inputs=False, targets=False)
    x, y = windows.next_batch()
    assert windows.opened == 0 and x.shape == y.shape == (4, 16) and not x.any()
    assert windows.state_dict() == {"epoch": 0, "index": 4}   # the position still moves


def test_the_val_split_serves_eval_and_epochs_run_on(folders):
    cfg = config(folders["bytes"], vocab=256)
    val = make_batches(cfg, split="val")
    assert isinstance(val, TokenWindows) and val.split == "val"
    ref = reference_windows(folders["bytes"], "val", 16)
    x, _ = val.next_batch()
    assert all(any(np.array_equal(row, w[:-1]) for w in ref) for row in x.numpy())
    val.load_state_dict({"epoch": 5, "index": val.windows - 1})
    val.next_batch()
    assert val.state_dict() == {"epoch": 6, "index": 3}


# bad inputs before training --------------------------------------------------------------------

def test_a_missing_or_corrupt_folder_is_a_config_error(folders, tmp_path):
    with pytest.raises(ConfigError, match="no such token folder; make one with hybridpar"):
        config(tmp_path / "missing")
    broken = tmp_path / "broken"
    shutil.copytree(folders["bytes"], broken)
    next(broken.glob("train-*.bin")).write_bytes(b"\0" * 6)
    with pytest.raises(ConfigError, match=r"holds 6 bytes, but meta.json says"):
        config(broken, vocab=256)
    with pytest.raises(ConfigError, match=r"data.path is required with data.source = 'tokens'"):
        load_config(QUICKSTART, ["data.source=tokens"])


def test_a_vocabulary_larger_than_the_models_is_a_config_error(folders):
    with pytest.raises(ConfigError, match=r"320-token vocabulary .* vocab_size=256: ids >= 256 "
                                          r"have no embedding; set model.vocab_size >= 320"):
        config(folders["bpe"], vocab=256)


# runs ------------------------------------------------------------------------------------------

def test_pp2_trains_evaluates_and_samples_text_with_the_tokenizer(folders, ref_run):
    run_dir, results = ref_run
    losses = same_on_every_rank(results, "losses")
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert sorted(same_on_every_rank(results, "eval")) == [3, 6]
    sample = (run_dir / "sample.txt").read_text(encoding="utf-8")
    prompt = open_tokens(folders["bpe"]).decode(reference_windows(folders["bpe"], "val", 16)[0][:8])
    assert sample.startswith(prompt) and len(sample) > len(prompt)   # BPE text, not bytes


def test_pp1_dp2_trains_the_same_sequence(two_ranks, ref_run):
    _, results = two_ranks["dp2"]
    losses = same_on_every_rank(results, "losses")
    assert losses == pytest.approx(ref_run[1][0]["losses"], abs=1e-5, rel=0)


def test_pp3_middle_stage_maps_nothing(folders, tmp_path):
    cfg = config(folders["bytes"], "parallel.pp=3", "train.steps=2", "train.eval_every=1",
                 "checkpoint.every=0", vocab=256)
    results = run(cfg, tmp_path, fn=_train_counting_maps)
    maps = {r["rank"]: r["maps"] for r in results}
    assert maps[1] == 0 and maps[0] > 0 and maps[2] > 0, maps
    assert results[1]["sample"] is None and results[2]["sample"] == results[0]["sample"]


def test_resume_continues_exactly_and_under_another_dp(folders, two_ranks, ref_run, tmp_path):
    ref_dir, ref = ref_run
    reference = ref[0]["losses"]
    _, first = two_ranks["first"]                # stopped after step 3 ...
    assert same_on_every_rank(first, "losses") == reference[:3]
    _, second = two_ranks["second"]              # ... and resumed by a new run in its folder
    assert same_on_every_rank(second, "start") == 2
    assert same_on_every_rank(second, "losses") == reference[2:]     # exactly
    other = tmp_path / "dp2"
    copy_checkpoint(ref_dir / "checkpoints" / "step-4", other)
    resumed = run(config(folders["bpe"], "parallel.pp=1", "parallel.dp=2"), other)
    assert same_on_every_rank(resumed, "start") == 4
    assert same_on_every_rank(resumed, "losses") == pytest.approx(reference[4:], abs=1e-5,
                                                                  rel=0)


def test_a_resume_on_other_data_names_what_changed_and_restart_overrides(folders, ref_run,
                                                                          tmp_path):
    ref_dir = ref_run[0]
    cases = []
    for name, overrides, folder in (("seq", ["data.seq_len=8"], "bpe"),
                                    ("corpus", [], "other"), ("seed", ["data.seed=4"], "bpe"),
                                    ("tokenizer", [], "bytes"),
                                    ("restart", ["data.seq_len=8", "data.restart=true"], "bpe"),
                                    ("bytes", ["data.source=corpus"], "bpe"),
                                    ("bytes-restart", ["data.source=corpus",
                                                       "data.restart=true"], "bpe")):
        copy_checkpoint(ref_dir / "checkpoints" / "step-4", tmp_path / name)
        cases.append((config(folders[folder], "parallel.pp=1", *overrides), str(tmp_path / name)))
    out = hybridpar.spawn(_resume_errors, 1, args=(cases,), timeout=TIMEOUT)[0]
    assert out[0].startswith("CheckpointError: checkpoint ") and \
        "changed: data.seq_len: 16 -> 8. Resume with the data it was trained on, or set " \
        "data.restart = true" in out[0]
    assert "changed: the corpus (meta.json fingerprint: its tokens)" in out[1]
    assert "changed: data.seed: 3 -> 4" in out[2]
    assert "changed: the tokenizer (meta.json tokenizer.sha256)" in out[3]
    assert out[4]["start"] == 4 and len(out[4]["losses"]) == STEPS - 4    # restarted order
    # issue 40.5: another source (bytes of the embedded corpus) is a change too, not a resume
    # that silently reads the token folder's position into other data
    assert "changed: data.source: 'tokens' -> 'corpus' (it was trained on a token folder" \
        in out[5] and out[5].startswith("CheckpointError")
    assert out[6]["start"] == 4 and len(out[6]["losses"]) == STEPS - 4
