"""Miles' token-in-token-out library (PyPI miles-tito-tokenizers 0.1.1, extracted from radixark/miles), as rlbench
uses it: a model family's TITO builder with the kwargs and append roles Miles registers for it, and the categories
its token comparator gives a difference.

Where rlbench deliberately differs from Miles:
- Miles' comparator splits two id sequences at special tokens and compares each segment's decoded text, so the same
  text re-segmented into other ids is no mismatch to it. rlbench compares ids first (tito.divergences) and gives
  Miles' category next to its own mode; "none" where Miles' text comparison sees nothing (a re-segmentation).
- Miles' chat-template check (testing/chat_template_verify.py) renders the history from the messages; rlbench plays
  what an engine samples after the generation prompt (tito_audit.py), so it also checks that the generation prompt
  and the turn as rendered agree (GLM-4.7's `<|assistant|><think>` against `<|assistant|></think>`, MiniMax's forced
  `<think>\\n`), which Miles never does.
- Miles' get_tito_tokenizer resolves the kwargs of a family's fixed template but not the template itself (the caller
  loads it); rlbench audits the tokenizer's own template and says when it is not the family's fixed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlbench.errors import BadInput

ROLES = ("tool", "user", "system")  # what Miles lets a builder append (resolve_fixed_chat_template's _VALID_ROLES)


def families() -> tuple[str, ...]:
    from miles_tito_tokenizers import TITOTokenizerType

    return tuple(t.value for t in TITOTokenizerType)


@dataclass
class Family:
    """A model family's TITO builder, as Miles makes it, and what rlbench reports about it."""

    name: str
    tito: object  # miles_tito_tokenizers.TITOTokenizer
    kwargs: dict  # the template kwargs it renders with: Miles' registered ones, the user's winning on conflict
    roles: tuple[str, ...]  # the roles it may append after an assistant turn
    fixed_template: str | None  # the fixed template file Miles ships for these roles (None: the model's own)
    notes: list[str] = field(default_factory=list)


def load_family(tok, name: str, kwargs: dict, roles: list[str] | None) -> Family:
    """Miles' builder for `name`; bad input (exit 2) for an unknown family, role or tokenizer it cannot serve."""
    from miles_tito_tokenizers import TITOTokenizerType, get_tito_tokenizer, resolve_fixed_chat_template

    if name not in families():
        raise BadInput(f"unknown TITO model family {name!r}; one of {', '.join(families())}", field="--tito-model")
    roles = list(roles or ["tool"])
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise BadInput(
            f"unknown append role(s) {', '.join(unknown)}; Miles allows {', '.join(ROLES)}",
            field="--tito-allowed-append-roles",
        )
    fixed = None
    try:
        if (
            name != TITOTokenizerType.DEFAULT.value
            and TITOTokenizerType.get_tokenizer_class(TITOTokenizerType(name)).SUPPORTED_TEMPLATES
        ):
            fixed, _ = resolve_fixed_chat_template(name, set(roles))
        tito = get_tito_tokenizer(
            tok, tokenizer_type=name, chat_template_kwargs=dict(kwargs), allowed_append_roles=roles
        )
    except ValueError as exc:  # no template registered for these roles
        raise BadInput(" ".join(str(exc).split()), field="--tito-allowed-append-roles") from None
    except (AssertionError, KeyError, TypeError) as exc:  # the tokenizer lacks the family's markup
        raise BadInput(
            f"the tokenizer cannot serve Miles' {name} builder ({exc.__class__.__name__}: "
            f"{' '.join(str(exc).split())[:160]})",
            field="--tito-model",
        ) from None
    _check_markup(tok, name, tito)
    family = Family(name, tito, dict(tito.chat_template_kwargs), tuple(roles), Path(fixed).name if fixed else None)
    if fixed and (tok.chat_template or "").strip() != Path(fixed).read_text(encoding="utf-8").strip():
        family.notes.append(
            f"the tokenizer's chat template is not {Path(fixed).name}, the fixed template Miles ships "
            f"for {name} with append roles {', '.join(roles)}: the tokenizer's own is audited"
        )
    return family


def _check_markup(tok, name: str, tito) -> None:
    """Miles' builder looks its family's markup up by name and gets None (or the unknown id) where the tokenizer
    has none: refused here, before it renders anything."""
    added = set(tok.added_tokens_decoder)
    ids = [v for k, v in vars(tito).items() if k.endswith("_id")]
    ids += list(tito.trailing_token_ids) + list(tito.special_token_ids or [])
    start = getattr(tito, "_assistant_start_str", None)
    opener = start is None or any(i in added for i in tok.encode(start, add_special_tokens=False))
    if not opener or any(i is None or i == tok.unk_token_id or not 0 <= i < len(tok) for i in ids):
        raise BadInput(
            f"the tokenizer cannot serve Miles' {name} builder: it lacks the family's markup "
            f"({start or 'its turn tokens'})",
            field="--tito-model",
        )


def render(family: Family, messages: list[dict], tools, generation: bool) -> str:
    """The family's rendering, as Miles' builder renders (its kwargs; DeepSeek through its encoder)."""
    return family.tito.render_messages(messages, add_generation_prompt=generation, tools=tools)


def comparator(tok, family: Family | None, assistant_start: str | None):
    """Miles' TokenSeqComparator: the family's own (its special ids and trailing trims), or a default one."""
    from miles_tito_tokenizers import TokenSeqComparator

    if family is not None:
        return family.tito.create_comparator()
    return TokenSeqComparator(tok, assistant_start_str=assistant_start)


def categories(compare, got: list[int], expected: list[int], blocks: list[tuple[int, int, int, int]]) -> list[str]:
    """For each block (tito.divergences) of `got` against `expected`, the category Miles' comparator gives the
    segment the block starts in: special_token_count (the special-token structure differs: Miles compares nothing
    further), special_token_type, assistant_text, non_assistant_text; "none" where its text comparison sees no
    difference there."""
    if not blocks:
        return []
    found = compare.compare_sequences(list(expected), list(got))
    if any(m.type.value == "special_token_count" for m in found):
        return ["special_token_count"] * len(blocks)
    by_segment = {m.segment_index: m.type.value for m in found}
    starts, at = [], 0
    for segment in compare.segment_by_special_tokens(list(got)):
        starts.append(at)
        at += len(segment.token_ids)
    out = []
    for i1, *_ in blocks:
        index = max([k for k, s in enumerate(starts) if s <= i1] or [0])
        out.append(by_segment.get(index, "none"))
    return out
