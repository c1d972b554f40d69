"""String formats: which namazu enforces, and how.

A format is enforced either by xgrammar's own grammar for it (where sampled grammar walks always
satisfy the format checker of `jsonschema`'s 2020-12 validator) or by an exact pattern written here
(where xgrammar's grammar admits strings the checker refuses: 2004-09-31 as a date, 072.1.1.1 as an
IPv4 address, 64-character host-name labels, or fractions of a second without end).

JSON Schema names more formats than namazu enforces; those it names but namazu cannot enforce are
refused under strict. A format name the specification does not know (OpenAPI's `int64`, `binary`,
`password`, ...) is an annotation, as the specification says, and is ignored.
"""
from __future__ import annotations

# Enforced by xgrammar's grammar for the format.
NATIVE_FORMATS = {"uuid", "email", "ipv6", "uri", "uri-reference"}

_YEAR = "[0-9]{4}"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
# RFC 3339 partial-time + offset; the fraction is bounded (nanoseconds) so a string cannot run away.
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?"
_OFFSET = "([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
# xgrammar cannot bound a patterned string's length, so the 253-character limit of a host name is kept
# by the shape: a first label of up to 63 characters and up to 7 more of up to 23 (63 + 7 * 24 = 231).
_SHORT_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,21}[A-Za-z0-9])?"

# Enforced by a pattern.
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}{_OFFSET}$",
    "time": f"^{_TIME}{_OFFSET}$",
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
    "hostname": f"^{_LABEL}(\\.{_SHORT_LABEL}){{0,7}}$",
}

ENFORCED_FORMATS = NATIVE_FORMATS | set(FORMAT_PATTERNS)

# Every format the JSON Schema drafts 04 .. 2020-12 define.
KNOWN_FORMATS = {
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
}
