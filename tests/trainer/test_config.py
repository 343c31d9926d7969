"""GRPOConfig: one help line per field, TRL-style names, loss-type defaults, field-naming errors."""

import dataclasses

import pytest

from trainer.config import GRPOConfig, SpecError


def test_every_field_has_help_and_expected_names():
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    assert all(f.metadata.get("help") for f in fields.values())
    for name in ("num_prompts_per_step", "num_generations_per_prompt", "max_new_tokens", "temperature",
                 "learning_rate", "loss_type", "epsilon", "epsilon_high", "beta", "scale_rewards",
                 "num_iterations", "eval_interval", "r", "alpha", "dropout", "target_modules", "seed"):
        assert name in fields, name
    assert GRPOConfig().num_generations_per_prompt == 8 and GRPOConfig().eval_interval == 10


def test_dapo_switches_on_its_tricks():
    dapo, grpo = GRPOConfig(loss_type="dapo"), GRPOConfig()
    assert dapo.clip_high == 0.28 and dapo.use_dynamic_sampling and dapo.use_overlong_filter
    assert grpo.clip_high == 0.2 and not grpo.use_dynamic_sampling and not grpo.use_overlong_filter
    assert GRPOConfig(loss_type="dapo", dynamic_sampling=False).use_dynamic_sampling is False


@pytest.mark.parametrize("bad, field", [({"loss_type": "ppo"}, "loss_type"), ({"scale_rewards": "x"}, "scale_rewards"),
                                        ({"num_generations_per_prompt": 0}, "num_generations_per_prompt"),
                                        ({"learning_rat": 1.0}, "learning_rat"), ({"max_turns": 0}, "max_turns"),
                                        ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                        ({"top_p": 0.9, "importance_sampling_correction": False},
                                         "importance_sampling_correction"),
                                        ({"top_k": 20, "importance_sampling_correction": False},
                                         "importance_sampling_correction")])
def test_errors_name_the_field(bad, field):
    with pytest.raises(SpecError, match=field):
        GRPOConfig.from_dict(bad)


def test_negative_beta_and_non_positive_learning_rate_are_refused():
    import pytest

    from trainer.config import GRPOConfig, SpecError

    with pytest.raises(SpecError, match="config.beta"):
        GRPOConfig(beta=-0.1)
    with pytest.raises(SpecError, match="config.learning_rate"):
        GRPOConfig(learning_rate=0.0)
