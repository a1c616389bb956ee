"""`check tito`: token-in-token-out drift, found by comparing ids and classified by cause.

The rule (research.md, section 2): the token sequence a trajectory was sampled as must be what
the trainer sees; the full sequence of turn n-1 must be a bit-exact prefix of turn n's input.

The audit (`audit(tokenizer)`) plays a token-in-token-out builder over generated conversation
shapes: the generation prompt is tokenised, each assistant turn is sampled as the template
renders it, up to and including the stop token (none for a truncated turn), and the environment's
messages are appended as the rendered suffix (what the template adds when the conversation
grows). The buffer is then compared, as ids, with the trainer's re-render of the whole
conversation, and with each extended rendering on the way (the prefix property). Each first
divergence is classified:

  1  reencode   the text is the same, the ids are not (BPE is not one-to-one); or decoding was
                lossy (byte tokens that are no valid UTF-8 alone become U+FFFD)
  2  separator  whitespace after an end-of-turn lost or doubled
  4  reasoning  <think>...</think> of an earlier turn dropped from history
  5  position   an earlier turn renders differently once it is no longer last
  8  special    special tokens dropped by decode(skip_special_tokens=True)
  10 truncated  a truncated turn closed with an end-of-turn token never sampled
A divergence after the last sampled token that adds only whitespace is reported but not strict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlbench.checks.compare import first_divergence

MODES = {
    "reencode": (1, "re-encoding changes the ids of the same text"),
    "separator": (2, "separator after an end-of-turn lost or doubled"),
    "reasoning": (4, "reasoning stripped from earlier turns"),
    "position": (5, "a turn renders differently once it is no longer last"),
    "special": (8, "special tokens dropped by decode(skip_special_tokens=True)"),
    "truncated": (10, "a truncated turn closed with an end-of-turn never sampled"),
    "other": (0, "unclassified"),
}
CALCULATOR = {"name": "calculator", "description": "evaluates an arithmetic expression"}


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def _call(expr):
    return {"name": "calculator", "arguments": expr}


SHAPES: dict[str, tuple[list[dict], list | None]] = {
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
class Finding:
    shape: str  # conversation shape (audit) or sample (run check)
    mode: str
    number: int
    strict: bool
    index: int
    expected: list[int]  # ids around the index, as the trainer's rendering has them
    got: list[int]  # as the sampled buffer has them
    expected_text: str
    got_text: str
    where: str  # "final re-render", "prefix after turn 2", ...


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


def render(tok, messages, tools, generation: bool) -> str:
    """The chat template's text for `messages`. Renders transformers' own compiled template with the
    variables `apply_chat_template` gives it: for the plain dicts a recording holds the text is the
    same (test_tito_render.py checks that), at half the cost per call; the public path is kept for
    anything else."""
    compiled = _compiled(tok)
    if compiled is None:
        return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=False)
    from jinja2.runtime import new_context

    template, base = compiled
    # jinja's Template.render walks the template's globals (a ChainMap) twice on every call; with
    # them merged into `base` once, a shared context needs neither walk, and renders the same text.
    context = new_context(template.environment, template.name, template.blocks,
                          {**base, "messages": messages, "tools": tools, "add_generation_prompt": generation},
                          shared=True, globals=None)
    return template.environment.concat(template.root_render_func(context))


def _compiled(tok):
    if not hasattr(tok, "_rlbench_template"):
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # private in transformers: without it, the public path
            tok._rlbench_template = None
        else:
            template = _compile_jinja_template(tok.chat_template) if tok.chat_template else None
            tok._rlbench_template = None if template is None else \
                (template, {**dict(template.globals), **tok.special_tokens_map})
    return tok._rlbench_template


def encode(tok, text: str) -> list[int]:
    # The Rust tokenizer directly: the same ids as tok.encode, without transformers' Python wrapper,
    # which costs three times the encoding itself (bench/tito_throughput.py).
    backend = getattr(tok, "backend_tokenizer", None)
    return backend.encode(text, add_special_tokens=False).ids if backend is not None else \
        tok.encode(text, add_special_tokens=False)


def decode_many(tok, sequences: list[list[int]]) -> list[str]:
    # One call each: the backend's decode_batch hands work to a thread pool, which for a handful of
    # short sequences costs more than it saves (measured: x1.5 slower on 2 cores).
    return [decode(tok, s) for s in sequences]


def _byte_table(tok) -> dict[int, bytes] | None:
    """For a byte-level BPE (GPT-2's byte-to-unicode alphabet: Qwen, Llama 3, ...), each id's bytes,
    so a decode is a join and a UTF-8 decode with replacement: the same text as the tokenizer's own
    decode (test_tito_render.py checks 20,000 random sequences) at a third of its per-call cost,
    which dominates the short decodes classification makes."""
    if not hasattr(tok, "_rlbench_bytes"):
        tok._rlbench_bytes = None
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None and json.loads(backend.to_str()).get("decoder", {}).get("type") == "ByteLevel":
            visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
            to_byte = {chr(b): b for b in visible}
            extra = 0
            for b in range(256):
                if b not in visible:
                    to_byte[chr(256 + extra)] = b
                    extra += 1
            table = {i: bytes(to_byte[c] for c in token)
                     for token, i in backend.get_vocab(with_added_tokens=False).items()}
            table.update({i: t.content.encode() for i, t in tok.added_tokens_decoder.items()})
            tok._rlbench_bytes = table
    return tok._rlbench_bytes


def decode(tok, ids: list[int], skip_special_tokens: bool = False) -> str:
    table = None if skip_special_tokens else _byte_table(tok)
    if table is not None:
        return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def classify(tok, got: list[int], expected: list[int], index: int, turn_ends: list[int],
             truncated_ends: list[int]) -> tuple[str, bool]:
    """(mode, strict) of the first divergence at `index` between a sampled buffer and a rendering.
    Each test decodes only what it needs, in this order: the run check classifies every finding."""
    eos = tok.eos_token_id
    if index in truncated_ends and index < len(expected) and expected[index] == eos:
        return "truncated", True
    end = min([e for e in turn_ends if e > index] or [len(got)])
    segment = got[max(0, index - 3):end]
    window = slice(index, index + 8)
    whole_got, whole_exp, text_got, text_exp, text_segment = decode_many(
        tok, [got, expected, got[window], expected[window], segment])
    if whole_got == whole_exp:
        return "reencode", True
    if ("<think>" in text_got) != ("<think>" in text_exp):  # a think block on one side only
        return "reasoning", True
    if index in turn_ends or (index > 0 and got[index - 1] == eos):  # at a turn boundary
        rest_got = decode(tok, got[index:]) if index < len(got) else ""
        rest_exp = decode(tok, expected[index:]) if index < len(expected) else ""
        whitespace = not (text_got.strip() or text_exp.strip()) or \
            (index >= len(got) and not rest_exp.strip()) or (index >= len(expected) and not rest_got.strip())
        if whitespace or _whitespace_token(tok, got, index) or _whitespace_token(tok, expected, index):
            trailing = index >= (turn_ends[-1] if turn_ends else 0)
            return "separator", not (trailing and whitespace)
    if _dropped(tok, got, index) != _dropped(tok, expected, index):
        return "special", True
    # Byte tokens that are no valid UTF-8 on their own decode to U+FFFD, and that re-encodes to other
    # bytes: re-encoding drift with the text itself lost (a random policy samples such bytes often).
    # Look back a little: the lone byte may equal the first byte of U+FFFD's own encoding, which
    # moves the first differing id just past it.
    if "\ufffd" in text_segment and encode(tok, text_segment) != segment:
        return "reencode", True
    return "position", True


def _dropped(tok, ids: list[int], index: int) -> bool:
    """Whether decode(skip_special_tokens=True) drops the token at `index`: any token marked special
    (not only the named ones that `all_special_ids` lists)."""
    if not hasattr(tok, "_rlbench_special"):
        tok._rlbench_special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return index < len(ids) and ids[index] in tok._rlbench_special


def _whitespace_token(tok, ids: list[int], index: int) -> bool:
    return index < len(ids) and not decode(tok, [ids[index]]).strip()


def _finding(tok, shape, where, got, expected, index, turn_ends, truncated_ends) -> Finding:
    mode, strict = classify(tok, got, expected, index, turn_ends, truncated_ends)
    lo, hi = max(0, index - 3), index + 4
    text_exp, text_got = decode_many(tok, [expected[lo:hi], got[lo:hi]])
    return Finding(shape, mode, MODES[mode][0], strict, index, list(expected[lo:hi]), list(got[lo:hi]),
                   text_exp, text_got, where)


def audit_shape(tok, shape: str, messages: list[dict], tools) -> list[Finding]:
    """Play a token-in-token-out builder over one conversation; return its first divergence(s)."""
    eos = tok.eos_token_id
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    buffer = encode(tok, render(tok, messages[: turns[0]], tools, True))
    turn_ends, truncated_ends, findings = [], [], []
    for k, j in enumerate(turns):
        prompt = render(tok, messages[:j], tools, True)
        turn = render(tok, messages[: j + 1], tools, False)
        if not turn.startswith(prompt):
            ids_a, ids_b = encode(tok, prompt), encode(tok, turn)
            index = first_divergence(ids_a, ids_b)
            return [_finding(tok, shape, f"generation prompt vs turn {j}", ids_a, ids_b, index, [], [])]
        body = turn[len(prompt):]
        stop = body.find(tok.eos_token)
        content = body if stop < 0 else body[:stop]
        truncated = bool(messages[j].get("truncated"))
        sampled = encode(tok, content)
        # What a naive builder does with the sampled ids: decode them to text (special tokens skipped).
        if decode(tok, sampled, skip_special_tokens=True) != decode(tok, sampled):
            dropped = next(i for i in range(len(sampled)) if _dropped(tok, sampled, i))
            findings.append(Finding(shape, "special", MODES["special"][0], True, len(buffer) + dropped,
                                    sampled[max(0, dropped - 3): dropped + 4], [], decode(tok, sampled),
                                    decode(tok, sampled, skip_special_tokens=True), f"decode of turn {j}"))
        buffer += sampled + ([] if truncated else [eos])
        turn_ends.append(len(buffer))
        if truncated:
            truncated_ends.append(len(buffer))
        if k + 1 < len(turns):
            grown = render(tok, messages[: turns[k + 1]], tools, True)
            if not grown.startswith(turn):  # the history renders differently now: the prefix property fails
                ids_a, ids_b = encode(tok, turn), encode(tok, grown)
                index = first_divergence(ids_a, ids_b)
                findings.append(_finding(tok, shape, f"prefix after turn {j}", ids_a, ids_b, index, [], []))
                return findings
            buffer += encode(tok, grown[len(turn):])
    final = encode(tok, render(tok, messages, tools, False))
    index = first_divergence(buffer, final)
    if index is not None:
        findings.append(_finding(tok, shape, "final re-render", buffer, final, index, turn_ends, truncated_ends))
    return findings


def audit(tokenizer_dir: str | Path, shapes: list[str] | None = None) -> AuditReport:
    from rlbench.core.model import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    names = shapes or list(SHAPES)
    report = AuditReport(str(tokenizer_dir), names)
    for name in names:
        messages, tools = SHAPES[name]
        report.findings += audit_shape(tok, name, messages, tools)
    return report


@dataclass
class SampleFinding:
    step: int | None
    sample: int
    where: str
    finding: Finding


@dataclass
class RunReport:
    source: str
    samples: int
    findings: list[SampleFinding] = field(default_factory=list)

    @property
    def rates(self) -> dict[str, float]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.finding.mode] = counts.get(f.finding.mode, 0) + 1
        return {mode: count / self.samples for mode, count in counts.items()}

    @property
    def strict(self) -> bool:
        return any(f.finding.strict for f in self.findings)


def _check_turns(tok, turns: list[dict], trained: list[int], label: str) -> Finding | None:
    """The TITO rule: each turn's prompt + sampled ids is a prefix of the next turn's prompt, and the
    last one's of the ids the trainer trains on."""
    eos = tok.eos_token_id
    for k in range(len(turns)):
        got = list(turns[k]["prompt_ids"]) + list(turns[k]["output_ids"])
        nxt, where = (list(turns[k + 1]["prompt_ids"]), f"turn {k + 1}'s prompt") if k + 1 < len(turns) \
            else (list(trained), "the trained ids")
        index = first_divergence(got, nxt[: len(got)] if len(nxt) >= len(got) else nxt)
        if index is not None:
            truncated = [len(got)] if not turns[k]["output_ids"] or turns[k]["output_ids"][-1] != eos else []
            return _finding(tok, label, f"turn {k} vs {where}", got, nxt, index, [len(got)], truncated)
    return None


def _check_rendered(tok, ids: list[int], messages: list[dict], label: str) -> Finding | None:
    """A single sequence against the chat template's rendering of the same messages."""
    expected = encode(tok, render(tok, messages, None, False))
    index = first_divergence(ids, expected)
    if index is None:
        return None
    truncated = [len(ids)] if messages and messages[-1].get("truncated") else []
    return _finding(tok, label, "the chat template's re-render", ids, expected, index, [len(ids)], truncated)


def check_run(path: str | Path, tokenizer_dir: str | Path | None = None) -> RunReport:
    """Every sample of a run directory (or a JSONL of {messages, token_ids}) held to the TITO rule."""
    import json

    from rlbench.core.model import load_tokenizer
    from rlbench.errors import BadInput
    from rlbench.rundir import recording
    from rlbench.rundir.directory import read_run

    path = Path(path)
    if path.is_file():
        if tokenizer_dir is None:
            raise BadInput("a JSONL of trajectories needs --tokenizer", path=path)
        tok = load_tokenizer(tokenizer_dir)
        report = RunReport(str(path), 0)
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids, messages = [int(t) for t in row["token_ids"]], row["messages"]
            except (ValueError, KeyError, TypeError) as exc:
                raise BadInput(f"line {lineno}: expected {{\"messages\": [...], \"token_ids\": [...]}} "
                               f"({exc.__class__.__name__})", path=path) from None
            report.samples += 1
            found = _check_rendered(tok, ids, messages, f"line {lineno}")
            if found is not None:
                report.findings.append(SampleFinding(None, lineno, found.where, found))
        return report
    from rlbench.core.context import check_made_with

    run = read_run(path)
    tokenizer_dir = tokenizer_dir or run.manifest["config"]["model"]["tokenizer"]
    check_made_with(run, tokenizer=tokenizer_dir)
    tok = load_tokenizer(tokenizer_dir)
    report = RunReport(str(run.root), 0)
    for step in run.steps:
        tensors, meta = recording.read_step(run.root, step)
        offsets, tokens = tensors["offsets"].tolist(), tensors["tokens"].tolist()  # once a step, not a sample
        for i, sample in enumerate(meta["samples"]):
            report.samples += 1
            ids = tokens[offsets[i]: offsets[i + 1]]
            label = f"step {step} sample {i}"
            if sample.get("turns"):
                found = _check_turns(tok, sample["turns"], ids, label)
            else:
                reply = {"role": "assistant", "content": sample["response"]}
                if sample.get("finish_reason") == "length":
                    reply["truncated"] = True
                found = _check_rendered(tok, ids, list(sample["messages"]) + [reply], label)
            if found is not None:
                report.findings.append(SampleFinding(step, i, found.where, found))
    return report
