"""GRPOConfig: one help line per field, TRL-style names, loss-type defaults, field-naming errors."""

import dataclasses
import json

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


@pytest.mark.parametrize("values, field", [
    ({"learning_rate": 0.0}, "config.learning_rate"), ({"epsilon": 1.0}, "config.epsilon"),
    ({"max_turns": 0}, "config.max_turns"), ({"loss_type": "ppo"}, "config.loss_type"),
    ({"top_p": 0.9, "importance_sampling_correction": False}, "config.importance_sampling_correction"),
])
def test_a_spec_error_names_its_field(values, field):
    with pytest.raises(SpecError) as exc:
        GRPOConfig.from_dict(values)
    assert exc.value.field == field and str(exc.value).startswith(field) and exc.value.errors == {
        field: str(exc.value)}
    assert str(exc.value) == exc.value.message


def test_types_are_checked_from_the_annotations_all_at_once():
    with pytest.raises(SpecError) as exc:
        GRPOConfig.from_dict({"learning_rate": "fast", "max_steps": 1.5, "seed": True, "target_modules": "q_proj",
                              "max_turns": "3", "bf16": 1})
    assert set(exc.value.errors) == {"config.learning_rate", "config.max_steps", "config.seed",
                                     "config.target_modules", "config.max_turns", "config.bf16"}
    assert exc.value.errors["config.learning_rate"] == "config.learning_rate must be a number, got 'fast'"
    assert exc.value.errors["config.max_turns"] == "config.max_turns must be an integer or null, got '3'"
    assert exc.value.errors["config.bf16"] == "config.bf16 must be true or false, got 1"
    with pytest.raises(SpecError, match="config.target_modules must be a list of strings"):
        GRPOConfig(target_modules=["q_proj", 3])
    # A JSON integer where a float belongs is that float, so a stored config reads back in the dataclass's types.
    assert GRPOConfig.from_dict({"learning_rate": 1, "max_turns": None}).learning_rate == 1.0
    assert isinstance(GRPOConfig(learning_rate=1).learning_rate, float)


def test_unknown_names_are_one_error_each():
    with pytest.raises(SpecError) as exc:
        GRPOConfig.from_dict({"lr": 1e-4, "epochs": 3, "max_steps": 5})
    assert exc.value.errors == {"config.epochs": "config.epochs is not a GRPOConfig field",
                                "config.lr": "config.lr is not a GRPOConfig field"}
    assert "unknown field(s) epochs, lr" in str(exc.value)
    import pickle

    again = pickle.loads(pickle.dumps(exc.value))  # a worker's exception travels with its fields
    assert (again.field, again.errors, str(again)) == (exc.value.field, exc.value.errors, str(exc.value))


def test_the_algorithms_rules_and_the_specs_fields_are_named_too(tmp_path, tiny_model):
    from trainer.config import load_spec, resolve_config

    with pytest.raises(SpecError) as exc:
        resolve_config({"beta": 0.0}, "dpo")
    assert exc.value.field == "config.beta"
    with pytest.raises(SpecError) as exc:
        resolve_config({"max_steps": 10, "sft_steps": 10}, "sft_grpo")
    assert exc.value.field == "config.sft_steps"
    (tmp_path / "train.jsonl").write_text("{}\n")
    for spec, field in [({"model": str(tiny_model), "num_gpus": 0}, "num_gpus"), ({}, "model"),
                        ({"model": str(tiny_model), "train": "nope.jsonl"}, "train"),
                        ({"model": str(tiny_model), "config": {"learning_rate": -1}}, "config.learning_rate")]:
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        with pytest.raises(SpecError) as exc:
            load_spec(tmp_path / "spec.json")
        assert exc.value.field == field, spec


def test_a_partial_config_resolves_as_the_complete_one():
    """A job stores every field now; older jobs stored only what was set. Both read back the same."""
    from trainer.config import resolve_config

    for algorithm, partial in [("grpo", {"learning_rate": 1e-3, "num_generations_per_prompt": 8}),
                               ("dpo", {"max_steps": 30}), ("sft_grpo", {"max_steps": 40, "sft_steps": 10})]:
        complete = resolve_config(partial, algorithm).to_dict()
        assert set(complete) == {f.name for f in dataclasses.fields(GRPOConfig)}
        assert resolve_config(complete, algorithm) == resolve_config(partial, algorithm)
        assert json.loads(json.dumps(complete)) == complete  # what a JSON column stores, it reads back
    assert resolve_config({}, "dpo").beta == 0.1 and resolve_config({}, "dpo").loss_type == "sigmoid"
    assert resolve_config({"beta": 0.3}, "dpo").beta == 0.3


def test_the_evaluate_command_lines_defaults_are_grpoconfigs():
    from trainer.cli import build_parser

    args = build_parser().parse_args(["evaluate", "--model", "m", "--suite", "s.jsonl"])
    cfg = GRPOConfig()
    assert (args.samples, args.temperature, args.max_new_tokens, args.max_turns, args.max_seq_len, args.engine,
            args.seed) == (cfg.eval_samples_per_prompt, cfg.eval_temperature, cfg.max_new_tokens, cfg.max_turns,
                           cfg.max_seq_len, cfg.rollout_engine, cfg.seed)
