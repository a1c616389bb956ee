"""The conversation shapes check tito --audit plays, by name, each as (messages, tools): single- and multi-turn
chats, tool calls and their results, reasoning turns (in reasoning_content; inline_reasoning() moves the reasoning
into the content, the form the audit also plays it in)."""

from __future__ import annotations

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluates an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def user_message(text):
    return {"role": "user", "content": text}


def assistant_message(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def calculator_call(expr):
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}


def inline_reasoning(messages: list[dict]) -> list[dict]:
    """The same conversation with each assistant turn's reasoning_content moved inline into its content, as
    DeepSeek-R1's and QwQ's templates read a turn (and Qwen3's, besides reasoning_content):
    `<think>\\n{reasoning}\\n</think>\\n\\n{content}`."""
    out = []
    for m in messages:
        reasoning = m.get("reasoning_content") if m["role"] == "assistant" else None
        if reasoning:
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m['content']}"
        out.append(m)
    return out


def conversation_shapes() -> dict[str, tuple[list[dict], list | None]]:
    """The conversation shapes the audit plays, by name: (messages, tools). Built when called, not when the
    module is imported, so that a mutation tool that switches a change on at call time reaches the helpers
    above (bench/mutation.py); a fresh dict each call, microseconds, that no caller can alter for another."""
    return {
        "single-turn": ([user_message("Is 7 even or odd?"), assistant_message("odd")], None),
        "multi-turn": (
            [
                user_message("Is 7 even or odd?"),
                assistant_message("odd"),
                user_message("And 12?"),
                assistant_message("even"),
            ],
            None,
        ),
        "tool-result": (
            [
                user_message("Is 3 plus 4 even or odd?"),
                assistant_message("", tool_calls=[calculator_call("3+4")]),
                {"role": "tool", "content": "7"},
                assistant_message("odd"),
            ],
            None,
        ),
        "consecutive-tool-results": (
            [
                user_message("Is 3 plus 4 even, and 6?"),
                assistant_message("", tool_calls=[calculator_call("3+4"), calculator_call("6")]),
                {"role": "tool", "content": "7"},
                {"role": "tool", "content": "6"},
                assistant_message("odd even"),
            ],
            None,
        ),
        "reasoning": (
            [
                user_message("Is 7 even or odd?"),
                assistant_message("odd", reasoning_content="7 ends in 7"),
                user_message("And 12?"),
                assistant_message("even", reasoning_content="12 ends in 2"),
            ],
            None,
        ),
        "truncated": (
            [
                user_message("Is 7 even or odd?"),
                assistant_message("The answer", truncated=True),
                user_message("Go on."),
                assistant_message("odd"),
            ],
            None,
        ),
        "multi-turn-with-tools": (
            [
                user_message("Is 7 even or odd?"),
                assistant_message("odd"),
                user_message("And 12?"),
                assistant_message("even"),
            ],
            [CALCULATOR],
        ),
        "tool-result-with-tools": (
            [
                user_message("Is 3 plus 4 even or odd?"),
                assistant_message("", tool_calls=[calculator_call("3+4")]),
                {"role": "tool", "content": "7"},
                assistant_message("odd"),
            ],
            [CALCULATOR],
        ),
    }
