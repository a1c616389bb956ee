"""Token-in-token-out (TITO) drift: what the check compares and how a divergence is classified.

The rule (research.md, section 2): the ids a trajectory was sampled as are the ids the trainer
sees; the full sequence of turn n-1 is a bit-exact prefix of turn n's input. Ids are compared,
never text; only a divergence found in the ids is then decoded, to name its cause:

  1  reencode   the text is the same, the ids are not (BPE is not one-to-one); or decoding was
                lossy (byte tokens that are no valid UTF-8 alone become U+FFFD)
  2  separator  whitespace after an end-of-turn lost or doubled
  3  stop       a stop token that also opens the next turn (GLM's <|user|>, <|observation|>) kept, doubled or
                swapped: the sampled stop and the rendered opener are one id, which a builder must not repeat
  4  reasoning  <think>...</think> of an earlier turn dropped from history, or sampled reasoning the
                template does not render at all
  5  position   an earlier turn renders differently once it is no longer last
  8  special    special tokens dropped by decode(skip_special_tokens=True)
  10 truncated  a truncated turn closed with an end-of-turn never sampled, and the conversation
                continues after it
     template   the chat template raised on this conversation shape (audit)

Not findings: whitespace a rendering adds after the last sampled end-of-turn, the end-of-turn it adds
to a truncated last turn, and a stop id sampled last that the rendering leaves out (nothing was
trained after any of them).

Every place where two sequences part is a divergence of its own (`divergences`): a reasoning strip
is named even behind an earlier separator. Next to each mode stands the category Miles' token
comparator gives the same difference (tito_miles.py), which compares decoded text per segment.

The checks themselves: tito_audit.py (a chat template against generated conversation shapes) and
tito_run.py (a run's recorded samples, through several lenses).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rlbench.checks.compare import first_divergence

MODES = {
    "reencode": (1, "re-encoding changes the ids of the same text"),
    "separator": (2, "separator after an end-of-turn lost or doubled"),
    "stop": (3, "a stop token that also opens the next turn kept, doubled or swapped"),
    "reasoning": (4, "reasoning, or the think block around it, lost from what was sampled"),
    "position": (5, "a turn renders differently once it is no longer last"),
    "special": (8, "special tokens dropped by decode(skip_special_tokens=True)"),
    "truncated": (10, "a truncated turn closed with an end-of-turn never sampled, and continued after"),
    "unsampled": (0, "trained as sampled, but no request of the step sampled these ids with these log-probs"),
    "template": (0, "the chat template raised on this conversation"),
    "other": (0, "unclassified"),
}
CONTEXT = 3  # ids shown before a divergence
SHOWN = 4  # ids shown from it
SPECIALS_WINDOW = 8  # ids read from a divergence on to tell a special token dropped (mode 8) from one swapped


@dataclass
class Finding:
    shape: str  # conversation shape (audit) or sample (run check)
    mode: str
    number: int
    strict: bool
    index: int  # the first id where the two sequences part
    context: list[int]  # the ids just before it, on which both agree
    expected: list[int]  # from the index on, as the reference (the trainer's rendering, the next turn) has them
    got: list[int]  # from the index on, as the sampled buffer has them
    context_text: str
    expected_text: str
    got_text: str
    where: str  # "final re-render", "turn 0 vs turn 1's prompt", ...
    category: str = ""  # what Miles' comparator calls the same difference ("none": its text comparison sees none)
    expected_index: int = -1  # where `expected` starts in the expected sequence (-1: at `index`, as `got`)


def render(tok, messages, tools, generation: bool, kwargs: dict | None = None) -> str:
    """The chat template's text for `messages`, with `kwargs` (enable_thinking, clear_thinking, ...) as template
    variables. Renders transformers' own compiled template with the variables `apply_chat_template` gives it, and
    the messages as it gives them: keys whose value is None dropped (an OpenAI-style `content: None` is no key, not
    the text "None"), reasoning under each name templates read. For plain dicts the text is the same
    (test_tito_render.py checks that), at half the cost per call; the public path is kept for anything else."""
    compiled = _compiled(tok)
    kwargs = kwargs or {}
    if compiled is None:
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=False, **kwargs
        )
    from jinja2.runtime import new_context

    template, base = compiled
    # jinja's Template.render walks the template's globals (a ChainMap) twice on every call; with
    # them merged into `base` once, a shared context needs neither walk, and renders the same text.
    variables = {
        **base,
        **kwargs,
        "messages": [_as_transformers_gives(m) for m in messages],
        "tools": tools,
        "documents": None,
        "add_generation_prompt": generation,
    }
    context = new_context(template.environment, template.name, template.blocks, variables, shared=True, globals=None)
    return template.environment.concat(template.root_render_func(context))


_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")  # transformers' _REASONING_FIELDS, in its order


def _as_transformers_gives(message):
    """A message as transformers' apply_chat_template hands it to the template: None-valued keys dropped, and the
    reasoning (under whichever name it came) also as `thinking` and `reasoning_content`."""
    if not isinstance(message, dict):
        return message
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_NAMES if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _compiled(tok):
    if not hasattr(tok, "_rlbench_template"):
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # private in transformers: without it, the public path
            tok._rlbench_template = None
        else:
            template = _compile_jinja_template(tok.chat_template) if tok.chat_template else None
            tok._rlbench_template = (
                None if template is None else (template, {**dict(template.globals), **tok.special_tokens_map})
            )
    return tok._rlbench_template


def encode(tok, text: str) -> list[int]:
    # The Rust tokenizer directly: the same ids as tok.encode, without transformers' Python wrapper,
    # which costs three times the encoding itself (bench/tito_throughput.py).
    backend = getattr(tok, "backend_tokenizer", None)
    return (
        backend.encode(text, add_special_tokens=False).ids
        if backend is not None
        else tok.encode(text, add_special_tokens=False)
    )


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
        # "decoder" is null in a tokenizer that has none (a WordLevel one, say): no byte table then either
        if backend is not None and (json.loads(backend.to_str()).get("decoder") or {}).get("type") == "ByteLevel":
            visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
            to_byte = {chr(b): b for b in visible}
            extra = 0
            for b in range(256):
                if b not in visible:
                    to_byte[chr(256 + extra)] = b
                    extra += 1
            table = {
                i: bytes(to_byte[c] for c in token) for token, i in backend.get_vocab(with_added_tokens=False).items()
            }
            table.update({i: t.content.encode() for i, t in tok.added_tokens_decoder.items()})
            tok._rlbench_bytes = table
    return tok._rlbench_bytes


def decode(tok, ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of `ids`; a padded id (core/vocab.py: an id the tokenizer has none for) adds none, as in the
    tokenizer's own decode."""
    table = None if skip_special_tokens else _byte_table(tok)
    if table is not None:
        return b"".join([table.get(i, b"") for i in ids]).decode("utf-8", "replace")
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def canonical(tok, ids: list[int]) -> list[int]:
    """The ids a pipeline that decodes and re-tokenises would turn `ids` into."""
    return encode(tok, decode(tok, ids))


def only_closing(tok, got: list[int], expected: list[int], truncated_last: bool) -> bool:
    """`got` is a prefix of `expected`, and what `expected` adds is whitespace after the last sampled
    end-of-turn (or, after a truncated last turn, the end-of-turn the rendering closes it with)."""
    if expected[: len(got)] != list(got):
        return False
    rest = list(expected[len(got) :])
    if truncated_last and rest[:1] == [tok.eos_token_id]:
        rest = rest[1:]
    return not decode(tok, rest).strip()


def classify(
    tok,
    got: list[int],
    expected: list[int],
    index: int,
    turn_ends: list[int],
    truncated_ends: list[int],
    stops: frozenset[int] = frozenset(),
    extends: bool = False,
) -> tuple[str, bool]:
    """(mode, strict) of the first divergence at `index` between a sampled buffer and a rendering.
    Each test decodes only what it needs, in this order: a run check may classify many findings.
    `stops`: the ids that end a sampled turn (generation_config.json's), besides the end-of-turn.
    `extends`: the rendering goes on past the buffer (the next turn's prompt): the same text then means the
    rendering's text starts with the buffer's."""
    eos = tok.eos_token_id
    if index in truncated_ends and index < len(expected) and expected[index] in stops | {eos}:
        return "truncated", True
    end = min([e for e in turn_ends if e > index] or [len(got)])
    segment = got[max(0, index - 3) : end]
    window = slice(index, index + 8)
    whole_got, whole_exp, text_got, text_exp, text_segment = decode_many(
        tok, [got, expected, got[window], expected[window], segment]
    )
    # The same text with other ids, whitespace a rendering adds after the final end-of-turn aside.
    if (
        whole_got == whole_exp
        or (index < min(len(got), len(expected)) and whole_got.rstrip() == whole_exp.rstrip())
        or (extends and whole_exp.startswith(whole_got))
    ):
        return "reencode", True
    if _specials_dropped(tok, got, expected, index):
        return "special", True
    if stops and _stop_differs(got, expected, index, stops):
        return "stop", True
    if ("<think>" in text_got) != ("<think>" in text_exp):  # a think block on one side only
        return "reasoning", True
    if index in turn_ends or (0 < index <= len(got) and got[index - 1] in stops | {eos}):  # at a turn boundary
        rest_got, rest_exp = decode(tok, got[index:]), decode(tok, expected[index:])  # "" past an end
        whitespace = (
            not (text_got.strip() or text_exp.strip())
            or (index >= len(got) and not rest_exp.strip())
            or (index >= len(expected) and not rest_got.strip())
        )
        if whitespace or _whitespace_token(tok, got, index) or _whitespace_token(tok, expected, index):
            return "separator", True
    if decode_drops(tok, got, index) != decode_drops(tok, expected, index):
        return "special", True
    # Byte tokens that are no valid UTF-8 on their own decode to U+FFFD, and that re-encodes to other
    # bytes: re-encoding drift with the text itself lost (a random policy samples such bytes often).
    # Look back a little: the lone byte may equal the first byte of U+FFFD's own encoding, which
    # moves the first differing id just past it.
    if "\ufffd" in text_segment and encode(tok, text_segment) != segment:
        return "reencode", True
    return "position", True


def _stop_differs(got: list[int], expected: list[int], index: int, stops: frozenset[int]) -> bool:
    """A stop id on one side at `index`: kept, doubled, or swapped for another id. Asked after _specials_dropped,
    so a special stop the sampled side merely lacks (a decode(skip_special_tokens=True) dropped it) is mode 8
    already; a special token sampled where the rendering has a stop is a swap, and a stop."""
    return (index < len(got) and got[index] in stops) or (index < len(expected) and expected[index] in stops)


def _same_without_specials(tok, got: list[int], expected: list[int]) -> bool:
    """Whether two windows read the same once special tokens are skipped, whitespace aside (as far as the shorter
    text goes): a decode that skipped an end-of-turn also loses the separator a builder puts after it."""
    a, b = ("".join(decode(tok, ids, skip_special_tokens=True).split()) for ids in (got, expected))
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _specials_dropped(tok, got: list[int], expected: list[int], index: int) -> bool:
    """The rendering has a special token at `index` that the sampled side lacks, and both read the same once
    special tokens are skipped: what decode(skip_special_tokens=True) and a re-encode make (mode 8), <|im_end|>
    included. A special token on the sampled side too must be one the rendering has after the dropped ones (only
    special tokens and whitespace between, within SPECIALS_WINDOW ids); another one in its place is a swap."""
    if not decode_drops(tok, expected, index):
        return False
    if decode_drops(tok, got, index):
        for k in range(index + 1, min(len(expected), index + SPECIALS_WINDOW)):
            if expected[k] == got[index]:
                break
            if not (decode_drops(tok, expected, k) or _whitespace_token(tok, expected, k)):
                return False
        else:
            return False
    return _same_without_specials(tok, got[index : index + SPECIALS_WINDOW], expected[index : index + SPECIALS_WINDOW])


def decode_drops(tok, ids: list[int], index: int) -> bool:
    """Whether decode(skip_special_tokens=True) drops the token at `index`: any token marked special
    (not only the named ones that `all_special_ids` lists)."""
    if not hasattr(tok, "_rlbench_special"):
        tok._rlbench_special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return index < len(ids) and ids[index] in tok._rlbench_special


def _whitespace_token(tok, ids: list[int], index: int) -> bool:
    return index < len(ids) and not decode(tok, [ids[index]]).strip()


def finding(
    tok,
    shape: str,
    where: str,
    got: list[int],
    expected: list[int],
    index: int,
    turn_ends: list[int],
    truncated_ends: list[int],
    mode: tuple[str, bool] | None = None,
    extends: bool = False,
) -> Finding:
    """The divergence at `index`, classified (unless `mode` is given; `extends` as classify's), with the ids on
    both sides from the index on and the few ids before it, each with its text."""
    mode = mode or classify(tok, got, expected, index, turn_ends, truncated_ends, extends=extends)
    return _shown(tok, shape, where, got, expected, index, mode)


def _shown(tok, shape: str, where: str, got: list[int], expected: list[int], index: int, mode: tuple[str, bool]):
    """A finding of `mode` at `index`: the ids on both sides from it on and the few before it, each with its text."""
    name, strict = mode
    context = list(got[max(0, index - CONTEXT) : index])
    exp, gt = list(expected[index : index + SHOWN]), list(got[index : index + SHOWN])
    context_text, exp_text, got_text = decode_many(tok, [context, exp, gt])
    return Finding(
        shape, name, MODES[name][0], strict, index, context, exp, gt, context_text, exp_text, got_text, where
    )


def divergence(
    tok,
    shape: str,
    where: str,
    got: list[int],
    expected: list[int],
    turn_ends: list[int],
    truncated_ends: list[int],
    truncated_last: bool = False,
) -> Finding | None:
    """The first divergence of `got` from `expected` as a finding, or None: none, or only the closing
    whitespace / end-of-turn a rendering adds after the last sampled id."""
    index = first_divergence(got, expected)
    if index is None or only_closing(tok, got, expected, truncated_last):
        return None
    return finding(tok, shape, where, got, expected, index, turn_ends, truncated_ends)


def divergences(
    tok, got: list[int], expected: list[int], truncated_last: bool = False, stops: frozenset[int] = frozenset()
) -> list[tuple[int, int, int, int]]:
    """Every place where `got` and `expected` part, as (i1, i2, j1, j2): got[i1:i2] stands where expected has
    expected[j1:j2], the ids between blocks agreeing (difflib's longest-matching-block alignment). Left out: a last
    block that is only what a rendering closes with (only_closing), or a stop id sampled last that the rendering
    leaves out."""
    from difflib import SequenceMatcher

    if list(got) == list(expected):
        return []
    blocks = [
        (i1, i2, j1, j2)
        for tag, i1, i2, j1, j2 in SequenceMatcher(None, got, expected, autojunk=False).get_opcodes()
        if tag != "equal"
    ]
    blocks = _joined(tok, got, expected, blocks)
    if blocks and _closing(tok, got, expected, blocks[-1], truncated_last, stops):
        blocks.pop()
    return blocks


def _joined(tok, got, expected, blocks: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Blocks that are one change: the alignment matches single ids inside a changed stretch ('Hello' against
    'Bye' shares 'e'; 'tan'+'t'+'ool' against 'tant'+'ool' shares 'ool'), which splits one divergence into several.
    Neighbours are joined back when the ids between them are few and no special token (a segment boundary), or
    when their joint stretch reads the same on both sides (a re-segmentation)."""
    out: list[tuple[int, int, int, int]] = []
    for block in blocks:
        if out:
            a1, a2, b1, b2 = out[-1]
            i1, i2, j1, j2 = block
            plain = i1 - a2 <= 2 and not any(decode_drops(tok, got, k) for k in range(a2, i1))
            if plain or (i1 - a2 <= 3 and decode(tok, got[a1:i2]) == decode(tok, expected[b1:j2])):
                out[-1] = (a1, i2, b1, j2)
                continue
        out.append(block)
    return out


def _closing(tok, got, expected, block, truncated_last: bool, stops: frozenset[int]) -> bool:
    i1, i2, j1, j2 = block
    if i2 != len(got):  # the last block ends both sequences or neither: difflib's opcodes end in an equal run
        return False
    rest = list(expected[j1:])
    if i1 == i2:  # nothing sampled here: what the rendering adds after the last sampled id
        if truncated_last and rest and rest[0] in stops | {tok.eos_token_id}:
            rest = rest[1:]
        return not decode(tok, rest).strip()
    tail = list(got[i1:])  # sampled, not rendered: a stop id, as the very last id, and at most whitespace around it
    return tail[-1] in stops and not decode(tok, tail[:-1] + rest).strip()


def block_findings(
    tok,
    shape: str,
    where: str,
    got: list[int],
    expected: list[int],
    turn_ends: list[int],
    truncated_ends: list[int],
    truncated_last: bool = False,
    stops: frozenset[int] = frozenset(),
    reasoning: tuple[str, ...] = (),
    extension: bool = False,
    hazard=None,
    compare=None,
) -> list[Finding]:
    """A finding for each divergence of `got` from `expected` (divergences), each classified on its own: the
    expected side seen as if everything before the block had agreed. `reasoning`: the reasoning texts of the
    conversation's turns; a block that has one on a side only is mode 4 whatever markers surround it.
    `extension`: `expected` may go on past `got` (a longer rendering): what it adds at the end is no divergence.
    `hazard(mode, i1, i2)`: True makes the finding a hazard (not strict). `compare`: Miles' comparator, whose
    category each finding then carries (tito_miles.categories)."""
    blocks = divergences(tok, got, expected, truncated_last, stops)
    aligned = len(expected)  # how much of `expected` stands against `got` (the rest: what an extension adds)
    if extension and blocks and blocks[-1][0] == blocks[-1][1] == len(got):
        aligned = blocks.pop()[2]
    found = []
    for i1, i2, j1, j2 in blocks:
        view = list(got[:i1]) + list(expected[j1:])
        # The alignment may put ids both sides share at a block's start. Never None: the two sides of a block differ
        # from its start on (no difflib block has got[i1:] == expected[j1:]; none in 700,000 random pairs).
        i1 = first_divergence(got, view)
        mode = (
            ("reasoning", True)
            if reasoning_block(tok, got[i1:i2], expected[j1:j2], reasoning)
            else classify(tok, got, view, i1, turn_ends, truncated_ends, stops)
        )
        if hazard is not None and hazard(mode[0], i1, i2):
            mode = (mode[0], False)
        f = _shown(tok, shape, where, got, view, i1, mode)
        f.expected_index = j1
        found.append(f)
    if compare is not None:
        from rlbench.checks.tito_miles import categories

        for f, category in zip(found, categories(compare, got, expected[:aligned], blocks)):
            f.category = category
    return found


def reasoning_block(tok, got: list[int], expected: list[int], reasoning: tuple[str, ...]) -> bool:
    """A turn's reasoning on one side of a block only, whole, or in part against nothing (think markers aside)."""
    a, b = (decode(tok, ids).strip() for ids in (got, expected))
    bare_a, bare_b = (x.replace("<think>", "").replace("</think>", "").strip() for x in (a, b))
    for text in (r.strip() for r in reasoning):
        if not text:
            continue
        if (text in a) != (text in b):
            return True
        if (len(bare_a) >= 3 and bare_a in text and not bare_b) or (len(bare_b) >= 3 and bare_b in text and not bare_a):
            return True
    return False
