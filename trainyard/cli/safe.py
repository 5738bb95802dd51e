"""Text from the server, and above all from jobs, made safe to print on the user's terminal.

A job's output reaches `trainyard logs` byte for byte, and job names, failure messages, event
messages and error messages are server text that users (or their jobs) wrote. Printed raw, an ESC
sequence in them would act on the reader's terminal: clear the screen, rewrite earlier lines, set
the window title, write the clipboard (OSC 52), plant hyperlinks (OSC 8), or, on some terminals,
answer back keystrokes. `clean` shows every C0 control (but tab), DEL, every C1 control and the
Unicode bidirectional overrides (which reorder what a line appears to say) visibly as `\\xNN` /
`\\uNNNN`: ESC itself becomes the four characters `\\x1b`, so whatever followed it is plain text.

The CLI prints tables and progress with rich, which reads `[...]` as markup and `:name:` as emoji
in plain strings: `text` wraps a cleaned string in a rich Text, which rich prints as it is.
"""
from __future__ import annotations

import re

_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(value: object) -> str:
    """`value` as text with every control character shown as an escape (tab kept)."""
    return _UNSAFE.sub(_visible, value if isinstance(value, str) else str(value))


def text(value: object, style: str = ""):
    """A rich Text of `clean(value)`: printed literally (no markup, no emoji codes)."""
    from rich.text import Text

    return Text(clean("" if value is None else value), style=style)
