"""scripts/torch_names.py: every torch name hybridpar's source reaches, looked up in this torch."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import torch_names


def test_every_torch_name_hybridpar_uses_exists_in_the_pinned_torch(capsys):
    assert torch_names.main([]) == 0
    assert " 0 missing" in capsys.readouterr().out


def test_a_name_this_torch_lacks_is_named_with_its_file(tmp_path, capsys):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "import torch\nimport torch.distributed as dist\n"
        "from torch.nn import functional as F\n"
        "from torch._subclasses.fake_tensor import NoSuchError\n"
        "def f(x):\n    dist.no_such_collective(x)\n    return F.relu(torch.zeros(1)).sum()\n")
    assert torch_names.main(["--root", str(package), "--json", str(tmp_path / "n.json")]) == 1
    out = capsys.readouterr().out
    assert "MISSING torch.distributed.no_such_collective  (pkg/a.py)" in out
    assert "MISSING torch._subclasses.fake_tensor.NoSuchError" in out
    assert "relu" not in out and "zeros" not in out   # names this torch has
    assert set(torch_names.used_names(package)) >= {"torch.nn.functional.relu", "torch.zeros"}
