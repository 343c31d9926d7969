"""Typed configuration of a training job: `GRPOConfig` (TRL-style field names) and the job spec loader.

GRPOConfig checks every field once, where it is made: its type (from its annotation) and its range, raising a
`SpecError` whose `field` names it. `resolve_config` layers the algorithm's defaults under a job's values; the
trainer reads a spec's config through it and the platform a stored job's. `load_spec` reads `spec.json`
(`trainer.jobdir` names a job directory's files), resolves paths against its folder and fails the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer import jobdir

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo")
# DPO's losses, by TRL's DPOConfig names; `trainer.dpo` implements the standard (sigmoid) one.
DPO_LOSS_TYPES = ("sigmoid",)
SCALE_REWARDS = ("group", "batch", "none")
ALGORITHMS = ("grpo", "sft", "dpo", "sft_grpo")
# Algorithms whose optimisation is GRPO's (sft_grpo's after its SFT stage): they take the GRPO losses.
GRPO_ALGORITHMS = ("grpo", "sft_grpo")
# Defaults that differ by algorithm, applied by `load_spec` to the fields a spec leaves out: DPO's beta is
# the preference temperature (TRL's default 0.1), not GRPO's KL coefficient (default 0, no KL).
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {"dpo": {"beta": 0.1, "loss_type": "sigmoid"}}
ENGINES = ("hf", "vllm")
# transformers' scheduler names (`get_scheduler`), as TRL takes them in `lr_scheduler_type`.
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
# Holdout metrics where less is better; metric_for_best_model picks the direction from here by default.
LOWER_IS_BETTER = frozenset({"invalid_output_rate", "unsafe_action_rate", "mean_completion_tokens", "loss"})
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class SpecError(ValueError):
    """A job spec or config value a user can fix. `field` names it as the spec does (`config.learning_rate`,
    `model`, `train`; `spec` for the file as a whole) and the message, which names it too, says what is wrong.
    When several fields are wrong at once (unknown names, wrong types), `errors` holds one message per field
    and `field` is the first of them."""

    def __init__(self, field: str, message: str, *, errors: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.errors: dict[str, str] = dict(errors) if errors else {field: message}

    def __reduce__(self) -> tuple:  # pickled whole (a worker's result, a subprocess): the field travels too
        return type(self), (self.field, self.message), {"errors": self.errors}

    @classmethod
    def of(cls, errors: Mapping[str, str]) -> SpecError:
        """One error for several fields: each keeps its own message."""
        return cls(next(iter(errors)), "; ".join(errors.values()), errors=errors)


@dataclass
class GRPOConfig:
    """Hyper-parameters of one GRPO (or SFT) run. Names follow TRL's `GRPOConfig` where one exists."""

    # --- sampling -------------------------------------------------------------------------------------
    num_prompts_per_step: int = field(default=8, metadata={"help": "Distinct prompts (groups) per optimizer step."})
    num_generations_per_prompt: int = field(
        default=8, metadata={"help": "Completions sampled per prompt (G); advantages are computed within a group."}
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Token limit of one model turn."})
    max_turns: int | None = field(
        default=None,
        metadata={"help": "Caps the model turns of an episode; None = the task's env.max_turns (else "
                          "trainer.envs.DEFAULT_MAX_TURNS), 1 = single-turn."},
    )
    max_seq_len: int = field(
        default=2048, metadata={"help": "Hard cap on prompt + all turns; an episode that reaches it ends."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of rollouts."})
    top_p: float = field(
        default=1.0,
        metadata={"help": "Nucleus sampling of rollouts and evaluation; 1 = off. The loss corrects for the "
                          "truncation by importance sampling (needs importance_sampling_correction)."},
    )
    top_k: int = field(
        default=0,
        metadata={"help": "Sample among the k most likely tokens; 0 = off. Corrected for like top_p."},
    )
    rollout_engine: str = field(default="hf", metadata={"help": "`hf` (transformers generate) or `vllm` (GPU)."})
    rollout_compile: bool = field(
        default=False,
        metadata={"help": "`hf` engine: decode with a static KV cache and a compiled forward (torch.compile; CUDA "
                          "graphs on a GPU). Prompts are left-padded to a multiple of 64 tokens and batches to a "
                          "power of two, so a job compiles a few shapes, each once (about 30 s on a CPU)."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.5, metadata={"help": "Fraction of GPU memory vLLM may take (the trainer needs the rest)."}
    )
    importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "Truncated importance sampling: reweight tokens by min(pi_train/pi_sampler, cap)."},
    )
    importance_sampling_cap: float = field(default=2.0, metadata={"help": "Cap C of the truncated IS weight."})
    rollout_batch_groups: int | None = field(
        default=None,
        metadata={"help": "Groups sampled together in one generation batch; None = all of a process's groups of "
                          "a sampling round. Each batch is seeded by (seed, step, round, batch), so with a value "
                          "that divides num_prompts_per_step / processes a run samples the same on any number "
                          "of processes (torchrun)."},
    )

    # --- optimisation ---------------------------------------------------------------------------------
    learning_rate: float = field(default=1e-5, metadata={"help": "AdamW learning rate of the LoRA parameters."})
    lr_scheduler_type: str | None = field(
        default=None,
        metadata={"help": "constant | constant_with_warmup | linear | cosine (transformers' get_scheduler), over "
                          "max_steps; None = constant for GRPO, cosine for SFT. constant with warmup = "
                          "constant_with_warmup. Logged as `lr` each step."},
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "Steps of linear warmup from 0 (step 1 runs at lr 0, as in transformers); "
                                     "wins over warmup_ratio when > 0."}
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Warmup as a share of max_steps (rounded up), when warmup_steps is 0."}
    )
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps of the run (sft_grpo: both stages)."})
    sft_steps: int = field(
        default=20,
        metadata={"help": "sft_grpo only: the first sft_steps steps imitate the task set's references (SFT), "
                          "the rest train GRPO from there, one adapter and one job."},
    )
    sft_learning_rate: float = field(
        default=2e-4,
        metadata={"help": "sft_grpo only: the constant learning rate of the SFT stage (learning_rate and "
                          "lr_scheduler_type are the GRPO stage's)."},
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Passes over each rollout batch (mu in the GRPO paper); >1 makes clipping bite."}
    )
    train_batch_size: int = field(
        default=32, metadata={"help": "Sequences per forward/backward micro-batch (gradients are accumulated)."}
    )
    share_prompt_prefix: bool = field(
        default=True,
        metadata={"help": "Run each group's prompt through the training forward once, its G completions "
                          "attending to it (same logprobs and gradients, fewer tokens)."},
    )
    pack_sequences: bool = field(
        default=True,
        metadata={"help": "Lay a micro-batch's rows end to end instead of padding each, every row attending to "
                          "itself only; with share_prompt_prefix, one copy of a prompt is followed by as many of "
                          "its completions as a costed width holds. Same logprobs and gradients, fewer positions; "
                          "prefix sharing then works under gradient checkpointing too. Needs sdpa or eager "
                          "attention (others run unpacked)."},
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute each layer's activations in the backward instead of keeping them (far less "
                          "memory, about a third more compute); without pack_sequences the gradient forward "
                          "then runs without prefix sharing (layers drop the KV cache under checkpointing)."},
    )
    bf16: bool = field(
        default=True,
        metadata={"help": "Autocast the training forwards to bfloat16 on a CUDA GPU (logprobs, entropy and loss "
                          "stay float32); no effect on CPU."},
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})

    # --- loss -----------------------------------------------------------------------------------------
    loss_type: str = field(
        default="grpo", metadata={"help": "grpo | dr_grpo | dapo | gspo; sigmoid for dpo (its default there)."}
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the importance ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip range (clip-higher); None = epsilon, or 0.28 for dapo."}
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "GRPO: KL coefficient against the base model (the adapter disabled); 0 = no KL. "
                          "DPO: the preference temperature, > 0 (0.1 when a dpo spec leaves it out)."},
    )
    scale_rewards: str = field(
        default="group", metadata={"help": "Advantage scaling: group std, batch std, or none (Dr. GRPO)."}
    )
    format_reward: float = field(
        default=0.0,
        metadata={"help": "GRPO: added to the reward of each episode whose output parses (any failure but "
                          "invalid_format), so that a group where every sample fails still pulls away from "
                          "unparseable output; 0 = the verifier's reward alone. What counts as passed is unchanged."},
    )
    mask_truncated_completions: bool | None = field(
        default=None,
        metadata={"help": "Overlong filtering: truncated episodes get no loss; None = on for dapo only."},
    )
    dynamic_sampling: bool | None = field(
        default=None,
        metadata={"help": "Drop zero-variance groups and sample new prompts to refill; None = on for dapo."},
    )
    max_resample_rounds: int = field(
        default=3, metadata={"help": "Extra sampling rounds dynamic sampling may spend to refill a step."}
    )

    # --- evaluation and checkpoints -------------------------------------------------------------------
    eval_interval: int = field(default=10, metadata={"help": "Evaluate on the holdout (and checkpoint) every N steps."})
    save_steps: int | None = field(
        default=None,
        metadata={"help": "Also checkpoint (adapter, optimizer, scheduler, RNG, step; no evaluation) every N steps, "
                          "so a run can resume from there; None = checkpoints at evaluations only."},
    )
    eval_samples_per_prompt: int = field(default=4, metadata={"help": "Samples per holdout prompt at evaluation."})
    regression_samples_per_prompt: int = field(
        default=16,
        metadata={"help": "Samples per regression case at evaluation, on both models the gate compares: at 16 the "
                          "gate's regression rule refuses three cases falling 100% -> 50% 84% of the time (34% "
                          "at 8). The suite's cost per model measured is its cases times this."},
    )
    eval_temperature: float = field(default=1.0, metadata={"help": "Sampling temperature at evaluation."})
    eval_max_prompts: int | None = field(default=None, metadata={"help": "Evaluate on the first N holdout rows only."})
    eval_on_start: bool = field(default=True, metadata={"help": "Evaluate the starting policy before step 1."})
    metric_for_best_model: str = field(
        default="success_rate", metadata={"help": "Holdout metric that picks the best checkpoint (adapters/best)."}
    )
    greater_is_better: bool | None = field(
        default=None,
        metadata={"help": "Whether a higher metric_for_best_model is better; None = False for the metrics in "
                          "LOWER_IS_BETTER (invalid_output_rate, unsafe_action_rate, mean_completion_tokens), "
                          "else True."},
    )

    # --- LoRA -----------------------------------------------------------------------------------------
    r: int = field(default=16, metadata={"help": "LoRA rank."})
    alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES), metadata={"help": "Module names LoRA wraps."}
    )

    # --- misc -----------------------------------------------------------------------------------------
    seed: int = field(default=0, metadata={"help": "Seed of prompt order, sampling and LoRA init."})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads; None = torch's default."})

    def __post_init__(self) -> None:
        _check_types(self)
        _check_choice("loss_type", self.loss_type, LOSS_TYPES + DPO_LOSS_TYPES)
        _check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        _check_choice("rollout_engine", self.rollout_engine, ENGINES)
        if self.lr_scheduler_type is not None:
            _check_choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
        for name in ("num_prompts_per_step", "num_generations_per_prompt", "max_new_tokens", "max_steps",
                     "num_iterations", "train_batch_size", "eval_interval", "eval_samples_per_prompt",
                     "regression_samples_per_prompt", "r"):
            _check(self, name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("max_turns", "save_steps", "rollout_batch_groups"):
            _check(self, name, getattr(self, name) is None or getattr(self, name) >= 1, "must be null or >= 1")
        _check(self, "temperature", self.temperature > 0, "must be > 0 for sampled rollouts")
        _check(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        _check(self, "top_k", self.top_k >= 0, "must be >= 0 (0 = off)")
        if (self.top_p < 1 or self.top_k > 0) and not self.importance_sampling_correction:
            # The sampler's distribution is the truncated one; only the IS weight tells the loss so.
            raise SpecError("config.importance_sampling_correction",
                            "config.importance_sampling_correction must be true when top_p < 1 or top_k > 0: they "
                            "truncate the sampling distribution and the loss accounts for that through importance "
                            "sampling (or leave top_p at 1 and top_k at 0)")
        _check(self, "epsilon", 0 <= self.epsilon < 1, "must be in [0, 1)")
        _check(self, "beta", self.beta >= 0, "(the KL coefficient) must be >= 0")
        _check(self, "learning_rate", self.learning_rate > 0, "must be > 0")
        _check(self, "sft_learning_rate", self.sft_learning_rate > 0, "must be > 0")
        _check(self, "format_reward", 0 <= self.format_reward <= 1, "must be in [0, 1]")
        _check(self, "warmup_steps", self.warmup_steps >= 0, "must be >= 0")
        _check(self, "warmup_ratio", 0 <= self.warmup_ratio <= 1, "must be in [0, 1]")

    # Resolved defaults that depend on the loss type (DAPO switches on its three tricks).
    @property
    def clip_high(self) -> float:
        if self.epsilon_high is not None:
            return self.epsilon_high
        return 0.28 if self.loss_type == "dapo" else self.epsilon

    @property
    def use_dynamic_sampling(self) -> bool:
        return self.loss_type == "dapo" if self.dynamic_sampling is None else self.dynamic_sampling

    @property
    def use_overlong_filter(self) -> bool:
        if self.mask_truncated_completions is None:
            return self.loss_type == "dapo"
        return self.mask_truncated_completions

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps or math.ceil(self.warmup_ratio * self.max_steps)

    def grpo_steps(self, algorithm: str) -> int:
        """The steps that train GRPO: all of them, or those after sft_grpo's SFT stage."""
        return self.max_steps - self.sft_steps if algorithm == "sft_grpo" else self.max_steps

    def scheduler_name(self, algorithm: str) -> str:
        """The transformers scheduler this run uses: its default per algorithm, warmup never ignored."""
        name = self.lr_scheduler_type or ("cosine" if algorithm == "sft" else "constant")
        return "constant_with_warmup" if name == "constant" and self.num_warmup_steps else name

    @property
    def best_metric_higher(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        return self.metric_for_best_model not in LOWER_IS_BETTER

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "config") -> GRPOConfig:
        """A config from JSON-like values: an unknown name is one error per name, then every field is checked
        as GRPOConfig always checks it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"config.{unknown[0]}",
                            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                            errors={f"config.{name}": f"{where}.{name} is not a GRPOConfig field" for name in unknown})
        return cls(**data)


def resolve_config(values: Mapping[str, Any] | None = None, algorithm: str = "grpo", *,
                   where: str = "config") -> GRPOConfig:
    """The config a job runs with: `values` over the algorithm's own defaults (`ALGORITHM_DEFAULTS`) over the
    dataclass's, checked field by field and against the algorithm (a SpecError names the field). The trainer
    reads a spec's config through it; the platform a stored job's, whether the job stored every field or,
    as older jobs did, only those set, so both resolve the same."""
    config = GRPOConfig.from_dict({**ALGORITHM_DEFAULTS.get(algorithm, {}), **(values or {})}, where=where)
    check_algorithm(config, algorithm, where=where)
    return config


@functools.cache
def config_field_types() -> dict[str, tuple[type, ...]]:
    """Each GRPOConfig field's allowed runtime types, read from its annotation (`float | None` gives
    `(float, NoneType)`, `list[str]` gives `(list,)`): what GRPOConfig checks a value against and what a form
    parses its text into. Read-only: the mapping is shared."""
    import types
    import typing

    hints = typing.get_type_hints(GRPOConfig)
    out = {}
    for f in dataclasses.fields(GRPOConfig):
        hint = hints[f.name]
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        out[f.name] = tuple(typing.get_origin(a) or a for a in (typing.get_args(hint) if union else (hint,)))
    return out


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               list: "a list of strings"}


def _type_ok(value: Any, allowed: tuple[type, ...]) -> bool:
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):  # True is an int to Python, not to a user
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    if isinstance(value, list):  # list[str] is the one list GRPOConfig has
        return list in allowed and all(isinstance(item, str) for item in value)
    return isinstance(value, tuple(a for a in allowed if a is not type(None)))


def _check_types(config: GRPOConfig) -> None:
    """Every field against its annotation, all wrong ones at once; an integer where a float belongs becomes
    that float (a JSON `1` for a learning rate), so a stored config reads back as the dataclass's types."""
    errors = {}
    for name, allowed in config_field_types().items():
        value = getattr(config, name)
        if not _type_ok(value, allowed):
            words = " or ".join(_TYPE_WORDS.get(a, "null" if a is type(None) else a.__name__) for a in allowed)
            errors[f"config.{name}"] = f"config.{name} must be {words}, got {value!r}"
        elif float in allowed and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, name, float(value))
    if errors:
        raise SpecError.of(errors)


def _check(config: GRPOConfig, name: str, ok: bool, rule: str) -> None:
    if not ok:
        raise SpecError(f"config.{name}", f"config.{name} {rule}, got {getattr(config, name)!r}")


def check_algorithm(config: GRPOConfig, algorithm: str, *, where: str = "config") -> None:
    """The fields whose meaning depends on the algorithm hold a value that algorithm takes."""
    if algorithm == "dpo":
        if config.loss_type not in DPO_LOSS_TYPES:
            raise SpecError("config.loss_type", f"{where}.loss_type must be one of {', '.join(DPO_LOSS_TYPES)} for dpo; "
                            f"got {config.loss_type!r}")
        if not config.beta > 0:
            raise SpecError("config.beta", f"{where}.beta (the DPO temperature) must be > 0, got {config.beta!r}")
    elif algorithm in GRPO_ALGORITHMS and config.loss_type not in LOSS_TYPES:
        raise SpecError("config.loss_type", f"{where}.loss_type {config.loss_type!r} is a DPO loss; {algorithm} takes "
                        f"{', '.join(LOSS_TYPES)}")
    if algorithm == "sft_grpo" and not 1 <= config.sft_steps < config.max_steps:
        raise SpecError("config.sft_steps", f"{where}.sft_steps must be an integer from 1 to max_steps - 1 ({config.max_steps - 1}) "
                        f"for sft_grpo, so that both stages run; got {config.sft_steps!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(f"config.{name}", f"config.{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class JobSpec:
    """What the platform writes to `spec.json`. Relative paths resolve against the job directory."""

    model: str
    job_dir: Path
    algorithm: str = "grpo"
    adapter: str | None = None
    train: Path | None = None
    holdout: Path | None = None
    regression: Path | None = None
    config: GRPOConfig = field(default_factory=GRPOConfig)
    tracking_uri: str | None = None
    experiment_name: str = "flywheel"
    run_name: str | None = None
    mlflow: bool = True
    num_gpus: int = 1  # processes (one GPU each) the job runs on; > 1 = torchrun on one host
    resume_from: str | None = None  # a checkpoint folder to continue from instead of the newest one

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["config"] = self.config.to_dict()
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in out.items()}


SPEC_FIELDS = {f.name for f in dataclasses.fields(JobSpec)} - {"job_dir"}


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Read and validate `spec.json`; `job_dir` is the spec's folder unless the spec names one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise SpecError("spec", f"spec not found: {path}") from exc
    except json.JSONDecodeError as exc:
        raise SpecError("spec", f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise SpecError("spec", f"{path}: the spec must be a JSON object")
    job_dir = Path(data.pop("job_dir", None) or path.parent).resolve()
    unknown = sorted(set(data) - SPEC_FIELDS)
    if unknown:
        raise SpecError(unknown[0], f"{path}: unknown field(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(SPEC_FIELDS))}", errors={name: f"{path}: unknown field {name}"
                                                                       for name in unknown})
    if "model" not in data:
        raise SpecError("model", f"{path}: `model` (a local model directory) is required")
    algorithm = data.get("algorithm", "grpo")
    if algorithm not in ALGORITHMS:
        raise SpecError("algorithm", f"{path}: algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    config_data = data.get("config") or {}
    if not isinstance(config_data, dict):
        raise SpecError("config", f"{path}: config must be a JSON object of GRPOConfig fields")
    config = resolve_config(config_data, algorithm, where=f"{path}: config")

    def resolve(key: str, default: str | None) -> Path | None:
        value = data.get(key, default)
        if value is None:
            return None
        p = Path(value)
        p = p if p.is_absolute() else job_dir / p
        return p if (p.exists() or key not in data) else _missing(path, key, p)

    train = resolve("train", jobdir.TRAIN)
    holdout = resolve("holdout", jobdir.suite_file("holdout"))
    regression = resolve("regression", jobdir.suite_file("regression"))
    if train is None or not train.exists():
        raise SpecError("train", f"{path}: train file {train} does not exist")
    model = data["model"]
    model_path = Path(model) if Path(model).is_absolute() else job_dir / model
    if not model_path.exists():
        raise SpecError("model", f"{path}: model directory {model_path} does not exist (models load from local paths only)")
    num_gpus = data.get("num_gpus", 1)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise SpecError("num_gpus", f"{path}: num_gpus must be an integer >= 1, got {num_gpus!r}")
    resume_from = data.get("resume_from")
    if resume_from is not None:
        resume_from = str(resolve_checkpoint(job_dir, resume_from, where=f"{path}: resume_from"))
    adapter = data.get("adapter")
    if adapter is not None:
        adapter_path = Path(adapter) if Path(adapter).is_absolute() else job_dir / adapter
        if not adapter_path.exists():
            raise SpecError("adapter", f"{path}: adapter directory {adapter_path} does not exist")
        adapter = str(adapter_path)
    return JobSpec(
        model=str(model_path),
        job_dir=job_dir,
        algorithm=algorithm,
        adapter=adapter,
        train=train,
        holdout=holdout if holdout and holdout.exists() else None,
        regression=regression if regression and regression.exists() else None,
        config=config,
        tracking_uri=data.get("tracking_uri"),
        experiment_name=data.get("experiment_name", "flywheel"),
        run_name=data.get("run_name"),
        mlflow=bool(data.get("mlflow", True)),
        num_gpus=num_gpus,
        resume_from=resume_from,
    )


def resolve_checkpoint(job_dir: Path, value: str | os.PathLike, *, where: str = "resume_from") -> Path:
    """A checkpoint folder (`checkpoints/step-000010`, absolute or relative to the job directory) that holds a
    complete checkpoint."""
    p = Path(value)
    p = p if p.is_absolute() else job_dir / p
    if not (p / "state.json").exists():
        raise SpecError("resume_from", f"{where}: {p} is not a checkpoint folder (no state.json); checkpoints "
                        f"are JOB/{jobdir.CHECKPOINTS}/step-NNNNNN")
    return p.resolve()


def _missing(spec_path: Path, key: str, p: Path) -> Path:
    raise SpecError(key, f"{spec_path}: {key} file {p} does not exist")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a bad line is reported with its line number."""
    rows = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SpecError(f"{Path(path).name}:{i}", f"{path}:{i}: not valid JSON ({exc})") from exc
    return rows


def write_jsonl(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
