import pytest

from training.config import DEFAULT_TARGET_MODULES, ConfigError, LoraSpec, TrainConfig


def test_defaults_are_valid_and_round_trip():
    config = TrainConfig()
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.clip_high == config.epsilon
    assert LoraSpec().target_modules == list(DEFAULT_TARGET_MODULES)
    assert LoraSpec.from_dict(LoraSpec().to_dict()) == LoraSpec()


def test_unknown_key_is_named():
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"steps": 3, "learning_rat": 1e-4})
    assert info.value.field == "learning_rat"
    assert info.value.message == "unknown hyperparameter; did you mean learning_rate?"
    assert str(info.value) == "learning_rat: unknown hyperparameter; did you mean learning_rate?"


@pytest.mark.parametrize(
    ("key", "meant"),
    [("lr", "learning_rate"), ("kl", "kl_coef"), ("Steps", "steps"), ("temp", "temperature")],
)
def test_an_unknown_key_gets_the_closest_name(key, meant):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({key: 1})
    assert info.value.problems == [(key, f"unknown hyperparameter; did you mean {meant}?")]


def test_an_unknown_key_far_from_any_name_gets_no_guess():
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"zzzz": 1})
    assert info.value.problems == [("zzzz", "unknown hyperparameter")]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"steps": "10"}, "steps"),
        ({"steps": 2.0}, "steps"),
        ({"steps": True}, "steps"),  # a bool is not a count
        ({"scale_rewards": 1}, "scale_rewards"),
        ({"learning_rate": "1e-4"}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"epsilon_high": "0.3"}, "epsilon_high"),
        ({"loss_type": 1}, "loss_type"),
    ],
)
def test_wrong_type_names_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(data)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"groups_per_step": -1}, "groups_per_step"),
        ({"group_size": 1}, "group_size"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
        ({"learning_rate": 0}, "learning_rate"),
        ({"temperature": 0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"epsilon": 0}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"kl_coef": -1}, "kl_coef"),
        ({"max_grad_norm": 0}, "max_grad_norm"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"seed": -1}, "seed"),
        ({"loss_type": "grpo"}, "loss_type"),
        ({"normalization": "dapo"}, "normalization"),
    ],
)
def test_out_of_range_names_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(data)
    assert info.value.field == field


def test_ints_are_accepted_for_float_fields():
    config = TrainConfig.from_dict({"learning_rate": 1, "top_p": 1, "epsilon_high": 1, "kl_coef": 0})
    assert isinstance(config.learning_rate, float) and config.learning_rate == 1.0
    assert isinstance(config.epsilon_high, float)
    assert config.clip_high == 1.0


def test_epsilon_high_may_be_null():
    assert TrainConfig.from_dict({"epsilon_high": None}).epsilon_high is None


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError) as info:
        TrainConfig(temperature=-1.0)
    assert info.value.field == "temperature"


def test_field_help_describes_every_field():
    help_ = TrainConfig.field_help()
    assert list(help_) == list(TrainConfig().to_dict())
    for name, entry in help_.items():
        assert entry["help"] and "\n" not in entry["help"], name
        assert entry["default"] == getattr(TrainConfig(), name)
    assert help_["steps"]["type"] == "int"
    assert help_["epsilon_high"]["type"] == "float | None"
    assert help_["loss_type"]["choices"] == ["ppo", "cispo"]
    assert LoraSpec.field_help()["target_modules"]["type"] == "list[str]"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"rank": 0}, "rank"),
        ({"alpha": 0.5}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": "q_proj"}, "target_modules"),
        ({"target_modules": ["q_proj", 3]}, "target_modules"),
        ({"bias": "all"}, "bias"),
    ],
)
def test_lora_spec_validation_names_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        LoraSpec.from_dict(data)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("data", "field", "reason"),
    [
        ({"steps": 100_001}, "steps", "start another run from the last checkpoint"),
        ({"group_size": 257}, "group_size", "advantages"),
        ({"groups_per_step": 2000}, "groups_per_step", "memory"),
        ({"groups_per_step": 1024, "group_size": 16}, "group_size", "completions per step"),
        ({"max_new_tokens": 10**6}, "max_new_tokens", "context"),
        ({"learning_rate": 2.0}, "learning_rate", "diverges"),
        ({"epsilon": 50}, "epsilon", "clips nothing"),
        ({"kl_coef": 1e9}, "kl_coef", "base model"),
        ({"seed": 2**32}, "seed", "32-bit seed"),
        ({"eval_pass_threshold": 1e300}, "eval_pass_threshold", "moderate"),
    ],
)
def test_maxima_name_the_field_and_the_reason(data, field, reason):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(data)
    assert info.value.field == field and reason in info.value.message


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"steps": 0, "learning_rat": 1, "temperature": "hot", "seed": -1, "top_p": 2})
    assert [field for field, _ in info.value.problems] == [
        "learning_rat",
        "steps",
        "temperature",
        "top_p",
        "seed",
    ]
    assert info.value.field == "learning_rat"


def test_numbers_past_a_float_are_refused_not_crashed_on():
    for value in (10**400, -(10**400)):
        with pytest.raises(ConfigError) as info:
            TrainConfig.from_dict({"learning_rate": value})
        assert info.value.field == "learning_rate"
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"steps": 10**4301})
    assert info.value.field == "steps"


def test_field_help_gives_the_range():
    help_ = TrainConfig.field_help()
    assert help_["seed"]["minimum"] == 0 and help_["seed"]["maximum"] == 2**32 - 1
    assert "minimum" not in help_["loss_type"]
