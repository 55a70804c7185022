"""The examples run as a user runs them and do what they say.

Each example starts its own ranks, and starting them (imports, rendezvous) leaves the two
cores of the development machines partly idle, so the `outputs` fixture runs the examples
two at a time, each as its own process with its own time limit; every test asserts on its
example's output.
"""

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_HF = importlib.util.find_spec("transformers") is not None
EXAMPLES = {   # name -> the command line's arguments after the interpreter
    "hybrid_mlp": ["examples/hybrid_mlp.py", "--steps", "30"],
    "balance_gpt": ["examples/balance_gpt.py", "--steps", "5"],
    "resume_reshard": ["examples/resume_reshard.py", "--steps", "6"],
    "export_plain": ["examples/export_plain.py", "--steps", "4", "--tokens", "20"],
    **({"hf_llama": ["examples/hf_llama.py"]} if HAS_HF else {}),
}
TIMEOUT = 300          # seconds, each example
AT_ONCE = 2
# The `outputs` fixture runs all five (two at a time) inside the first test: pytest's
# 300 s per test (pyproject.toml) was passed twice on a loaded 2-core EPYC; each example
# keeps its own TIMEOUT.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every example's (exit status, stdout, stderr) by name, run AT_ONCE at a time, the
    longest first; an example past its time limit is killed (status "timeout (300 s)")."""
    folder = tmp_path_factory.mktemp("examples")
    waiting = sorted(EXAMPLES, key=lambda name: name != "hf_llama")
    running, done = {}, {}
    try:
        while waiting or running:
            while waiting and len(running) < AT_ONCE:
                name = waiting.pop(0)
                with open(folder / f"{name}.out", "w") as out, \
                        open(folder / f"{name}.err", "w") as err:
                    proc = subprocess.Popen([sys.executable, *EXAMPLES[name]], cwd=ROOT,
                                            stdout=out, stderr=err)
                running[name] = (proc, time.monotonic())
            time.sleep(0.1)
            for name, (proc, start) in list(running.items()):
                if proc.poll() is None and time.monotonic() - start < TIMEOUT:
                    continue
                status = proc.poll()
                if status is None:
                    proc.kill()
                    proc.wait()
                    status = f"timeout ({TIMEOUT} s)"
                del running[name]
                done[name] = (status, (folder / f"{name}.out").read_text(),
                              (folder / f"{name}.err").read_text())
    finally:
        for proc, _ in running.values():
            proc.kill()
            proc.wait()
    return done


def output(outputs, name):
    """The example's stdout, once it ran to the end with exit status 0."""
    status, out, err = outputs[name]
    assert status == 0, f"examples/{name}.py: exit status {status}\n{err[-3000:]}"
    return out


def test_hybrid_mlp_example_trains_on_four_ranks(outputs):
    out = output(outputs, "hybrid_mlp")
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[0] > 1.0 and losses[-1] < 0.1 * losses[0], out
    assert "same on every rank: True" in out


def test_balance_example_prints_the_stage_table_and_trains_with_it(outputs):
    out = output(outputs, "balance_gpt")
    assert "slowest / fastest stage:" in out
    balance = re.search(r"balance = \[(\d+), (\d+)\]", out)
    assert balance and sum(map(int, balance.groups())) == 7  # gpt with 4 blocks: 7 layers
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first


def test_resume_reshard_example_continues_under_another_layout_with_the_same_losses(outputs):
    out = output(outputs, "resume_reshard")
    assert "saved checkpoints/step-3" in out, out
    rows = re.findall(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+$", out, re.MULTILINE)
    assert [int(step) for step, _, _ in rows] == [4, 5, 6], out   # resumed after step 3
    for _, original, resharded in rows:
        assert abs(float(original) - float(resharded)) < 1e-4, out
    assert "within fp32 noise: True" in out


def test_export_example_samples_the_pipelines_text_from_the_plain_model(outputs):
    out = output(outputs, "export_plain")
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first, out
    assert re.search(r"exported step-4: \d+ tensors, [\d,]+ values", out), out
    assert "plain model sample:\n" in out
    assert "same text as the pipeline's sample: True" in out


def test_hugging_face_llama_example_trains_on_four_ranks_and_is_the_readmes(outputs):
    pytest.importorskip("transformers", reason="pip install 'hybridpar[hf]'")
    code = (ROOT / "examples" / "hf_llama.py").read_text()
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text()   # shown verbatim
    out = output(outputs, "hf_llama")
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0], out
