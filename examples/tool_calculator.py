"""Tool use: a tiny policy learns to answer sums by calling a calculator.

    python examples/tool_calculator.py             # about half a minute on a laptop CPU

Everything is local: a word-level tokenizer with a Qwen-style chat template (built here),
a random two-layer policy, questions "What is a + b ?" for digits a and b. The policy
sees the `calculator` tool through the template (`Trainer(tools=[calculator])`); a turn
holding `<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>`
gets the result back as a "tool" message, and a turn without a call is the final answer,
scored by exact match.

A random policy never writes a well-formed call, so, as tool-use RL usually does, the run
starts from a short supervised warm start on demonstrations (the call, the tool's reply,
the answer) for half of the questions. Then GRPO trains on all of them: the exact-match
reward rises on the questions the warm start never showed (it prints both halves).
"""

import argparse
import ast
import operator

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxppo
from jaxppo.models.config import ModelConfig
from jaxppo.models.model import Model
from jaxppo.rollout.environments import chat_continuation

CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
TEMPLATE = ("{% if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
            "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: the expression, e.g. "3 + 4"
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers with +, - and *")

    return str(value(ast.parse(expression.strip(), mode="eval").body))


def calculator_tokenizer():
    """A word-level tokenizer (built here, no files) whose two added tokens hold a call's
    fixed JSON, so that a call is five tokens: open, a, +, b, close."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    words = ["What", "is", "?", "+", "-", "*", "user", "assistant", "tool", "system", "tools:", "calculator", "error:"]
    vocab = {w: i for i, w in enumerate(specials + words + [str(n) for n in range(19)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (CALL_OPEN, CALL_CLOSE)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|im_end|>")
    tok.chat_template = TEMPLATE
    return tok


def exact_match(prompts, completions, answer):
    """1 when the final turn (after the last tool reply, else the whole completion) says
    exactly the answer, else 0."""
    finals = [c.rsplit("assistant", 1)[-1].split() for c in completions]
    return [float(f == [str(a)]) for f, a in zip(finals, answer)]


def questions():
    """All 100 questions, as chat prompts with their answers; the warm start's half first."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    order = np.random.default_rng(0).permutation(len(pairs))
    return [{"prompt": [{"role": "user", "content": f"What is {a} + {b} ?"}], "answer": a + b}
            for a, b in (pairs[i] for i in order)]


def warm_start(model, params, tok, rows, tools, steps, length):
    """Supervised steps on demonstration conversations (loss on the policy's tokens)."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    seqs, targets = [], []
    for row in rows:
        a, b = row["prompt"][0]["content"].split()[2:5:2]
        prompt = tok(tok.apply_chat_template(row["prompt"], tools=tools, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids
        call = tok(f"{CALL_OPEN} {a} + {b} {CALL_CLOSE}", add_special_tokens=False).input_ids + [end]
        reply = tok(chat_continuation(tok, [{"role": "tool", "content": str(row["answer"])}], "<|im_end|>", tools),
                    add_special_tokens=False).input_ids
        final = tok(str(row["answer"]), add_special_tokens=False).input_ids + [end]
        seqs.append(prompt + call + reply + final)
        targets.append([0] * len(prompt) + [1] * len(call) + [0] * len(reply) + [1] * len(final))
    ids = np.zeros((len(seqs), length), np.int32)
    mask, train = np.zeros_like(ids), np.zeros_like(ids)
    for i, (s, t) in enumerate(zip(seqs, targets)):
        ids[i, :len(s)], mask[i, :len(s)], train[i, :len(s)] = s, 1, t
    tx = optax.adam(3e-3)

    def loss(p):
        logits = model.apply(p, ids[:, :-1], mask[:, :-1])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(logp * train[:, 1:]) / jnp.sum(train[:, 1:])

    @jax.jit
    def step(p, opt):
        value, grads = jax.value_and_grad(loss)(p)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, value

    opt = tx.init(params)
    for _ in range(steps):
        params, opt, value = step(params, opt)
    return params, float(value)


def evaluate(trainer, rows, samples=8):
    """Sampled exact match on the first and second half of the questions (each asked
    `samples` times) and tool calls per episode, with the trainer's current policy."""
    from jaxppo.rollout.environments import EpisodeSetup, run_episodes
    from jaxppo.rollout.prompts import PromptBatch

    index = np.repeat(np.arange(len(rows)), samples)
    batch = PromptBatch(index, jnp.asarray(trainer.parts.table.ids[index]), jnp.asarray(trainer.parts.table.mask[index]))
    setup = EpisodeSetup(trainer.parts.environment, trainer.parts.table, trainer.tokenizer)
    episodes = run_episodes(setup, trainer.parts.spec, trainer.state.params, batch, jax.random.key(1), 0)
    scores = np.asarray(exact_match(None, episodes.conversations, [rows[i]["answer"] for i in index]))
    half = len(index) // 2
    return float(scores[:half].mean()), float(scores[half:].mean()), episodes.metrics["env/tool_calls"] / len(index)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warm-start-steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/tool_calculator")
    args = parser.parse_args(argv)
    tok = calculator_tokenizer()
    rows = questions()
    tools = [jaxppo.rollout.tools.tool_schema(calculator)]
    query, response = 24, 16
    config = ModelConfig(model_type="gpt2", vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=4, intermediate_size=256, max_position_embeddings=query + response,
                         eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    model = Model(config)
    params, sft_loss = warm_start(model, model.init(jax.random.key(0)), tok, rows[:50], tools, args.warm_start_steps,
                                  query + response)
    print(f"warm start: {args.warm_start_steps} supervised steps on 50 demonstrations (loss {sft_loss:.3f})")

    config = jaxppo.Config.for_algorithm(
        "grpo", batch_size=64, mini_batch_size=32, ppo_epochs=1, num_generations=8, kl_loss_coef=0.0,
        response_length=response, learning_rate=1e-3, data=jaxppo.DataConfig(query_length=query),
        environment=jaxppo.EnvironmentConfig(turn_length=8, max_turns=2),
        run=jaxppo.RunConfig(iterations=args.iterations, output_dir=args.output_dir, resume=False, sample_every=0,
                             export_final=False, plot=False, report_to="jsonl", progress=False))
    trainer = jaxppo.Trainer(config, policy=(model, params), tokenizer=tok, prompts=rows, reward_fns=[exact_match],
                             tools=[calculator])
    before = evaluate(trainer, rows)
    history = trainer.train()
    after = evaluate(trainer, rows)
    for name, (shown, unseen, calls) in (("after the warm start", before), ("after GRPO", after)):
        print(f"exact match {name}: {shown:.3f} on the 50 demonstrated questions, {unseen:.3f} on the 50 others; "
              f"{calls:.2f} tool calls per episode")
    return {"history": history, "before": before, "after": after}


if __name__ == "__main__":
    main()
