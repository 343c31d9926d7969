"""SFT, then GRPO, in one job (`"algorithm": "sft_grpo"`): the warm start and the RL that follows it share
one LoRA adapter, one job directory, one event stream and one final report, so the platform gates one
candidate.

Steps 1..sft_steps imitate the task set's references (`trainer.sft`: a task's solution, its stated
reference, or a good trajectory), at `sft_learning_rate`; steps sft_steps+1..max_steps are GRPO on the same
rows' verifiers, with the GRPO stage's learning rate and schedule. The holdout is evaluated at the end of
the SFT stage too, so the page shows what each stage did; the best checkpoint is chosen over both stages.
AdamW's moments start afresh with the GRPO stage (SFT's gradient scale says nothing about GRPO's).
A `stage` event opens each stage; a resumed run opens the stage it resumes in.
"""

from __future__ import annotations

from typing import Any

from trainer.config import JobSpec
from trainer.loop import RewardFn, grpo_steps, prepare_grpo
from trainer.runner import JobRunner
from trainer.sft import build_examples, sft_steps
from trainer.tracking import EventLog


def train_sft_grpo(spec: JobSpec, events: EventLog, *, reward_fn: RewardFn | None = None) -> dict[str, Any]:
    run = JobRunner(spec, events)
    cfg = run.cfg
    last_sft = cfg.sft_steps
    run.extra_eval_steps.add(last_sft)
    prepare_grpo(run)
    try:
        examples = build_examples(run.train_rows, run.tokenizer, cfg.max_seq_len)
        if not examples:
            raise ValueError(f"{spec.train}: the SFT stage has nothing to imitate (no task with a reference or a "
                             "solution that passes, no good trajectory); train with grpo instead")
        run.maybe_eval_start()
        start = run.state["step"] + 1
        if start <= last_sft:
            events.emit("stage", stage="sft", first_step=1, last_step=last_sft, examples=len(examples))

            def on_step(step: int, stats: dict[str, float]) -> None:
                run.step = step
                run.log_step(step, {"examples": len(examples), **stats})

            run.step = start
            sft_steps(run.model, run.optimizer, run.params, examples, pad_id=run.tokenizer.pad_token_id,
                      steps=range(start, last_sft + 1), batch_size=cfg.train_batch_size, rng=run.rng,
                      scheduler=run.scheduler, max_grad_norm=cfg.max_grad_norm, dist=run.dist, on_step=on_step)
        if run.state["step"] <= last_sft:
            run.optimizer.state.clear()  # the moments SFT left; a run resumed inside GRPO keeps GRPO's
        events.emit("stage", stage="grpo", first_step=last_sft + 1, last_step=cfg.max_steps)
        grpo_steps(run, range(max(run.state["step"], last_sft) + 1, cfg.max_steps + 1), reward_fn)
        return run.finish()
    except Exception as exc:
        raise run.fail(exc) from exc
