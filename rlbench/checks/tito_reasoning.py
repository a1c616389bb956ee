"""The reasoning probe of `check tito --audit`: the forms a chat template reads a turn's reasoning in, and a turn as
a model that reasoned sampled it.

A template reads a turn's reasoning in one of two forms, or both (Qwen3):
- reasoning_content, a message key (the shape "reasoning"): probed where the template renders it in some position,
  at least as the last turn (renders_reasoning);
- inline, `<think>\\n...\\n</think>\\n\\nanswer` in the content (the shape "reasoning-inline", the same turns
  through inline_reasoning()): probed where the template drops or changes that think block in some position
  (changes_inline_reasoning). DeepSeek-R1 and QwQ strip it from every assistant turn with
  `content.split('</think>')[-1]` and open `<think>\\n` at the generation prompt; Qwen3 strips it from the turns
  before the last user message.
A template that reads neither (plain ChatML: reasoning_content rendered nowhere, a think block in the content passed
through unchanged in every position, as any text) serves a model that samples no reasoning, and the shape is not
audited ("not a reasoning template: probe skipped"). One that keeps a turn's reasoning where it is sampled (the last
turn, the generation prompt) and strips it from the history is probed, and that is mode 4, in the form the finding's
shape names.

What was sampled (with_reasoning): the turn as the template renders it after the prompt, with the reasoning put back
where the template left it out: in the think block it left empty, before the </think> it closes the block the prompt
opened with, or, for an inline turn whose think block it dropped, the content as the model wrote it.
"""

from __future__ import annotations

import re

from rlbench.checks.tito_builders import template_errors
from rlbench.checks.tito_shapes import inline_reasoning


def reasoning_of(message: dict) -> str:
    """A turn's reasoning: its reasoning_content, or else the think block inline in its content."""
    reasoning = str(message.get("reasoning_content") or "").strip()
    content = message.get("content")
    if reasoning or not isinstance(content, str) or "</think>" not in content:
        return reasoning
    return content.split("</think>")[0].split("<think>")[-1].strip()


_EMPTY_THINK = re.compile(r"<think>(\s*)</think>")


def with_reasoning(body: str, message: dict, prompt: str) -> tuple[str, bool]:
    """The turn as sampled: its rendering after the prompt (the text the buffer holds before it), with the message's
    reasoning in the think block the template left empty, or an inline turn's content as it reads where the template
    dropped its think block, or the reasoning before a closing </think> when the prompt opened the block. True when
    the reasoning has no place in the rendering at all: the template loses it whatever the builder does."""
    reasoning = reasoning_of(message)
    if not reasoning or reasoning in body:
        return body, False
    empty = _EMPTY_THINK.search(body)
    if empty:
        inner = f"\n{reasoning}\n" if empty.group(1) else reasoning
        return body[: empty.start()] + "<think>" + inner + "</think>" + body[empty.end() :], False
    sampled = _inline_sampled(body, message, prompt)
    if sampled is not None:
        return sampled, False
    if body.lstrip().startswith("</think>") and prompt.rstrip().endswith("<think>"):
        return reasoning + body, False
    return body, True


def _inline_sampled(body: str, message: dict, prompt: str) -> str | None:
    """An inline turn whose think block the rendering dropped (`content.split('</think>')[-1]`): what the model
    sampled, its content up to the answer's end (less the part of the think block the prompt opened), then what the
    rendering closes the turn with. None where the rendering has more than whitespace before the answer."""
    content = message.get("content")
    if str(message.get("reasoning_content") or "").strip() or not isinstance(content, str):
        return None
    answer = content.split("</think>")[-1].strip()
    at = body.find(answer)
    if at < 0 or body[:at].strip():
        return None
    sampled = content[: content.rindex(answer) + len(answer)]
    opened = re.search(r"<think>(\s*)$", prompt)
    if opened and sampled.lstrip().startswith("<think>"):
        sampled = sampled.lstrip()[len("<think>") :]
        sampled = sampled[len(opened.group(1)) :] if sampled.startswith(opened.group(1)) else sampled
    return sampled + body[at + len(answer) :]


NOT_REASONING = (
    "not a reasoning template: probe skipped (the template renders a turn's reasoning_content "
    "nowhere, not even in the last turn, and a think block in an assistant's content unchanged in every position)"
)
INLINE = "-inline"  # the reasoning shape played with its reasoning inline: its name plus this


def is_reasoning_probe(messages: list[dict]) -> bool:
    """Whether a shape is the reasoning probe: an assistant turn carries reasoning_content."""
    return any(_carries_reasoning(m) for m in messages)


def _carries_reasoning(message: dict) -> bool:
    """An assistant turn with reasoning_content that is more than whitespace."""
    return message["role"] == "assistant" and bool(str(message.get("reasoning_content") or "").strip())


def reasoning_forms(builder, name: str, messages: list[dict], tools) -> list[tuple[str, list[dict]]]:
    """The forms the reasoning probe `name` is played in, each as (shape, messages): with reasoning_content where
    the template renders it (renders_reasoning), inline (`name`-inline) where it drops or changes a think block in
    an assistant's content (changes_inline_reasoning); none: not a reasoning template."""
    forms = [(name, messages)] if renders_reasoning(builder, messages, tools) else []
    inline = inline_reasoning(messages)
    if changes_inline_reasoning(builder, inline, tools):
        forms.append((name + INLINE, inline))
    return forms


def changes_inline_reasoning(builder, messages: list[dict], tools) -> bool:
    """Whether the template drops or changes a think block inline in an assistant's content in some position: a
    turn's reasoning, which the model sampled, is not in its rendering as the last turn (DeepSeek-R1 and QwQ strip it
    from every turn), or the think block rendered there is not in the whole conversation's rendering (Qwen3 strips
    it from the turns before the last user message). A template that renders it alike in every position (plain
    ChatML passes it through as any text) has no inline reasoning to probe. One that cannot render the probe is
    probed, so that its error is the shape's finding."""
    try:
        whole = builder.render(messages, tools, False)
        for j, message in enumerate(messages):
            reasoning = reasoning_of(message) if message["role"] == "assistant" else ""
            if reasoning:
                block = _think_block(builder.render(messages[: j + 1], tools, False), reasoning)
                if block is None or block not in whole:
                    return True
    except template_errors():
        return True
    return False


def _think_block(text: str, reasoning: str) -> str | None:
    """The think block around the last `reasoning` in `text` (markers included where it has them); None: none."""
    at = text.rfind(reasoning)
    if at < 0:
        return None
    start, end = text.rfind("<think>", 0, at), text.find("</think>", at + len(reasoning))
    start = start if start >= 0 and "</think>" not in text[start:at] else at
    return text[start : end + len("</think>") if end >= 0 else at + len(reasoning)]


def renders_reasoning(builder, messages: list[dict], tools) -> bool:
    """Whether the template renders reasoning in some position: each assistant turn with reasoning, rendered as the
    last turn (where every reasoning template keeps it) and in the whole conversation, holds its reasoning or a think
    block for it. A template that never does (plain ChatML) is not a reasoning template: the model it serves samples
    no reasoning, and the probe's reasoning_content, which it ignores, is no drift. One that does is probed, and a
    turn whose reasoning is kept last but stripped from the history stays mode 4. A template that cannot render the
    probe is probed, so that its error is the shape's finding."""
    turns = [j for j, m in enumerate(messages) if _carries_reasoning(m)]
    try:
        whole = builder.render(messages, tools, False)
        for j in turns:
            prompt, turn = builder.render(messages[:j], tools, True), builder.render(messages[: j + 1], tools, False)
            body = turn[len(prompt) :] if turn.startswith(prompt) else turn
            if not with_reasoning(body, messages[j], prompt)[1] or reasoning_of(messages[j]) in whole:
                return True
    except template_errors():
        return True
    return False
