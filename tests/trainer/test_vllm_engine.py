"""The vLLM engine's own logic, with a stand-in `vllm` module (vLLM needs a GPU and is not installed here):
one LoRARequest (new id, new folder) per policy version, old adapter folders rotated out, an unchanged policy
not saved again, and vLLM's per-token logprob dicts turned into our rollout format."""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.config import GRPOConfig, write_jsonl
from trainer.models import attach_lora
from trainer.rollout import make_engine
from trainer.rollout.vllm import VLLMEngine

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


class FakeLLM:
    """Answers prompt i with `script[i % len(script)]`: (token ids, finish reason)."""

    instances: list[FakeLLM] = []
    reject_logprobs_mode = False  # True: behave like a vLLM older than `logprobs_mode`
    script: list[tuple[list[int], str]] = [([5, 6, EOS], "stop"), ([7, 8, 9], "length")]

    def __init__(self, **kwargs):
        if self.reject_logprobs_mode and "logprobs_mode" in kwargs:
            raise TypeError("LLM.__init__() got an unexpected keyword argument 'logprobs_mode'")
        self.kwargs = kwargs
        self.calls: list[dict] = []
        FakeLLM.instances.append(self)

    def generate(self, inputs, params, lora_request=None, use_tqdm=True):
        self.calls.append({"inputs": inputs, "params": params, "lora_request": lora_request})
        outs = []
        for i, inp in enumerate(inputs):
            ids, reason = self.script[i % len(self.script)]
            # The sampled token's logprob plus a runner-up, as vLLM returns when the sample is not the top token.
            lps = [{t: Logprob(-0.1 * (k + 1), rank=2), 99: Logprob(-0.01, rank=1)} for k, t in enumerate(ids)]
            outs.append(RequestOutput(str(i), inp["prompt_token_ids"], [
                CompletionOutput(0, "", tuple(ids), None, lps if params.logprobs is not None else None, reason)]))
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
    monkeypatch.setattr(FakeLLM, "reject_logprobs_mode", False)
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
    assert llm.kwargs["max_lora_rank"] >= 4 and llm.kwargs["max_model_len"] == 512
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
    assert params.max_tokens == 3 and params.temperature == 0.7 and params.logprobs == 0
    assert params.stop_token_ids == [EOS]
    assert fake_vllm.instances[0].calls[0]["inputs"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert [g.token_ids for g in gens] == [[5, 6, EOS], [7, 8, 9]]
    assert [g.finished for g in gens] == [True, False]  # "length": cut at max_new_tokens
    # The sampled token's logprob, not the top-ranked one's.
    assert gens[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert engine.generate([], max_new_tokens=3, temperature=1.0) == []


def test_older_vllm_raw_logprobs_are_not_used_at_other_temperatures(fake_vllm, tmp_path):
    fake_vllm.reject_logprobs_mode = True  # reset by the fixture
    engine = VLLMEngine("/models/base", types.SimpleNamespace(eos_token_id=EOS), GRPOConfig(), work_dir=tmp_path)
    assert engine.raw_logprobs is True and "logprobs_mode" not in fake_vllm.instances[-1].kwargs
    # Raw logprobs are pre-temperature: at T=0.7 they are not the sampler's, so no IS correction from them.
    assert all(g.logprobs is None for g in engine.generate([[1]], max_new_tokens=3, temperature=0.7))
    assert engine.generate([[1]], max_new_tokens=3, temperature=1.0)[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])


def test_evaluate_with_vllm_keeps_its_scratch_out_of_the_users_folders(fake_vllm, tiny_model, workplace_tasks,
                                                                        tmp_path, monkeypatch):
    from trainer.cli import cmd_evaluate
    from trainer.models import load_model
    from trainer.tracking import EventLog

    base, _ = load_model(tiny_model, device="cpu")
    adapter = tmp_path / "adapter"
    attach_lora(base, GRPOConfig(r=4, alpha=8)).save_pretrained(str(adapter))
    write_jsonl(tmp_path / "suite.jsonl", workplace_tasks["holdout"][:2])
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(fake_vllm, "script", [([EOS], "stop")])
    args = argparse.Namespace(model=str(tiny_model), adapter=str(adapter), suite=str(tmp_path / "suite.jsonl"),
                              samples=2, temperature=1.0, max_new_tokens=8, max_turns=None, engine="vllm", seed=0,
                              out=None)
    events = EventLog(None)
    assert cmd_evaluate(args, events) == 0
    llm = fake_vllm.instances[-1]
    assert llm.kwargs["max_lora_rank"] >= 4
    assert {c["lora_request"].lora_path for c in llm.calls} == {str(adapter.resolve())}
    assert events.events[-1]["event"] == "done" and events.events[-1]["metrics"]["n"] == 4
    # No rollout_adapters folder in the working directory, nor in its parent.
    assert not list((tmp_path / "work").rglob("rollout_adapters"))
