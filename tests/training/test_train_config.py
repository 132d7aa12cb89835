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
    assert info.value.message == "unknown hyperparameter"
    assert str(info.value) == "learning_rat: unknown hyperparameter"


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
