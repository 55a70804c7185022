"""The run config: TOML into dataclasses, --set overrides, one-line errors, resolved JSON."""

import json
from pathlib import Path

import pytest
from config_errors import error_of

from hybridpar.balance import BALANCERS
from hybridpar.train import Config, ConfigError, load_config
from hybridpar.train.configs.config import ParallelConfig, TrainConfig, write_resolved

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = sorted(p for p in CONFIGS.glob("*.toml") if p.name != "example_mlp.toml")

SMALL = """\
[model]
name = "gpt"
n_layer = 2
n_head = 4
n_embd = 32
block_size = 16

[parallel]
pp = 2
tp = 2
"""


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    return path


def write(tmp_path, text, name="cfg.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def made_inputs(tmp_path, monkeypatch):
    """A folder with what configs/finetune_llama.toml reads, made as its header says (tiny):
    the pretrained model (scripts/make_pretrained.py) and the token folder (tokenize)."""
    pytest.importorskip("transformers")
    from test_finetune import make_pretrained, tokenize

    monkeypatch.chdir(tmp_path)
    pretrained = make_pretrained("llama", tmp_path / "runs" / "pretrained" / "llama")
    tokenize(tmp_path / "runs" / "tokens" / "docs", "--tokenizer", str(pretrained))


@pytest.fixture
def made_chat_inputs(tmp_path, monkeypatch):
    """What configs/sft_llama.toml reads, made as its header says (tiny)."""
    pytest.importorskip("transformers")
    from test_sft import made_inputs

    monkeypatch.chdir(tmp_path)
    made_inputs(tmp_path)


# the configs that read files their header's commands make, and the fixture that makes them
MADE = {"finetune_llama.toml": "made_inputs", "sft_llama.toml": "made_chat_inputs"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_says_what_it_runs(path, request):
    if path.name in MADE:
        with pytest.raises(ConfigError, match=r"runs/pretrained/|runs/tokens/"):
            load_config(path)
        request.getfixturevalue(MADE[path.name])
    config = load_config(path)
    assert config.name == path.stem
    assert path.read_text().startswith("# ")
    assert Config.from_dict(config.to_dict()) == config


def test_the_expected_configs_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {"quickstart", "gpt_pp4", "gpt_tp4", "gpt_dp2_pp2", "unet_pp3",
            "gpt_large_gpu"} <= names


def test_quickstart_is_gpt_on_the_corpus_over_two_stages_of_two_shards():
    config = load_config(CONFIGS / "quickstart.toml")
    assert config.model.name == "gpt" and config.data.source == "corpus"
    assert (config.parallel.pp, config.parallel.tp, config.parallel.dp) == (2, 2, 1)
    assert config.parallel.schedule == "1f1b"


def test_unet_config_defers_batch_norm_and_gpu_config_is_bf16():
    assert load_config(CONFIGS / "unet_pp3.toml").parallel.deferred_batch_norm
    assert load_config(CONFIGS / "gpt_large_gpu.toml").train.precision == "bf16"


def test_defaults_fill_every_key_and_resolve_model_options(tmp_path):
    config = load_config(write(tmp_path, ""))
    assert config.parallel == ParallelConfig() and config.train == TrainConfig()
    assert config.model.name == "gpt" and config.model.args["n_layer"] == 4
    assert "tp" not in config.model.args and "group" not in config.model.args
    assert config.data.seq_len == config.model.args["block_size"] == 64
    assert config.parallel.dp is None and config.parallel.balance == "params"


def test_overrides_of_every_type(small):
    config = load_config(small, [
        "parallel.pp=3",                  # int
        "train.lr=3e-4",                  # float
        "train.grad_clip=1",              # int widened to float
        "parallel.schedule=1f1b",         # bare word: a string
        'parallel.checkpoint="never"',    # quoted string
        "parallel.balance=[1, 3, 1]",     # list
        "parallel.deferred_batch_norm=true",  # bool
        "parallel.dp=none",               # None where allowed
        "model.n_layer=2",                # a model option
        "model.dropout=0.1",
        'parallel.tp_plan={"*.fc" = "column"}',  # an inline table
    ])
    par = config.parallel
    assert (par.pp, par.schedule, par.checkpoint, par.balance) == (3, "1f1b", "never", [1, 3, 1])
    assert par.deferred_batch_norm is True and par.dp is None
    assert par.tp_plan == {"*.fc": "column"}
    assert config.train.lr == 3e-4 and config.train.grad_clip == 1.0
    assert isinstance(config.train.grad_clip, float)
    assert config.model.args["dropout"] == 0.1


def test_the_replica_check_is_off_by_default_and_takes_a_period_and_a_tolerance(small):
    assert (ParallelConfig().check_replicas, ParallelConfig().replica_atol) == (0, 0.0)
    config = load_config(small, ["parallel.check_replicas=10", "parallel.replica_atol=1e-6"])
    assert (config.parallel.check_replicas, config.parallel.replica_atol) == (10, 1e-6)
    assert load_config(small, ["parallel.replica_atol=0"]).parallel.replica_atol == 0.0
    assert Config.from_dict(config.to_dict()) == config


def test_overrides_replace_a_list_balance_with_a_name_and_the_last_one_wins(small):
    config = load_config(small, ["parallel.balance=time", "train.steps=5", "train.steps=7"])
    assert config.parallel.balance == "time" and config.train.steps == 7


def test_a_model_is_chosen_by_name_with_its_own_options(tmp_path):
    path = write(tmp_path, '[model]\nname = "mlp"\nhidden = 32\n')
    config = load_config(path, ["model.hidden=64"])
    assert config.model.args["hidden"] == 64 and config.data.seq_len is None
    message = error_of(path, "model.name=unet")       # hidden is no option of unet
    assert "unknown option of model 'unet': model.hidden" in message and "model.depth" in message
    unet = load_config(write(tmp_path, '[model]\nname = "unet"\n', "u.toml"), ["model.depth=3"])
    assert unet.model.args["depth"] == 3 and unet.model.args["channels"] == 8


def test_missing_file_suggests_the_closest(tmp_path):
    write(tmp_path, "", "quickstart.toml")
    message = error_of(tmp_path / "quickstrat.toml")
    assert "no such config file" in message and "quickstart.toml" in message


def test_invalid_toml_names_line_and_column(tmp_path):
    message = error_of(write(tmp_path, "[train]\nsteps = = 3\n"))
    assert "invalid TOML" in message and "line 2" in message and "column" in message


def test_unknown_section_lists_the_sections(tmp_path):
    message = error_of(write(tmp_path, "[trian]\nsteps = 3\n"))
    assert "unknown section trian" in message and "did you mean train?" in message
    assert "model, data, parallel, train, optim, checkpoint, logging" in message


def test_unknown_key_suggests_the_closest(tmp_path):
    message = error_of(write(tmp_path, "[train]\nstpes = 3\n"))
    assert "unknown key train.stpes" in message and "did you mean train.steps?" in message
    assert "train.batch_size" in message


def test_an_unknown_key_given_by_set_is_the_same_error_and_says_so(small):
    message = error_of(small, "parallel.schedul=1f1b")
    assert "unknown key parallel.schedul" in message
    assert "did you mean parallel.schedule?" in message
    assert "(from --set parallel.schedul=1f1b)" in message
    message = error_of(small, "optimizer.lr=1")
    assert "unknown section optimizer; did you mean optim?" in message
    assert "unknown key optim.lr" in error_of(small, "optim.lr=1")


def test_a_malformed_set_is_an_error(small):
    assert "is not section.key=value" in error_of(small, "steps=3")
    assert "is not section.key=value" in error_of(small, "train.steps")


@pytest.mark.parametrize("override, expected", [
    ("train.steps=ten", "train.steps must be an integer, got 'ten'"),
    ("train.steps=2.5", "train.steps must be an integer, got 2.5"),
    ("train.lr=fast", "train.lr must be a number, got 'fast'"),
    ("parallel.deferred_batch_norm=1", "must be true or false, got 1"),
    ("parallel.balance=[1, 'a']", "parallel.balance must be a list of integers or a string"),
    ("parallel.tp=none", "parallel.tp must be an integer, got 'none'"),
    ("model.n_layer=four", "model.n_layer must be an integer, got 'four'"),
    ("model.bias=3", "model.bias must be true or false, got 3"),
    ("parallel.check_replicas=2.5", "parallel.check_replicas must be an integer, got 2.5"),
    ("parallel.check_replicas=true", "parallel.check_replicas must be an integer, got True"),
    ("parallel.replica_atol=tiny", "parallel.replica_atol must be a number, got 'tiny'"),
])
def test_wrong_types_name_the_key_and_the_type(small, override, expected):
    assert expected in error_of(small, override)


@pytest.mark.parametrize("override, expected", [
    ("parallel.schedule=zb", "parallel.schedule must be one of 'gpipe', '1f1b', 'zb-h1', "
                             "'interleaved', 'zbv', got 'zb'"),
    ("parallel.virtual_stages=0", "parallel.virtual_stages must be"),
    ("parallel.checkpoint=sometimes", "'always', 'except_last', 'never'"),
    ("train.precision=fp16", "train.precision must be one of 'fp32', 'bf16'"),
    ("parallel.balance=fast", "'time', 'size', 'params', 'uniform', got 'fast'"),
    ("data.source=web", "data.source must be one of 'synthetic', 'text', 'corpus'"),
    ("parallel.tp_plan=manual", "parallel.tp_plan must be one of 'auto'"),
    ('parallel.tp_plan={"*.fc" = "col"}',
     "'column', 'row', 'vocab', 'replicate', 'replicate_sum_grad', a TPDense style "),
])
def test_values_outside_their_choices_list_the_choices(small, override, expected):
    assert expected in error_of(small, override)


def test_a_tpdense_style_in_the_tp_plan_is_accepted(small):
    cfg = load_config(small, ['parallel.tp_plan={"*.mlp.fc" = "dense_gather"}'])
    assert cfg.parallel.tp_plan == {"*.mlp.fc": "dense_gather"}


def test_hugging_face_styles_the_library_reads_are_accepted(small):
    # "local_params" does nothing here (`hf_plan`), as `apply_tp_plan` reads it
    plan = '{"layers.*.self_attn.sinks" = "colwise", "layers.*.self_attn" = "local_params"}'
    cfg = load_config(small, [f"parallel.tp_plan={plan}"])
    assert cfg.parallel.tp_plan["layers.*.self_attn"] == "local_params"


@pytest.mark.parametrize("override, expected", [
    ("train.steps=0", "train.steps must be positive, got 0"),
    ("train.batch_size=-4", "train.batch_size must be positive"),
    ("parallel.chunks=0", "parallel.chunks must be positive, got 0"),
    ("parallel.pp=0", "parallel.pp must be positive"),
    ("parallel.dp=0", "parallel.dp must be positive"),
    ("train.lr=0", "train.lr must be positive"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
    ("checkpoint.keep=0", "checkpoint.keep must be positive"),
    ("data.val_fraction=1.5", "data.val_fraction must be in [0, 1)"),
    ("train.min_lr=1", "train.min_lr=1.0 is above train.lr"),
    ("train.lr=inf", "train.lr must be a finite number, got inf"),
    ("parallel.check_replicas=-1", "parallel.check_replicas must be >= 0, got -1"),
    ("parallel.replica_atol=-1e-6", "parallel.replica_atol must be >= 0, got -1e-06"),
    ("parallel.replica_atol=nan", "parallel.replica_atol must be a finite number, got nan"),
])
def test_sizes_out_of_range_are_rejected(small, override, expected):
    assert expected in error_of(small, override)


def test_unknown_model_name_lists_the_models(small):
    assert "unknown model.name 'gpt3'; choose one of gpt, mlp, unet" in error_of(
        small, "model.name=gpt3")


def test_unknown_model_option_lists_the_model_keyword_parameters(small):
    message = error_of(small, "model.n_layers=3")
    assert "unknown option of model 'gpt': model.n_layers" in message
    assert "did you mean model.n_layer?" in message
    for option in ("vocab_size", "block_size", "n_head", "n_embd", "dropout", "bias"):
        assert f"model.{option}" in message
    assert "model.tp" in error_of(small, "model.tp=2") and "parallel.tp" in error_of(
        small, "model.tp=2")


def test_invalid_model_options_are_the_model_s_own_message(small):
    assert "n_embd=33 is not divisible by n_head=4" in error_of(small, "model.n_embd=33")


@pytest.mark.parametrize("override, expected", [
    ("parallel.tp=3", "n_head=4 is not divisible by tp=3"),
    ("parallel.tp=8", "n_head=4 is not divisible by tp=8"),
])
def test_tp_that_does_not_divide_the_heads_is_rejected_with_valid_sizes(small, override, expected):
    message = error_of(small, override)
    assert expected in message and "valid tp sizes" in message and "[1, 2, 4]" in message


def test_tp_that_does_not_divide_the_vocabulary_is_rejected(small):
    message = error_of(small, "model.vocab_size=258", "parallel.tp=4")
    assert "vocab_size=258 is not divisible by tp=4" in message


def test_tp_that_does_not_divide_the_mlp_hidden_size_is_rejected(tmp_path):
    path = write(tmp_path, '[model]\nname = "mlp"\nhidden = 30\n[parallel]\ntp = 4\n')
    assert "hidden=30 is not divisible by tp=4" in error_of(path)


def test_tp_for_a_model_without_parallel_layers_asks_for_a_plan(tmp_path):
    path = write(tmp_path, '[model]\nname = "unet"\n[parallel]\ntp = 2\n')
    assert "has no tensor-parallel layers; set parallel.tp_plan" in error_of(path)
    assert load_config(path, ["parallel.tp_plan=auto"]).parallel.tp_plan == "auto"


def test_pp_larger_than_the_layers_is_rejected(small):
    # gpt: embeddings + n_layer blocks + norm + head = 5 layers
    message = error_of(small, "parallel.pp=6")
    assert "parallel.pp=6 is more stages than the 5 layers of model 'gpt'" in message
    assert "between 1 and 5" in message
    assert load_config(small, ["parallel.pp=5"]).parallel.pp == 5


@pytest.mark.parametrize("balance, expected", [
    ("[2, 3]", None),
    ("[5]", "has 1 stages but the pipeline has pp=2"),
    ("[2, 2]", "covers 4 layers but model 'gpt' has 5"),
    ("[0, 5]", "has a stage with no layer"),
])
def test_a_list_balance_must_cover_the_model_in_pp_stages(small, balance, expected):
    # the rule and its words are HybridPipe's (`pipeline.parameters.partition.balance_problem`)
    if expected is None:
        assert load_config(small, [f"parallel.balance={balance}"]).parallel.balance == [2, 3]
    else:
        message = error_of(small, f"parallel.balance={balance}")
        assert expected in message and "summing to the 5 layers" in message
        assert message.endswith("or one of " + ", ".join(map(repr, BALANCERS)) +
                                f" (from --set parallel.balance={balance})")


def test_batch_size_must_divide_by_dp(small):
    message = error_of(small, "parallel.dp=3", "train.batch_size=16")
    assert "train.batch_size=16 is not divisible by parallel.dp=3" in message
    assert load_config(small, ["parallel.dp=4"]).parallel.dp == 4


def test_data_sources_are_checked_against_the_model(small, tmp_path):
    assert "data.path is required" in error_of(small, "data.source=text")
    assert "no such file" in error_of(small, "data.source=text", f"data.path={tmp_path}/x")
    text = tmp_path / "tiny.txt"
    text.write_text("hello")
    assert load_config(small, ["data.source=text", f"data.path={text}"]).data.path == str(text)
    assert "at least 256" in error_of(small, "data.source=corpus", "model.vocab_size=128")
    unet = write(tmp_path, '[model]\nname = "unet"\n[data]\nsource = "corpus"\n', "u.toml")
    assert "takes data.source = 'synthetic'" in error_of(unet)
    assert "longer than model.block_size=16" in error_of(small, "data.seq_len=17")
    assert load_config(small, ["data.seq_len=8"]).data.seq_len == 8


def test_a_section_that_is_not_a_table_is_rejected(tmp_path):
    assert "[train] must be a table" in error_of(write(tmp_path, "train = 3\n"))


def test_resolved_config_round_trips_through_json(small, tmp_path):
    config = load_config(small, ["parallel.balance=[2, 3]", 'parallel.tp_plan={"a" = "row"}',
                                 "train.lr=1e-3"])
    path = write_resolved(config, tmp_path / "runs" / "small")
    assert path == tmp_path / "runs" / "small" / "config.json"
    assert [p.name for p in path.parent.iterdir()] == ["config.json"]   # no temporary left
    data = json.loads(path.read_text())
    assert data["name"] == "small" and data["model"]["n_layer"] == 2
    assert data["parallel"]["dp"] is None and data["data"]["seq_len"] == 16
    assert Config.from_dict(data) == config
    assert Config.from_dict(config.to_dict()).to_dict() == data
    write_resolved(config, path.parent)                                 # overwrite in place
    assert json.loads(path.read_text()) == data


def test_from_dict_checks_like_a_file():
    with pytest.raises(ConfigError, match=r"^<dict>: unknown key train.step;"):
        Config.from_dict({"train": {"step": 3}})


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.schedule=zbv", "parallel.virtual_stages=3"],
     "schedule 'zbv' holds 2 stages per rank (a V), got virtual_stages=3"),
    (["parallel.schedule=1f1b", "parallel.virtual_stages=2"],
     "schedule '1f1b' holds one stage per rank"),
    (["parallel.schedule=interleaved", "parallel.pp=3", "parallel.virtual_stages=2"],
     "parallel.pp * virtual_stages=6 is more stages than the 5 layers"),
    (["parallel.schedule=zbv", "parallel.balance=[2, 3]"],
     "parallel.balance [2, 3] has 2 stages but the pipeline has pp * virtual_stages=4"),
])
def test_virtual_stages_are_checked_against_the_schedule_and_the_model(small, overrides,
                                                                       expected):
    assert expected in error_of(small, *overrides)


# every numeric key's range, from its declaration (issue 40, point 10) -------------------------

def _numeric_fields():
    import dataclasses
    import typing

    from hybridpar.train.configs.keys import numeric
    from hybridpar.train.configs.sections import SECTION_CLASSES, ModelConfig

    for section, cls in {"model": ModelConfig, **SECTION_CLASSES}.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name != "args" and numeric(hints[f.name]):
                yield f"{section}.{f.name}", hints[f.name], f


def _outside(spec, tp):
    """Values just outside the field's range (and choices), as the field's type."""
    from hybridpar.train.configs.keys import INT64_MAX

    bounds, choices = spec.metadata["range"], spec.metadata["choices"]
    integer = "int" in str(tp) and "float" not in str(tp)
    out = []
    if bounds.low is not None:
        out.append(bounds.low if bounds.low_open else bounds.low - (1 if integer else 0.5))
    high = bounds.high if bounds.high is not None else (INT64_MAX if integer else None)
    if high is not None:
        out.append(high if bounds.high_open else high + 1 if integer else high * 2 + 1)
    if choices and not isinstance(choices[0], str):
        out.append(max(choices) + 1)
    return out


def test_every_numeric_key_declares_a_range():
    fields = list(_numeric_fields())
    assert {"train.seed", "data.seed", "parallel.timeout", "optim.betas"} <= {k for k, *_ in
                                                                              fields}
    assert [k for k, _, f in fields if f.metadata.get("range") is None] == []


@pytest.mark.parametrize("name,tp,spec", list(_numeric_fields()), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_every_numeric_key_refuses_values_out_of_its_range_by_name(small, name, tp, spec):
    values = _outside(spec, tp)
    assert values, name
    for value in values:
        if "list" in str(tp) and not isinstance(value, list):
            value = [value]
        if name == "optim.betas":
            value = [*value, 0.5]
        message = error_of(small, f"{name}={value!r}".replace("'", '"'))
        assert f"{name} must be" in message, (value, message)


@pytest.mark.parametrize("override,expected", [
    ("train.seed=18446744073709551616", "train.seed must be in [0, 4294967295] (torch's CPU "
     "generator keeps 32 bits of a seed), got 18446744073709551616"),
    ("data.seed=4294967296", "data.seed must be in [0, 4294967295]"),
    ("parallel.timeout=1e10", "parallel.timeout must be in (0, 604800] (a week), got "
     "10000000000.0"),
    ("parallel.timeout=1e300", "parallel.timeout must be in (0, 604800] (a week)"),
    ("train.steps=99999999999999999999", "train.steps must be <= 9223372036854775807 (a 64-bit "
     "integer)"),
])
def test_numbers_that_failed_late_in_the_workers_are_refused_first(small, override, expected):
    assert expected in error_of(small, override)


def test_model_options_are_finite_and_integers_within_int64(small):
    # (each builder checks its own ranges: `n_layer must be a positive integer`); past int64
    # torch failed with a multi-line "Overflow when unpacking long long"
    message = error_of(small, "model.vocab_size=99999999999999999999999")
    assert "model.vocab_size must be <= 9223372036854775807 (a 64-bit integer)" in message
    assert "model.dropout must be a finite number, got nan" in error_of(small, "model.dropout=nan")
