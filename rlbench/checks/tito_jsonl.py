"""`check tito JSONL`: trajectories, each {messages, token_ids}, held to the chat template's re-render.

The ids of each trajectory against the chat template's rendering of its messages (with the row's `tools` and
template kwargs, rendered as transformers renders them), which is what a re-tokenising pipeline would train on:
every place they part is a finding, and a row the template cannot render is that row's finding. Equal ids say only
that: the trajectory is the template's re-render, which a naive pipeline gives by construction, never "no drift".
A row may also give `sampled`, the engine's output ids of each assistant turn in order: each must then stand in its
trained ids, in order, unchanged ("trained on what was sampled"); a difference from the re-render inside a sampled
turn is then a hazard (what a re-rendering pipeline would change), outside one a finding.

Where a row's sampled turn is not in its trained ids as sampled, where it stands is found by alignment: anchored
after the message before it (its generation prompt follows), where its text reads most alike; each stretch that
differs there is classified in the whole trained sequence, and reasoning the trained ids lack is one finding.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlbench.checks.compare import first_divergence
from rlbench.checks.tito import Finding, decode, decode_many, encode, finding, render
from rlbench.checks.tito_report import RunReport, SampleFinding
from rlbench.errors import BadInput

ROW_KEYS = ("messages", "token_ids", "tools", "chat_template_kwargs", "sampled")


def check_jsonl(path: Path, tok, tokenizer_dir, kwargs: dict) -> RunReport:
    """Every trajectory of a JSONL file; `kwargs`: the chat template kwargs of every row (a row's own win)."""
    from rlbench.checks.tito_builders import PlainBuilder, assistant_start, stop_ids
    from rlbench.checks.tito_miles import comparator

    report = RunReport(str(path), "rendered", kwargs=kwargs)
    stops, unread = stop_ids(tok, tokenizer_dir), {}
    compare = comparator(tok, None, assistant_start(tok, PlainBuilder(tok, kwargs)))
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = _row(path, lineno, line, len(tok))
        for key in sorted(set(row) - set(ROW_KEYS)):
            unread[key] = unread.get(key, 0) + 1
        report.samples += 1
        report.sampled_rows += row.get("sampled") is not None
        for found in _judge_row(
            tok, lineno, row, {**kwargs, **(row.get("chat_template_kwargs") or {})}, stops, compare
        ):
            report.findings.append(SampleFinding(None, lineno, found.where, found))
    if not report.samples:  # no verdict speaks for nothing
        raise BadInput("undetermined: no trajectory to judge (the file holds no row)", path=path)
    if unread:
        report.notes.append(
            "not read: "
            + ", ".join(f"{k} ({n} rows)" for k, n in sorted(unread.items()))
            + f"; a row's fields are {', '.join(ROW_KEYS)}"
        )
    return report


def _row(path: Path, lineno: int, line: str, vocab: int) -> dict:
    """One trajectory, its fields checked: refused with the line and the field that is wrong."""
    shape = (
        '{"messages": [...], "token_ids": [...], optional "tools": [...], "chat_template_kwargs": {...}, '
        '"sampled": [[the engine output ids of each assistant turn], ...]}'
    )
    try:
        row = json.loads(line)
        if not isinstance(row, dict):
            raise TypeError("row")
        row["token_ids"] = _ids(row["token_ids"], vocab)
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise TypeError("messages")
        if row.get("tools") is not None and not (
            isinstance(row["tools"], list) and all(isinstance(x, dict) for x in row["tools"])
        ):
            raise TypeError("tools")
        if row.get("chat_template_kwargs") is not None and not isinstance(row["chat_template_kwargs"], dict):
            raise TypeError("chat_template_kwargs")
        if row.get("sampled") is not None:
            if not isinstance(row["sampled"], list):
                raise TypeError("sampled")
            row["sampled"] = [_ids(s, vocab) for s in row["sampled"]]
            if len(row["sampled"]) != sum(m["role"] == "assistant" for m in messages):
                raise ValueError("sampled: one list of ids per assistant message")
    except (ValueError, KeyError, TypeError) as exc:
        what = (
            str(exc)
            if isinstance(exc, ValueError) and str(exc).startswith(("sampled", "token id"))
            else f"{exc.__class__.__name__}: {exc}"
        )
        raise BadInput(f"line {lineno}: expected {shape} ({what})", path=path) from None
    return row


def _ids(value, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise TypeError("ids")
    bad = next((i for i in value if not 0 <= i < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the tokenizer's vocabulary (0..{vocab - 1})")
    return list(value)


def _judge_row(tok, lineno: int, row: dict, kwargs: dict, stops: frozenset[int], compare) -> list[Finding]:
    """One trajectory against the template's re-render, and against its engine's outputs where it gives them."""
    from rlbench.checks.tito import block_findings
    from rlbench.checks.tito_audit import template_error
    from rlbench.checks.tito_builders import template_errors

    ids, messages, sampled = row["token_ids"], row["messages"], row.get("sampled")
    label = f"line {lineno}"
    try:
        expected = encode(tok, render(tok, messages, row.get("tools"), False, kwargs))
    except template_errors() as exc:  # a template that refuses the conversation: this row's finding
        return [template_error(label, exc)]
    reasoning = tuple(str(m.get("reasoning_content") or "") for m in messages if m["role"] == "assistant")
    found, spans = [], []
    if sampled is not None:
        before = [_text(messages[i - 1]) if i else "" for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans, missing = _place(tok, label, ids, sampled, stops, reasoning, before)
        found += missing
    ends = [e for _, e in spans] or [len(ids)]

    def hazard(mode: str, i1: int, i2: int) -> bool:
        return any(s < max(i2, i1 + 1) and i1 < e for s, e in spans)

    truncated = bool(messages and messages[-1].get("truncated"))
    return found + block_findings(
        tok,
        label,
        "the chat template's re-render",
        ids,
        expected,
        ends,
        [],
        truncated_last=truncated,
        stops=stops,
        reasoning=reasoning,
        hazard=hazard if sampled is not None else None,
        compare=compare,
    )


def _text(message: dict) -> str:
    return message.get("content") if isinstance(message.get("content"), str) else ""


def _place(
    tok, label: str, ids: list[int], sampled: list[list[int]], stops, reasoning, before: list[str]
) -> tuple[list, list]:
    """Where each sampled turn stands in the trained ids, in order ((start, end) spans), and a finding for each
    place where one does not stand there as it was sampled. `before`: the text of the message before each turn
    (what the trained ids render just before it)."""
    spans, found, cursor = [], [], 0
    for k, turn in enumerate(sampled):
        at = _find(ids, turn, cursor)
        if at is not None:
            spans.append((at, at + len(turn)))
            cursor = at + len(turn)
            continue
        start, resume = (min(x, len(ids)) for x in _aligned(tok, ids, turn, cursor, before[k]))
        spans.append((start, resume))
        found += _turn_findings(tok, label, k, ids, turn, start, resume, stops, reasoning)
        cursor = resume
    return spans, found


def _aligned(tok, ids: list[int], turn: list[int], cursor: int, before: str = "") -> tuple[int, int]:
    """Where a turn that is not in the trained ids as sampled stands best, from `cursor` on: (start, end). Anchored
    where it reads most alike (_anchor), its first and last aligned ids bound it. A head of the turn before its
    first aligned id counts as in the trained ids only where the ids just before read as that head (re-encoded);
    otherwise the trained ids lack it (stripped reasoning, a decode that skipped special tokens)."""
    from difflib import SequenceMatcher

    anchor = _anchor(tok, ids, turn, cursor, before)
    low = max(cursor, anchor - 8)
    window = ids[low : max(low, anchor + len(turn) + 2)]
    blocks = [b for b in SequenceMatcher(None, window, turn, autojunk=False).get_matching_blocks() if b.size]
    if 2 * sum(b.size for b in blocks) < len(turn):  # few ids in common (a re-encoding): the anchor, the turn's length
        return max(cursor, anchor), max(cursor, anchor + len(turn))
    first, last = blocks[0], blocks[-1]
    at, head = low + first.a, decode(tok, turn[: first.b])
    start = (
        next((at - k for k in range(1, first.b + 5) if at - k >= cursor and decode(tok, ids[at - k : at]) == head), at)
        if head
        else at
    )
    return start, low + last.a + last.size


def _anchor(tok, ids: list[int], turn: list[int], cursor: int, before: str = "") -> int:
    """Where the turn most likely starts in the trained ids: of the places its longest run of ids puts it and those
    where a turn ending like it (its last id, a stop) would start, the one whose text reads most like the turn's.
    Where the message before the turn is found, only the few ids after it (the generation prompt's) are places."""
    from difflib import SequenceMatcher

    rest = ids[cursor:]
    longest = SequenceMatcher(None, rest, turn, autojunk=False).find_longest_match(0, len(rest), 0, len(turn))
    places = [cursor + longest.a - longest.b] + [
        p + 1 - len(turn) for p in range(cursor, len(ids)) if turn and ids[p] == turn[-1]
    ]
    after = _after_text(tok, ids, cursor, before.strip())
    if after is not None:
        places = list(range(after, min(len(ids), after + 12) + 1))
    text = decode(tok, turn)

    def alike(start: int) -> float:
        return SequenceMatcher(
            None, decode(tok, ids[max(cursor, start) : start + len(turn)]), text, autojunk=False
        ).ratio()

    return max(places, key=lambda s: (alike(s), -s))


def _after_text(tok, ids: list[int], cursor: int, text: str) -> int | None:
    """The index of the first id after the first place, from `cursor` on, where the ids read `text`."""
    if len(text) < 2:
        return None
    pieces = decode_many(tok, [[i] for i in ids[cursor:]])
    joined = "".join(pieces)
    at = joined.find(text)
    if at < 0:
        return None
    length, end = 0, at + len(text)
    for i, piece in enumerate(pieces):
        length += len(piece)
        if length >= end:
            return cursor + i + 1
    return None


def _turn_findings(tok, label: str, k: int, ids, turn, start: int, end: int, stops, reasoning) -> list[Finding]:
    """The divergences of a sampled turn from the trained ids at (start, end), each classified in the whole trained
    sequence (its context decides: a turn boundary, a think block) against the trained ids as they would be had
    they kept what was sampled there. Reasoning the trained ids lack is one finding (mode 4), however the
    alignment of its text with theirs splits it."""
    from rlbench.checks.tito import reasoning_block, classify, divergences

    # the trained ids after the turn continue both sides, so that what the turn lacks at its end stays at its end;
    # where the turn ends in them is taken where that leaves the fewest ids apart
    def apart(stop: int) -> list[tuple[int, int, int, int]]:
        tail = list(ids[stop : stop + 40])
        return [b for b in divergences(tok, ids[start : stop + 40], list(turn) + tail) if b[2] < len(turn)]

    end = min(
        range(end, min(len(ids), end + 8) + 1), key=lambda s: (sum(max(b[1] - b[0], b[3] - b[2]) for b in apart(s)), s)
    )
    blocks = apart(end)
    lost = _lost_reasoning(tok, turn, ids[start:end], reasoning[k] if k < len(reasoning) else "")
    found = []
    if lost is not None:
        first = next((b for b in blocks if b[3] > lost[0] and b[2] < lost[1]), None)
        if first is not None:
            blocks = [b for b in blocks if not (b[3] > lost[0] - 2 and b[2] < lost[1] + 2)] + [first]
            blocks.sort()
    for a1, a2, b1, b2 in blocks:
        i1, i2, b2 = start + a1, start + a2, min(b2, len(turn))
        view = list(ids[:i1]) + list(turn[b1:b2]) + list(ids[i2:])
        if view == list(ids):
            continue
        i1 = first_divergence(ids, view)  # the alignment may put ids both sides share at a block's start
        in_lost = lost is not None and b2 > lost[0] and b1 < lost[1]
        mode = (
            ("reasoning", True)
            if in_lost or reasoning_block(tok, ids[i1:i2], turn[b1:b2], reasoning)
            else classify(tok, ids, view, i1, [], [], stops)
        )
        f = finding(tok, label, f"assistant turn {k}: sampled vs trained", ids, view, i1, [], [], mode=mode)
        f.expected_index = b1
        found.append(f)
    return found


def _lost_reasoning(tok, turn: list[int], trained: list[int], reasoning: str) -> tuple[int, int] | None:
    """The ids of the turn that hold its reasoning, (first, end), where the trained ids do not have that text."""
    text = reasoning.strip()
    if not text or text in decode(tok, trained):
        return None
    at, pieces = decode(tok, turn).find(text), decode_many(tok, [[i] for i in turn])
    if at < 0:
        return None
    first, end, length = None, len(turn), 0
    for i, piece in enumerate(pieces):
        if first is None and length + len(piece) > at:
            first = i
        length += len(piece)
        if length >= at + len(text):
            end = i + 1
            break
    return (first or 0, end)


def _find(ids: list[int], part: list[int], start: int) -> int | None:
    """The first index >= start where `part` stands in `ids`."""
    if not part:
        return start
    for i in range(start, len(ids) - len(part) + 1):
        if ids[i] == part[0] and ids[i : i + len(part)] == part:
            return i
    return None
