"""The examples run as a user runs them and do what they say."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_hybrid_mlp_example_trains_on_four_ranks():
    out = subprocess.run([sys.executable, "examples/hybrid_mlp.py", "--steps", "30"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[0] > 1.0 and losses[-1] < 0.1 * losses[0], out
    assert "same on every rank: True" in out


def test_balance_example_prints_the_stage_table_and_trains_with_it():
    out = subprocess.run([sys.executable, "examples/balance_gpt.py", "--steps", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "slowest / fastest stage:" in out
    balance = re.search(r"balance = \[(\d+), (\d+)\]", out)
    assert balance and sum(map(int, balance.groups())) == 7  # gpt with 4 blocks: 7 layers
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first


def test_resume_reshard_example_continues_under_another_layout_with_the_same_losses():
    out = subprocess.run([sys.executable, "examples/resume_reshard.py", "--steps", "6"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "saved checkpoints/step-3" in out, out
    rows = re.findall(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+$", out, re.MULTILINE)
    assert [int(step) for step, _, _ in rows] == [4, 5, 6], out   # resumed after step 3
    for _, original, resharded in rows:
        assert abs(float(original) - float(resharded)) < 1e-4, out
    assert "within fp32 noise: True" in out


def test_export_example_samples_the_pipelines_text_from_the_plain_model():
    out = subprocess.run([sys.executable, "examples/export_plain.py", "--steps", "4",
                          "--tokens", "20"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first, out
    assert re.search(r"exported step-4: \d+ tensors, [\d,]+ values", out), out
    assert "plain model sample:\n" in out
    assert "same text as the pipeline's sample: True" in out


def test_hugging_face_llama_example_trains_on_four_ranks_and_is_the_readmes():
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    code = (ROOT / "examples" / "hf_llama.py").read_text()
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text()   # shown verbatim
    out = subprocess.run([sys.executable, "examples/hf_llama.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0], out
