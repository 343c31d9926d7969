"""Command line of the trainer: build-tiny, train, evaluate, latency, score and demo.

stdout carries only JSON lines (events, or score rows); logs and library chatter go to stderr. A failure
prints an `{"event": "error", "step": ..., "message": ...}` line and exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer.tracking import EventLog, claim_stdout, error_message, log_traceback

DEFAULT_WORKDIR = Path("var") / "trainer"


def _quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def cmd_build_tiny(args: argparse.Namespace, events: EventLog) -> int:
    from trainer.tiny import build_tiny

    t0 = time.perf_counter()
    path = build_tiny(args.out, steps=args.steps, seed=args.seed, arch=args.arch, hidden=args.hidden,
                      layers=args.layers, heads=args.heads, device=args.device, log=lambda e: events.emit(**e))
    meta = json.loads((Path(path) / "tiny.json").read_text())
    events.emit("done", path=str(path), **meta, total_seconds=round(time.perf_counter() - t0, 2))
    return 0


def cmd_train(args: argparse.Namespace, events: EventLog) -> int:
    from trainer.config import load_spec, resolve_checkpoint
    from trainer.distributed import init_from_env, shutdown

    spec = load_spec(args.spec)
    if args.resume_from:
        spec.resume_from = str(resolve_checkpoint(spec.job_dir, args.resume_from, where="--resume-from"))
    init_from_env()  # under torchrun: join the job's process group; alone: nothing
    try:
        if spec.algorithm == "sft":
            from trainer.sft import train_sft

            train_sft(spec, events)
        elif spec.algorithm == "dpo":
            from trainer.dpo import train_dpo

            train_dpo(spec, events)
        elif spec.algorithm == "sft_grpo":
            from trainer.staged import train_sft_grpo

            train_sft_grpo(spec, events)
        else:
            from trainer.loop import train_grpo

            train_grpo(spec, events)
    finally:
        shutdown()
    return 0


def cmd_evaluate(args: argparse.Namespace, events: EventLog) -> int:
    from trainer.config import read_jsonl, write_jsonl
    from trainer.evaluation import evaluate_rows
    from trainer.models import load_model, load_tokenizer
    from trainer.rollout.hf import HFEngine

    t0 = time.perf_counter()
    rows = read_jsonl(args.suite)
    with contextlib.ExitStack() as scratch:
        if args.engine == "vllm":
            # vLLM holds the model (and the adapter) itself: a second copy in transformers would only take
            # GPU memory. Evaluation never syncs a new policy, so the engine's adapter folder stays empty: a
            # temp dir that goes away with the run, never a folder beside (or above) the user's files.
            tokenizer = load_tokenizer(args.model)
            work_dir = scratch.enter_context(tempfile.TemporaryDirectory(prefix="flywheel-evaluate-"))
            engine: Any = vllm_eval_engine(args.model, tokenizer, args.adapter, work_dir)
        else:
            model, tokenizer = load_model(args.model)
            if args.adapter:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, args.adapter)
            model.eval()
            engine = HFEngine(model, tokenizer)
        import torch

        torch.manual_seed(args.seed)
        metrics, cases = evaluate_rows(engine, tokenizer, rows, samples_per_prompt=args.samples,
                                       temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                       max_turns=args.max_turns, max_seq_len=args.max_seq_len, keep_messages=True)
    for case in cases:
        events.emit("eval", case=case)
    if args.out:
        write_jsonl(args.out, cases)
    events.emit("done", suite=str(args.suite), model=str(args.model), adapter=args.adapter, metrics=metrics,
                cases=len(cases), results=args.out, seconds=round(time.perf_counter() - t0, 2))
    return 0


def cmd_latency(args: argparse.Namespace, events: EventLog) -> int:
    """Per-case generation time of production (A) and a candidate (B): see `trainer.latency`."""
    from trainer.config import read_jsonl, write_jsonl
    from trainer.latency import measure_latency

    t0 = time.perf_counter()
    rows = measure_latency(args.model, read_jsonl(args.suite), adapter_a=args.adapter_a or None,
                           adapter_b=args.adapter_b, cases=args.cases, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=args.seed,
                           on_case=lambda row: events.emit("latency", case=row))
    if args.out:
        write_jsonl(args.out, rows)
    events.emit("done", suite=str(args.suite), model=str(args.model), adapter_a=args.adapter_a or None,
                adapter_b=args.adapter_b, cases=len(rows), results=args.out,
                seconds=round(time.perf_counter() - t0, 2))
    return 0


def vllm_eval_engine(model_path: str, tokenizer: Any, adapter: str | None, work_dir: str | Path) -> Any:
    """A vLLM engine that samples the base model, or the given adapter as one fixed LoRA request."""
    from trainer.config import GRPOConfig
    from trainer.rollout.vllm import VLLMEngine

    rank = 16
    if adapter:  # vLLM must be told the largest LoRA rank it will be asked to load
        rank = json.loads((Path(adapter) / "adapter_config.json").read_text()).get("r", rank)
    # No training here: the sampler's logprobs feed no loss, so no importance-sampling correction to keep.
    engine = VLLMEngine(model_path, tokenizer, GRPOConfig(r=rank, importance_sampling_correction=False),
                        work_dir=work_dir)
    if adapter:
        from vllm.lora.request import LoRARequest

        engine.lora_request = LoRARequest("eval", 1, str(Path(adapter).resolve()))
    return engine


def _objects(path: str, what: str) -> list[dict[str, Any]]:
    from trainer.config import read_jsonl

    rows = read_jsonl(path)
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {what} row {i} is not a JSON object")
    return rows


def _unscored(cid: Any, check: str, reason: str) -> dict[str, Any]:
    """The score row of a case that could not be judged: the same fields as any other, a reward of 0 and
    `error` saying why, so a consumer that reads only reward/passed/failure still counts it as failed."""
    return {"id": cid, "reward": 0.0, "passed": False, "failure": "invalid_format",
            "checks": {check: {"ok": False, "reason": reason}}, "error": reason}


def cmd_score(args: argparse.Namespace, out: Any) -> int:
    """One `{id, reward, passed, failure, checks}` line per case. A case without a completion or with a bad
    verifier spec still gets its line (with `error`), the others are scored, and the exit status is 1."""
    from trainer.verifiers.rewards import score_task

    completions = {str(r.get("id")): r.get("completion") for r in _objects(args.completions, "completions")}
    cases = _objects(args.cases, "cases")
    status = 0
    for case in cases:
        cid = case.get("id")
        if str(cid) not in completions:
            row = _unscored(cid, "completion", "no completion with this id")
        else:
            try:
                s = score_task(case, completions[str(cid)], tools=case.get("tools"))  # a verifier or weighted rewards
            except Exception as exc:  # a bad spec in one case should not hide the other cases' scores
                row = _unscored(cid, "verifier", error_message(exc))
            else:
                row = {"id": cid, **s.to_dict()}
        status = status or int("error" in row)
        out.write(json.dumps(row, default=str) + "\n")
    out.flush()
    return status


def cmd_demo(args: argparse.Namespace, events: EventLog) -> int:
    from trainer.config import JobSpec, write_jsonl
    from trainer.envs.workplace import generate_tasks
    from trainer.loop import train_grpo
    from trainer.tiny import build_tiny

    t0 = time.perf_counter()
    work = Path(args.workdir)
    if args.model:  # an existing model directory (a tiny model built before, or any local model)
        model = Path(args.model)
        if not model.is_dir():
            raise FileNotFoundError(f"--model {args.model}: not a model directory")
    else:
        model = work / "tiny"
        if not (model / "tiny.json").exists():
            build_tiny(model, log=lambda e: events.emit(**{**e, "event": "step", "phase": "build-tiny"}))
    job = work / f"demo-seed{args.seed}-{int(time.time())}"
    job.mkdir(parents=True)
    write_jsonl(job / "train.jsonl",
                generate_tasks(args.train_prompts, seed=args.seed, split="train", difficulty="single"))
    write_jsonl(job / "holdout.jsonl",
                generate_tasks(args.holdout_prompts, seed=args.seed, split="holdout", difficulty="single"))
    config = demo_config(args.steps, args.seed)
    spec = JobSpec(model=str(model.resolve()), job_dir=job, train=job / "train.jsonl",
                   holdout=job / "holdout.jsonl", config=config, mlflow=args.mlflow)
    (job / "spec.json").write_text(json.dumps({k: v for k, v in spec.to_dict().items() if k != "job_dir"}))

    class DemoLog(EventLog):
        def emit(self, event: str, **fields: Any) -> dict[str, Any]:
            if event == "done":  # the demo's last line: before/after on the holdout and wall time
                fields["seconds"] = round(time.perf_counter() - t0, 2)
                fields["job_dir"] = str(job)
            return super().emit(event, **fields)

    train_grpo(spec, DemoLog(events.stream))
    return 0


def demo_config(steps: int, seed: int) -> Any:
    """The CPU recipe the demo and the learning test use on the tiny model (single-call workplace tasks)."""
    from trainer.config import GRPOConfig

    return GRPOConfig(
        num_prompts_per_step=16, num_generations_per_prompt=8, max_new_tokens=48, temperature=1.0,
        learning_rate=1e-3, max_steps=steps, eval_interval=max(steps, 1), eval_samples_per_prompt=4,
        loss_type="grpo", beta=0.0, scale_rewards="group", r=16, alpha=32, seed=seed, train_batch_size=64,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-tiny", help="build the tiny CPU model (or a larger one of its kind) into OUT")
    b.add_argument("out")
    b.add_argument("--steps", type=int, default=1000, help="SFT warm-start steps")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    b.add_argument("--hidden", type=int, default=128, help="hidden size (the MLP is twice that)")
    b.add_argument("--layers", type=int, default=2)
    b.add_argument("--heads", type=int, default=2)
    b.add_argument("--device", default="cpu", help="where to train it: cpu or cuda")
    b.add_argument("--threads", type=int, default=None)
    t = sub.add_parser("train", help="run a training job from its spec.json (under torchrun: on several processes)")
    t.add_argument("--spec", required=True)
    t.add_argument("--resume-from", help="continue from this checkpoint folder (JOB/checkpoints/step-NNNNNN) "
                                         "instead of the newest; checkpoints of later steps are discarded")
    e = sub.add_parser("evaluate", help="evaluate a model (and adapter) on a suite JSONL")
    # Every default is GRPOConfig's, so a measurement with no flags samples as a job's evaluation does.
    from trainer.config import ENGINES, GRPOConfig

    cfg = GRPOConfig()
    e.add_argument("--model", required=True)
    e.add_argument("--adapter")
    e.add_argument("--suite", required=True)
    e.add_argument("--samples", type=int, default=cfg.eval_samples_per_prompt, help="samples per case")
    e.add_argument("--temperature", type=float, default=cfg.eval_temperature, help="0 = greedy")
    e.add_argument("--max-new-tokens", type=int, default=cfg.max_new_tokens)
    e.add_argument("--max-turns", type=int, default=cfg.max_turns)
    e.add_argument("--max-seq-len", type=int, default=cfg.max_seq_len,
                   help="prompt and completion tokens of an episode")
    e.add_argument("--engine", choices=ENGINES, default=cfg.rollout_engine)
    e.add_argument("--seed", type=int, default=cfg.seed)
    e.add_argument("--out", help="also write per-case results to this JSONL")
    e.add_argument("--threads", type=int, default=None)
    lt = sub.add_parser("latency", help="per-case generation time of production (A) and a candidate (B), "
                                        "one request at a time, A/B/B/A per case")
    lt.add_argument("--model", required=True)
    lt.add_argument("--adapter-a", default="", help="production's adapter; empty: the base model")
    lt.add_argument("--adapter-b", required=True, help="the candidate's adapter")
    lt.add_argument("--suite", required=True)
    lt.add_argument("--cases", type=int, default=30, help="at most this many cases of the suite, chosen by --seed")
    lt.add_argument("--max-new-tokens", type=int, default=cfg.max_new_tokens)
    lt.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--out", help="also write per-case rows to this JSONL")
    lt.add_argument("--threads", type=int, default=None)
    s = sub.add_parser("score", help="run verifiers only: CASES.jsonl x COMPLETIONS.jsonl")
    s.add_argument("cases")
    s.add_argument("completions")
    d = sub.add_parser("demo", help="tiny model + workplace tasks: baseline, GRPO, holdout again")
    d.add_argument("--steps", type=int, default=80)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--workdir", default=str(DEFAULT_WORKDIR))
    d.add_argument("--model", help="use this model directory instead of building the tiny model in WORKDIR/tiny")
    d.add_argument("--train-prompts", type=int, default=400, help="generated train tasks")
    d.add_argument("--holdout-prompts", type=int, default=100, help="generated holdout tasks (4 samples each)")
    d.add_argument("--mlflow", action="store_true", help="also log to MLflow (a sqlite store in the job dir)")
    d.add_argument("--threads", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    stdout = claim_stdout()
    events = EventLog(stdout, keep=False)
    if args.command == "train" and int(os.environ.get("RANK", "0")) > 0:
        # Under torchrun rank 0 speaks for the job; the other ranks' stdout carries only their own errors.
        from trainer.distributed import RankEventLog

        events = RankEventLog(stdout, rank=int(os.environ["RANK"]))
    try:
        if args.command == "score":  # verifiers only: no torch, no transformers
            return cmd_score(args, stdout)
        _quiet_libraries()
        _threads(getattr(args, "threads", None))
        handler = {"build-tiny": cmd_build_tiny, "train": cmd_train, "evaluate": cmd_evaluate,
                   "latency": cmd_latency, "demo": cmd_demo}[args.command]
        return handler(args, events)
    except Exception as exc:
        from trainer.runner import JobFailed

        log_traceback()
        if not isinstance(exc, JobFailed):  # a JobFailed has already reported its step
            when = " before training started" if args.command in ("train", "demo") else ""
            events.emit("error", step=0, message=f"{args.command} failed{when}: {error_message(exc)}")
        return 1
    finally:
        sys.stderr.flush()


if __name__ == "__main__":
    raise SystemExit(main())
