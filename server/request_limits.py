"""Input from outside, bounded: every string field of an incoming message has a length limit checked before the
servicer looks at it, every enum field must hold a value the protocol defines, and a status message quotes client
input only as a short escaped prefix and is never longer than MAX_DETAILS_BYTES in all.

Limits: fields named `text` take up to the service's max_text_chars; every other string (keys, model, adapter and
dtype names, kinds, session ids, config hashes) takes up to MAX_NAME_CHARS. Messages nested in a request are
walked too (a PutSourceKV header's model name, ...).
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

__all__ = ["MAX_NAME_CHARS", "MAX_DETAILS_BYTES", "check_message", "quote", "clip_details"]

MAX_NAME_CHARS = 256  # a content key is 64 hex characters; names and kinds are shorter still
MAX_DETAILS_BYTES = 1024  # a status message on the wire (C-core clients refuse metadata over 8 KiB)
QUOTE_CHARS = 48  # how much of a client's value a message quotes


def check_message(message, max_text_chars: int, path: str = "") -> None:
    """ValueError naming the first field that is too long or holds an unknown enum value."""
    for field, value in message.ListFields():
        name = f"{path}{field.name}"
        values = value if field.is_repeated else (value,)
        if field.type == FieldDescriptor.TYPE_STRING:
            limit = max_text_chars if field.name == "text" else MAX_NAME_CHARS
            for v in values:
                if len(v) > limit:
                    raise ValueError(f"{name} is {len(v)} characters long; this server takes at most {limit}")
        elif field.type == FieldDescriptor.TYPE_ENUM:
            known = field.enum_type.values_by_number
            for v in values:
                if v not in known:
                    raise ValueError(f"{name} = {v} is not a {field.enum_type.name} value "
                                     f"(known: {', '.join(f'{n.name}={n.number}' for n in field.enum_type.values)})")
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            for v in values:
                check_message(v, max_text_chars, f"{name}.")


def quote(value, limit: int = QUOTE_CHARS) -> str:
    """A client's value as it may appear in a status message: its first `limit` characters, escaped (repr, then
    ASCII), and its length when cut."""
    if not isinstance(value, str):
        value = str(value)
    shown = repr(value[:limit]).encode("ascii", "backslashreplace").decode("ascii")
    return shown if len(value) <= limit else f"{shown}... ({len(value)} characters)"


def clip_details(message: str) -> str:
    """A status message safe to send: ASCII (anything else escaped), no control characters, at most
    MAX_DETAILS_BYTES."""
    text = message.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    if len(text) > MAX_DETAILS_BYTES:
        text = text[:MAX_DETAILS_BYTES - 25] + " ... (message shortened)"
    return text
