"""The tool layer (issue 19, item 3): schemas through the chat template, the Hermes/Qwen
call parser, calls with a timeout, every kind of bad call an error message and a count."""

import json
import time

import pytest

import jaxppo
from jaxppo import demo
from jaxppo.errors import ToolCallError
from jaxppo.rollout.environments import chat_continuation
from jaxppo.rollout.tools import ERROR_KINDS, ToolEnvironment, check_tools, parse_tool_calls


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the numerator
        b: the denominator
    """
    return a / b


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def undocumented(x):
    return x


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_parser_reads_hermes_blocks_and_refuses_malformed_ones():
    text = "Let me add. " + call("add", a=2, b=3) + "\n" + '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}</tool_call>'
    assert parse_tool_calls(text) == [("add", {"a": 2, "b": 3}), ("divide", {"a": 1, "b": 4})]
    assert parse_tool_calls("The answer is 5.") == []
    for bad, message in [("<tool_call>{\"name\": \"add\"", "not closed"), ("<tool_call>{add}</tool_call>", "not valid JSON"),
                         ('<tool_call>{"arguments": {}}</tool_call>', "must be"),
                         ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object")]:
        with pytest.raises(ToolCallError, match=message) as info:
            parse_tool_calls(bad)
        assert info.value.kind == "parse"


def test_each_bad_call_is_an_error_message_and_a_count_never_a_crash():
    env = ToolEnvironment([add, divide, slow], timeout=0.2)
    env.reset("q")
    cases = [
        (call("add", a=2, b=3), "5", None),
        (call("divide", a=1, b=4), "0.25", None),
        ("<tool_call>{oops}</tool_call>", "error: the tool call is not valid JSON", "parse"),
        (call("multiply", a=2, b=3), "error: unknown tool 'multiply'; tools: add, divide, slow", "unknown_tool"),
        (call("add", a=2), "error: wrong arguments for add", "bad_arguments"),
        (call("add", a="2", b=3), "error: argument 'a' of add must be a int", "bad_arguments"),
        (call("divide", a=1, b=0), "error: divide raised ZeroDivisionError", "raised"),
        (call("slow", seconds=5), "error: slow did not finish within 0.2 s", "timeout"),
    ]
    for text, content, kind in cases:
        result = env.step(text)
        assert not result.done and result.reward is None
        assert result.observation[0]["role"] == "tool" and result.observation[0]["content"].startswith(content), text
        for k in ERROR_KINDS:
            assert result.metrics[f"tool_errors/{k}"] == (1 if k == kind else 0), (text, k)
    final = env.step("The answer is 5.")
    assert final.done and final.observation is None and final.metrics["tool_calls"] == 0


def test_tool_schemas_checked_before_anything_compiles(tmp_path):
    schemas = check_tools([add, divide])
    assert schemas[0]["function"]["name"] == "add"
    assert schemas[0]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    with pytest.raises(ValueError, match="tool 'undocumented' cannot be described"):
        check_tools([undocumented])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        check_tools([add, add])


TEMPLATE = ("{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
            "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_trainer_shows_the_tools_through_the_template_and_steps_them(tmp_path):
    tok = demo.demo_tokenizer()
    tok.chat_template = TEMPLATE
    prompts = [[{"role": "user", "content": f"{a} + {b}?"}] for a, b in ((1, 2), (3, 4))]
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=4, mini_batch_size=4, ppo_epochs=1, num_generations=2)
    tc = dict(iterations=1, query_length=112, response_length=24, turn_length=8, output_dir=str(tmp_path),
              progress=False, sample_every=0, export_final=False, plot=False, report_to="jsonl")
    trainer = jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(tok, width=32, layers=1, max_len=136), tokenizer=tok,
                             prompts=prompts, reward_fns=lambda p, c: [0.0] * len(c), tools=[add, divide])
    assert trainer.parts.table.texts[0] == ("<|im_start|>system\ntools: add divide<|im_end|>\n<|im_start|>user\n1 + 2?"
                                      "<|im_end|>\n<|im_start|>assistant\n")
    assert trainer.parts.environment.tools[1]["function"]["name"] == "divide"
    metrics = trainer.step()
    assert metrics["env/tool_calls"] == 0 and metrics["env/turns_mean"] == 1.0  # a random policy calls nothing
    # A tool result continues the conversation as the template renders it.
    assert chat_continuation(tok, [{"role": "tool", "content": "3"}], "<|im_end|>", trainer.parts.environment.tools) == \
        "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="give the prompts as chat messages"):
        jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(tok, width=32, layers=1, max_len=136), tokenizer=tok,
                       prompts=["1 + 2?", "3 + 4?"], reward_fns=lambda p, c: [0.0] * len(c), tools=[add])
    with pytest.raises(ValueError, match="give environment or tools, not both"):
        jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(tok, width=32, layers=1, max_len=136), tokenizer=tok,
                       prompts=prompts, tools=[add], environment=ToolEnvironment)
