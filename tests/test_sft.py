"""configs/sft_llama.toml as its header says: a chat model made offline, the repository's
conversations tokenized with its chat template and a loss mask, `hybridpar run` at pp2 x tp2.

The eval loss (the held-out conversations' assistant tokens) falls, and sample.txt is the
first held-out conversation's prompt, as the template renders it, and the model's answer.
The loss itself is checked against a plain transformers loop in tests/test_masked_labels.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_in_process import hybridpar
from test_finetune import SMALL, make_pretrained

from hybridpar.cli import main

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sft_llama.toml"
CONVERSATIONS = ROOT / "examples" / "data" / "conversations.jsonl"


def made_inputs(root: Path) -> tuple[Path, Path]:
    """The pretrained chat model and the token folder, made by the config's own commands."""
    pretrained = make_pretrained("llama", root / "runs" / "pretrained" / "llama-chat", "--chat")
    config = root / CONFIG.name
    config.write_text(CONFIG.read_text())
    assert main(["tokenize", str(CONVERSATIONS), "-o", str(root / "runs" / "tokens" / "chat"),
                 "--chat", "--config", str(config), "--workers", "1", "--quiet"]) == 0
    return pretrained, config


def test_the_sft_config_trains_on_conversations_and_answers_a_held_out_prompt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    pretrained, config = made_inputs(tmp_path)
    tok = AutoTokenizer.from_pretrained(pretrained)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    meta = json.loads((tmp_path / "runs" / "tokens" / "chat" / "meta.json").read_text())
    assert meta["chat"]["mask"] == "assistant" and meta["documents"] == 270
    assert 0 < meta["chat"]["counted"] < meta["tokens"]

    steps = 8
    sets = [f"train.steps={steps}", "train.eval_every=4", "checkpoint.every=8",
            "train.lr=3e-3", *SMALL]
    done = hybridpar("run", config, *[a for s in sets for a in ("--set", s)], cwd=tmp_path,
                     timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "sft_llama"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [4, 8] and evals[8] < evals[4], evals
    sample = (run_dir / "sample.txt").read_text()
    first = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]
    prompts = {tok.apply_chat_template(r["messages"][:[m["role"] for m in r["messages"]]
                                                     .index("assistant")],
                                       tokenize=False, add_generation_prompt=True)
               for r in first if "messages" in r}
    assert any(sample.startswith(p) and len(sample) > len(p) for p in prompts), sample
