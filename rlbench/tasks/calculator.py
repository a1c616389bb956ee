"""A multi-turn task with a calculator tool, and two ways of building its trajectories.

The model is asked a parity question; it may call the calculator (`<tool_call>calculator 3+4
</tool_call>`) and gets the result back as a tool message, or, if it calls nothing, the user asks
it to check again. Then it answers once more. Two assistant turns, always.

- `generate_tito`: token-in-token-out. One append-only id buffer: the sampled ids go in as they
  are (mask 1); the environment's message goes in as the rendered suffix, the text the chat
  template adds when the conversation grows by it, tokenised on its own (mask 0).
- `generate_naive`: what many pipelines do. After each turn the sampled ids are decoded to text
  (special tokens skipped), the conversation is re-rendered and re-tokenised, and the next turn is
  prompted with that; the trajectory is the final re-render. The ids the model sampled are not the
  ids it is trained on wherever decode-then-encode is not the identity: drift, by construction,
  for `check tito` to find.
"""

from __future__ import annotations

import re

from rlbench.core.generate import GenerateEnv, Trajectory
from rlbench.core.types import Prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluates + - * of small integers",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_CALL = re.compile(r"<tool_call>\s*calculator\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def calculator(expression: str) -> str:
    """The tool: integers joined by + - * (and unary minus). Parsed with `ast` and walked over a
    whitelist of node types, so nothing but that arithmetic is ever evaluated."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**6:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return (
                left + right
                if isinstance(node.op, ast.Add)
                else left - right
                if isinstance(node.op, ast.Sub)
                else left * right
            )
        raise ValueError(type(node).__name__)

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error: expected integers joined by + - *"


def _environment(messages: list[dict], text: str) -> dict:
    """The next message: the tool's result if the model called it, else a user follow-up."""
    call = _CALL.search(text)
    if call:
        return {"role": "tool", "content": calculator(call.group(1))}
    return {"role": "user", "content": "Check again."}


def _render(tok, messages, generation: bool) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation, tokenize=False)


def _assistant(env: GenerateEnv, ids) -> dict:
    text = env.tokenizer.decode(list(ids), skip_special_tokens=True)
    return {"role": "assistant", "content": text}


def generate_tito(env: GenerateEnv, prompt: Prompt, prompt_ids, seed: int) -> Trajectory:
    tok = env.tokenizer
    messages = list(prompt.messages)
    buffer = list(_prefix_ids(tok, messages))
    start = len(buffer)
    mask, logprobs, turns, result = [], [], [], None
    for turn in range(2):
        result = env.sample(buffer, seed, turn)
        turns.append({"prompt_ids": list(buffer), "output_ids": list(result.output_ids)})
        buffer += result.output_ids
        mask += [1] * len(result.output_ids)
        logprobs += list(result.logprobs)
        reply = _assistant(env, result.output_ids)
        if result.finish_reason == "length":
            reply["truncated"] = True
        messages.append(reply)
        if turn == 0:
            before = _render(tok, messages, False)
            messages.append(_environment(messages, tok.decode(list(result.output_ids))))
            after = _render(tok, messages, True)
            suffix = tok.encode(after[len(before) :], add_special_tokens=False)
            buffer += suffix
            mask += [0] * len(suffix)
            logprobs += [0.0] * len(suffix)
    return Trajectory(
        buffer[start:],
        mask,
        logprobs,
        result.finish_reason,
        messages[-1]["content"],
        messages,
        turns,
        result.engine_id,
        result.weight_version,
        prompt_ids=buffer[:start],
    )


def generate_naive(env: GenerateEnv, prompt: Prompt, prompt_ids, seed: int) -> Trajectory:
    tok = env.tokenizer
    messages = list(prompt.messages)
    turns, sampled_logprobs, result = [], [], None
    for turn in range(2):
        ids = tok.encode(_render(tok, messages, True), add_special_tokens=False)  # re-rendered, re-tokenised
        result = env.sample(ids, seed, turn)
        turns.append({"prompt_ids": list(ids), "output_ids": list(result.output_ids)})
        sampled_logprobs.append(list(result.logprobs))
        reply = _assistant(env, result.output_ids)
        if result.finish_reason == "length":
            reply["truncated"] = True
        messages.append(reply)
        if turn == 0:
            messages.append(_environment(messages, tok.decode(list(result.output_ids))))
    # The trainer's view: the whole conversation re-rendered; the last turn's span trained.
    start = len(tok.encode(_render(tok, messages[:1], True), add_special_tokens=False))
    full = tok.encode(_render(tok, messages, False), add_special_tokens=False)
    last_prompt = tok.encode(_render(tok, messages[:-1], True), add_special_tokens=False)
    response = full[start:]
    trained = len(full) - len(last_prompt)
    mask = [0] * (len(response) - trained) + [1] * trained
    last = sampled_logprobs[-1][:trained] + [0.0] * max(0, trained - len(sampled_logprobs[-1]))
    logprobs = [0.0] * (len(response) - trained) + last
    return Trajectory(
        response,
        mask,
        logprobs,
        result.finish_reason,
        messages[-1]["content"],
        messages,
        turns,
        result.engine_id,
        result.weight_version,
        prompt_ids=full[:start],
    )


def _prefix_ids(tok, messages) -> list[int]:
    return tok.encode(_render(tok, messages, True), add_special_tokens=False)
