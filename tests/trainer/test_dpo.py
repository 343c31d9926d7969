"""DPO: the loss is the sigmoid DPO formula of the answers' summed logprobs; the reference is the policy with
its adapter disabled (equal to the policy at step 0, to the untouched base model after training); a few steps
on the tiny model raise the preference margin on pairs it never trained on; a malformed row fails naming the
row and the field, through the command line too."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import GRPOConfig, JobSpec, SpecError, load_spec, write_jsonl
from trainer.dpo import (
    PairError,
    answer_logprobs,
    collate_pairs,
    dpo_loss,
    dpo_update,
    encode_pairs,
    train_dpo,
    validate_pair,
)
from trainer.tiny import noisy_solution
from trainer.tracking import EventLog

REPO = Path(__file__).resolve().parents[2]


def pair_rows(tasks: list[dict], seed: int) -> list[dict]:
    """Promoted-failure pairs from workplace tasks: the reference call chosen, a corrupted call (a wrong
    argument value or tool, what the tiny model's label noise makes) rejected."""
    rng = random.Random(seed)
    rows = []
    for task in tasks:
        row = {k: v for k, v in task.items() if k != "solution"}
        row["chosen"], row["rejected"] = task["solution"][0], noisy_solution(task, rng)[0]
        if row["chosen"] != row["rejected"]:  # a corruption may draw the value it replaces
            rows.append(row)
    return rows


def dpo_config(**overrides) -> GRPOConfig:
    values = {"loss_type": "sigmoid", "beta": 0.1, "r": 16, "alpha": 32, "num_threads": 1}
    return GRPOConfig(**{**values, **overrides})


def test_loss_is_the_formula_on_a_hand_computed_batch():
    # Pair 0: the chosen answer gained 0.5 nats over the reference and the rejected one lost 0.5, so
    # z = beta * (0.5 - (-0.5)) = 0.5 and the loss is -log sigmoid(0.5) = log(1 + e^-0.5) = 0.474077.
    # Pair 1: the chosen answer is where the reference has it and the rejected one gained 0.5:
    # z = 0.5 * (0 - 0.5) = -0.25, loss log(1 + e^0.25) = 0.825939.
    policy_c, policy_r = torch.tensor([-5.0, -3.0]), torch.tensor([-6.0, -2.0])
    ref_c, ref_r = torch.tensor([-5.5, -3.0]), torch.tensor([-5.5, -2.5])
    losses, chosen, rejected = dpo_loss(policy_c, policy_r, ref_c, ref_r, beta=0.5)
    assert losses.tolist() == pytest.approx([0.4740769842, 0.8259394199], abs=1e-7)
    assert chosen.tolist() == pytest.approx([0.25, 0.0])  # beta * (policy - reference)
    assert rejected.tolist() == pytest.approx([-0.25, 0.25])
    # The gradient of the mean loss pushes the chosen answer up and the rejected one down, by
    # beta * sigmoid(-z) / 2 each: 0.5 * 0.377541 / 2 and 0.5 * 0.562177 / 2.
    pc = policy_c.clone().requires_grad_()
    pr = policy_r.clone().requires_grad_()
    dpo_loss(pc, pr, ref_c, ref_r, beta=0.5)[0].mean().backward()
    assert pc.grad.tolist() == pytest.approx([-0.0943852, -0.1405443], abs=1e-6)
    assert pr.grad.tolist() == pytest.approx([0.0943852, 0.1405443], abs=1e-6)


def full_logits_answer_logprobs(model, batch) -> torch.Tensor:
    """Summed logprobs of the trained tokens from the model's own forward and full logits."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return (logp * batch.loss_mask).sum(dim=1)


def test_answer_logprobs_and_loss_match_the_full_forward(make_lora_policy, workplace_tasks):
    model, tok = make_lora_policy()  # a non-zero adapter: the policy differs from the reference
    pairs, _ = encode_pairs(pair_rows(workplace_tasks["train"][:5], seed=0), tok, source="train.jsonl")
    batch = collate_pairs(pairs, tok.pad_token_id)
    # Only the answers train: every pair's prompt is masked, each answer's tokens are not.
    for i, p in enumerate(pairs):
        assert batch.loss_mask[i, : p.prompt_len - 1].sum() == 0
        assert batch.loss_mask[i].sum() == sum(p.chosen[1]) > 0
        assert batch.loss_mask[len(pairs) + i].sum() == sum(p.rejected[1]) > 0
    with torch.no_grad():
        policy = full_logits_answer_logprobs(model, batch)
        with model.disable_adapter():
            ref = full_logits_answer_logprobs(model, batch)
        for share in (True, False):
            c, r = answer_logprobs(model, batch, share_prefix=share)
            assert torch.cat([c, r]).tolist() == pytest.approx(policy.tolist(), abs=1e-4)
    n = len(pairs)
    losses, _, _ = dpo_loss(c, r, *ref.chunk(2), beta=0.1)
    for k in range(n):
        z = 0.1 * ((float(policy[k]) - float(ref[k])) - (float(policy[n + k]) - float(ref[n + k])))
        assert float(losses[k]) == pytest.approx(math.log1p(math.exp(-z)), abs=1e-5)


def test_reference_is_the_adapter_disabled(tiny_model, workplace_tasks):
    from trainer.models import attach_lora, load_model, trainable_parameters

    torch.manual_seed(0)
    base, tok = load_model(tiny_model, device="cpu")
    model = attach_lora(base, dpo_config(r=4, alpha=8))
    frozen = {k: v.clone() for k, v in model.named_parameters() if "lora_" not in k}
    pairs, _ = encode_pairs(pair_rows(workplace_tasks["train"][:24], seed=0), tok, source="train.jsonl")
    batch = collate_pairs(pairs[:8], tok.pad_token_id)

    def logprobs(reference: bool) -> torch.Tensor:
        with torch.no_grad():
            if reference:
                with model.disable_adapter():
                    return torch.cat(answer_logprobs(model, batch))
            return torch.cat(answer_logprobs(model, batch))

    # Step 0: a new adapter adds nothing (LoRA's B starts at zero), so policy and reference are one model.
    assert torch.equal(logprobs(False), logprobs(True))
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    cfg = dpo_config(r=4, alpha=8, train_batch_size=8)
    first = dpo_update(model, optimizer, params, pairs[:8], cfg, pad_id=tok.pad_token_id)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["margin"] == 0.0
    for k in range(3):
        dpo_update(model, optimizer, params, pairs[8 * (k % 3):8 * (k % 3 + 1)], cfg, pad_id=tok.pad_token_id)
    policy, reference = logprobs(False), logprobs(True)
    assert (policy - reference).abs().max() > 0.1  # the adapter moved the policy ...
    for k, v in model.named_parameters():  # ... and nothing else
        if "lora_" not in k:
            assert torch.equal(v, frozen[k]), k
    # The reference is exactly the base model as loaded, with no adapter at all.
    plain, _ = load_model(tiny_model, device="cpu")
    with torch.no_grad():
        assert torch.equal(torch.cat(answer_logprobs(plain, batch)), reference)


def test_dpo_job_raises_held_out_margin(tiny_model, workplace_tasks, tmp_path):
    train = pair_rows(workplace_tasks["train"][:200], seed=0)
    holdout = pair_rows(workplace_tasks["holdout"][:60], seed=1)
    assert not {r["id"] for r in train} & {r["id"] for r in holdout}  # held out: never trained on
    for row in holdout[4:]:  # a pair without a verifier is measured by its margin alone
        del row["verifier"]
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "holdout.jsonl", holdout)
    # Measured with seeds 0/1/2 of the run: held-out margin 0.170/0.190/0.183, 4.7/4.2/3.9 standard errors.
    cfg = dpo_config(learning_rate=3e-3, max_steps=30, num_prompts_per_step=16, train_batch_size=32,
                     eval_interval=15, eval_samples_per_prompt=2, max_new_tokens=48)
    events = EventLog(None)
    done = train_dpo(JobSpec(model=str(tiny_model), job_dir=tmp_path, algorithm="dpo", train=tmp_path / "train.jsonl",
                             holdout=tmp_path / "holdout.jsonl", config=cfg, mlflow=False), events)

    evals = [e for e in events.events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 15, 30]
    before, after = evals[0]["metrics"], evals[-1]["metrics"]
    assert before["pairs"] == after["pairs"] == len(holdout)
    # At step 0 the policy is the reference: every margin is exactly 0.
    assert before["margin"] == 0.0 and before["loss"] == pytest.approx(math.log(2))
    gain = after["margin"] - before["margin"]
    print(f"held-out margin {before['margin']:.3f} -> {after['margin']:.3f} (3 SE {3 * after['margin_se']:.3f}), "
          f"accuracy {after['accuracy']:.2f}, loss {after['loss']:.3f}")
    assert gain > 3 * after["margin_se"], after
    assert after["accuracy"] > 0.6 and after["loss"] < math.log(2)
    # The rows with a verifier were also sampled and scored, as a GRPO job's holdout is.
    assert after["n"] == 4 * 2 and "success_rate" in after
    assert len((tmp_path / "evals" / "holdout-step-000030.jsonl").read_text().splitlines()) == 4

    steps = [e for e in events.events if e["event"] == "step"]
    assert len(steps) == 30
    for key in ("loss", "rewards/chosen", "rewards/rejected", "margin", "accuracy", "grad_norm", "lr", "step_time"):
        assert all(key in e for e in steps), key
    assert steps[0]["margin"] == 0.0 and steps[0]["loss"] == pytest.approx(math.log(2))
    assert steps[-1]["margin"] == pytest.approx(steps[-1]["rewards/chosen"] - steps[-1]["rewards/rejected"])
    # The job directory as the platform reads it.
    assert done["event"] == "done" and done["step"] == 30 and done["holdout_after"] == after
    assert (Path(done["adapter"]) / "adapter_model.safetensors").exists()
    assert (tmp_path / "adapters" / "last" / "adapter_config.json").exists()
    assert (tmp_path / "checkpoints" / "step-000030" / "state.json").exists()


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.pop("chosen"), "row 3 (id 'p-3'): chosen: missing"),
    (lambda r: r.update(rejected={"role": "user", "content": "x"}), "row 3 (id 'p-3'): rejected.role: must be"),
    (lambda r: r.update(chosen={"role": "assistant", "content": 7}), "row 3 (id 'p-3'): chosen.content: must be"),
    (lambda r: r.update(chosen={"role": "assistant"}), "row 3 (id 'p-3'): chosen: an assistant message needs"),
    (lambda r: r.update(rejected=[{"role": "tool", "content": "x"}]), "row 3 (id 'p-3'): rejected[0].role"),
    (lambda r: r.update(rejected=r["chosen"]), "row 3 (id 'p-3'): chosen and rejected are the same"),
    (lambda r: r.update(messages=[]), "row 3 (id 'p-3'): messages: must be a non-empty list"),
])
def test_malformed_row_names_row_and_field(change, message):
    row = {"id": "p-3", "messages": [{"role": "user", "content": "Assign T4 to Peggy."}],
           "chosen": {"role": "assistant", "content": "ok", "tool_calls": [{"type": "function", "function": {
               "name": "update_task", "arguments": "{\"task_id\": \"T4\", \"assignee\": \"Peggy\"}"}}]},
           "rejected": {"role": "assistant", "content": "ok", "tool_calls": [{"type": "function", "function": {
               "name": "update_task", "arguments": "{\"task_id\": \"T4\", \"assignee\": \"Kevin\"}"}}]}}
    validate_pair(row, "train.jsonl: row 3")
    change(row)
    with pytest.raises(PairError) as err:
        validate_pair(row, "train.jsonl: row 3")
    assert str(err.value).startswith(f"train.jsonl: {message}")


def test_spec_defaults_and_checks_for_dpo(tmp_path, tiny_model):
    (tmp_path / "train.jsonl").write_text("")

    def spec(algorithm: str, config: dict) -> Path:
        path = tmp_path / "spec.json"
        path.write_text(json.dumps({"model": str(tiny_model), "algorithm": algorithm, "config": config}))
        return path

    cfg = load_spec(spec("dpo", {})).config
    assert (cfg.beta, cfg.loss_type) == (0.1, "sigmoid")  # TRL's DPOConfig defaults
    assert load_spec(spec("dpo", {"beta": 0.3})).config.beta == 0.3
    assert load_spec(spec("grpo", {})).config.beta == 0.0
    with pytest.raises(SpecError, match=r"config\.beta \(the DPO temperature\) must be > 0"):
        load_spec(spec("dpo", {"beta": 0.0}))
    with pytest.raises(SpecError, match=r"config\.loss_type must be one of sigmoid for dpo"):
        load_spec(spec("dpo", {"loss_type": "grpo"}))
    with pytest.raises(SpecError, match=r"config\.loss_type 'sigmoid' is a DPO loss"):
        load_spec(spec("grpo", {"loss_type": "sigmoid"}))


def test_cli_dpo_job_with_a_malformed_row_fails_naming_it(tiny_model, workplace_tasks, tmp_path):
    rows = pair_rows(workplace_tasks["train"][:3], seed=0)
    del rows[1]["rejected"]
    write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "spec.json").write_text(json.dumps({"model": str(tiny_model), "algorithm": "dpo", "mlflow": False,
                                                    "config": {"max_steps": 1, "num_threads": 1}}))
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--spec", str(tmp_path / "spec.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert events[-1]["event"] == "error"
    assert (f"PairError: {tmp_path / 'train.jsonl'}: row 2 (id {rows[1]['id']!r}): rejected: missing"
            in events[-1]["message"])
