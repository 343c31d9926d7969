"""The vLLM engine's own logic, with a stand-in `vllm` module (vLLM needs a GPU and is not installed here):
one LoRARequest (new id, new folder) per policy version, old adapter folders rotated out, an unchanged policy
not saved again, vLLM's per-token logprob dicts turned into our rollout format, a LoRA rank vLLM accepts, a
too-long prompt reported with its task, sleep mode around the update, and an older vLLM's fallbacks.

The stand-in refuses what vLLM refuses (a max_lora_rank outside its set, a request longer than
max_model_len, an engine argument it does not know, generating while asleep), so a test passes only when
the engine asks vLLM for something it would accept."""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.config import GRPOConfig, JobSpec, write_jsonl
from trainer.loop import train_grpo
from trainer.models import attach_lora, load_tokenizer
from trainer.rollout import PromptTooLong, make_engine
from trainer.rollout.vllm import VLLMEngine
from trainer.tracking import EventLog

EOS = 2


# The stand-in mirrors the shapes of vLLM's public objects: RequestOutput.outputs[0] is a CompletionOutput
# whose `logprobs` is one {token_id: Logprob} dict per generated token (the sampled token among them).
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


VLLM_LORA_RANKS = {1, 8, 16, 32, 64, 128, 256, 320, 512}  # vllm/config/lora.py: max_lora_rank's Literal


class FakeLLM:
    """Answers prompt i with `script[i % len(script)]`: (token ids, finish reason)."""

    instances: list[FakeLLM] = []
    unknown_args: tuple[str, ...] = ()  # engine arguments this "vLLM" is too old to know
    script: list[tuple[list[int], str]] = [([5, 6, EOS], "stop"), ([7, 8, 9], "length")]

    def __init__(self, **kwargs):
        for name in self.unknown_args:
            if name in kwargs:
                raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{name}'")
        if kwargs.get("max_lora_rank", 16) not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank ({kwargs['max_lora_rank']}) must be one of {sorted(VLLM_LORA_RANKS)}")
        self.kwargs = kwargs
        self.calls: list[dict] = []
        self.log: list[str] = []  # generate / sleep / wake_up, in order
        self.asleep = False
        FakeLLM.instances.append(self)

    def sleep(self, level=1):
        assert self.kwargs.get("enable_sleep_mode"), "sleep() needs enable_sleep_mode=True"
        assert not self.asleep
        self.asleep = True
        self.log.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.asleep = False
        self.log.append("wake_up")

    def generate(self, inputs, params, lora_request=None, use_tqdm=True):
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine")
        self.log.append("generate")
        params_list = params if isinstance(params, list) else [params] * len(inputs)
        self.calls.append({"inputs": inputs, "params": params_list, "lora_request": lora_request})
        outs = []
        limit = self.kwargs.get("max_model_len", 2048)
        for i, (inp, p) in enumerate(zip(inputs, params_list, strict=True)):
            n = len(inp["prompt_token_ids"])
            if n + p.max_tokens > limit:  # vLLM's input processor: refuses the whole call
                raise ValueError(f"The decoder prompt (length {n}) plus the number of requested output tokens "
                                 f"({p.max_tokens}) is longer than the maximum model length of {limit}.")
            ids, reason = self.script[i % len(self.script)]
            ids = ids[: p.max_tokens]
            # The sampled token's logprob plus a runner-up, as vLLM returns when the sample is not the top token.
            lps = [{t: Logprob(-0.1 * (k + 1), rank=2), 99: Logprob(-0.01, rank=1)} for k, t in enumerate(ids)]
            outs.append(RequestOutput(str(i), inp["prompt_token_ids"], [
                CompletionOutput(0, "", tuple(ids), None, lps if p.logprobs is not None else None, reason)]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, SamplingParams
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    vllm.lora, lora.request = lora, request
    for name, mod in {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(FakeLLM, "instances", [])
    monkeypatch.setattr(FakeLLM, "unknown_args", ())
    return FakeLLM


@pytest.fixture
def policy():
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, eos_token_id=EOS))
    return attach_lora(base, GRPOConfig(r=4, alpha=8))


def test_sync_saves_each_version_once_with_a_new_request(fake_vllm, policy, tmp_path):
    cfg = GRPOConfig(r=4, rollout_engine="vllm", max_seq_len=512, seed=3)
    engine = make_engine(cfg, policy, types.SimpleNamespace(eos_token_id=EOS), model_path="/models/base",
                         work_dir=tmp_path)
    assert isinstance(engine, VLLMEngine)
    llm = fake_vllm.instances[0]
    assert llm.kwargs["model"] == "/models/base" and llm.kwargs["enable_lora"] is True
    assert llm.kwargs["max_lora_rank"] == 8 and llm.kwargs["max_model_len"] == 512
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and engine.raw_logprobs is False
    assert engine.lora_request is None  # before the first sync the base model samples

    saves = []
    save = policy.save_pretrained
    policy.save_pretrained = lambda path, **kw: (saves.append(path), save(path, **kw))
    requests = []
    for version in range(4):
        with torch.no_grad():  # a new policy version: different adapter weights
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.01 * (version + 1))
        engine.sync(policy, version)
        requests.append(engine.lora_request)
        engine.generate([[1, 3, 4]], max_new_tokens=8, temperature=1.0)
        assert llm.calls[-1]["lora_request"] is engine.lora_request  # generate samples the synced version

    # vLLM caches adapters by integer id: each version needs its own id and its own folder.
    assert len({r.lora_int_id for r in requests}) == 4 and len({r.lora_path for r in requests}) == 4
    assert len({r.lora_name for r in requests}) == 4
    last = Path(requests[-1].lora_path)
    assert last.parent == tmp_path / "rollout_adapters"
    assert (last / "adapter_config.json").exists() and (last / "adapter_model.safetensors").exists()
    from safetensors.torch import load_file

    saved = load_file(str(last / "adapter_model.safetensors"))
    assert all(torch.allclose(w, torch.full_like(w, 0.04)) for k, w in saved.items() if "lora_B" in k)
    # Only the newest keep_versions folders stay on disk.
    kept = sorted(p.name for p in (tmp_path / "rollout_adapters").iterdir())
    assert kept == [Path(r.lora_path).name for r in requests[-engine.keep_versions:]]

    # The same version again (an eval right before the next step): no save, the same request.
    engine.sync(policy, 3)
    assert len(saves) == 4 and engine.lora_request is requests[-1]


def test_generate_turns_vllm_outputs_into_generations(fake_vllm, tmp_path):
    engine = VLLMEngine("/models/base", types.SimpleNamespace(eos_token_id=EOS), GRPOConfig(), work_dir=tmp_path)
    gens = engine.generate([[1, 2], [3]], max_new_tokens=3, temperature=0.7)
    params = fake_vllm.instances[0].calls[0]["params"]
    assert all(p.max_tokens == 3 and p.temperature == 0.7 and p.logprobs == 0 for p in params)
    assert all(p.stop_token_ids == [EOS] for p in params)
    assert fake_vllm.instances[0].calls[0]["inputs"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert [g.token_ids for g in gens] == [[5, 6, EOS], [7, 8, 9]]
    assert [g.finished for g in gens] == [True, False]  # "length": cut at max_new_tokens
    # The sampled token's logprob, not the top-ranked one's.
    assert gens[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert engine.generate([], max_new_tokens=3, temperature=1.0) == []
    assert all(p.top_p == 1.0 and p.top_k == -1 for p in params)  # -1: no top-k in every vLLM version


def test_generate_samples_with_the_configs_top_p_and_top_k(fake_vllm, tmp_path):
    engine = VLLMEngine("/models/base", types.SimpleNamespace(eos_token_id=EOS), GRPOConfig(top_p=0.9, top_k=20),
                        work_dir=tmp_path)
    engine.generate([[1, 2]], max_new_tokens=3, temperature=0.7)
    (params,) = fake_vllm.instances[0].calls[0]["params"]
    assert params.top_p == 0.9 and params.top_k == 20


@pytest.mark.parametrize("r, rank", [(1, 1), (4, 8), (8, 8), (20, 32), (33, 64), (200, 256), (300, 320), (512, 512)])
def test_max_lora_rank_is_one_vllm_accepts(fake_vllm, tmp_path, r, rank):
    # The stand-in, like vLLM, refuses a max_lora_rank outside its set: r = 20 must ask for 32, not 20.
    VLLMEngine("/models/base", types.SimpleNamespace(eos_token_id=EOS), GRPOConfig(r=r), work_dir=tmp_path)
    assert fake_vllm.instances[-1].kwargs["max_lora_rank"] == rank


def test_a_lora_rank_above_vllms_largest_names_the_field(fake_vllm, tmp_path):
    with pytest.raises(ValueError, match=r"config.r = 600"):
        VLLMEngine("/models/base", types.SimpleNamespace(eos_token_id=EOS), GRPOConfig(r=600), work_dir=tmp_path)


def test_a_turn_never_asks_for_more_than_max_model_len(fake_vllm, tmp_path):
    engine = VLLMEngine("/models/base", types.SimpleNamespace(eos_token_id=EOS), GRPOConfig(max_seq_len=10),
                        work_dir=tmp_path)
    engine.generate([[1] * 4, [1] * 9, [1] * 2], max_new_tokens=8, temperature=1.0)
    # What is left of max_model_len, or max_new_tokens when that fits (vLLM refuses a request past the limit).
    assert [p.max_tokens for p in fake_vllm.instances[-1].calls[-1]["params"]] == [6, 1, 8]
    with pytest.raises(PromptTooLong) as exc:  # no room for a single token
        engine.generate([[1] * 3, [1] * 10], max_new_tokens=8, temperature=1.0)
    assert exc.value.index == 1 and "10 tokens" in str(exc.value) and "max_seq_len" in str(exc.value)


def test_a_prompt_longer_than_max_model_len_is_an_error_event_naming_the_task(fake_vllm, tiny_model, job_dir):
    from trainer.config import read_jsonl
    from trainer.runner import JobFailed

    config = GRPOConfig(rollout_engine="vllm", max_seq_len=12, num_prompts_per_step=2, num_generations_per_prompt=2,
                        max_steps=1, eval_on_start=False, r=4, alpha=8, num_threads=1)
    events = EventLog(None)
    spec = JobSpec(model=str(tiny_model), job_dir=job_dir, train=job_dir / "train.jsonl", config=config, mlflow=False)
    with pytest.raises(JobFailed):
        train_grpo(spec, events)
    error = events.events[-1]
    assert error["event"] == "error" and error["step"] == 1
    named = re.search(r"task '([^']+)': its prompt is (\d+) tokens", error["message"])
    assert named, error["message"]
    assert named.group(1) in {row["id"] for row in read_jsonl(job_dir / "train.jsonl")}
    assert int(named.group(2)) >= 12 and "max_seq_len" in error["message"]


def test_vllm_sleeps_through_each_update(fake_vllm, tiny_model, job_dir, monkeypatch):
    """enable_sleep_mode: vLLM's GPU memory is free while the trainer computes its update (sleep level 1,
    the weights kept in CPU memory), and the engine is awake again for the next rollout."""
    import trainer.loop

    states = []
    real = trainer.loop.optimize

    def spy(run, episodes, rewards):
        states.append(run.engine.llm.asleep)
        return real(run, episodes, rewards)

    monkeypatch.setattr(trainer.loop, "optimize", spy)
    tokenizer = load_tokenizer(tiny_model)
    monkeypatch.setattr(fake_vllm, "script", [([5, 6, tokenizer.eos_token_id], "stop"), ([7, 8], "length")])
    config = GRPOConfig(rollout_engine="vllm", num_prompts_per_step=2, num_generations_per_prompt=2, max_steps=2,
                        max_new_tokens=8, eval_on_start=False, eval_interval=10, r=4, alpha=8, num_threads=1,
                        learning_rate=1e-2)
    events = EventLog(None)
    spec = JobSpec(model=str(tiny_model), job_dir=job_dir, train=job_dir / "train.jsonl", config=config, mlflow=False)
    counter = itertools.count()
    train_grpo(spec, events, reward_fn=lambda ep: float(next(counter) % 2))
    llm = fake_vllm.instances[-1]
    assert llm.kwargs["enable_sleep_mode"] is True
    assert states == [True, True]  # asleep during both updates
    # Each step: rollouts, sleep, update; step 2's first generate wakes it (no holdout: no eval after).
    first_sleep = llm.log.index("sleep1")
    assert set(llm.log[:first_sleep]) == {"generate"}
    assert llm.log[first_sleep + 1] == "wake_up" and llm.log[first_sleep + 2] == "generate"
    assert llm.log[-1] == "sleep1" and llm.log.count("sleep1") == 2 and llm.log.count("wake_up") == 1
    steps = [e for e in events.events if e["event"] == "step"]
    assert len(steps) == 2 and all(s["grad_norm"] > 0 for s in steps)


def test_older_vllm_without_sleep_mode_keeps_its_memory_and_runs(fake_vllm, tmp_path):
    fake_vllm.unknown_args = ("enable_sleep_mode",)  # reset by the fixture
    engine = VLLMEngine("/models/base", types.SimpleNamespace(eos_token_id=EOS), GRPOConfig(), work_dir=tmp_path)
    llm = fake_vllm.instances[-1]
    assert engine.sleep_mode is False and "enable_sleep_mode" not in llm.kwargs
    engine.sleep()  # nothing to free: vllm_gpu_memory_utilization is what it keeps
    assert engine.generate([[1]], max_new_tokens=3, temperature=1.0)[0].token_ids == [5, 6, EOS]
    assert "sleep1" not in llm.log


def test_older_vllm_refuses_to_train_off_policy_without_a_word(fake_vllm, tmp_path):
    """Without logprobs_mode vLLM returns pre-temperature logprobs: at T != 1 the importance-sampling
    correction cannot be computed, so a job that asks for it fails at the start instead of running without it."""
    fake_vllm.unknown_args = ("logprobs_mode",)  # reset by the fixture
    tok = types.SimpleNamespace(eos_token_id=EOS)
    with pytest.raises(ValueError, match="importance_sampling_correction") as exc:
        VLLMEngine("/models/base", tok, GRPOConfig(temperature=0.7), work_dir=tmp_path)
    assert "upgrade vLLM" in str(exc.value)

    with pytest.raises(ValueError, match="importance_sampling_correction"):  # raw logprobs are not top-p's
        VLLMEngine("/models/base", tok, GRPOConfig(top_p=0.9), work_dir=tmp_path)

    # At T = 1 raw logprobs are the sampler's: the correction stays on.
    engine = VLLMEngine("/models/base", tok, GRPOConfig(temperature=1.0), work_dir=tmp_path)
    assert engine.raw_logprobs is True and "logprobs_mode" not in fake_vllm.instances[-1].kwargs
    assert engine.generate([[1]], max_new_tokens=3, temperature=1.0)[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    # The user turned the correction off: T = 0.7 trains, and no made-up logprobs come back.
    engine = VLLMEngine("/models/base", tok, GRPOConfig(temperature=0.7, importance_sampling_correction=False),
                        work_dir=tmp_path)
    assert all(g.logprobs is None for g in engine.generate([[1]], max_new_tokens=3, temperature=0.7))


def test_evaluate_with_vllm_loads_no_hf_model_and_keeps_its_scratch_out_of_the_users_folders(
        fake_vllm, tiny_model, workplace_tasks, tmp_path, monkeypatch):
    import trainer.models
    from trainer.cli import cmd_evaluate
    from trainer.models import load_model

    base, _ = load_model(tiny_model, device="cpu")
    adapter = tmp_path / "adapter"
    attach_lora(base, GRPOConfig(r=20, alpha=8)).save_pretrained(str(adapter))
    write_jsonl(tmp_path / "suite.jsonl", workplace_tasks["holdout"][:2])
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(fake_vllm, "script", [([EOS], "stop")])

    loaded = []

    class NoHFModel:  # vLLM holds the model: a transformers copy would take GPU memory for nothing
        @staticmethod
        def from_pretrained(*args, **kwargs):
            loaded.append(args)
            raise AssertionError("evaluate --engine vllm loaded the model into transformers")

    monkeypatch.setattr(trainer.models, "AutoModelForCausalLM", NoHFModel)
    args = argparse.Namespace(model=str(tiny_model), adapter=str(adapter), suite=str(tmp_path / "suite.jsonl"),
                              samples=2, temperature=0.7, max_new_tokens=8, max_turns=None, max_seq_len=2048, engine="vllm", seed=0,
                              out=None)
    events = EventLog(None)
    assert cmd_evaluate(args, events) == 0
    assert loaded == []
    llm = fake_vllm.instances[-1]
    assert llm.kwargs["max_lora_rank"] == 32  # the adapter's r = 20, rounded up to a rank vLLM takes
    assert {c["lora_request"].lora_path for c in llm.calls} == {str(adapter.resolve())}
    assert events.events[-1]["event"] == "done" and events.events[-1]["metrics"]["n"] == 4
    # No rollout_adapters folder in the working directory, nor in its parent.
    assert not list((tmp_path / "work").rglob("rollout_adapters"))
