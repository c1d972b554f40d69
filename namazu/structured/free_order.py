"""Objects whose keys come in any order, as one llguidance grammar that grows linearly with the keys.

JSON Schema gives an object's keys no order, but both compilers write the declared properties in the
order the schema lists them, and undeclared ones after them. `any_order.py` lists every order for
objects of at most 3 properties; a context-free grammar that takes n keys in any order, each at most
once, needs about 2^n rules. llguidance's parametric rules carry a 64-bit value through a rule: a set
of bits, one per declared key. An object becomes one rule

    obj::_ : "}"                                      %if <the required keys' bits are set>
           | sep::_ "\\"name\\"" ": " value obj::<bit of name and bit 63 set>   %if <bit of name clear>
           | sep::_ OTHER ": " extra obj::<bit 63 set>          (when undeclared keys are admitted)

where bit 63 says a key was written (so a ", " comes first), OTHER is any JSON string but the declared
keys (an undeclared key can never spell a declared one), and min/maxProperties on a closed object count
the bits. The rule is materialized lazily per value during parsing: its size is linear in the keys.

Each value is translated the same way where it is an object, an array (its bounds kept by a counter in
the parameter), an `anyOf`, a `$ref` (a rule per definition, so recursion stays a rule), a type list
with an object in it (the object part, or the other types alone), or a map (one `patternProperties`
pattern no declared key matches, or `propertyNames`); any other sub-schema is a leaf compiled by
llguidance's own JSON compiler (`%json {...}`, with namazu's separators and escapes). A sub-schema the
translation does not read (an object with two patterns, or counts beside undeclared keys) is a leaf
too: it keeps llguidance's fixed order, narrower, never wider. Past 63 declared properties the optional
keys beyond the 63rd are not tracked and may come twice (a JSON parser keeps the last, which was
checked). Where the translation cannot be done at all (`Unsupported`, or llguidance refuses a leaf: a
look-around pattern) the backend refuses a strict schema and fixes the order of a non-strict one.
"""
from __future__ import annotations

import json
from typing import Any

from namazu.structured.any_order import MAX_ANY_ORDER
from namazu.structured.llguidance_backend import JSON_OPTIONS

MAX_KEYS = 63             # bits 0..62: the first 63 declared keys seen (required first); bit 63: a key was written
WROTE = 1 << 63
# A JSON string as llguidance writes one under JSON_OPTIONS: no control characters, no DEL, no \u.
_STRING = r'/"([^"\\\x00-\x1F\x7F]|\\["\\bfnrt])*"/'
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "minProperties", "maxProperties",
                "patternProperties", "propertyNames"}
_KEY_KEYS = {"type", "enum", "const", "pattern", "minLength", "maxLength", "format"}   # a key's own schema
_ARRAY_KEYS = {"type", "items", "minItems", "maxItems"}
_TYPES = ("null", "boolean", "object", "array", "number", "string")
# the keywords that apply to one type only (JSON Schema ignores them for an instance of another)
_OBJECT_ONLY = {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
                "maxProperties", "propertyNames", "dependentRequired"}
_ARRAY_ONLY = {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains"}
_SCALAR_ONLY = {"minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                "exclusiveMaximum", "multipleOf"}


def _only(s: dict, types: list[str]) -> dict:
    """`s` for instances of `types` alone: the keywords of the other kinds dropped (they do not apply)."""
    drop = set()
    if "object" not in types:
        drop |= _OBJECT_ONLY
    if "array" not in types:
        drop |= _ARRAY_ONLY
    if not set(types) & {"string", "number", "integer"}:
        drop |= _SCALAR_ONLY
    return {**{k: v for k, v in s.items() if k not in drop}, "type": types[0] if len(types) == 1 else types}


class Unsupported(ValueError):
    """The schema cannot be written as a free-order grammar; it takes the ordinary path."""


def _objects(s: Any):
    """Every object-like node of a normalized schema, $defs included."""
    stack = [s]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
        elif isinstance(s, dict):
            yield s
            for k, v in s.items():
                if k in ("properties", "patternProperties", "$defs") and isinstance(v, dict):
                    stack.extend(v.values())
                elif k not in ("enum", "const"):
                    stack.append(v)


def needs_free_order(schema: Any) -> bool:
    """True when an object of the normalized schema has keys that any_order.py leaves in a fixed order:
    more than MAX_ANY_ORDER declared properties, or at least one beside undeclared ones."""
    for s in _objects(schema):
        props = s.get("properties")
        t = s.get("type")
        if isinstance(props, dict) and props and (t is None or t == "object" or isinstance(t, list) and "object" in t):
            if len(props) > MAX_ANY_ORDER or s.get("additionalProperties", True) is not False:
                return True
    return False


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _cond(parts: list[str]) -> str:
    if not parts:
        return "true"
    out = parts[-1]
    for p in reversed(parts[:-1]):
        out = f"and({p}, {out})"
    return out


class _Lark:
    def __init__(self, root: Any):
        self.defs = root.get("$defs", {}) if isinstance(root, dict) else {}
        self.lines: list[str] = []
        self.memo: dict[str, str] = {}        # a sub-schema's JSON text -> its rule
        self.def_rules: dict[str, str] = {}   # a $defs name -> its rule

    def new(self, prefix: str) -> str:
        return f"{prefix}{len(self.lines)}_{len(self.memo) + len(self.def_rules)}"

    def rule(self, s: Any) -> str:
        key = json.dumps(s, sort_keys=True)
        if key not in self.memo:
            name = self.memo[key] = self.new("r")
            self.lines.append(f"{name}: {self.body(s, name)}")
        return self.memo[key]

    def ref(self, ref: str) -> str:
        if not ref.startswith("#/$defs/") or ref[len("#/$defs/"):] not in self.defs:
            raise Unsupported(f"$ref {ref!r}")
        target = ref[len("#/$defs/"):]
        if target not in self.def_rules:
            name = self.def_rules[target] = self.new("d")
            self.lines.append(f"{name}: {self.rule(self.defs[target])}")
        return self.def_rules[target]

    def body(self, s: Any, name: str) -> str:
        if not isinstance(s, dict):
            return self.leaf(s)
        t = s.get("type")
        if t is None and not set(s) & {"$ref", "anyOf", "enum", "const"} and set(s) & (_OBJECT_KEYS | _ARRAY_KEYS):
            t = list(_TYPES)           # {"properties": ...} alone admits every type, objects checked
        if isinstance(t, list) and len(t) > 1 and ("object" in t or "array" in t):
            # {"type": ["object", "null"], "properties": ...}: object keywords do not apply to a null,
            # so the schema is its object part or its other types, each with its own keywords alone
            parts = [_only(s, [one]) for one in ("object", "array") if one in t]
            rest = [x for x in t if x not in ("object", "array")]
            return " | ".join(self.rule(p) for p in parts + ([_only(s, rest)] if rest else []))
        if set(s) == {"$ref"} and isinstance(s["$ref"], str):
            return self.ref(s["$ref"])
        if set(s) == {"anyOf"} and isinstance(s["anyOf"], list) and any(b is not False for b in s["anyOf"]):
            return " | ".join(self.rule(b) for b in s["anyOf"] if b is not False)
        if t == "object" and set(s) <= _OBJECT_KEYS and isinstance(s.get("properties", {}), dict) and \
                (s.get("properties") or s.get("patternProperties") or isinstance(s.get("additionalProperties"), dict)):
            return self.obj(s, name)
        if t == "array" and set(s) <= _ARRAY_KEYS and isinstance(s.get("items", True), (dict, bool)):
            return self.array(s, name)
        return self.leaf(s)

    def leaf(self, s: Any) -> str:
        """llguidance's JSON compiler for `s`, with the definitions it references."""
        if s is False:
            raise Unsupported("a schema that accepts nothing")
        s = {} if s is True else dict(s)
        text = json.dumps(s)
        if '"$ref"' in text:
            if '"$ref": "#"' in text:
                raise Unsupported("a reference to the root from a leaf")
            s["$defs"] = self.reachable(s)
        return "%json " + json.dumps({**s, "x-guidance": JSON_OPTIONS})

    def reachable(self, s: Any) -> dict[str, Any]:
        """The definitions a leaf references, directly or through each other (its own copy of them)."""
        out: dict[str, Any] = {}
        stack = [s]
        while stack:
            x = stack.pop()
            if isinstance(x, list):
                stack.extend(x)
            elif isinstance(x, dict):
                ref = x.get("$ref")
                if isinstance(ref, str) and ref.startswith("#/$defs/"):
                    target = ref[len("#/$defs/"):]
                    if target not in self.defs:
                        raise Unsupported(f"$ref {ref!r}")
                    if target not in out:
                        out[target] = self.defs[target]
                        stack.append(self.defs[target])
                stack.extend(v for k, v in x.items() if k not in ("enum", "const", "$ref"))
        return out

    def obj(self, s: dict, name: str) -> str:
        # a property whose schema is false may not appear: it is no alternative, and no undeclared key
        forbidden = [k for k, v in s.get("properties", {}).items() if v is False]
        props: dict[str, Any] = {k: v for k, v in s.get("properties", {}).items() if v is not False}
        patterns = s.get("patternProperties", {})
        if patterns and not self.pattern_apart(s):
            return self.leaf(s)
        names = self.key_schema(s)
        if "propertyNames" in s and (names is None or props or forbidden or patterns):
            return self.leaf(s)
        required = [k for k in props if k in set(s.get("required", []))]
        if len(required) != len(set(s.get("required", []))):
            raise Unsupported("a required property that is forbidden or undeclared")
        extra = s.get("additionalProperties", True)
        lo, hi = s.get("minProperties"), s.get("maxProperties")
        uncounted = extra is not False or patterns or len(props) > MAX_KEYS
        if uncounted and (hi is not None or (lo or 0) > 1) or len(required) > MAX_KEYS:
            return self.leaf(s)       # keys that are not counted: llguidance's own object (fixed order)
        order = required + [k for k in props if k not in required]     # the required keys are bits 0..r-1
        n = min(len(order), MAX_KEYS)
        end = [f"is_ones([0:{len(required)}])"] if required else []
        if uncounted and lo == 1:
            end.append("bit_set(63)")          # some key was written
        elif lo is not None:
            end.append(f"bit_count_ge([0:{n}], {int(lo)})")
        room = [f"bit_count_lt([0:{n}], {int(hi)})"] if hi is not None else []
        param = f"{name}_k"
        alts = [f'"}}" %if {_cond(end)}']
        keys = []
        for bit, key in enumerate(order):
            term = f"K{name.upper()}_{bit}"
            keys.append(term)
            self.lines.append(f"{term}: {_lit(_lit(key))}")
            if bit < MAX_KEYS:
                alts.append(f'sep::_ {term} ": " {self.rule(props[key])} {param}::bit_or({hex(WROTE | 1 << bit)}) '
                            f"%if {_cond([f'bit_clear({bit})', *room])}")
            else:    # past 63 bits, an optional key is not tracked: it may come twice (json keeps the last)
                alts.append(f'sep::_ {term} ": " {self.rule(props[key])} {param}::set_bit(63)')
        for i, key in enumerate(forbidden):
            keys.append(f"K{name.upper()}_F{i}")
            self.lines.append(f"{keys[-1]}: {_lit(_lit(key))}")
        for pattern, value in patterns.items():
            if value is not False:      # a key llguidance's own string-with-pattern checks
                key = self.rule({"type": "string", "pattern": pattern})
                alts.append(f'sep::_ {key} ": " {self.rule(value)} {param}::set_bit(63)')
        if extra is not False and names is not None:      # a map: every key checked by propertyNames
            alts.append(f'sep::_ {self.rule(names)} ": " {self.rule(extra)} {param}::set_bit(63)')
        elif extra is not False:
            other = f"O{name.upper()}"
            self.lines.append(f"{other}: STRING & ~({' | '.join(keys)})" if keys else f"{other}: STRING")
            alts.append(f'sep::_ {other} ": " {self.rule(extra)} {param}::set_bit(63)')
        self.lines.append(f"{param}::_ : " + "\n    | ".join(alts))
        return f'"{{" {param}::0x0'

    def key_schema(self, s: dict) -> Any:
        """The string schema every key must satisfy (`propertyNames`, through one $ref), or None."""
        names = s.get("propertyNames")
        if isinstance(names, dict) and set(names) == {"$ref"} and isinstance(names["$ref"], str):
            names = self.defs.get(names["$ref"][len("#/$defs/"):]) if names["$ref"].startswith("#/$defs/") else None
        if not isinstance(names, dict) or not set(names) <= _KEY_KEYS or names.get("type", "string") != "string":
            return None
        return {**names, "type": "string"}

    @staticmethod
    def pattern_apart(s: dict) -> bool:
        """True when the object's one pattern leaves out every declared key and nothing else is admitted
        (a key is then checked by exactly one schema: its property's, or the pattern's)."""
        import re

        patterns = s["patternProperties"]
        if len(patterns) != 1 or s.get("additionalProperties", True) is not False:
            return False
        (pattern, _), = patterns.items()
        try:
            rx = re.compile(pattern)
        except (re.error, TypeError):
            return False
        return not any(rx.search(k) for k in s.get("properties", {}))

    def array(self, s: dict, name: str) -> str:
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        if s.get("items", True) is False:
            if lo:
                raise Unsupported("an array that accepts nothing")
            return '"[" "]"'
        item = self.rule(s.get("items", True))
        if hi is not None and int(hi) < lo:
            raise Unsupported("maxItems below minItems")
        empty = ['"[" "]"'] if lo == 0 else []
        if hi is not None and int(hi) == 0:
            return '"[" "]"'
        if lo <= 1 and hi is None:
            return " | ".join(empty + [f'"[" {item} (", " {item})* "]"'])
        tail = f"{name}_n::_"
        more = f"lt([0:32], {int(hi)})" if hi is not None else "true"
        self.lines.append(f'{tail} : "]" %if ge([0:32], {lo})\n    | ", " {item} {name}_n::incr([0:32]) %if {more}')
        return " | ".join(empty + [f'"[" {item} {name}_n::0x1'])

    def grammar(self, root: Any) -> str:
        body = {k: v for k, v in root.items() if k != "$defs"} if isinstance(root, dict) else root
        start = self.rule(body)
        head = [f"start: {start}", f"STRING: {_STRING}", 'sep::_ : "" %if bit_clear(63) | ", " %if bit_set(63)']
        return "\n".join(head + self.lines) + "\n"


def lark_grammar(schema: Any) -> str:
    """The normalized schema (before any_order.py) as an llguidance Lark grammar in which every object
    it can read takes its keys in any order; Unsupported where it cannot be written."""
    return _Lark(schema).grammar(schema)
