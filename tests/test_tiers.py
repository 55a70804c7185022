"""tests/tiers.py names real tests, and what it says the suite keeps is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiers import CAMPAIGN, COLLECTED, in_campaign

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("prefix", sorted(CAMPAIGN))
def test_each_campaign_entry_names_a_test_and_what_the_suite_keeps(prefix):
    path, _, name = prefix.partition("::")
    source = (TESTS.parent / path).read_text(encoding="utf-8")
    name = name.partition("[")[0]   # a corner of a matrix: the test function's name
    if name:
        assert re.search(rf"^def {re.escape(name)}\w*\(", source, re.MULTILINE), prefix
    for kept in re.findall(r"test_\w+\.py", CAMPAIGN[prefix]):
        assert (TESTS / kept).is_file(), (prefix, kept)


def test_each_campaign_entry_of_a_collected_file_names_a_collected_test(request):
    # a `*` entry with a typo would name nothing (and the suite would keep the corner)
    files, named = request.config.stash[COLLECTED]
    for key in CAMPAIGN:
        if "::" in key and key.partition("::")[0] in files:
            assert key in named, key


def test_a_node_id_is_the_campaigns_by_its_prefix():
    assert in_campaign("tests/test_examples.py::test_hybrid_mlp_example_trains_on_four_ranks")
    assert in_campaign("tests/test_compile.py::test_tp2_compiled_matches_eager_with_graph_"
                       "breaks_at_the_collectives")
    assert not in_campaign("tests/test_compile.py::test_a_smaller_last_micro_batch_recompiles_"
                           "once_with_a_dynamic_batch")
    assert not in_campaign("tests/test_pipe_parity.py::test_mlp_two_stages_matches_one_device")


def test_a_star_in_an_entry_stands_for_any_text_and_brackets_are_literal():
    family = "tests/test_hf_families.py::test_a_family_trains_as_its_own_transformers_model"
    assert in_campaign(f"{family}[phi3-pp1tp2-gpipe-hf]")
    assert not in_campaign(f"{family}[phi3-pp2tp2-zbv-auto]")
    assert not in_campaign(f"{family}[h]")
    layouts = "tests/test_hf_layouts.py::test_hugging_face_models_train_as_on_one_device"
    assert in_campaign(f"{layouts}[llama-pp2tp2-zbv-hf]")
    assert not in_campaign(f"{layouts}[llama-pp2tp2-zbv-auto]")
