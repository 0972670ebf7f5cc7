"""Tools on top of the environment contract: Python functions the policy may call.

    trainer = jaxppo.Trainer(config, tc, policy=..., tokenizer=..., prompts=chat_prompts,
                             reward_fns=[exact_match], tools=[calculator])

Each tool is a function with typed parameters and a Google-style docstring (an "Args:"
section); its JSON schema (transformers' `get_json_schema`) is passed to the tokenizer's
chat template as `tools=`, so the prompts show the tools the way the model was trained
to see them. A model turn holding tool calls in the template's format (Hermes / Qwen:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, `parse_tool_calls`) gets the
results back as "tool" messages; a turn without a call is the final answer and ends the
episode. A bad call (unparseable, an unknown tool, wrong arguments, a tool that raises or
runs past its timeout) becomes an error message to the model and is counted in
`env/tool_errors/<kind>`; it never stops the run.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from typing import Callable, Optional, Sequence

from jaxppo.errors import TOOL_ERROR_KINDS, ToolCallError
from jaxppo.rollout.environments import StepResult

__all__ = ["ToolCallError", "parse_tool_calls", "tool_schema", "ToolEnvironment", "tool_environment", "check_tools",
           "ERROR_KINDS"]

ERROR_KINDS = TOOL_ERROR_KINDS
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BASIC = {int: (int,), float: (int, float), str: (str,), bool: (bool,), list: (list,), dict: (dict,)}


def parse_tool_calls(text: str) -> list:
    """[(name, arguments dict), ...] from the `<tool_call>{json}</tool_call>` blocks of a
    model turn (Hermes / Qwen's format); [] when there are none. Raises `ToolCallError`
    ("parse") for an unclosed block, JSON that does not parse, or a body without a string
    "name" and an object (or JSON-string object) "arguments"."""
    calls = []
    if text.count("<tool_call>") != text.count("</tool_call>"):
        raise ToolCallError("parse", "a <tool_call> block is not closed with </tool_call>")
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            raise ToolCallError("parse", f"the tool call is not valid JSON ({err.msg}): {body.strip()[:80]}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallError("parse", f'a tool call must be {{"name": ..., "arguments": {{...}}}}; got {body.strip()[:80]}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise ToolCallError("parse", f"the arguments of {call['name']!r} must be a JSON object")
        calls.append((call["name"], arguments))
    return calls


def tool_schema(fn: Callable) -> dict:
    """The function's JSON schema for `apply_chat_template(tools=...)` (transformers'
    `get_json_schema`: typed parameters and a docstring with an "Args:" section)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described to the model: {err}. A tool needs "
                         "type hints on every parameter and a docstring with a description and an Args: section") from None


def check_tools(tools: Sequence[Callable]) -> tuple:
    """The tools' schemas, checked before anything compiles (callables, unique names,
    describable)."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError(f"tools must be a non-empty list of functions; got {tools!r:.60}")
    names = set()
    for fn in tools:
        if not callable(fn):
            raise ValueError(f"tools entry {fn!r:.60} is not a function")
        if fn.__name__ in names:
            raise ValueError(f"two tools are named {fn.__name__!r}; tool names must be unique")
        names.add(fn.__name__)
    return tuple(tool_schema(fn) for fn in tools)


def _bind(fn: Callable, arguments: dict):
    """Check `arguments` against the signature and its basic type hints."""
    try:
        bound = inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        raise ToolCallError("bad_arguments", f"wrong arguments for {fn.__name__}: {err}") from None
    hints = getattr(fn, "__annotations__", {})
    for name, value in bound.arguments.items():
        hint = hints.get(name)
        if isinstance(hint, str):  # postponed annotations
            hint = {t.__name__: t for t in _BASIC}.get(hint)
        allowed = _BASIC.get(hint)
        if allowed and (not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool))):
            raise ToolCallError("bad_arguments", f"argument {name!r} of {fn.__name__} must be a {hint.__name__}, got "
                                                 f"{value!r:.40}")
    return bound


def _run(fn: Callable, bound, timeout: float) -> str:
    """The tool's result as text, in a daemon thread given `timeout` seconds."""
    result = {}

    def target():
        try:
            result["value"] = fn(*bound.args, **bound.kwargs)
        except Exception as err:
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ToolCallError("timeout", f"{fn.__name__} did not finish within {timeout} s")
    if "error" in result:
        err = result["error"]
        raise ToolCallError("raised", f"{fn.__name__} raised {type(err).__name__}: {err}")
    value = result.get("value")
    return value if isinstance(value, str) else json.dumps(value)


class ToolEnvironment:
    """An environment whose `step` runs the tool calls of a model turn (see the module's
    docstring). `tools`: the functions; `timeout`: seconds per call; `max_calls`: calls
    run per turn (more are answered with an error); `parser`: text -> [(name, args)]."""

    def __init__(self, tools: Sequence[Callable], timeout: float = 10.0, max_calls: int = 4,
                 parser: Callable = parse_tool_calls):
        self.tools = {fn.__name__: fn for fn in tools}
        self.timeout, self.max_calls, self.parser = float(timeout), int(max_calls), parser

    def reset(self, prompt, **columns):
        pass

    def step(self, completion: str) -> StepResult:
        counts = {"tool_calls": 0, **{f"tool_errors/{kind}": 0 for kind in ERROR_KINDS}}
        try:
            calls = self.parser(completion)
        except ToolCallError as err:
            counts[f"tool_errors/{err.kind}"] = 1
            return StepResult([{"role": "tool", "content": f"error: {err}"}], None, False, counts)
        if not calls:
            return StepResult(None, None, True, counts)  # no call: the final answer
        messages = []
        for i, (name, arguments) in enumerate(calls):
            counts["tool_calls"] += 1
            try:
                if i >= self.max_calls:
                    raise ToolCallError("bad_arguments", f"at most {self.max_calls} tool calls per turn")
                if name not in self.tools:
                    raise ToolCallError("unknown_tool", f"unknown tool {name!r}; tools: {', '.join(self.tools)}")
                content = _run(self.tools[name], _bind(self.tools[name], arguments), self.timeout)
            except ToolCallError as err:
                counts[f"tool_errors/{err.kind}"] += 1
                content = f"error: {err}"
            messages.append({"role": "tool", "name": name, "content": content})
        return StepResult(messages, None, False, counts)


def tool_environment(tools: Sequence[Callable], timeout: float = 10.0, max_calls: int = 4,
                     parser: Optional[Callable] = None) -> Callable:
    """A factory of `ToolEnvironment`s over `tools` (what `Trainer(tools=...)` uses)."""
    def factory():
        return ToolEnvironment(tools, timeout, max_calls, parser or parse_tool_calls)

    factory.__qualname__ = f"tools[{','.join(fn.__name__ for fn in tools)}]"
    return factory
