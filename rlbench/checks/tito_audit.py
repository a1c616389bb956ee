"""`check tito --audit`: a chat template against the token-in-token-out rule, before any run.

The audit plays a TITO builder (tito_builders.py: rlbench's plain one, or Miles' for a model family) over
generated conversation shapes, with the template kwargs given (enable_thinking, clear_thinking, ...):
the generation prompt is tokenised; each assistant turn is sampled as an engine given that prompt samples
it: the turn as the template renders it after the prompt, with the message's reasoning where the template
leaves it out (a model that reasoned sampled its reasoning, whatever the template keeps), up to and
including the first stop id (generation_config.json's, besides the end-of-turn; a stop the rendering only
opens the next message with is sampled too), none for a truncated turn; then the builder appends the
environment's messages and the next generation prompt. The buffer is compared, as ids, with the template's
rendering of the whole conversation, and every divergence is classified (tito.py), each with the category
Miles' comparator gives it.

Stages, each named in a finding's `where`:
- generation prompt vs turn j: the turn as rendered does not begin with the prompt the engine was given.
- decode of turn j: a naive builder's decode(skip_special_tokens=True) and re-encode of the sampled ids.
- prefix after turn j (plain builder): the rendering of the grown conversation does not extend the history.
- builder error: Miles' builder refused to merge (its rendered-suffix check).
- re-render after turn j / final re-render: the buffer against the template's rendering.
After a broken prefix or generation prompt the shape goes on from the template's own rendering, so what
follows is still audited and nothing is reported twice.

The reasoning shape probes reasoning templates only (tito_reasoning.py), in each form the template reads a turn's
reasoning in: reasoning_content ("reasoning") and inline, a think block in the content ("reasoning-inline"). One that
reads neither (plain ChatML) is not audited ("not a reasoning template: probe skipped"); one that keeps the reasoning
where it is sampled and strips it from the history is probed, and that is mode 4.

Findings and hazards. A finding (strict, exit 1): the template, under the chosen builder and kwargs,
gives the engine and the trainer other ids than it renders for the same conversation. A hazard (reported,
exit 1 only with strict=True, `--strict`): what only a naive pipeline breaks, which trains on a re-render or
on decoded text: the sampled ids re-tokenised (mode 1 in sampled ids), a skip-special decode (8), the
end-of-turn a template closes a truncated turn with (10: no message key says truncated), and an empty think
block that the generation prompt opened and the rendering of a turn without reasoning drops (GLM-4.7,
MiniMax).

Tool calls take the shape Hugging Face documents and most templates read (Llama 3.x, Mistral,
Qwen): `{"type": "function", "function": {"name": ..., "arguments": {...}}}`, arguments a dict.
A template that raises on a shape (many refuse parallel tool calls, for one) is that shape's
finding, "template error: ...", and the other shapes are still audited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlbench.checks.tito import MODES, Finding, block_findings, decode, decode_drops, encode, finding
from rlbench.checks.tito_builders import (
    BuildError,
    PlainBuilder,
    PrefixBroken,
    assistant_start,
    make_builder,
    stop_ids,
    template_errors,
)
from rlbench.errors import BadInput
from rlbench.checks.tito_reasoning import (
    NOT_REASONING,
    is_reasoning_probe,
    reasoning_forms,
    reasoning_of,
    with_reasoning,
)
from rlbench.checks.tito_shapes import conversation_shapes


@dataclass
class AuditReport:
    tokenizer: str
    shapes: list[str]  # the shapes audited
    findings: list[Finding] = field(default_factory=list)  # strict ones and hazards (strict False)
    builder: str = "plain"  # or the Miles family
    kwargs: dict = field(default_factory=dict)  # the template kwargs every rendering had
    roles: list[str] | None = None  # the roles the builder may append (None: any)
    skipped: dict[str, str] = field(default_factory=dict)  # shape: why it was not audited
    notes: list[str] = field(default_factory=list)
    fail_on_hazards: bool = False  # --strict

    @property
    def modes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.mode] = counts.get(f.mode, 0) + 1
        return counts

    @property
    def hazards(self) -> list[Finding]:
        return [f for f in self.findings if not f.strict]

    @property
    def strict(self) -> bool:
        return any(f.strict for f in self.findings) or (self.fail_on_hazards and bool(self.findings))


def template_error(shape: str, exc: Exception, stage: str = "template error") -> Finding:
    message = " ".join(str(exc).split()) or exc.__class__.__name__
    return Finding(
        shape,
        "template",
        MODES["template"][0],
        True,
        -1,
        [],
        [],
        [],
        "",
        "",
        f"{exc.__class__.__name__}: {message}",
        f"{stage}: {message}",
    )


@dataclass
class _Play:
    """What one shape is played with."""

    tok: object
    builder: object
    stops: frozenset[int]
    compare: object = None  # Miles' comparator, for the categories


def audit_shape(
    tok, shape: str, messages: list[dict], tools, builder=None, stops: frozenset[int] | None = None, compare=None
) -> list[Finding]:
    """Play a token-in-token-out builder over one conversation; return every divergence, or, where the template
    (or the builder) cannot render the conversation, what was found up to there and that error."""
    play = _Play(
        tok, builder or PlainBuilder(tok, {}), stops if stops is not None else frozenset({tok.eos_token_id}), compare
    )
    found: list[Finding] = []
    try:
        _audit_shape(play, shape, messages, tools, found)
    except template_errors() as exc:  # UndefinedError, raise_exception() from inside the template, Miles' wrapping
        found.append(template_error(shape, exc))
    return found


def _audit_shape(play: _Play, shape: str, messages: list[dict], tools, found: list[Finding]) -> None:
    tok, b = play.tok, play.builder
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    reasoning = tuple(reasoning_of(m) for m in messages if m["role"] == "assistant")
    buffer = encode(tok, b.render(messages[: turns[0]], tools, True))
    state = _State()
    for k, j in enumerate(turns):
        prompt, turn = b.render(messages[:j], tools, True), b.render(messages[: j + 1], tools, False)
        following = b.render(messages[: turns[k + 1]], tools, True) if k + 1 < len(turns) else None
        if not turn.startswith(prompt):
            found += _compare(
                play,
                state,
                shape,
                f"generation prompt vs turn {j}",
                encode(tok, prompt),
                encode(tok, turn),
                reasoning,
                extension=True,
                hazard=_empty_think(messages[j]),
            )
            buffer = _resync(play, state, shape, f"re-render before turn {j}", buffer, prompt, reasoning, found)
            common = _common_text_prefix(tok, prompt, turn)
            head, body = turn[:common], turn[common:]
            buffer = encode(tok, head)
        else:
            head, body = prompt, turn[len(prompt) :]
        body, lost = with_reasoning(body, messages[j], head)
        if lost:
            found.append(_lost_reasoning(shape, j))
        truncated = bool(messages[j].get("truncated"))
        after = following[len(turn) :] if following is not None and following.startswith(turn) else ""
        sampled = _sample(play, body, after, truncated)
        found += _decode_hazard(play, shape, j, buffer, sampled)
        state.spans.append((len(buffer), len(buffer) + len(sampled)))
        buffer = buffer + sampled
        state.turn_ends.append(len(buffer))
        if truncated:
            state.truncated_ends.append(len(buffer))
        if following is None:
            continue
        try:
            buffer = b.extend(messages[: j + 1], messages[: turns[k + 1]], buffer, tools)
        except BuildError as exc:  # the plain builder's broken prefix, or Miles' builder refusing to merge
            if not isinstance(exc, PrefixBroken):
                found.append(template_error(shape, exc, "builder error"))
            if not following.startswith(turn) or not isinstance(exc, PrefixBroken):
                found += _compare(
                    play,
                    state,
                    shape,
                    f"prefix after turn {j}",
                    encode(tok, turn),
                    encode(tok, following),
                    reasoning,
                    extension=True,
                )
            _resync(play, state, shape, f"re-render after turn {j}", buffer, turn, reasoning, found)
            buffer = encode(tok, following)
    final = encode(tok, b.render(messages, tools, False))
    found += _compare(
        play,
        state,
        shape,
        "final re-render",
        buffer,
        final,
        reasoning,
        truncated_last=bool(messages[turns[-1]].get("truncated")),
    )


@dataclass
class _State:
    """Where the sampled turns lie in the buffer (ids after each, and the truncated ones), and its id spans."""

    turn_ends: list[int] = field(default_factory=list)
    truncated_ends: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


def _compare(
    play: _Play,
    state: _State,
    shape: str,
    where: str,
    got: list[int],
    expected: list[int],
    reasoning: tuple[str, ...],
    extension: bool = False,
    truncated_last: bool = False,
    hazard=None,
) -> list[Finding]:
    def is_hazard(mode: str, i1: int, i2: int) -> bool:
        if hazard is not None:
            return hazard
        sampled = any(s < max(i2, i1 + 1) and i1 < e for s, e in state.spans)
        return mode == "truncated" or (mode == "reencode" and sampled)

    return block_findings(
        play.tok,
        shape,
        where,
        got,
        expected,
        state.turn_ends,
        state.truncated_ends,
        truncated_last,
        play.stops,
        reasoning,
        extension=extension,
        hazard=is_hazard,
        compare=play.compare,
    )


def _resync(
    play: _Play,
    state: _State,
    shape: str,
    where: str,
    buffer: list[int],
    text: str,
    reasoning: tuple[str, ...],
    found: list[Finding],
) -> list[int]:
    """Before the shape goes on from the template's rendering `text`: the buffer so far against it."""
    found += _compare(play, state, shape, where, buffer, encode(play.tok, text), reasoning)
    return encode(play.tok, text)


def _empty_think(message: dict) -> bool:
    """A turn without reasoning: what a generation prompt opened and its rendering dropped is an empty think
    block, which no message key can carry; with reasoning, the rendering has lost what was sampled."""
    return not reasoning_of(message)


def _common_text_prefix(tok, a: str, b: str) -> int:
    """The length of the text that `a` and `b` share as ids (a cut between whole tokens)."""
    ids_a, ids_b = encode(tok, a), encode(tok, b)
    n = 0
    while n < min(len(ids_a), len(ids_b)) and ids_a[n] == ids_b[n]:
        n += 1
    return len(decode(tok, ids_b[:n]))


def _lost_reasoning(shape: str, j: int) -> Finding:
    return Finding(
        shape,
        "reasoning",
        MODES["reasoning"][0],
        True,
        -1,
        [],
        [],
        [],
        "",
        "",
        "",
        f"turn {j}: its reasoning is not in the template's rendering of the turn, even as the last turn",
    )


def _sample(play: _Play, body: str, after: str, truncated: bool) -> list[int]:
    """The ids an engine samples for a turn rendered as `body`: up to and including the first stop id; if the body
    has none, the stop the rendering opens the next message with (`after`), else the end-of-turn. A truncated turn
    ends before any stop."""
    tok, stops = play.tok, play.stops
    ids = encode(tok, body)
    at = next((i for i, t in enumerate(ids) if t in stops), None)
    if truncated:
        return ids if at is None else ids[:at]
    if at is not None:
        return ids[: at + 1]
    opener = encode(tok, after)[:1]
    if opener and opener[0] in stops:
        return ids + opener
    return ids + [tok.eos_token_id if tok.eos_token_id is not None else min(stops)]


def _decode_hazard(play: _Play, shape: str, j: int, buffer: list[int], sampled: list[int]) -> list[Finding]:
    """What a naive builder does with the sampled ids: decode them to text (special tokens skipped) and encode that
    again. The stop the turn ends with is left aside: a template renders it back."""
    tok = play.tok
    content = sampled[:-1] if sampled and sampled[-1] in play.stops else sampled
    if decode(tok, content, skip_special_tokens=True) == decode(tok, content):
        return []
    dropped = next(i for i in range(len(content)) if decode_drops(tok, content, i))
    naive = encode(tok, decode(tok, content, skip_special_tokens=True))
    return [
        finding(
            tok,
            shape,
            f"decode of turn {j}",
            buffer + naive,
            buffer + content,
            len(buffer) + dropped,
            [],
            [],
            mode=("special", False),
        )
    ]


def _appended_roles(messages: list[dict]) -> set[str]:
    """The roles a builder must append after an assistant turn in this conversation."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return {m["role"] for m in messages[first:] if m["role"] != "assistant"}


def audit(
    tokenizer_dir: str | Path,
    shapes: list[str] | None = None,
    family: str | None = None,
    kwargs: dict | None = None,
    roles: list[str] | None = None,
    strict: bool = False,
) -> AuditReport:
    """Every shape played with the builder (`family`: Miles' for that model family; None: rlbench's plain one)."""
    from rlbench.core.model import load_tokenizer
    from rlbench.checks.tito_miles import comparator

    tok = load_tokenizer(tokenizer_dir)
    if not tok.chat_template and not (family or "").startswith("deepseek"):
        raise BadInput("the tokenizer has no chat template to audit", path=tokenizer_dir)
    builder = make_builder(tok, family, kwargs or {}, roles)
    known = conversation_shapes()
    names = shapes or list(known)
    report = AuditReport(
        str(tokenizer_dir),
        [],
        builder=builder.name,
        kwargs=dict(builder.kwargs),
        roles=list(builder.roles) if builder.roles is not None else None,
        fail_on_hazards=strict,
    )
    if builder.family is not None:
        report.notes += builder.family.notes
    stops = stop_ids(tok, tokenizer_dir)
    if not stops:  # nothing ends a sampled turn: no turn could be played
        raise BadInput(
            "expected an eos token (tokenizer_config.json eos_token, or generation_config.json "
            "eos_token_id) to end each sampled turn; the tokenizer has none",
            path=tokenizer_dir,
        )
    compare = comparator(tok, builder.family, assistant_start(tok, builder))
    for name in names:
        messages, tools = known[name]
        extra = _appended_roles(messages) - set(builder.roles) if builder.roles is not None else set()
        if extra:
            report.skipped[name] = (
                f"it appends {', '.join(sorted(extra))} after an assistant turn, which the "
                f"{builder.name} builder is not allowed to (--tito-allowed-append-roles)"
            )
            continue
        forms = reasoning_forms(builder, name, messages, tools) if is_reasoning_probe(messages) else [(name, messages)]
        if not forms:
            report.skipped[name] = NOT_REASONING
        for shape, played in forms:
            report.shapes.append(shape)
            report.findings += audit_shape(tok, shape, played, tools, builder, stops, compare)
    return report
