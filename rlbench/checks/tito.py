"""Token-in-token-out (TITO) drift: what the check compares and how a divergence is classified.

The rule (research.md, section 2): the ids a trajectory was sampled as are the ids the trainer
sees; the full sequence of turn n-1 is a bit-exact prefix of turn n's input. Ids are compared,
never text; only a divergence found in the ids is then decoded, to name its cause:

  1  reencode   the text is the same, the ids are not (BPE is not one-to-one); or decoding was
                lossy (byte tokens that are no valid UTF-8 alone become U+FFFD)
  2  separator  whitespace after an end-of-turn lost or doubled
  4  reasoning  <think>...</think> of an earlier turn dropped from history
  5  position   an earlier turn renders differently once it is no longer last
  8  special    special tokens dropped by decode(skip_special_tokens=True)
  10 truncated  a truncated turn closed with an end-of-turn never sampled, and the conversation
                continues after it
     template   the chat template raised on this conversation shape (audit)

Not findings: whitespace a rendering adds after the last sampled end-of-turn, and the end-of-turn
it adds to a truncated last turn (nothing was trained after either).

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
    "reasoning": (4, "reasoning stripped from earlier turns"),
    "position": (5, "a turn renders differently once it is no longer last"),
    "special": (8, "special tokens dropped by decode(skip_special_tokens=True)"),
    "truncated": (10, "a truncated turn closed with an end-of-turn never sampled, and continued after"),
    "template": (0, "the chat template raised on this conversation"),
    "other": (0, "unclassified"),
}
CONTEXT = 3  # ids shown before a divergence
SHOWN = 4  # ids shown from it


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
        # "decoder" is null in a tokenizer that has none (a WordLevel one, say): no byte table then either
        if backend is not None and (json.loads(backend.to_str()).get("decoder") or {}).get("type") == "ByteLevel":
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


def canonical(tok, ids: list[int]) -> list[int]:
    """The ids a pipeline that decodes and re-tokenises would turn `ids` into."""
    return encode(tok, decode(tok, ids))


def only_closing(tok, got: list[int], expected: list[int], truncated_last: bool) -> bool:
    """`got` is a prefix of `expected`, and what `expected` adds is whitespace after the last sampled
    end-of-turn (or, after a truncated last turn, the end-of-turn the rendering closes it with)."""
    if expected[: len(got)] != list(got):
        return False
    rest = list(expected[len(got):])
    if truncated_last and rest[:1] == [tok.eos_token_id]:
        rest = rest[1:]
    return not decode(tok, rest).strip()


def classify(tok, got: list[int], expected: list[int], index: int, turn_ends: list[int],
             truncated_ends: list[int]) -> tuple[str, bool]:
    """(mode, strict) of the first divergence at `index` between a sampled buffer and a rendering.
    Each test decodes only what it needs, in this order: a run check may classify many findings."""
    eos = tok.eos_token_id
    if index in truncated_ends and index < len(expected) and expected[index] == eos:
        return "truncated", True
    end = min([e for e in turn_ends if e > index] or [len(got)])
    segment = got[max(0, index - 3):end]
    window = slice(index, index + 8)
    whole_got, whole_exp, text_got, text_exp, text_segment = decode_many(
        tok, [got, expected, got[window], expected[window], segment])
    # The same text with other ids, whitespace a rendering adds after the final end-of-turn aside.
    if whole_got == whole_exp or (index < min(len(got), len(expected)) and whole_got.rstrip() == whole_exp.rstrip()):
        return "reencode", True
    if ("<think>" in text_got) != ("<think>" in text_exp):  # a think block on one side only
        return "reasoning", True
    if index in turn_ends or (index > 0 and got[index - 1] == eos):  # at a turn boundary
        rest_got = decode(tok, got[index:]) if index < len(got) else ""
        rest_exp = decode(tok, expected[index:]) if index < len(expected) else ""
        whitespace = not (text_got.strip() or text_exp.strip()) or \
            (index >= len(got) and not rest_exp.strip()) or (index >= len(expected) and not rest_got.strip())
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


def decode_drops(tok, ids: list[int], index: int) -> bool:
    """Whether decode(skip_special_tokens=True) drops the token at `index`: any token marked special
    (not only the named ones that `all_special_ids` lists)."""
    if not hasattr(tok, "_rlbench_special"):
        tok._rlbench_special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return index < len(ids) and ids[index] in tok._rlbench_special


def _whitespace_token(tok, ids: list[int], index: int) -> bool:
    return index < len(ids) and not decode(tok, [ids[index]]).strip()


def finding(tok, shape: str, where: str, got: list[int], expected: list[int], index: int, turn_ends: list[int],
            truncated_ends: list[int], mode: tuple[str, bool] | None = None) -> Finding:
    """The divergence at `index`, classified (unless `mode` is given), with the ids on both sides from
    the index on and the few ids before it, each with its text."""
    name, strict = mode or classify(tok, got, expected, index, turn_ends, truncated_ends)
    context = list(got[max(0, index - CONTEXT): index])
    exp, gt = list(expected[index: index + SHOWN]), list(got[index: index + SHOWN])
    context_text, exp_text, got_text = decode_many(tok, [context, exp, gt])
    return Finding(shape, name, MODES[name][0], strict, index, context, exp, gt, context_text, exp_text, got_text,
                   where)


def divergence(tok, shape: str, where: str, got: list[int], expected: list[int], turn_ends: list[int],
               truncated_ends: list[int], truncated_last: bool = False) -> Finding | None:
    """The first divergence of `got` from `expected` as a finding, or None: none, or only the closing
    whitespace / end-of-turn a rendering adds after the last sampled id."""
    index = first_divergence(got, expected)
    if index is None or only_closing(tok, got, expected, truncated_last):
        return None
    return finding(tok, shape, where, got, expected, index, turn_ends, truncated_ends)
