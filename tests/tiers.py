"""The suite and the campaign: which tests `make test` runs and which `make campaign` runs.

The suite (`make test`, under 10 minutes on 2 cores) keeps every feature's parity cases,
every error path, and the mechanism of every fault of docs/reliability.md in-process. The
campaign (`make campaign`; CI runs both) holds the long runs that repeat what the suite
already checks in-process, at the cost of fresh interpreters and many ranks:

    kind                 what                                         the suite keeps
    as a user types it   examples/, `hybridpar run` end to end, its   the same steps and the
                         agent killed or signalled, runs at once      same mechanisms in-process
    measurements         estimated vs measured peak memory, builds    exact byte counts
                         within their shard, benchmark smoke runs
    wider sweeps         compiled pipelines and tp, `hybridpar        one case of each; each
                         check` of Hugging Face models, the HF        family over two stages
                         families at tp 2 on one stage, corners of    under both plans; every
                         the layout x schedule x recompute matrices   schedule, recompute mode
                         (8-rank layouts among them)                  and layout kind

What each test costs, its ranks included: scripts/cpu_per_test.py (a pytest plugin).

A test is in the campaign when its node id starts with one of `CAMPAIGN`'s keys (where a `*`
stands for any text: a corner of a matrix); the value says what the suite keeps of it.
"""

from __future__ import annotations

import re

import pytest

__all__ = ["CAMPAIGN", "COLLECTED", "TIERS", "campaign_keys", "in_campaign"]

TIERS = ("suite", "campaign", "all")
# the files collected and the `CAMPAIGN` keys that named a collected test, before any is
# deselected (conftest.py fills it, test_tiers.py reads it)
COLLECTED = pytest.StashKey[tuple[set[str], set[str]]]()

_CLI = "tests/test_run_cli.py::"
_CHECK_MEMORY = "tests/test_check_memory.py::"
_CHECK_HF = "tests/test_check_hf.py::"
_GPU_CHECK = "tests/test_gpu_check_smoke.py::"
_FAULTS = "tests/test_launcher_faults.py::"
_FAMILIES = "tests/test_hf_families.py::test_a_family_trains_as_its_own_transformers_model["
_LAYOUTS = "tests/test_hf_layouts.py::test_hugging_face_models_train_as_on_one_device["
_EXPORTS = "tests/test_hf_families.py::test_an_export_loads_with_from_pretrained_and_gives_the_" \
    "pipes_logits["
_ZERO = "tests/test_zero.py::test_zero_1_and_2_train_with_the_losses_of_zero_0"
_MASTER = "tests/test_master_weights.py::"
_VIRTUAL = "tests/test_virtual_parity.py::"
_PIPE_TP = "tests/test_pipe_tp.py::test_tensor_parallel_gpt_pipeline_matches_one_device"
_RECOMPUTE = "tests/test_layer_checkpoint.py::test_layer_checkpointing_trains_as_one_device"
_SP = "tests/test_sequence_parallel.py::test_sequence_parallel_gpt_trains_as_one_device"
_SP_HF = "tests/test_sequence_parallel.py::test_hugging_face_decoders_train_sequence_" \
    "parallel_as_one_device"
_MASKED = "tests/test_masked_labels.py::test_every_layout_trains_as_the_token_mean_on_one_device"
_CHANGING = "tests/test_p2p_order.py::test_changing_shapes_equal_one_device_and_known_" \
    "shapes_send_no_header"

CAMPAIGN: dict[str, str] = {
    # as a user types it: fresh interpreters, `hybridpar run`'s agent and workers
    "tests/test_examples.py": "each example's features: the parity, balance, resume and "
                              "export tests",
    _CLI + "test_run_trains_resumes_and_exports": "test_train_run.py (resume, export), "
                                                  "test_run_cli.py's failing worker",
    _CLI + "test_two_nodes_on_localhost_train_like_one": "test_launcher_faults.py's network "
                                                         "rendezvous",
    _CLI + "test_torchrun_runs_the_worker_module": "test_train_run.py's runs of the same worker "
                                                   "module in-process",
    _FAULTS + "test_runs_started_at_once": "test_launcher_faults.py's store bound by the agent "
                                           "and new for each attempt",
    _FAULTS + "test_kill_9_of_the_agent": "test_launcher_faults.py's process lifetime (parent "
                                          "and named process gone) and held run directories",
    _CLI + "test_a_killed_worker_is_restarted": "test_train_run.py's resume after a crash, "
                                                "test_run_cli.py's failing worker",
    "tests/test_run_stops.py::test_sigterm_to_hybridpar_run": "test_run_stops.py's signal on "
                                                             "one rank stopping every rank",
    "tests/test_trace.py::test_hybridpar_run_trace_writes_one_step_and_logs_comm_per_step":
        "test_trace.py's traced steps in-process",
    "tests/test_loopback.py::test_hybridpar_run_listens_on_loopback_only":
        "test_loopback.py's store and rendezvous checks",
    "tests/test_bad_inputs.py::test_a_run_whose_workers_fail_ends_in_one_line_and_leaves_"
    "nothing_running": "test_run_cli.py's failing worker",
    # each layout x pack on one of the two models stays (9 of 16)
    _MASKED + "[llama-pp2tp1dp2]": "its qwen3-pp2tp1dp2",
    _MASKED + "[llama-pp2tp1dp2-pad]": "its qwen3-pp2tp1dp2-pad",
    _MASKED + "[qwen3-pp2tp2dp1-": "its llama-pp2tp2dp1 -documents and -pad",
    _MASKED + "[qwen3-pp1tp2dp2-sp": "its llama-pp1tp2dp2-sp and -sp-pad",
    _MASKED + "[qwen3-pp2tp1dp2-documents]": "its llama-pp2tp1dp2-documents",
    "tests/test_masked_labels.py::test_hybridpar_run_on_a_masked_folder_trains_at_pp2_dp2_as_"
    "on_one_rank[none]": "its [pad] (a masked folder through hybridpar run, padded)",
    "tests/test_finetune.py::test_finetune_llama_config_trains_at_pp2_tp2_and_exports": "its "
        "other families' step from a token folder and export",
    "tests/test_sft.py": "test_masked_labels.py's hybridpar run on a folder of conversations, "
                         "test_tokenize_chat.py, test_config.py's load of configs/sft_llama.toml",
    "tests/test_run_memory_limit.py::test_a_model_larger_than_each_rank_allows_loads_trains_"
    "and_exports": "test_run_memory_limit.py's budget checks, test_hf_shard_load.py",
    # measurements
    _CHECK_MEMORY + "test_the_estimated_peak_of_each_rank": "test_zero.py's exact state counts",
    _CHECK_MEMORY + "test_the_dp_buckets_hold": "test_dp_reduce.py",
    _CHECK_MEMORY + "test_zero_2_holds_the_gradients": "test_zero_parity.py",
    _CHECK_MEMORY + "test_layer_checkpointing_keeps": "test_layer_checkpoint.py",
    _CHECK_MEMORY + "test_a_7b_llama_is_checked": "test_check.py",
    "tests/test_check.py::test_the_quick_start_passes_with_the_real_models_parameter_bytes":
        "test_check.py's dry runs of small models",
    "tests/test_memory_bound.py": "test_meta_build_layouts.py, test_hf_shard_load.py",
    "tests/test_bench_smoke.py": "the benchmarks' subjects' own tests",
    "tests/test_bench_loader_smoke.py": "test_tokens_source.py",
    "tests/test_bench_zero_smoke.py": "test_zero.py",
    "tests/test_bench_build_memory_smoke.py": "test_meta_build_layouts.py",
    "tests/test_tokenize_bench_smoke.py": "test_tokenize.py",
    "tests/test_hf_probe.py::test_the_coverage_script": "test_hf_probe.py's probe, "
                                                         "test_hf_families.py",
    "tests/test_gpu_microbatch_smoke.py": "test_device.py",
    _GPU_CHECK + "test_every_check_passes": "test_device.py, test_nccl_order_plans.py",
    _GPU_CHECK + "test_the_tables_and_verdicts": "test_gpu_check_smoke.py's verdict rules",
    _GPU_CHECK + "test_the_numbers_behind": "test_gpu_check_smoke.py's verdict rules",
    "tests/test_imports.py::test_every_module_imports_alone": "test_imports.py's one-way "
                                                              "arrows, test_architecture.py",
    "tests/test_tp_dense.py::test_the_tp_dense_example_matches_plain_linear_layers":
        "test_tp_dense.py's dense layers against nn.Linear",
    "tests/test_tp_shard.py::test_example_runs_on_two_ranks_and_matches_the_plain_module":
        "test_tp_shard.py's strategies against the unsharded module",
    # wider sweeps
    "tests/test_check.py::test_the_large_gpu_config_passes_on_8_fake_ranks":
        "test_check.py's pp2 x tp2 dry runs",
    "tests/test_check.py::test_virtual_stages_dry_run_every_stage": "test_nccl_order_plans.py "
                                                                    "(every schedule's replay)",
    "tests/test_compile.py::test_pipe_pp2_compiled": "test_compile.py's compiled blocks",
    "tests/test_compile.py::test_tp2_compiled": "test_compile.py's compiled blocks",
    "tests/test_compile.py::test_compiled_gpt_matches_eager": "test_compile.py's compiled "
                                                              "blocks (deferred weight "
                                                              "gradients, a dynamic batch)",
    _CHECK_HF + "test_the_cli_checks": "test_check.py",
    _CHECK_HF + "test_the_hf_plan": "test_check.py",
    _CHECK_HF + "test_a_pretrained_llama": "test_check.py",
    _CHECK_HF + "test_gpt2_with": "test_check.py",
    _CHECK_HF + "test_at_dp2": "test_check.py",
    _CHECK_HF + "test_any_decoder": "test_hf_probe.py",
    _ZERO: "test_zero_parity.py's zero 1 and 2 at pp2 x dp2, tp2 x dp2, pp2 x tp2 x dp2 and zbv "
           "(every parameter in float64, not only the losses)",
    "tests/test_zero.py::test_a_zero_1_checkpoint_resumes_at_another": "test_zero.py's zero-2 "
                                                                       "resume at dp 1, zero 0",
    _MASTER + "test_bf16_layouts_train_as_one_rank[pp2 x tp2 x dp2 zero1]": "its pp2 x dp2 and "
                                                                           "tp2 x dp2 at zero 1",
    _MASTER + "test_fp32_zero_1_at_pp2_x_tp2_x_dp2": "test_zero_parity.py",
    _PIPE_TP + "[pp2tp2dp2-": "its pp 2 x tp 2 layouts, test_virtual_parity.py's pp2 x tp2 x "
                              "dp2",
    _RECOMPUTE + "[pp2tp2dp1-zb-h1-layers]": "its gpipe, 1f1b and zbv layers and zb-h1 "
                                             "selective",
    _RECOMPUTE + "[pp1tp2dp2-1f1b-selective]": "its zb-h1 selective",
    _SP + "[pp2tp2dp1-zb-h1-never]": "its tp2 gpipe, pp2 x tp2 1f1b and zbv, the zb-h1 "
                                     "dropout case",
    _SP + "[pp2tp2dp1-interleaved-": "its zbv with layers",
    _SP + "[pp2tp2dp2-": "its pp2 x tp2 layouts",
    _SP_HF + "[mistral-": "qwen3, llama, gpt2 and granite",
    _SP_HF + "[phi-": "qwen3, llama, gpt2 and granite",
    _CHANGING + "[gpt-pp2tp1-1f1b]": "its five other layouts",
    _CHANGING + "[skipnet-pp3tp1-zb-h1]": "its five other layouts (skipnet pp3 1f1b)",
    _CHANGING + "[gpt-pp2tp2-zb-h1]": "its five other layouts",
    _CHANGING + "[gpt-pp2tp2-1f1b]": "its gpt pp2tp2 gpipe and zbv, skipnet's",
    "tests/test_train_run.py::test_resume_under_another_layout_matches_the_uninterrupted_run"
    "[pp4-tp1-dp1]": "its pp1-tp1-dp1 and pp2-tp1-dp2 (a checkpoint of another layout)",
    "tests/test_train_run.py::test_resume_under_another_layout_matches_the_uninterrupted_run"
    "[pp1-tp4-dp1]": "its pp1-tp1-dp1 and pp2-tp1-dp2, test_tp_state.py's other tp sizes",
    _LAYOUTS + "mistral-pp2tp2-1f1b-hf]": "its llama's and qwen3's, mistral's pp2tp2-zbv-auto",
    _LAYOUTS + "qwen2-pp2tp2-1f1b-hf]": "its llama's and qwen3's, qwen2's pp2tp2-zbv-auto",
    "tests/test_train_run.py::test_resume_under_virtual_stages_matches_the_uninterrupted_run":
        "test_train_run.py's resumes under other layouts, with dropout and after a crash",
    "tests/test_tokenize_concurrent.py::test_two_real_tokenize_processes_into_one_folder":
        "test_tokenize_concurrent.py's guards in-process",
    "tests/test_export_disk_full.py::test_a_file_size_limit_is_cannot_write_out_and_exit_2":
        "its full disk (ENOSPC) cases, the same one-line error and nothing left behind",
    _EXPORTS + "gemma2]": "the exports of granite, cohere and phi3",
    _EXPORTS + "gpt_neox]": "the exports of granite, cohere and phi3",
    _EXPORTS + "granite_swa]": "the exports of granite, cohere (per-head norms) and phi3; "
                               "granite_swa's sinks cut by head at pp2tp2-zbv-auto",
    # families whose mechanism another family of the suite carries
    _FAMILIES + "gemma-pp2tp2-zbv-auto]": "gemma2's and gemma3_text's scaled embedding",
    _FAMILIES + "glm4-pp2tp2-zbv-auto]": "phi's partial rotary",
    _FAMILIES + "starcoder2-pp2tp2-zbv-auto]": "gemma2's sliding window",
    _FAMILIES + "*-pp2tp1-1f1b]": "test_hf_families.py's pp2tp2 cases of each family (two "
                                  "stages)",
    _LAYOUTS + "gpt2-pp4tp1-": "test_hf_layouts.py's gpt2-pp2tp1-1f1b, test_pipe_parity.py's "
                               "four stages",
    _FAMILIES + "*-pp2tp2-1f1b-hf]": "test_hf_families.py's pp2tp2-zbv-auto of each family, "
                                     "its exports under their own plans (granite, "
                                     "granite_swa)",
    _LAYOUTS + "*-pp2tp2-1f1b-auto]": "test_hf_layouts.py's pp2tp2-zbv-auto and -1f1b-hf",
    _VIRTUAL + "test_tp_gpt_pp2_tp2_dp2_matches_one_device[interleaved]": "its [zbv]",
    _VIRTUAL + "test_mlp_over_checkpoint_modes_and_uneven_batches_matches_one_device":
        "its gpt cases under zbv and interleaved, test_layer_checkpoint.py's modes under zbv",
    "tests/test_torch_floor.py::test_a_session_whose_first_spawn_is_from_another_folder":
        "tests/conftest.py's forkserver started from the checkout (every spawn of the suite)",
    _MASTER + "test_a_bf16_zero_1_checkpoint_resumes": "test_zero.py's zero-2 resume at "
                                                       "another layout",
    # tp 2 on one stage: the same plans over two stages (pp 2 x tp 2) stay
    _FAMILIES + "*-pp1tp2-gpipe-": "test_hf_families.py's pp2tp2-zbv-auto and pp2tp2-1f1b-hf of "
                                   "each family",
    _LAYOUTS + "*-pp1tp2-gpipe-": "test_hf_layouts.py's pp2tp2-1f1b-auto and -hf of each "
                                  "family",
    _LAYOUTS + "*-pp2tp2-zbv-hf]": "test_hf_layouts.py's pp2tp2-zbv-auto of each family",
    # experts: the suite keeps gpipe, 1f1b, zbv, tp 2, dp 2 and packed documents
    "tests/test_moe_gpt.py::test_the_moe_gpt_pipeline_equals_one_device[*-interleaved-":
        "its zbv case (virtual stages) and the other schedules",
    "tests/test_moe_gpt.py::test_the_moe_gpt_pipeline_equals_one_device[*-zb-h1-":
        "its zbv case (split backward) and the other schedules",
    "tests/test_moe_ep.py::test_expert_parallel_moe_gpt_equals_one_device[pp2tp2dp2ep2-":
        "ep 2 with pp 2 and with tp 2 (4 ranks each)",
    "tests/test_moe_ep.py::test_a_bf16_zero1_run_at_ep2_resumes_from_its_checkpoint_exactly":
        "test_moe_ep.py's zero-1 run resumed at ep 1 (float32) and bf16's zero 1 = zero 0",
    "tests/test_moe_hf.py::test_a_mixtral_config_at_ep2_built_on_meta_trains_as_at_ep1":
        "test_moe_checkpoints.py's meta build at pp2 x dp2 x ep2 (the one-device experts)",
    "tests/test_moe_checkpoints.py::test_the_dry_run_of_a_meta_built_mixtral_at_ep2_holds_":
        "test_moe_ep.py's dry run at ep 2 (the gpt's experts per rank, the all-to-alls)",
    # Hugging Face experts: each family in one or two layouts, every layout by some family
    **{f"tests/test_moe_hf.py::test_a_hugging_face_moe_trains_as_the_plain_model[{family}-"
       f"{layout}]": f"{family}-{' and '.join(kept)} (and {layout} of another family)"
       for family, kept in (("mixtral", ("pp2-1f1b", "pp2dp2ep2-1f1b")),
                            ("qwen2_moe", ("pp2tp2-1f1b-auto", "dp2ep2-gpipe")),
                            ("qwen3_moe", ("pp2-zbv",)), ("olmoe", ("pp2dp2-gpipe",)),
                            ("granitemoe", ("pp2-1f1b",)),
                            ("gpt_oss", ("pp2tp2-1f1b-auto", "tp2dp2ep2-auto")),
                            ("cohere2_moe", ("dp2ep2-gpipe",)), ("flex_olmo", ("pp2-1f1b",)),
                            ("mellum", ("dp2ep2-gpipe",)), ("minimax", ("pp2-1f1b",)))
       for layout in ("pp2-1f1b", "pp2-zbv", "pp2dp2-gpipe", "pp2tp2-1f1b-auto",
                      "dp2ep2-gpipe", "pp2dp2ep2-1f1b", "tp2dp2ep2-auto", "pp2dp2ep2-zbv",
                      "pp2tp2dp2ep2-1f1b-auto")
       # the 8-rank layout exists for two families only (test_moe_hf.EIGHT_RANKS)
       if layout not in kept
       and (not layout.startswith("pp2tp2dp2") or family in ("mixtral", "qwen2_moe"))},
}


def _prefix(key: str) -> re.Pattern[str]:
    """`key` as a pattern of node id prefixes (`*`: any text)."""
    return re.compile(".*".join(map(re.escape, key.split("*"))))


_PREFIXES = [_prefix(key) for key in CAMPAIGN]


def campaign_keys(nodeid: str) -> list[str]:
    """The `CAMPAIGN` keys that name the test `nodeid` (``tests/test_x.py::test_y[...]``)."""
    return [key for key, prefix in zip(CAMPAIGN, _PREFIXES) if prefix.match(nodeid)]


def in_campaign(nodeid: str) -> bool:
    """Whether the test `nodeid` is the campaign's."""
    return bool(campaign_keys(nodeid))
