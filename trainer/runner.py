"""What GRPO, SFT and DPO jobs share: loading, resume, evaluation, checkpoints and the final report.

`JobRunner` owns the job directory contract; `trainer.loop` (GRPO), `trainer.sft` (SFT) and `trainer.dpo`
(DPO) each write only their own optimisation loop on top of it. Under torchrun every rank builds one; only
rank 0 evaluates, checkpoints and talks to MLflow (`trainer.distributed`).
"""

from __future__ import annotations

import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from transformers import get_scheduler

from trainer import jobdir
from trainer.checkpoints import (
    discard_after,
    latest_checkpoint,
    load_checkpoint,
    publish_adapter,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from trainer.config import GRPOConfig, JobSpec, read_jsonl, write_jsonl
from trainer.distributed import current, rollout_seed
from trainer.evaluation import evaluate_rows
from trainer.models import attach_lora, load_model, trainable_parameters
from trainer.rollout import make_engine
from trainer.tracking import EventLog, Tracker


def make_scheduler(cfg: GRPOConfig, optimizer: torch.optim.Optimizer, algorithm: str = "grpo") -> LRScheduler:
    """transformers' scheduler of the config's type and warmup over max_steps. The loop steps it once per
    training step (the num_iterations passes of a step share its lr), so step 1 trains at its value at 0.
    sft_grpo: sft_learning_rate, constant, for the SFT stage's steps, then the GRPO schedule over the rest
    (warmup_ratio a share of those): one scheduler, so a checkpoint in either stage resumes as it was."""
    if algorithm != "sft_grpo":
        return get_scheduler(cfg.scheduler_name(algorithm), optimizer, num_warmup_steps=cfg.num_warmup_steps,
                             num_training_steps=cfg.max_steps)
    grpo_total = cfg.grpo_steps(algorithm)
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * grpo_total)
    name = cfg.lr_scheduler_type or "constant"
    name = "constant_with_warmup" if name == "constant" and warmup else name
    # The GRPO stage's multiplier as transformers computes it, taken from a scheduler on a throwaway optimizer.
    scratch = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    grpo_factor = get_scheduler(name, scratch, num_warmup_steps=warmup, num_training_steps=grpo_total).lr_lambdas[0]
    sft_factor = cfg.sft_learning_rate / cfg.learning_rate
    sft_total = cfg.sft_steps
    return LambdaLR(optimizer, lambda i: sft_factor if i < sft_total else grpo_factor(i - sft_total))


class JobFailed(RuntimeError):
    """Raised after the `error` event has been emitted; the CLI turns it into a non-zero exit."""


class JobRunner:
    def __init__(self, spec: JobSpec, events: EventLog) -> None:
        self.spec = spec
        self.cfg = cfg = spec.config
        self.events = events
        self.job = spec.job_dir
        self.job.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.step = 0  # the step being worked on; named in an error event
        self.extra_eval_steps: set[int] = set()  # evaluated besides every eval_interval (a stage's end)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)  # prompt order: its own stream, saved in checkpoints

        self.train_rows = read_jsonl(spec.train)
        if not self.train_rows:
            raise ValueError(f"{spec.train} has no rows")
        self.holdout_rows = read_jsonl(spec.holdout) if spec.holdout else []
        if cfg.eval_max_prompts:
            self.holdout_rows = self.holdout_rows[: cfg.eval_max_prompts]
        self.regression_rows = read_jsonl(spec.regression) if spec.regression else []

        base, self.tokenizer = load_model(spec.model)
        self.model = attach_lora(base, cfg, spec.adapter)
        self.params = trainable_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.scheduler = make_scheduler(cfg, self.optimizer, spec.algorithm)
        self.state: dict[str, Any] = {"step": 0, "best_step": None, "best_metric": None, "mlflow_run_id": None,
                                      "baseline": None, "last_eval": None}
        self.dist = current()
        self.resumed_from: Path | None = Path(spec.resume_from) if spec.resume_from else latest_checkpoint(self.job)
        if self.resumed_from is not None:
            self.state, rng = load_checkpoint(self.resumed_from, self.model, self.optimizer, self.scheduler)
            restore_rng(rng, self.rng)
            if spec.resume_from and self.dist.is_main:
                self._rewind_to(self.resumed_from)
        self.dist.broadcast_params(self.params)
        self.tracker = Tracker(enabled=spec.mlflow and self.dist.is_main, job_dir=self.job,
                               tracking_uri=spec.tracking_uri, experiment_name=spec.experiment_name, run_name=spec.run_name,
                               run_id=self.state.get("mlflow_run_id"))
        if self.resumed_from is None:
            self.tracker.log_params({"algorithm": spec.algorithm, "model": spec.model, "adapter": spec.adapter,
                                     **self.cfg.to_dict()})
        self.state["mlflow_run_id"] = self.tracker.run_id
        self.engine = make_engine(cfg, self.model, self.tokenizer, model_path=spec.model, work_dir=self.job)

    def release_rollout_memory(self) -> None:
        """Before an update: an engine that holds GPU memory of its own (vLLM) gives it back until its next
        generate. The HF engine samples with the trainer's own model and has nothing to free."""
        sleep = getattr(self.engine, "sleep", None)
        if sleep is not None:
            sleep()

    def _rewind_to(self, path: Path) -> None:
        """After resuming from an earlier checkpoint: drop the later ones, and make adapters/last and
        adapters/best those of the run as it stood then (a later best belongs to the abandoned future)."""
        discard_after(self.job, self.state["step"])
        publish_adapter(path / "adapter", jobdir.last_adapter(self.job))
        best = self.state.get("best_step")
        best_dir = jobdir.checkpoint_dir(self.job, best) / "adapter" if best is not None else None
        if best_dir is not None and best_dir.exists():
            publish_adapter(best_dir, jobdir.best_adapter(self.job))
        else:
            shutil.rmtree(jobdir.best_adapter(self.job), ignore_errors=True)

    @property
    def lr(self) -> float:
        """The learning rate of the coming optimizer step."""
        return float(self.optimizer.param_groups[0]["lr"])

    # --- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, step: int, rows: list[dict], split: str = "holdout") -> dict[str, Any]:
        cfg = self.cfg
        sampled = self.sampled_rows(rows)
        metrics: dict[str, Any] = {}
        if sampled:
            self.engine.sync(self.model, step)
            # Seeded by the step alone, like the rollouts: the same adapter gets the same evaluation whether
            # the run was resumed or ran on several processes.
            torch.manual_seed(rollout_seed(cfg.seed, step, -1, 0))
            metrics, cases = evaluate_rows(
                self.engine, self.tokenizer, sampled,
                samples_per_prompt=cfg.regression_samples_per_prompt if split == "regression" else cfg.eval_samples_per_prompt,
                temperature=cfg.eval_temperature, max_new_tokens=cfg.max_new_tokens, max_turns=cfg.max_turns,
                # The policy's turns of each sample, as `python -m trainer evaluate` keeps them: the checkpoint
                # inspector shows them beside production's on the same prompts.
                max_seq_len=cfg.max_seq_len, keep_messages=True,
            )
            out = jobdir.eval_results(self.job, split, step)
            out.parent.mkdir(exist_ok=True)
            write_jsonl(out, cases)
        metrics.update(self.extra_eval_metrics(split))
        self.events.emit("eval", step=step, split=split, metrics=metrics)
        self.tracker.log_metrics(metrics, step, prefix=f"{split}/")
        return metrics

    def sampled_rows(self, rows: list[dict]) -> list[dict]:
        """The rows an evaluation samples episodes of: all of them (a DPO job keeps only those with a verifier)."""
        return rows

    def extra_eval_metrics(self, split: str) -> dict[str, Any]:
        """Metrics an algorithm adds to each evaluation of `split` (DPO: the held-out preference margin)."""
        return {}

    # --- checkpoints --------------------------------------------------------------------------------
    def checkpoint(self, step: int, metrics: dict[str, Any] | None) -> None:
        """Save where the run stands. `metrics` None: a `save_steps` checkpoint, with no evaluation to judge
        the adapter by, so it never becomes the best."""
        key = self.cfg.metric_for_best_model
        if metrics is None:
            is_best = False
        else:
            value = metrics.get(key)
            best = self.state.get("best_metric")
            # Without a holdout metric to judge by, the newest adapter is the best one there is.
            if value is None or best is None:
                is_best = True
            else:
                is_best = value > best if self.cfg.best_metric_higher else value < best
            if is_best:
                self.state["best_step"], self.state["best_metric"] = step, value
            self.state["last_eval"] = metrics
        self.state["step"] = step
        path = save_checkpoint(self.job, step, self.model, self.optimizer, self.state, rng_state(self.rng),
                               scheduler=self.scheduler)
        publish_adapter(path / "adapter", jobdir.last_adapter(self.job))
        if is_best:
            publish_adapter(path / "adapter", jobdir.best_adapter(self.job))
            self.tracker.log_artifacts(jobdir.best_adapter(self.job), "adapter-best")
        self.events.emit("checkpoint", step=step, path=path, adapter=jobdir.last_adapter(self.job),
                         best=is_best, best_step=self.state["best_step"], best_metric=self.state["best_metric"],
                         metric=key)

    def should_eval(self, step: int) -> bool:
        return step % self.cfg.eval_interval == 0 or step == self.cfg.max_steps or step in self.extra_eval_steps

    def maybe_eval_start(self) -> None:
        if (self.dist.is_main and self.state["step"] == 0 and self.holdout_rows and self.cfg.eval_on_start
                and not self.state["baseline"]):
            self.state["baseline"] = self.evaluate(0, self.holdout_rows)

    def log_step(self, step: int, stats: dict[str, Any]) -> None:
        """A finished optimizer step: its event line, its MLflow metrics, then evaluate and checkpoint as due."""
        self.events.emit("step", step=step, **stats)
        self.tracker.log_metrics(stats, step, prefix="train/")
        self.end_of_step(step)

    def end_of_step(self, step: int) -> None:
        """Evaluate and checkpoint every eval_interval steps (and at the last), checkpoint alone every
        save_steps. Rank 0 only: the other ranks wait for it at their next collective."""
        self.state["step"] = step
        if not self.dist.is_main:
            return
        if self.should_eval(step):
            self.checkpoint(step, self.evaluate(step, self.holdout_rows) if self.holdout_rows else {})
        elif self.cfg.save_steps and step % self.cfg.save_steps == 0:
            self.checkpoint(step, None)

    # --- end of run ---------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        if not self.dist.is_main:
            return {}
        best_dir = jobdir.best_adapter(self.job)
        regression = None
        if self.regression_rows and best_dir.exists():
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(self.model, load_file(str(best_dir / "adapter_model.safetensors")))
            regression = self.evaluate(self.state["best_step"] or 0, self.regression_rows, split="regression")
        self.tracker.log_artifacts(jobdir.last_adapter(self.job), "adapter-last")
        self.tracker.end("FINISHED")
        return self.events.emit(
            "done", step=self.state["step"], best_step=self.state["best_step"],
            best_metric=self.state["best_metric"], metric=self.cfg.metric_for_best_model,
            adapter=best_dir if best_dir.exists() else None, last_adapter=jobdir.last_adapter(self.job),
            holdout_before=self.state.get("baseline"), holdout_after=self.state.get("last_eval"),
            regression=regression, mlflow_run_id=self.tracker.run_id, mlflow_error=self.tracker.error,
            resumed_from=self.resumed_from, seconds=round(time.perf_counter() - self.started, 2),
        )

    def fail(self, exc: BaseException) -> JobFailed:
        message = f"step {self.step} failed: {type(exc).__name__}: {exc}"
        self.events.emit("error", step=self.step, message=message)
        self.tracker.end("FAILED")
        return JobFailed(message)
