"""`check tito --audit`: a chat template against the token-in-token-out rule, before any run.

The audit plays a TITO builder over generated conversation shapes: the generation prompt is
tokenised, each assistant turn is sampled as the template renders it, up to and including the stop
token (none for a truncated turn), and the environment's messages are appended as the rendered
suffix (what the template adds when the conversation grows). The buffer is then compared, as ids,
with the trainer's re-render of the whole conversation, and each extended rendering with the one
before it (the prefix property). Each first divergence is classified (tito.py).

Tool calls take the shape Hugging Face documents and most templates read (Llama 3.x, Mistral,
Qwen): `{"type": "function", "function": {"name": ..., "arguments": {...}}}`, arguments a dict.
A template that raises on a shape (many refuse parallel tool calls, for one) is that shape's
finding, "template error: ...", and the other shapes are still audited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlbench.checks.tito import MODES, Finding, decode, decode_drops, divergence, encode, finding, render
from rlbench.errors import BadInput

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "evaluates an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def _call(expr):
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}


def conversation_shapes() -> dict[str, tuple[list[dict], list | None]]:
    """The conversation shapes the audit plays, by name: (messages, tools). Built when called, not when the
    module is imported, so that a mutation tool that switches a change on at call time reaches the helpers
    above (bench/mutation.py); a fresh dict each call, microseconds, that no caller can alter for another."""
    return {
        "single-turn": ([_user("Is 7 even or odd?"), _assistant("odd")], None),
        "multi-turn": ([_user("Is 7 even or odd?"), _assistant("odd"), _user("And 12?"), _assistant("even")], None),
        "tool-result": ([_user("Is 3 plus 4 even or odd?"), _assistant("", tool_calls=[_call("3+4")]),
                         {"role": "tool", "content": "7"}, _assistant("odd")], None),
        "consecutive-tool-results": ([_user("Is 3 plus 4 even, and 6?"),
                                      _assistant("", tool_calls=[_call("3+4"), _call("6")]),
                                      {"role": "tool", "content": "7"}, {"role": "tool", "content": "6"},
                                      _assistant("odd even")], None),
        "reasoning": ([_user("Is 7 even or odd?"), _assistant("odd", reasoning_content="7 ends in 7"),
                       _user("And 12?"), _assistant("even", reasoning_content="12 ends in 2")], None),
        "truncated": ([_user("Is 7 even or odd?"), _assistant("The answer", truncated=True), _user("Go on."),
                       _assistant("odd")], None),
        "multi-turn-with-tools": ([_user("Is 7 even or odd?"), _assistant("odd"), _user("And 12?"),
                                   _assistant("even")], [CALCULATOR]),
        "tool-result-with-tools": ([_user("Is 3 plus 4 even or odd?"), _assistant("", tool_calls=[_call("3+4")]),
                                    {"role": "tool", "content": "7"}, _assistant("odd")], [CALCULATOR]),
    }


@dataclass
class AuditReport:
    tokenizer: str
    shapes: list[str]
    findings: list[Finding] = field(default_factory=list)

    @property
    def modes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.mode] = counts.get(f.mode, 0) + 1
        return counts

    @property
    def strict(self) -> bool:
        return any(f.strict for f in self.findings)


def _template_error(shape: str, exc: Exception) -> Finding:
    message = " ".join(str(exc).split()) or exc.__class__.__name__
    return Finding(shape, "template", MODES["template"][0], True, -1, [], [], [], "", "",
                   f"{exc.__class__.__name__}: {message}", f"template error: {message}")


def audit_shape(tok, shape: str, messages: list[dict], tools) -> list[Finding]:
    """Play a token-in-token-out builder over one conversation; return its first divergence(s), or the
    template's error when it cannot render the conversation."""
    from jinja2 import TemplateError

    try:
        return _audit_shape(tok, shape, messages, tools)
    except TemplateError as exc:  # UndefinedError, and raise_exception() from inside the template
        return [_template_error(shape, exc)]


def _audit_shape(tok, shape: str, messages: list[dict], tools) -> list[Finding]:
    eos = tok.eos_token_id
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    buffer = encode(tok, render(tok, messages[: turns[0]], tools, True))
    turn_ends, truncated_ends, findings = [], [], []
    for k, j in enumerate(turns):
        prompt = render(tok, messages[:j], tools, True)
        turn = render(tok, messages[: j + 1], tools, False)
        if not turn.startswith(prompt):
            ids_a, ids_b = encode(tok, prompt), encode(tok, turn)
            found = divergence(tok, shape, f"generation prompt vs turn {j}", ids_a, ids_b, [], [])
            return [found] if found is not None else []
        body = turn[len(prompt):]
        stop = body.find(tok.eos_token)
        content = body if stop < 0 else body[:stop]
        truncated = bool(messages[j].get("truncated"))
        sampled = encode(tok, content)
        # What a naive builder does with the sampled ids: decode them to text (special tokens skipped)
        # and encode that again.
        if decode(tok, sampled, skip_special_tokens=True) != decode(tok, sampled):
            dropped = next(i for i in range(len(sampled)) if decode_drops(tok, sampled, i))
            naive = encode(tok, decode(tok, sampled, skip_special_tokens=True))
            found = finding(tok, shape, f"decode of turn {j}", buffer + naive, buffer + sampled, len(buffer) + dropped,
                            [], [], mode=("special", True))
            findings.append(found)
        buffer += sampled + ([] if truncated else [eos])
        turn_ends.append(len(buffer))
        if truncated:
            truncated_ends.append(len(buffer))
        if k + 1 < len(turns):
            grown = render(tok, messages[: turns[k + 1]], tools, True)
            if not grown.startswith(turn):  # the history renders differently now: the prefix property fails
                found = divergence(tok, shape, f"prefix after turn {j}", encode(tok, turn), encode(tok, grown), [], [])
                return findings + ([found] if found is not None else [])
            buffer += encode(tok, grown[len(turn):])
    final = encode(tok, render(tok, messages, tools, False))
    found = divergence(tok, shape, "final re-render", buffer, final, turn_ends, truncated_ends,
                       truncated_last=bool(messages[turns[-1]].get("truncated")))
    return findings + ([found] if found is not None else [])


def audit(tokenizer_dir: str | Path, shapes: list[str] | None = None) -> AuditReport:
    from rlbench.core.model import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    if not tok.chat_template:
        raise BadInput("the tokenizer has no chat template to audit", path=tokenizer_dir)
    known = conversation_shapes()
    names = shapes or list(known)
    report = AuditReport(str(tokenizer_dir), names)
    for name in names:
        messages, tools = known[name]
        report.findings += audit_shape(tok, name, messages, tools)
    return report
