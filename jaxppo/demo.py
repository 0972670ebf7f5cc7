"""The embedded demo: a tiny byte-level policy, built-in prompts and a reward that needs
no download. It runs on a CPU in a few minutes and the score visibly rises.

The policy is a randomly initialised GPT-2-layout transformer over transformers'
`ByT5Tokenizer` vocabulary (bytes; the tokenizer needs no files). The reward is the
number of lowercase ASCII letters in the response (a random policy scores about 1 in 16
tokens); the KL penalty to the reference (the
initial policy) keeps it from collapsing onto one token at no cost.
"""

from __future__ import annotations

import jax

from jaxppo.algorithms import ESTIMATORS, REGISTRY
from jaxppo.models.config import ModelConfig
from jaxppo.models.model import Model

__all__ = ["DEMO_PROMPTS", "demo_tokenizer", "demo_policy", "lowercase_reward", "DEMO_PPO", "DEMO_TRAINER",
           "sum_pairs", "sums_rows", "parse_answer", "sums_reward", "DEMO_SUMS_PPO", "DEMO_SUMS_TRAINER",
           "DEMO_ALGORITHM"]

DEMO_PROMPTS = [
    "Once upon a time", "The weather today is", "My favourite food is", "In the morning I",
    "The best way to learn is", "A good friend is", "The city at night", "When I was young",
    "The ocean is", "Music makes me", "Tomorrow we will", "The old house",
    "Write a poem about cats:", "Describe a forest:", "What is your name?", "Tell me a story.",
    "How do birds fly?", "Why is the sky blue?", "List three colours:", "The train leaves at",
    "Dear diary,", "Breaking news:", "Recipe for soup:", "The meaning of life is",
    "Hello!", "Summarise the book:", "A short joke:", "The mountain was",
    "Rain on the window", "The last page said", "Under the bridge", "Far away there is",
]

# Demo defaults; every one can be overridden on the command line.
DEMO_PPO = dict(batch_size=64, mini_batch_size=16, ppo_epochs=4, kl_coef=0.3, cliprange=0.2, vf_coef=0.1)
DEMO_TRAINER = dict(iterations=80, query_length=32, response_length=16, learning_rate=1e-3,
                    critic_learning_rate=3e-3, max_grad_norm=1.0, sample_every=20, output_dir="runs/demo")


# The demo's settings per critic-free algorithm, over that algorithm's own defaults: the
# same 64 completions per iteration (8 prompts x 8), no critic learning rate to set.
DEMO_ALGORITHM = {name: dict(critic_learning_rate=None) for name, algorithm in REGISTRY.items()
                  if not ESTIMATORS[algorithm.estimator].uses_critic}


def demo_tokenizer():
    import transformers

    return transformers.ByT5Tokenizer()


def demo_policy(tokenizer, seed: int = 0, width: int = 64, layers: int = 2, max_len: int = 64):
    """(Model, params): a random GPT-2-layout causal LM over the tokenizer's vocabulary."""
    config = ModelConfig(model_type="gpt2", vocab_size=len(tokenizer), hidden_size=width, num_layers=layers,
                         num_heads=4, num_kv_heads=4, intermediate_size=4 * width, max_position_embeddings=max_len,
                         eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    model = Model(config)
    return model, model.init(jax.random.key(seed + 12345))


def lowercase_reward(prompts, responses):
    """Number of lowercase ASCII letters in each response."""
    return [float(sum(c.isascii() and c.islower() for c in text)) for text in responses]


# ---------------------------------------------------------------- the multi-turn demo

# Each prompt hides a digit (its `target` column); the policy guesses, the environment
# answers "higher" or "lower", and a right guess ends the episode.
MULTITURN_PROMPTS = [f"Guess my digit #{i}:" for i in range(40)]
MULTITURN_TARGETS = [(7 * i + 3) % 10 for i in range(40)]
DEMO_MULTITURN = dict(query_length=24, response_length=40, turn_length=3, max_turns=4, output_dir="runs/demo_multiturn")


class GuessTheDigit:
    """The multi-turn demo's environment: the policy has `max_turns` turns to name a
    hidden digit. A turn's first digit is its guess. Rewards: 1 for the right digit (the
    episode ends), 0.1 for a wrong one (the reply says " higher:" or " lower:"), 0 for a
    turn without a digit (the reply says " a digit:")."""

    def reset(self, prompt, target):
        self.target = int(target)

    def step(self, completion: str):
        from jaxppo.rollout.environments import StepResult

        guess = next((int(c) for c in completion if c in "0123456789"), None)
        if guess is None:
            return StepResult(" a digit:", 0.0, False)
        if guess == self.target:
            return StepResult(None, 1.0, True)
        return StepResult(" higher:" if guess < self.target else " lower:", 0.1, False)


def multiturn_prompts():
    """The multi-turn demo's prompt rows: {"prompt", "target"}."""
    return [{"prompt": p, "target": t} for p, t in zip(MULTITURN_PROMPTS, MULTITURN_TARGETS)]


# ---------------------------------------------------------------- the sums demo (a real model)

# SmolLM2-135M-Instruct (`jaxppo-fixture` prepares it) learns two-number sums with GRPO.
# Operands 1..50; the held-out sums are unordered pairs never trained on (neither a + b nor
# b + a is a training prompt), scored greedily before and after training.
SUMS_OPERANDS = (1, 50)
SUMS_HELD_OUT = 64
DEMO_SUMS_PPO = dict(batch_size=32, mini_batch_size=16, ppo_epochs=1, num_generations=8, kl_loss_coef=0.0)
# The held-out sums are the run's eval prompts: greedy answers before training, every 10
# iterations, and of the final policy (final_eval.json).
DEMO_SUMS_TRAINER = dict(iterations=30, query_length=64, response_length=16, learning_rate=1e-5, sample_every=10,
                         output_dir="runs/demo_sums", eval_every=10, eval_temperature=0.0)


def sum_pairs(seed: int = 0):
    """(training pairs, held-out pairs) of operands in `SUMS_OPERANDS`, each a list of
    (a, b): `SUMS_HELD_OUT` unordered pairs are held out, and no training pair is one of
    them in either order."""
    import numpy as np

    lo, hi = SUMS_OPERANDS
    unordered = [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1)]
    order = np.random.default_rng(seed).permutation(len(unordered))
    held = {unordered[i] for i in order[:SUMS_HELD_OUT]}
    train = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1) if (min(a, b), max(a, b)) not in held]
    return train, [unordered[i] for i in order[:SUMS_HELD_OUT]]


def sums_rows(pairs):
    """Prompt rows {"prompt": chat messages, "answer": a + b} for the trainer."""
    return [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b} for a, b in pairs]


def parse_answer(text: str):
    """The answer a completion gives: its last integer ("13 + 29 = 42" gives 42, "The sum is
    42." gives 42; thousands separators are not read), or None if it has none."""
    import re

    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def sums_reward(prompts, completions, answer):
    """1 where the completion's answer (`parse_answer`) is the sum, else 0."""
    return [float(parse_answer(c) == int(a)) for c, a in zip(completions, answer)]
