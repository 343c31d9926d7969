"""Each loss variant against a hand computation on a 2-sequence batch, and the group advantages."""

import math

import pytest
import torch

from trainer.losses import group_advantages, kl_k3, policy_loss, zero_variance_groups

# Two sequences, three completion positions; the second has only two real tokens.
LOGP = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]])
OLD = torch.tensor([[-1.2, -0.5, -1.0], [-0.6, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -0.5])
EPS, EPS_HI = 0.2, 0.28


def token_term(lp: float, old: float, a: float, hi: float = EPS) -> float:
    r = math.exp(lp - old)
    return -min(r * a, max(min(r, 1 + hi), 1 - EPS) * a)


def terms(hi: float = EPS) -> list[list[float]]:
    return [[token_term(LOGP[i, t].item(), OLD[i, t].item(), ADV[i].item(), hi) for t in range(3)] for i in range(2)]


def test_grpo_is_mean_per_sequence_then_over_sequences():
    t = terms()
    expected = ((t[0][0] + t[0][1] + t[0][2]) / 3 + (t[1][0] + t[1][1]) / 2) / 2
    loss, metrics = policy_loss(LOGP, OLD, ADV, MASK, loss_type="grpo", epsilon=EPS)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # Clipped: seq 0 tok 0 (ratio e^0.2 = 1.22 > 1.2, A>0) and seq 1 tok 1 (e^-0.5 = 0.61 < 0.8, A<0);
    # seq 1 tok 0 has ratio 1.49 but A<0, so the unclipped term is the min and the clip is inactive.
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)


def test_dapo_is_token_level_with_clip_higher():
    t = terms(hi=EPS_HI)
    expected = (sum(t[0]) + t[1][0] + t[1][1]) / 5
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_type="dapo", epsilon=EPS, epsilon_high=EPS_HI)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # clip-higher changes the first token: ratio 1.22 is inside [0.8, 1.28], so it is not clipped.
    assert t[0][0] == pytest.approx(-math.exp(0.2) * 1.0)


def test_dr_grpo_divides_by_a_constant():
    t = terms()
    expected = (sum(t[0]) + t[1][0] + t[1][1]) / (2 * 8)
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_type="dr_grpo", epsilon=EPS, max_completion_length=8)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_gspo_uses_one_sequence_level_ratio():
    s0 = math.exp(((-1.0 + 1.2) + 0.0 + (-2.0 + 1.0)) / 3)  # exp(mean log-ratio) = exp(-0.8/3)
    s1 = math.exp(((-0.2 + 0.6) + (-1.5 + 1.0)) / 2)  # exp(-0.05)
    eps = 0.1

    def seq(s: float, a: float) -> float:
        return -min(s * a, max(min(s, 1 + eps), 1 - eps) * a)

    expected = (seq(s0, 1.0) + seq(s1, -0.5)) / 2
    loss, metrics = policy_loss(LOGP, OLD, ADV, MASK, loss_type="gspo", epsilon=eps)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.0)  # s0 = 0.77 < 0.9 but A > 0: the min keeps it


def test_kl_term_and_gradient_flow():
    ref = torch.tensor([[-1.1, -0.4, -1.8], [-0.3, -1.2, -5.0]])
    logp = LOGP.clone().requires_grad_(True)
    beta = 0.1
    loss, metrics = policy_loss(logp, OLD, ADV, MASK, loss_type="dapo", epsilon=EPS, beta=beta, ref_logp=ref)
    t = terms()
    k = [[math.exp(ref[i, j].item() - LOGP[i, j].item()) - (ref[i, j].item() - LOGP[i, j].item()) - 1
          for j in range(3)] for i in range(2)]
    expected = (sum(t[0][j] + beta * k[0][j] for j in range(3)) + sum(t[1][j] + beta * k[1][j] for j in range(2))) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["kl"] == pytest.approx((sum(k[0]) + k[1][0] + k[1][1]) / 5, rel=1e-6)
    loss.backward()
    assert logp.grad[1, 2].item() == 0.0  # a masked token (observation or padding) gets no gradient
    assert (kl_k3(LOGP, LOGP) == 0).all()


def test_micro_batches_sum_to_the_full_batch():
    for loss_type in ("grpo", "dr_grpo", "dapo", "gspo"):
        kw = dict(loss_type=loss_type, epsilon=EPS, max_completion_length=4)
        full, _ = policy_loss(LOGP, OLD, ADV, MASK, **kw)
        parts = [policy_loss(LOGP[i:i + 1], OLD[i:i + 1], ADV[i:i + 1], MASK[i:i + 1], num_sequences=2,
                             num_tokens=5.0, **kw)[0] for i in range(2)]
        assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-6), loss_type


def test_importance_weights_scale_token_terms():
    w = torch.full_like(LOGP, 0.5)
    base, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_type="dapo")
    weighted, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_type="dapo", is_weights=w)
    assert weighted.item() == pytest.approx(0.5 * base.item())


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    std0 = math.sqrt((0.25 * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    adv = group_advantages(rewards, 4, "group")
    a = 0.5 / (std0 + 1e-4)
    assert adv[:4].tolist() == pytest.approx([a, -a, -a, a])
    assert adv[4:].tolist() == [0.0] * 4  # an all-equal group has no signal
    none = group_advantages(rewards, 4, "none")
    assert none.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    batch = group_advantages(rewards, 4, "batch")
    assert batch.tolist() == pytest.approx((none / (rewards.std() + 1e-4)).tolist())
    assert zero_variance_groups(rewards, 4).tolist() == [False, True]
    with pytest.raises(ValueError):
        group_advantages(rewards, 4, "global")


def test_gspo_with_importance_sampling_weights_each_sequence_by_its_mean_token_weight():
    """Truncated IS under GSPO: a sequence's clipped term times the mean of its tokens' IS weights (padding and
    observations excluded), as TRL's token-weighted loss averaged per sequence; a weight of 0 removes the
    sequence from the gradient."""
    w = torch.tensor([[0.5, 2.0, 1.0], [1.5, 0.25, 9.0]])  # 9.0 sits on a masked position: it must not count
    s0 = math.exp(((-1.0 + 1.2) + 0.0 + (-2.0 + 1.0)) / 3)
    s1 = math.exp(((-0.2 + 0.6) + (-1.5 + 1.0)) / 2)
    eps = 0.1

    def seq(s: float, a: float) -> float:
        return -min(s * a, max(min(s, 1 + eps), 1 - eps) * a)

    expected = (seq(s0, 1.0) * (0.5 + 2.0 + 1.0) / 3 + seq(s1, -0.5) * (1.5 + 0.25) / 2) / 2
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, OLD, ADV, MASK, loss_type="gspo", epsilon=eps, is_weights=w)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    unweighted, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_type="gspo", epsilon=eps)
    assert abs(loss.item() - unweighted.item()) > 1e-3  # the weights did something

    # d loss / d logp[0, t] = -A0 * s0 * mean(w0) / (3 * 2) on each real token (s0 is unclipped: A0 > 0, s0 < 1).
    loss.backward()
    grad0 = -1.0 * s0 * (3.5 / 3) / 3 / 2
    assert logp.grad[0].tolist() == pytest.approx([grad0] * 3, rel=1e-5)

    zero = w.clone()
    zero[1] = 0.0
    logp = LOGP.clone().requires_grad_(True)
    policy_loss(logp, OLD, ADV, MASK, loss_type="gspo", epsilon=eps, is_weights=zero)[0].backward()
    assert logp.grad[1].abs().sum().item() == 0.0 and logp.grad[0].abs().sum().item() > 0
