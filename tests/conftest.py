"""Set-up shared by every test file.

`hybridpar.spawn` forks its ranks from a forkserver that has imported torch and hybridpar
once (`hybridpar.launch.preload` adds to those). The ranks of the Hugging Face tests then import
transformers' model families on their own, 1-2 s of CPU a rank (4 ranks: 2-3 s a spawn on 2
cores). When the collected tests import transformers (they are being run), the forkserver
imports those modules too, once, before the first spawn starts it: what each rank runs is
unchanged, it only finds them imported.
"""

from __future__ import annotations

import sys

import hybridpar.launch

HF_PRELOAD = ["transformers", "transformers.models.auto.modeling_auto",
              "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
              "hybridpar.hf"]


def pytest_collection_finish(session):
    if "transformers" in sys.modules:
        hybridpar.launch.preload(*HF_PRELOAD)
