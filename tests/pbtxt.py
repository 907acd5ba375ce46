"""A small reader for the protobuf text format of the checkout's config.pbtxt files,
shared by tests/infrastructure/test_model_repository.py and tests/served/test_faults.py."""

from __future__ import annotations

import re
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"


_TOKEN = re.compile(r'\s+|#[^\n]*|(?P<tok>"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"#]+)')


def parse_pbtxt(text: str) -> dict:
    """Message -> {field: [values]}; nested messages become dicts, scalars str/int/float."""
    tokens = [m.group("tok") for m in _TOKEN.finditer(text) if m.group("tok")]
    message, end = _message(tokens, 0)
    assert end == len(tokens), f"unexpected {tokens[end]!r}"
    return message


def _message(tokens: list[str], i: int) -> tuple[dict, int]:
    fields: dict[str, list] = {}
    while i < len(tokens) and tokens[i] != "}":
        name = tokens[i]
        i += 1
        if tokens[i] == ":":
            i += 1
        if tokens[i] == "[":
            i += 1
            while tokens[i] != "]":
                value, i = _value(tokens, i)
                fields.setdefault(name, []).append(value)
                if tokens[i] == ",":
                    i += 1
            i += 1
        else:
            value, i = _value(tokens, i)
            fields.setdefault(name, []).append(value)
    return fields, i


def _value(tokens: list[str], i: int) -> tuple[object, int]:
    token = tokens[i]
    if token == "{":
        message, i = _message(tokens, i + 1)
        return message, i + 1
    if token.startswith('"'):
        return token[1:-1], i + 1
    for kind in (int, float):
        try:
            return kind(token), i + 1
        except ValueError:
            pass
    return token, i + 1  # an enum such as TYPE_FP32 or KIND_CPU, or true/false


def one(message: dict, field: str):
    (value,) = message[field]
    return value


def load(model: str) -> dict:
    return parse_pbtxt((REPOSITORY / model / "config.pbtxt").read_text())
