"""The sampler, the scorer and the GRPO update on the tiny model, on the CPU."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from agl_stream.training.batching import TrainSample
from agl_stream.training.device import Placement, place
from agl_stream.training.grpo import GRPO, GRPOConfig, clipped_loss, micro_batches
from agl_stream.training.model import content_hash, load_policy, save_policy, tiny_policy
from agl_stream.training.sampling import (
    sample,
    token_batch,
    token_logprobs,
    token_logprobs_and_entropy,
)


@pytest.fixture(scope="module")
def policy():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return tiny_policy(seed=0)


def test_recorded_logprobs_are_what_the_trainer_recomputes(policy) -> None:  # type: ignore[no-untyped-def]
    policy.model.eval()
    prompt = [1, 6]
    completion = sample(policy.model, prompt, 4, generator=torch.Generator().manual_seed(3))
    batch = token_batch([prompt], [completion.token_ids], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(policy.model, batch)
    recomputed = logp[0][batch.response_mask[0].bool()].tolist()
    assert recomputed == pytest.approx(completion.logprobs, abs=1e-4)


def test_clipped_loss_stops_pushing_past_the_clip() -> None:
    mask = torch.ones(1, 1)
    adv, weights = torch.tensor([1.0]), torch.tensor([1.0])
    far = torch.tensor([[0.5]], requires_grad=True)  # ratio e^0.5 = 1.65 > 1.2
    loss, clipped = clipped_loss(far, torch.zeros(1, 1), adv, weights, mask, 0.2)
    loss.backward()
    assert far.grad is not None and far.grad.item() == 0.0 and clipped.item() == 1.0
    near = torch.tensor([[0.0]], requires_grad=True)
    loss, clipped = clipped_loss(near, torch.zeros(1, 1), adv, weights, mask, 0.2)
    loss.backward()
    assert near.grad is not None and near.grad.item() < 0 and clipped.item() == 0.0


def test_an_update_makes_the_better_answer_more_likely() -> None:
    policy = tiny_policy(seed=1)
    prompt, good, bad = (1, 6), (6, 6), (4, 5)
    batch = token_batch([prompt, prompt], [good, bad], pad_id=0)

    def logp_of_good() -> float:
        with torch.no_grad():
            lp = token_logprobs(policy.model, batch)
        return float((lp[0] * batch.response_mask[0]).sum())

    before = logp_of_good()
    grpo = GRPO(policy.model, 0, GRPOConfig(learning_rate=1e-2, epochs=3))
    samples = [
        TrainSample(("r", "a"), prompt, good, 1.0, 1.0, 1.0, None),
        TrainSample(("r", "b"), prompt, bad, 0.0, -1.0, 1.0, None),
    ]
    stats = grpo.update(samples)
    assert logp_of_good() > before
    assert stats.tokens == 4 and stats.loss == stats.loss  # finite


def test_checkpoint_round_trip_and_hash(policy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    save_policy(policy, tmp_path / "a")
    again = load_policy(tmp_path / "a")
    for p, q in zip(policy.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert again.tokenizer.convert_ids_to_tokens([4, 5]) == ["a", "b"]
    save_policy(again, tmp_path / "b")
    assert content_hash(tmp_path / "a") == content_hash(tmp_path / "b")
    with pytest.raises(ValueError, match="not a model checkpoint"):
        load_policy(tmp_path / "missing")


def test_bad_settings_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="learning_rate"):
        GRPOConfig(learning_rate=0)
    with pytest.raises(ValueError, match="clip_epsilon"):
        GRPOConfig(clip_epsilon=1.5)
    with pytest.raises(ValueError, match="entropy_coef"):
        GRPOConfig(entropy_coef=-0.1)


def test_the_entropy_bonus_spreads_a_policy_that_has_nothing_else_to_learn() -> None:
    """With every advantage 0, the surrogate gives no gradient: the bonus alone moves the
    policy, towards a flatter next-token distribution at the response's positions."""
    prompt, answer = (1, 6), (6,)
    batch = token_batch([prompt], [answer], pad_id=0)

    def spread(policy) -> float:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            _, entropy = token_logprobs_and_entropy(policy.model, batch)
        assert entropy is not None
        return float((entropy * batch.response_mask).sum())

    samples = [TrainSample(("r", "a"), prompt, answer, 0.5, 0.0, 1.0, None)] * 4
    found = {}
    for coef in (0.0, 0.5):
        policy = tiny_policy(seed=1)
        before = spread(policy)
        GRPO(policy.model, 0, GRPOConfig(learning_rate=1e-2, epochs=3, entropy_coef=coef)).update(
            samples
        )
        found[coef] = spread(policy) - before
    # Without the bonus only AdamW's weight decay moves the weights (a trace of a change).
    assert abs(found[0.0]) < 1e-3 and found[0.5] > 0.02, found


def _varied_samples(count: int, seed: int) -> list[TrainSample]:
    """Prompts and responses of different lengths, advantages of both signs, two weights."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = (1, *(rng.randint(4, 8) for _ in range(rng.randint(1, 5))))
        response = tuple(rng.randint(4, 8) for _ in range(rng.randint(1, 6)))
        reward, advantage, weight = rng.random(), rng.uniform(-1, 1), rng.choice((1.0, 0.5))
        samples.append(
            TrainSample(("r", str(i)), prompt, response, reward, advantage, weight, None)
        )
    return samples


def _gradients(config: GRPOConfig, samples: list[TrainSample]) -> tuple[float, list[torch.Tensor]]:
    """The loss of one optimiser step on all `samples` and the gradients it stepped with
    (left on the parameters: zeroed at the start of a step, not after)."""
    policy = tiny_policy(seed=2)
    stats = GRPO(policy.model, 0, config).update(samples)
    grads = [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]
    assert grads
    return stats.loss, grads


@pytest.mark.parametrize(
    ("budget", "checkpointing"), [(1, False), (12, False), (30, False), (20, True)]
)
def test_micro_batches_give_the_update_of_the_whole_batch(budget: int, checkpointing: bool) -> None:
    """Split into micro-batches under a token budget (budget 1: one sequence a pass), with
    or without gradient checkpointing, a mini-batch's loss and the gradients of its
    optimiser step are those of the mini-batch in one pass."""
    samples = _varied_samples(12, seed=4)
    whole_loss, whole = _gradients(GRPOConfig(epochs=1, minibatch_size=12), samples)
    split = GRPOConfig(
        epochs=1, minibatch_size=12, micro_batch_tokens=budget, gradient_checkpointing=checkpointing
    )
    loss, grads = _gradients(split, samples)
    assert loss == pytest.approx(whole_loss, abs=1e-6)
    for expected, got in zip(whole, grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)


def test_micro_batches_stay_under_the_budget() -> None:
    lengths = [3, 9, 4, 4, 12, 1, 7]
    groups = micro_batches(lengths, 12)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        width = max(lengths[i] for i in group)
        assert len(group) * width <= 12 or len(group) == 1
    assert micro_batches(lengths, None) == [list(range(len(lengths)))]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        GRPOConfig(micro_batch_tokens=0)


def test_an_update_in_bfloat16_on_the_cpu() -> None:
    """--dtype bfloat16: weights, update and recorded logprobs in bfloat16 (the scores are
    computed in float32)."""
    policy = tiny_policy(seed=1)
    place(policy.model, Placement("cpu", "bfloat16"))
    before = [p.detach().clone() for p in policy.model.parameters()]
    stats = GRPO(policy.model, 0, GRPOConfig(learning_rate=1e-2)).update(_varied_samples(8, 1))
    assert math.isfinite(stats.loss)
    assert all(p.dtype == torch.bfloat16 for p in policy.model.parameters())
    assert any(
        not torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True)
    )
    completion = sample(policy.model.eval(), [1, 6], 3, generator=torch.Generator().manual_seed(0))
    assert len(completion.logprobs) == len(completion.token_ids) > 0
