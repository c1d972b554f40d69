"""A JSON schema of any draft (04 .. 2020-12) rewritten into the subset xgrammar enforces exactly.

xgrammar compiles a fixed set of keywords and silently ignores the rest, and some of the ones it reads
it reads loosely (sibling keywords of `anyOf`, `required` names that no property declares). So a
schema is not handed to it as written: `SchemaNormalizer` walks every sub-schema position once and
returns an equivalent schema in which every keyword is one xgrammar enforces as JSON Schema means it,
or refuses the schema naming the keyword and where it is.

- Annotations and keywords JSON Schema does not define are ignored, as the specification tells a
  validator to (`id`, `$comment`, `x-*`, `example`, ...), and logged once each at debug level.
- Draft differences are read by the schema's `$schema` (2020-12 when absent, as `jsonschema` does):
  draft-04's boolean `exclusiveMinimum`, array-form `items` + `additionalItems`, `dependencies`, and
  `$ref` whose siblings are ignored before 2019-09.
- Combinators become `anyOf` over plain branches: `allOf` is merged into one schema (properties
  merged, `required` united, bounds tightened, types intersected); `oneOf` is `anyOf` where its
  branches exclude each other (by type, const/enum, or a required property whose values differ, or
  one the other forbids); `if`/`then`/`else` where the condition is a property's const/enum over a
  finite domain; `dependentRequired` over a closed object; keywords beside an `anyOf` are merged into
  each branch. `uniqueItems` over enum/const items becomes the list of repetition-free arrays.
- `$ref`s must be local (`#...`); each target is normalized once, into `$defs`.
- A schema that accepts nothing (`type: []`, an empty enum, a required property nothing allows, a
  recursion without a base case) is refused: serving it would generate forever.

A validation keyword namazu cannot enforce this way is refused by name (`strict`), or dropped and
reported in `relaxed` (not strict: OpenAI's contract there is best effort).
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import re
from typing import Any
from urllib.parse import unquote

from namazu.structured.any_order import any_order
from namazu.structured.schema_formats import (
    ENFORCED_FORMATS,
    FORMAT_PATTERNS,
    KNOWN_FORMATS,
)

log = logging.getLogger(__name__)

# Keywords that assert something about an instance (all drafts 04 .. 2020-12).
VALIDATION = {
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "items", "additionalItems", "prefixItems", "maxItems", "minItems",
    "uniqueItems", "contains", "maxContains", "minContains", "unevaluatedItems", "maxProperties",
    "minProperties", "required", "properties", "patternProperties", "additionalProperties", "dependencies",
    "dependentRequired", "dependentSchemas", "propertyNames", "unevaluatedProperties", "allOf", "anyOf",
    "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef", "format",
}
# Keywords that hold schemas only for `$ref` to reach (normalized when referenced).
CONTAINERS = {"$defs", "definitions"}
# Validation keywords with no exact grammar in namazu (refused under strict, dropped otherwise).
UNSUPPORTED = {
    "not", "contains", "maxContains", "minContains", "unevaluatedItems", "unevaluatedProperties",
    "dependentSchemas", "$dynamicRef", "$recursiveRef",
}
TYPES = {"null", "boolean", "object", "array", "number", "integer", "string"}

MAX_DEPTH = 64              # nesting of sub-schemas (a hostile schema nests thousands deep)
MAX_NODES = 20_000          # sub-schemas visited, $refs and rewrites included
MAX_BRANCHES = 64           # alternatives one rewrite (dependentRequired, a product of anyOfs) may create
MAX_UNIQUE_ARRAYS = 256     # repetition-free arrays uniqueItems may expand into
MAX_ENUM = 4096             # values of one enum
MAX_PATTERN = 4096          # characters of one pattern
MAX_REPEAT = 1000           # a {n,m} bound in a pattern
MAX_EXPANDED = 20_000       # atoms of a pattern with its counted repetitions written out

_seen_ignored: set[str] = set()


class Unsatisfiable(ValueError):
    """A (sub-)schema no value satisfies: an error at the top, a branch dropped inside anyOf."""


def _note_ignored(key: str) -> None:
    if key not in _seen_ignored:
        _seen_ignored.add(key)
        log.debug("JSON schema keyword %r is not a validation keyword: ignored as an annotation", key)


def _draft(root: Any) -> int:
    uri = root.get("$schema", "") if isinstance(root, dict) else ""
    for mark, draft in (("draft-04", 4), ("draft-06", 6), ("draft-07", 7), ("2019-09", 2019)):
        if isinstance(uri, str) and mark in uri:
            return draft
    return 2020


def _key(v: Any) -> str:
    """A canonical text for JSON equality (1 == 1.0, key order ignored)."""
    def canon(x: Any) -> Any:
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, (int, float)):
            return int(x) if float(x).is_integer() and abs(x) < 2**63 else x
        if isinstance(x, list):
            return [canon(i) for i in x]
        if isinstance(x, dict):
            return {k: canon(i) for k, i in sorted(x.items())}
        return x
    return json.dumps(canon(v), sort_keys=True)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _types(s: Any) -> set[str] | None:
    """The JSON types a (raw, upgraded) schema's instances can have, None if any."""
    if s is False:
        return set()
    if not isinstance(s, dict):
        return None
    out: set[str] | None = None
    t = s.get("type")
    if isinstance(t, str):
        out = {t}
    elif isinstance(t, list):
        out = set(t)
    if out is not None and "number" in out:
        out.add("integer")
    vals = _values(s)
    if vals is not None:
        vt = {_json_type(v) for v in vals}
        out = vt if out is None else {x for x in vt if x in out}
    return out


def _values(s: Any) -> list[Any] | None:
    """The finite set of values a schema allows (const, enum, boolean, null), None if not finite."""
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return list(s["enum"])
    t = s.get("type")
    if t == "boolean":
        return [True, False]
    if t == "null":
        return [None]
    return None


class SchemaNormalizer:
    def __init__(self, root: Any, strict: bool = True, llguidance: bool = False):
        self.root, self.strict = root, strict
        # llguidance (when installed) enforces what xgrammar drops: lengths beside a pattern or an email
        # format. A schema that needs it says so here, and the backend compiles it with llguidance.
        self.llguidance = llguidance
        self.needs_llguidance = False
        self.orders = 0            # key orders written out for small objects (any_order.py)
        self.draft = _draft(root)
        self.relaxed: list[str] = []
        self.ref_names: dict[str, str] = {}
        self.defs: dict[str, Any] = {}
        self.pending: list[tuple[str, str]] = []
        self.nodes = 0
        self.inlining: list[str] = []

    # -- entry ------------------------------------------------------------------------------------
    def run(self) -> Any:
        try:
            out = self.norm(self.root, "#", 0)
            while self.pending:
                ref, name = self.pending.pop()
                self.defs[name] = self.norm(self.resolve(ref, "#"), ref, 0)
        except RecursionError:
            raise ValueError(f"the JSON schema nests deeper than {MAX_DEPTH} levels") from None
        if self.defs:
            out = {"anyOf": [out]} if not isinstance(out, dict) else dict(out)
            out["$defs"] = self.defs
        check_productive(out)
        self.unordered = out       # before any_order: free_order.py writes every order another way
        out, self.orders = any_order(out)
        return out

    def refuse(self, msg: str) -> None:
        """A keyword namazu cannot enforce: an error under strict, dropped (and noted) otherwise."""
        if self.strict:
            raise ValueError(msg)
        self.relaxed.append(msg)
        log.info("JSON schema not strict, constraint dropped: %s", msg)

    # -- $ref -------------------------------------------------------------------------------------
    def resolve(self, ref: str, where: str) -> Any:
        if not isinstance(ref, str):
            raise ValueError(f"$ref at {where} must be a string")
        base = self.root.get("$id") or self.root.get("id") if isinstance(self.root, dict) else None
        if not ref.startswith("#") and isinstance(base, str) and ref.startswith(base.split("#")[0] + "#"):
            ref = ref[len(base.split("#")[0]):]
        if not ref.startswith("#"):
            raise ValueError(f"$ref {ref!r} at {where} points outside the schema; namazu resolves only "
                             "references within it ('#/...')")
        frag = unquote(ref[1:])
        if frag and not frag.startswith("/"):
            target = self._anchor(self.root, frag)
            if target is None:
                raise ValueError(f"$ref {ref!r} at {where}: no $anchor {frag!r} in the schema")
            return target
        node = self.root
        for part in frag.split("/")[1:] if frag else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"$ref {ref!r} at {where} points to nothing in the schema")
        return node

    def _anchor(self, node: Any, name: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            return None
        if isinstance(node, dict):
            if node.get("$anchor") == name or node.get("$id") == "#" + name or node.get("id") == "#" + name:
                return node
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            return None
        for child in children:
            found = self._anchor(child, name, depth + 1)
            if found is not None:
                return found
        return None

    def ref_name(self, ref: str, where: str) -> str:
        self.resolve(ref, where)      # checks it exists
        if ref not in self.ref_names:
            name = f"r{len(self.ref_names)}"
            self.ref_names[ref] = name
            self.pending.append((ref, name))
        return "#/$defs/" + self.ref_names[ref]

    def inline(self, s: Any, where: str) -> Any:
        """The upgraded schema itself when `s` is a bare $ref (for merging and for reading its facts)."""
        seen = 0
        while isinstance(s, dict) and "$ref" in s:
            ref = s["$ref"]
            if ref in self.inlining or seen > MAX_DEPTH:
                raise ValueError(f"$ref {ref!r} at {where} is recursive and combined with other keywords; "
                                 "namazu cannot merge a recursive definition")
            rest = {k: v for k, v in s.items() if k != "$ref" and k in VALIDATION}
            target = self.upgrade(self.resolve(ref, where), ref)
            if rest and self.draft >= 2019:
                self.inlining.append(ref)
                try:
                    return self.merge(target, self.upgrade(rest, where), where)
                finally:
                    self.inlining.pop()
            s, seen = target, seen + 1
        return s

    # -- one node ---------------------------------------------------------------------------------
    def upgrade(self, s: Any, where: str) -> Any:
        """The validation keywords of one schema, in 2020-12's vocabulary; annotations dropped."""
        if isinstance(s, bool):
            return s
        if not isinstance(s, dict):
            raise ValueError(f"the JSON schema at {where} must be an object or a boolean, not {type(s).__name__}")
        out: dict[str, Any] = {}
        for key, value in s.items():
            if key in VALIDATION:
                out[key] = value
            elif key not in CONTAINERS:
                _note_ignored(key)
        if "$ref" in out and self.draft <= 7:
            return {"$ref": out["$ref"]}       # before 2019-09 a $ref's siblings are ignored
        if isinstance(out.get("items"), list):
            out["prefixItems"] = out.pop("items")
            if "additionalItems" in out:
                out["items"] = out.pop("additionalItems")
        out.pop("additionalItems", None)       # without array-form items it has no effect
        for bound, excl in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if isinstance(out.get(excl), bool):   # draft-04: a flag on minimum / maximum
                if out.pop(excl) and bound in out:
                    out[excl] = out.pop(bound)
        deps = out.pop("dependencies", None)
        if isinstance(deps, dict):
            for name, dep in deps.items():
                slot = "dependentRequired" if isinstance(dep, list) else "dependentSchemas"
                out.setdefault(slot, {})[name] = dep
        if "format" in out:
            fmt = out["format"]
            if not isinstance(fmt, str) or fmt not in KNOWN_FORMATS:
                _note_ignored(f"format {fmt!r}")
                del out["format"]
            elif fmt not in ENFORCED_FORMATS:
                del out["format"]
                self.refuse(f"the JSON schema asks for format {fmt!r} at {where}/format; namazu enforces the formats "
                            f"{sorted(ENFORCED_FORMATS)}")
        if "type" in out:
            t = out["type"]
            names = [t] if isinstance(t, str) else t
            if not isinstance(names, list) or any(n not in TYPES for n in names):
                raise ValueError(f"'type' at {where}/type must be one of {sorted(TYPES)} or a list of them, not {t!r}")
            if not names:
                raise ValueError(f"'type' at {where}/type is an empty list: the schema accepts nothing")
            if isinstance(t, list) and len(t) == 1:
                out["type"] = t[0]
        for key in ("then", "else"):
            if key in out and "if" not in out:
                del out[key]               # without "if" they have no effect
        return out

    def norm(self, s: Any, where: str, depth: int) -> Any:
        """The compiler-dialect schema equivalent to `s` (or a ValueError / a relaxation)."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ValueError(f"the JSON schema is too large to compile (more than {MAX_NODES} sub-schemas "
                             "after expanding references and combinators)")
        if depth > MAX_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_DEPTH} levels (at {where[:200]})")
        s = self.upgrade(s, where)
        if isinstance(s, bool):
            return s
        if "$ref" in s:
            rest = {k: v for k, v in s.items() if k != "$ref"}
            if not rest:
                return {"$ref": self.ref_name(s["$ref"], where)}
            return self.norm(self.inline(s, where), where, depth + 1)
        if "allOf" in s:
            return self.norm(self.merge_all(s, where), where, depth + 1)
        if "oneOf" in s:
            return self.norm(self.one_of(s, where), where, depth + 1)
        if "if" in s:
            return self.norm(self.if_then_else(s, where), where, depth + 1)
        if s.get("dependentRequired"):
            return self.norm(self.dependent_required(s, where), where, depth + 1)
        s.pop("dependentRequired", None)
        for key in sorted(UNSUPPORTED & set(s)):
            del s[key]
            self.refuse(f"the JSON schema uses '{key}' at {where}/{key}, which namazu cannot enforce; "
                        "remove it or express it with supported keywords")
        if "anyOf" in s:
            return self.any_of(s, where, depth)
        return self.simple(s, where, depth)

    # -- combinators -----------------------------------------------------------------------------
    def merge_all(self, s: dict, where: str) -> Any:
        branches = s.pop("allOf")
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"'allOf' at {where}/allOf must be a non-empty array of schemas")
        out: Any = s
        for i, b in enumerate(branches):
            b = self.inline(self.upgrade(b, f"{where}/allOf/{i}"), f"{where}/allOf/{i}")
            out = self.merge(out, b, f"{where}/allOf/{i}")
        return out

    def merge(self, a: Any, b: Any, where: str) -> Any:
        """One schema equivalent to both (raw, upgraded) schemas; ValueError where they cannot merge."""
        if a is False or b is False:
            return False
        if a is True or a == {}:
            return b
        if b is True or b == {}:
            return a
        a, b = self.inline(a, where), self.inline(b, where)
        if isinstance(a, bool) or isinstance(b, bool):
            return self.merge(a, b, where)
        out = dict(a)
        if "allOf" in b:
            out.setdefault("allOf", [])
            out["allOf"] = list(out["allOf"]) + list(b["allOf"])
        if {"properties", "patternProperties", "additionalProperties"} & (set(a) | set(b)):
            self._merge_objects(out, a, b, where)
        for key, v in b.items():
            if key in ("allOf", "properties", "patternProperties", "additionalProperties"):
                continue
            if key not in out or _key(out[key]) == _key(v):
                out[key] = v
                continue
            u = out[key]
            if key == "type":
                ta = {u} if isinstance(u, str) else set(u)
                tb = {v} if isinstance(v, str) else set(v)
                both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb)
                                    or ("number" in ta and "integer" in tb) else set())
                if not both:
                    return False
                out[key] = sorted(both) if len(both) > 1 else next(iter(both))
            elif key == "required":
                out[key] = list(dict.fromkeys(list(u) + list(v)))
            elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
                out[key] = max(u, v)
            elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
                out[key] = min(u, v)
            elif key == "enum":
                kb = {_key(x) for x in v}
                out[key] = [x for x in u if _key(x) in kb]
            elif key == "const":
                return False
            elif key == "uniqueItems":
                out[key] = bool(u) or bool(v)
            elif key == "multipleOf" and all(isinstance(x, int) for x in (u, v)):
                out[key] = u * v // math.gcd(u, v)
            elif key in ("items", "propertyNames", "contains", "not"):
                out[key] = {"allOf": [u, v]}
            elif key == "prefixItems" and isinstance(u, list) and isinstance(v, list):
                n = max(len(u), len(v))
                pad_a, pad_b = out.get("items", True), b.get("items", True)
                out[key] = [{"allOf": [u[i] if i < len(u) else pad_a, v[i] if i < len(v) else pad_b]}
                            for i in range(n)]
            elif key == "anyOf":
                prod = [{"allOf": [x, y]} for x in u for y in v]
                if len(prod) > MAX_BRANCHES:
                    raise ValueError(f"the anyOfs combined at {where} make {len(prod)} alternatives; "
                                     f"namazu expands at most {MAX_BRANCHES}")
                out[key] = prod
            elif key == "dependentRequired":
                merged = {k: list(x) for k, x in u.items()}
                for k, x in v.items():
                    merged[k] = list(dict.fromkeys(merged.get(k, []) + list(x)))
                out[key] = merged
            else:
                self.refuse(f"allOf at {where} combines two different '{key}' values; namazu cannot merge "
                            "them into one grammar")
        return out

    def _merge_objects(self, out: dict, a: dict, b: dict, where: str) -> None:
        pa, pb = a.get("properties", {}), b.get("properties", {})
        qa, qb = a.get("patternProperties", {}), b.get("patternProperties", {})
        apa, apb = a.get("additionalProperties", True), b.get("additionalProperties", True)
        if (qa and (qb or apb not in (True, {}))) or (qb and apa not in (True, {})):
            if not (_key(qa) == _key(qb) and _key(apa) == _key(apb)):
                raise ValueError(f"allOf at {where} combines patternProperties with other property rules; "
                                 "namazu cannot merge them into one grammar")

        def rule(props: dict, pats: dict, ap: Any, name: str) -> Any:
            if name in props:
                return props[name]
            hits = [sch for pat, sch in pats.items() if _search(pat, name, where)]
            if hits:
                return {"allOf": hits} if len(hits) > 1 else hits[0]
            return ap

        props: dict[str, Any] = {}
        for name in list(pa) + [n for n in pb if n not in pa]:
            x, y = rule(pa, qa, apa, name), rule(pb, qb, apb, name)
            props[name] = x if _key(x) == _key(y) or y in (True, {}) else y if x in (True, {}) \
                else {"allOf": [x, y]}
        if props:
            out["properties"] = props
        if qa or qb:
            out["patternProperties"] = qa or qb
        if apa is False or apb is False:
            out["additionalProperties"] = False
        elif apa in (True, {}) or apb in (True, {}) or _key(apa) == _key(apb):
            ap = apb if apa in (True, {}) else apa
            if ap not in (True, {}):
                out["additionalProperties"] = ap
            else:
                out.pop("additionalProperties", None)
        else:
            out["additionalProperties"] = {"allOf": [apa, apb]}

    def one_of(self, s: dict, where: str) -> Any:
        branches = s.pop("oneOf")
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"'oneOf' at {where}/oneOf must be a non-empty array of schemas")
        facts = [self.inline(self.upgrade(b, f"{where}/oneOf/{i}"), f"{where}/oneOf/{i}")
                 for i, b in enumerate(branches)]
        merged = [self.merge(s, f, where) for f in facts]
        branches = list(branches)
        for i, j in itertools.combinations(range(len(facts)), 2):
            if merged[i] is False or merged[j] is False or _exclusive(merged[i], merged[j], where):
                continue
            # Overlapping branches: each keeps only what the other does not accept. A branch the other
            # contains accepts nothing of its own (dropped); otherwise it keeps the objects without a
            # property the other requires (narrower than "this and not the other", never wider).
            if _string_only(facts[i]) and _string_only(facts[j]):
                # a non-string satisfies both (their keywords only test strings): no valid instance is one
                typed = [self.merge(merged[k], {"type": "string"}, where) for k in (i, j)]
                if _exclusive(typed[0], typed[1], where):
                    for k, t in zip((i, j), typed):
                        branches[k], merged[k] = {"allOf": [branches[k], {"type": "string"}]}, t
                    continue
            cut = {a: self._exclude(merged[a], facts[b], merged[b]) for a, b in ((i, j), (j, i))}
            if None in cut.values():
                self.refuse(f"oneOf at {where}/oneOf: branches {i} and {j} may both match, which namazu cannot "
                            "exclude; it enforces oneOf where the branches differ by type, const/enum, a "
                            "required property, or a property each requires and the other may leave out "
                            "(use anyOf if either may match)")
                break
            for a, how in cut.items():
                if how is False:
                    branches[a] = merged[a] = False
                else:
                    branches[a] = {"allOf": [branches[a], {"properties": {how: False}}]}
        branches = [b for b in branches if b is not False]
        if not branches:
            raise Unsatisfiable(f"no branch of oneOf at {where}/oneOf can match alone: it accepts nothing")
        if "anyOf" in s:
            return self.merge(s, {"anyOf": branches}, where)
        s["anyOf"] = branches
        return s

    def _exclude(self, a: Any, b_raw: Any, b: Any) -> str | bool | None:
        """How branch `a` (merged with its siblings) drops what branch `b` accepts: False when `a` is
        inside `b` (`b` only requires properties `a` requires: `a` has nothing of its own), the name of
        a property `b` requires and `a` may leave out (`a` without it), None when namazu cannot tell.
        Forbidding a property on an object open to others needs llguidance."""
        if not (isinstance(a, dict) and isinstance(b, dict) and isinstance(b_raw, dict)):
            return None
        a_types = _types(a)
        if set(b_raw) <= {"required", "type"} and set(b_raw.get("required", [])) <= set(a.get("required", [])) \
                and ("type" not in b_raw or (a_types is not None and a_types <= (_types(b_raw) or set()))):
            return False
        if {"object"} not in (a_types, _types(b)):
            return None       # a non-object in both is not told apart by a property
        missing = [n for n in b.get("required", []) if n not in a.get("required", [])]
        if not missing:
            return None
        closed = a.get("additionalProperties", True) is False and not a.get("patternProperties")
        return missing[0] if closed or self.llguidance else None

    def if_then_else(self, s: dict, where: str) -> Any:
        cond = self.upgrade(s.pop("if"), f"{where}/if")
        then, other = s.pop("then", True), s.pop("else", True)
        if cond is True or cond == {}:
            return self.merge(s, self.upgrade(then, f"{where}/then"), where)
        if cond is False:
            return self.merge(s, self.upgrade(other, f"{where}/else"), where)
        keys = set(cond) - {"type"}
        props = cond.get("properties") if isinstance(cond.get("properties"), dict) else {}
        req = cond.get("required", [])
        ok = keys <= {"properties", "required"} and len(props) == 1 and cond.get("type") in (None, "object") \
            and req in ([], list(props))
        if ok:
            (name, sub), = props.items()
            vals = _values(self.inline(self.upgrade(sub, where), where))
            declared = self.inline(self.upgrade(s.get("properties", {}).get(name, True), where), where)
            domain = _values(declared)
            ok = vals is not None and domain is not None
        if not ok:
            self.refuse(f"if/then/else at {where}/if: namazu enforces a condition only when it is one "
                        "property's const or enum over a property with finite values (an enum, a const, a "
                        "boolean)")
            return s
        inside = {_key(v) for v in vals}
        rest_vals = [v for v in domain if _key(v) not in inside]
        yes = self.merge(s, self.merge(cond, self.upgrade(then, f"{where}/then"), where), where)
        alternatives = [yes]
        if rest_vals:
            no = {"required": [name], "properties": {name: {"enum": rest_vals}}}
            alternatives.append(self.merge(s, self.merge(no, self.upgrade(other, f"{where}/else"), where), where))
        if req and name not in s.get("required", []):
            # the condition is also false when the property is absent
            absent = self._without(s, name, where, "if/then/else")
            alternatives.append(self.merge(absent, self.upgrade(other, f"{where}/else"), where))
        alternatives = [a for a in alternatives if a is not False]
        return {"anyOf": alternatives} if alternatives else False

    def _without(self, s: dict, name: str, where: str, what: str) -> Any:
        """`s` where property `name` is absent: exact only for a closed object (no other rule admits it)."""
        pats = s.get("patternProperties", {})
        closed = s.get("additionalProperties", True) is False and not any(_search(p, name, where) for p in pats)
        if not closed:
            raise ValueError(f"{what} at {where} needs property {name!r} to be absent, which namazu can enforce "
                             "only on a closed object (additionalProperties: false)")
        if name in s.get("required", []):
            return False
        out = dict(s)
        out["properties"] = {k: v for k, v in s.get("properties", {}).items() if k != name}
        return out

    def dependent_required(self, s: dict, where: str) -> Any:
        deps = s.pop("dependentRequired")
        if not isinstance(deps, dict):
            raise ValueError(f"'dependentRequired' at {where} must be an object of arrays")
        alternatives: list[Any] = [s]
        for name, needs in deps.items():
            grown: list[Any] = []
            for alt in alternatives:
                if alt is False:
                    continue
                if name in alt.get("required", []):
                    grown.append(self.merge(alt, {"required": list(needs)}, where))
                    continue
                try:
                    grown.append(self._without(alt, name, where, f"dependentRequired ({name!r})"))
                except ValueError as e:
                    self.refuse(str(e))
                    return s
                grown.append(self.merge(alt, {"required": [name, *needs]}, where))
            alternatives = [a for a in grown if a is not False]
            if len(alternatives) > MAX_BRANCHES:
                raise ValueError(f"dependentRequired at {where} makes {len(alternatives)} alternatives; namazu "
                                 f"expands at most {MAX_BRANCHES}")
        if not alternatives:
            return False
        return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}

    def any_of(self, s: dict, where: str, depth: int) -> Any:
        branches = s.pop("anyOf")
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"'anyOf' at {where}/anyOf must be a non-empty array of schemas")
        out = []
        for i, b in enumerate(branches):
            here = f"{where}/anyOf/{i}"
            if s:                    # xgrammar reads a branch alone: the siblings go into each one
                b = self.merge(s, self.upgrade(b, here), here)
            try:
                n = self.norm(b, here, depth + 1)
            except Unsatisfiable:
                continue
            if n is not False:
                out.append(n)
        if not out:
            raise Unsatisfiable(f"no branch of anyOf at {where}/anyOf accepts anything")
        return out[0] if len(out) == 1 else {"anyOf": out}

    # -- plain schemas ----------------------------------------------------------------------------
    def simple(self, s: dict, where: str, depth: int) -> Any:
        out: dict[str, Any] = {}
        for key, value in s.items():
            here = f"{where}/{key}"
            if key in ("properties", "patternProperties"):
                if not isinstance(value, dict):
                    raise ValueError(f"'{key}' at {here} must be an object of schemas")
                out[key] = {}
                for name, sub in value.items():
                    if key == "patternProperties":
                        check_pattern(name, f"{here}/{name}")
                        out[key][xgrammar_pattern(search_pattern(name))] = self.norm(sub, f"{here}/{name}",
                                                                                     depth + 1)
                    else:
                        out[key][name] = self.norm(sub, f"{here}/{name}", depth + 1)
            elif key in ("additionalProperties", "items", "propertyNames"):
                out[key] = self.norm(value, here, depth + 1)
            elif key == "prefixItems":
                if not isinstance(value, list):
                    raise ValueError(f"'prefixItems' at {here} must be an array of schemas")
                out[key] = [self.norm(sub, f"{here}/{i}", depth + 1) for i, sub in enumerate(value)]
            elif key == "required":
                if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                    raise ValueError(f"'required' at {here} must be an array of property names")
                out[key] = list(dict.fromkeys(value))
            elif key == "pattern":
                check_pattern(value, here)
                out[key] = xgrammar_pattern(search_pattern(value))
            elif key == "enum":
                if not isinstance(value, list):
                    raise ValueError(f"'enum' at {here} must be an array")
                if len(value) > MAX_ENUM:
                    raise ValueError(f"'enum' at {here} has {len(value)} values; namazu compiles at most {MAX_ENUM}")
                out[key] = value
            else:
                out[key] = value
        return self._finish(out, where, depth)

    def _finish(self, s: dict, where: str, depth: int) -> Any:
        if "enum" in s or "const" in s:
            return self._finite(s, where)
        if s.get("uniqueItems"):
            return self._unique(s, where, depth)
        s.pop("uniqueItems", None)
        t = s.get("type")
        kinds = {t} if isinstance(t, str) else set(t or TYPES)
        if "integer" in kinds and "number" not in kinds:
            for key, rnd in (("minimum", math.ceil), ("maximum", math.floor)):
                if isinstance(s.get(key), float):
                    s[key] = int(rnd(s[key]))
            if isinstance(s.get("exclusiveMinimum"), (int, float)):
                s["minimum"] = max(s.get("minimum", -math.inf), math.floor(s.pop("exclusiveMinimum")) + 1)
            if isinstance(s.get("exclusiveMaximum"), (int, float)):
                s["maximum"] = min(s.get("maximum", math.inf), math.ceil(s.pop("exclusiveMaximum")) - 1)
            if "minimum" in s and "maximum" in s and s["minimum"] > s["maximum"]:
                return False
        if "multipleOf" in s and "number" in kinds:
            # xgrammar enforces multipleOf on integers only; a multiple of a whole number is whole
            m = s["multipleOf"]
            if isinstance(m, int) or (isinstance(m, float) and m.is_integer()):
                if kinds - {"number", "integer"}:
                    self.refuse(f"multipleOf at {where}/multipleOf beside types other than numbers, which namazu "
                                "cannot enforce")
                    s.pop("multipleOf")
                else:
                    s["type"], s["multipleOf"] = "integer", int(m)
            else:
                s.pop("multipleOf")
                self.refuse(f"multipleOf {m} at {where}/multipleOf is not a whole number, which namazu cannot "
                            "enforce")
        fmt = s.get("format")
        if fmt in FORMAT_PATTERNS:
            if "pattern" in s:
                self.refuse(f"the JSON schema combines format {fmt!r} with a pattern at {where}; namazu enforces "
                            "one of them: drop the other")
                s.pop("pattern")
            del s["format"]
            s["pattern"] = xgrammar_pattern(FORMAT_PATTERNS[fmt])
        if "format" in s and "pattern" in s:
            self.refuse(f"the JSON schema combines format {fmt!r} with a pattern at {where}; xgrammar enforces "
                        "only one of them: drop the other")
            s.pop("format")
        if "format" in s and ({"minLength", "maxLength"} & set(s)) and fmt == "email" and self.llguidance:
            self.needs_llguidance = True
        elif "format" in s and ({"minLength", "maxLength"} & set(s)):
            for key in ("minLength", "maxLength"):
                s.pop(key, None)
            self.refuse(f"format {fmt!r} at {where} with minLength/maxLength, which xgrammar cannot enforce "
                        "together (it drops the lengths)")
        if "pattern" in s and ({"minLength", "maxLength"} & set(s)):
            self._pattern_lengths(s, where)
        if "object" in kinds and ({"properties", "required", "additionalProperties", "patternProperties",
                                   "minProperties", "maxProperties", "propertyNames"} & set(s)):
            return self._object(s, where)
        return s

    def _pattern_lengths(self, s: dict, where: str) -> None:
        """xgrammar drops minLength/maxLength beside a pattern: fold them into the pattern where it is
        one repeated character class (`^[a-z]+$`), drop them where the pattern implies them."""
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        folded = fold_lengths(s["pattern"], lo, hi)
        if folded is None and self.llguidance:
            self.needs_llguidance = True
        elif folded is None:
            s.pop("minLength", None)
            s.pop("maxLength", None)
            self.refuse(f"pattern with minLength/maxLength at {where}, which xgrammar cannot enforce together "
                        "(it drops the lengths); write the lengths into the pattern")
        elif folded is False:
            raise Unsatisfiable(f"the pattern at {where} allows no string of length {lo}..{hi}")
        else:
            s["pattern"] = folded
            s.pop("minLength", None)
            s.pop("maxLength", None)

    def _object(self, s: dict, where: str) -> Any:
        props = s.get("properties", {})
        pats = s.get("patternProperties", {})
        ap = s.get("additionalProperties", True)
        for name in s.get("required", []):
            if name in props:
                continue
            # xgrammar enforces `required` only for declared properties: declare it, with the schema the
            # object gives it as an additional (or pattern) property.
            hits = [sch for pat, sch in pats.items() if _search(pat, name, where)]
            rule = (hits[0] if len(hits) == 1 else {"anyOf": hits}) if hits else ap
            if rule is False:
                raise Unsatisfiable(f"'required' at {where}/required names {name!r}, which the object does not "
                                 "allow (no such property and additionalProperties: false): the schema accepts "
                                 "nothing")
            if len(hits) > 1:
                raise ValueError(f"required property {name!r} at {where} matches several patternProperties; "
                                 "namazu cannot combine them")
            props = {**props, name: rule if rule is not True else {}}
        closed = ap is False and not pats
        for name, sub in list(props.items()):
            if sub is False:
                if name in s.get("required", []):
                    raise Unsatisfiable(f"property {name!r} at {where}/properties is required and false: the schema "
                                     "accepts nothing")
                if not closed and self.llguidance:
                    self.needs_llguidance = True      # it keeps the key out of the undeclared ones
                    continue
                if not closed:
                    self.refuse(f"property {name!r} at {where}/properties is false (forbidden) on an object open "
                                "to other properties, which namazu cannot enforce without llguidance")
                props = {k: v for k, v in props.items() if k != name}
        if props or "properties" in s:
            s["properties"] = props
        lo = s.get("minProperties", 0)
        if lo > max(1, len(s.get("required", []))) and not closed:
            # an open object's extra keys may repeat, and a repeated key counts once in the parsed object
            s.pop("minProperties")
            self.refuse(f"minProperties at {where}/minProperties on an object open to additional properties, "
                        "which namazu cannot enforce (a repeated key counts once); close the object "
                        "(additionalProperties: false) or drop it")
        elif lo <= len(s.get("required", [])):
            s.pop("minProperties", None)
        return s

    def _finite(self, s: dict, where: str) -> Any:
        """const / enum: the values that also satisfy the node's other keywords, as exact schemas."""
        import jsonschema

        vals = [s["const"]] if "const" in s else list(s["enum"])
        rest = {k: v for k, v in s.items() if k not in ("enum", "const")}
        if rest:
            try:
                check = jsonschema.Draft202012Validator(rest, format_checker=jsonschema.Draft202012Validator
                                                        .FORMAT_CHECKER)
                vals = [v for v in vals if check.is_valid(v)]
            except Exception:   # a $ref inside, say: keep the values; the grammar still checks
                pass
        scalars, compound, seen = [], [], set()
        for v in vals:
            k = _key(v)
            if k in seen:
                continue
            seen.add(k)
            (compound if isinstance(v, (dict, list)) else scalars).append(v)
        if not scalars and not compound:
            raise Unsatisfiable(f"no value of the enum/const at {where} satisfies its schema: it accepts nothing")
        branches: list[Any] = []
        if scalars:
            branches.append({"const": scalars[0]} if len(scalars) == 1 else {"enum": scalars})
        branches += [_exact(v) for v in compound]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def _unique(self, s: dict, where: str, depth: int) -> Any:
        s.pop("uniqueItems")
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if hi is not None and hi <= 1:
            return self._finish(s, where, depth)       # at most one item: always unique
        items = s.get("items", True)
        vals = _values(items) if isinstance(items, dict) and "$ref" not in items else None
        if items is not False and (vals is None or "prefixItems" in s):
            self.refuse(f"uniqueItems at {where}/uniqueItems: namazu enforces it only over items that are an "
                        "enum or const (or booleans)")
            return self._finish(s, where, depth)
        vals = [] if items is False else list({_key(v): v for v in vals}.values())
        top = len(vals) if hi is None else min(hi, len(vals))
        count = sum(math.perm(len(vals), k) for k in range(lo, top + 1))
        if count > MAX_UNIQUE_ARRAYS:
            raise ValueError(f"uniqueItems at {where}/uniqueItems over {len(vals)} values allows {count} arrays; "
                             f"namazu expands at most {MAX_UNIQUE_ARRAYS}")
        arrays = [_exact(list(p)) for k in range(lo, top + 1) for p in itertools.permutations(vals, k)]
        if not arrays:
            raise Unsatisfiable(f"uniqueItems at {where}: no array of {lo}+ distinct items exists: it accepts nothing")
        return arrays[0] if len(arrays) == 1 else {"anyOf": arrays}


def _exact(v: Any) -> Any:
    """A schema that accepts exactly the JSON value `v` (compound consts written as structure, so that
    the grammar's separators are the ones it uses everywhere else)."""
    if isinstance(v, dict):
        return {"type": "object", "properties": {k: _exact(x) for k, x in v.items()}, "required": list(v),
                "additionalProperties": False}
    if isinstance(v, list):
        if not v:
            return {"type": "array", "maxItems": 0}
        return {"type": "array", "prefixItems": [_exact(x) for x in v], "items": False, "minItems": len(v)}
    return {"const": v}


def fold_lengths(pattern: str, lo: int, hi: int | None) -> str | bool | None:
    """A pattern equal to `pattern` restricted to lengths lo..hi (as xgrammar reads it: a whole-string
    match), False when no length fits, None when namazu cannot write one."""
    try:
        from re import _parser as sre  # type: ignore[attr-defined]
    except ImportError:                 # Python < 3.11
        import sre_parse as sre  # type: ignore[no-redef]
    try:
        parsed = sre.parse(pattern)
    except Exception:   # noqa: BLE001 -- checked elsewhere; here only "cannot fold"
        return None
    width_lo, width_hi = parsed.getwidth()
    top = hi if hi is not None else sre.MAXREPEAT
    if width_lo >= lo and width_hi <= top:
        return pattern                  # every match already has an allowed length
    if width_hi < lo or width_lo > top:
        return False
    items = list(parsed)
    core = [i for i in items if i[0] != sre.AT]
    anchors = [i for i in items if i[0] == sre.AT]
    if len(core) != 1 or len(anchors) != len(items) - 1 or core[0][0] != sre.MAX_REPEAT:
        return None
    rmin, rmax, body = core[0][1]
    if body.getwidth() != (1, 1):
        return None
    start = max(rmin, lo)
    end = min(rmax, top)
    if start > end:
        return False
    # the repeated atom, as written: strip the pattern's own quantifier and anchors
    text = pattern[1:] if pattern.startswith("^") else pattern
    text = text[:-1] if text.endswith("$") and not text.endswith("\\$") else text
    m = re.fullmatch(r"(.+?)(\*|\+|\?|\{\d+(?:,\d*)?\})", text, re.S)
    if not m:
        return None
    return f"^{m.group(1)}{{{start},{end if end != sre.MAXREPEAT else ''}}}$"


def _search(pattern: str, name: str, where: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        raise ValueError(f"the pattern {pattern!r} at {where} is not a regular expression namazu reads") from None


def search_pattern(pattern: str) -> str:
    """The pattern as a whole-string match that accepts what JSON Schema's pattern (a search) accepts:
    both compilers match a `pattern` against the whole string (`^https?://` would refuse
    "https://example.com"), so an unanchored side gets `[\\s\\S]*`. A pattern with an anchor or a
    lookaround elsewhere (`^a|b$`, `a\\b`), where rewriting is not this simple, is kept: a whole-string
    match of it is narrower than the search, never wider."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not _escaped(pattern, len(pattern) - 1)
    if start and end:
        return pattern
    core = pattern[1 if start else 0:len(pattern) - 1 if end else len(pattern)]
    anchors, alternation = _anchors_and_alternation(core)
    if anchors or (alternation and (start or end)) or re.search(r"\\[bBAZz]|\(\?[=!<]", core):
        return pattern
    return ("^" if start else "^[\\s\\S]*") + f"(?:{core})" + ("$" if end else "[\\s\\S]*$")


def _escaped(text: str, i: int) -> bool:
    """True when text[i] is escaped by an odd run of backslashes."""
    n = 0
    while i - n - 1 >= 0 and text[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _anchors_and_alternation(core: str) -> tuple[bool, bool]:
    """(an unescaped ^ or $ outside a character class, a | at the top level)."""
    depth, i, in_class, anchors, alternation = 0, 0, False, False, False
    while i < len(core):
        c = core[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if core[i + 1:i + 2] == "]" or core[i + 1:i + 3] == "^]":   # a leading ] is literal
                i += 2 if core[i + 1] == "]" else 3
                continue
        elif c in "^$":
            anchors = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            alternation = True
        i += 1
    return anchors, alternation


def xgrammar_pattern(pattern: str) -> str:
    """The same regular expression, written around an xgrammar 0.2.9 bug: inside a JSON schema, an
    optional group that ends in a repetition (`(x[0-9]+)?`) loses its first part (`a1` matches
    `a(x[0-9]+)?`). `{0,1}` means the same as `?` and is compiled right."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == ")" and pattern[i + 1:i + 2] == "?" and pattern[i + 2:i + 3] != "?":
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_pattern(pattern: Any, where: str) -> None:
    """A pattern is bounded work: its length, each repetition count, and the product of nested ones."""
    if not isinstance(pattern, str):
        raise ValueError(f"the pattern at {where} must be a string")
    if len(pattern) > MAX_PATTERN:
        raise ValueError(f"the pattern at {where} is {len(pattern)} characters; namazu compiles at most {MAX_PATTERN}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"the pattern at {where} is not a valid regular expression: {e}") from None
    if _expanded_size(pattern, where) > MAX_EXPANDED:
        raise ValueError(f"the pattern at {where} nests repetitions to more than {MAX_EXPANDED} copies; namazu "
                         "refuses it (its automaton, and so its compile time, would explode)")


def _expanded_size(pattern: str, where: str) -> int:
    """How many atoms the pattern has with every counted repetition written out (`(a{10}){10}`: 100)."""
    frames = [0]
    last = 0              # size of the atom just read, for a quantifier that follows it
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            last, i = 1, i + 2
        elif c == "[":
            j = i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last, i = 1, j + 1
        elif c == "(":
            frames.append(0)
            last, i = 0, i + 1
            continue
        elif c == ")" and len(frames) > 1:
            last, i = frames.pop(), i + 1
        elif c == "{" and _REPEAT.match(pattern, i):
            m = _REPEAT.match(pattern, i)
            n = max(int(m.group(1)), int(m.group(2) or 0))
            if n > MAX_REPEAT:
                raise ValueError(f"the pattern at {where} repeats {n} times ({m.group(0)}); namazu compiles "
                                 f"repetitions of at most {MAX_REPEAT}")
            frames[-1] += last * (max(n, 1) - 1)
            last, i = last * max(n, 1), m.end()
            continue
        else:
            last, i = 1, i + 1
        frames[-1] += last
    return sum(frames)


def _exclusive(a: Any, b: Any, where: str) -> bool:
    """True when no instance can satisfy both (raw, upgraded, inlined) schemas, by a cheap sufficient test."""
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not (ta & tb):
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not ({_key(v) for v in va} & {_key(v) for v in vb}):
        return True
    if va is not None and tb is not None and not ({_json_type(v) for v in va} & tb):
        return True
    if vb is not None and ta is not None and not ({_json_type(v) for v in vb} & ta):
        return True
    if ta is not None and tb is not None and ta & tb == {"string"}:
        fa, fb = _first_chars(a), _first_chars(b)
        if fa is not None and fb is not None and not (fa & fb):
            return True       # strings that cannot start alike (a uuid and a pattern ^\$...)
    if ta is not None and tb is not None and (ta & tb) - {"object"}:
        return False          # they share a non-object type: no property can tell them apart
    pa, pb = a.get("properties", {}), b.get("properties", {})
    ra, rb = set(a.get("required", [])), set(b.get("required", []))
    for name in ra & rb:
        x, y = pa.get(name), pb.get(name)
        if isinstance(x, dict) and isinstance(y, dict) and _exclusive(x, y, where):
            return True

    def forbids(s: dict, name: str) -> bool:
        props = s.get("properties", {})
        if name in props:
            return props[name] is False
        return s.get("additionalProperties", True) is False and not any(
            _search(p, name, where) for p in s.get("patternProperties", {}))
    if (ta is None or tb is None) and not (ta == {"object"} or tb == {"object"}):
        return False          # a non-object satisfies both when neither says "object"
    return any(forbids(b, n) for n in ra) or any(forbids(a, n) for n in rb)


_STRING_KEYS = {"pattern", "format", "minLength", "maxLength"}


def _string_only(s: Any) -> bool:
    """A (raw, upgraded) schema whose keywords all test strings only (so every non-string satisfies it)."""
    return isinstance(s, dict) and bool(s) and set(s) <= _STRING_KEYS


_HEX = frozenset("0123456789abcdefABCDEF")
_FORMAT_FIRST = {"uuid": _HEX, "date": frozenset("0123456789"), "date-time": frozenset("0123456789"),
                 "ipv4": frozenset("0123456789"), "time": frozenset("0123456789")}


def _first_chars(s: dict) -> frozenset[str] | None:
    """The characters a string of the (raw, upgraded) schema must start with (it is never empty), None
    when namazu cannot tell: read from a known format, or a pattern anchored at ^ whose first atom is a
    literal or a class of literals and ranges."""
    out = _FORMAT_FIRST.get(s.get("format", ""))
    pattern = s.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^"):
        first = _pattern_first(pattern)
        if first is not None:
            out = first if out is None else out & first
    return out


def _pattern_first(pattern: str) -> frozenset[str] | None:
    try:
        from re import _parser as sre  # type: ignore[attr-defined]
    except ImportError:                 # Python < 3.11
        import sre_parse as sre  # type: ignore[no-redef]
    try:
        items = list(sre.parse(pattern))
    except Exception:   # noqa: BLE001 -- checked elsewhere; here only "cannot tell"
        return None
    if len(items) < 2 or items[0] != (sre.AT, sre.AT_BEGINNING):
        return None
    op, arg = items[1]
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT) and arg[0] >= 1 and len(arg[2]) == 1:
        op, arg = list(arg[2])[0]
    if op == sre.LITERAL:
        return frozenset(chr(arg))
    if op != sre.IN:
        return None
    chars: set[str] = set()
    for kind, value in arg:
        if kind == sre.LITERAL:
            chars.add(chr(value))
        elif kind == sre.RANGE and value[1] - value[0] < 4096:
            chars.update(chr(c) for c in range(value[0], value[1] + 1))
        else:
            return None       # a negation, a category (\\d), a huge range: not read here
    return frozenset(chars)


_OBJECT_KEYS = {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
                "maxProperties", "propertyNames"}
_ARRAY_KEYS = {"items", "prefixItems", "minItems", "maxItems"}


def _grammar_kinds(s: dict) -> set[str]:
    """The JSON types xgrammar's grammar for a node generates: without `type`, a node with object (array)
    keywords generates only objects (arrays)."""
    t = s.get("type")
    if t is not None:
        return {t} if isinstance(t, str) else set(t)
    if _OBJECT_KEYS & set(s):
        return {"object"}
    if _ARRAY_KEYS & set(s):
        return {"array"}
    return set(TYPES)


def check_productive(schema: Any) -> None:
    """Refuses a normalized schema that no finite JSON value satisfies (a recursion with no base case,
    a required property that accepts nothing): the grammar would let a model generate forever."""
    defs = schema.get("$defs", {}) if isinstance(schema, dict) else {}
    good: set[str] = set()

    def ok(s: Any) -> bool:
        if s is True:
            return True
        if s is False or not isinstance(s, dict):
            return s is not False
        if "$ref" in s:
            return s["$ref"].rsplit("/", 1)[-1] in good
        if "anyOf" in s:
            return any(ok(b) for b in s["anyOf"])
        if "enum" in s:
            return bool(s["enum"])
        if "const" in s:
            return True
        kinds = _grammar_kinds(s)
        if kinds - {"object", "array"}:
            return True
        if "object" in kinds:
            props = s.get("properties", {})
            if all(ok(props.get(n, True)) for n in s.get("required", [])):
                return True
        if "array" in kinds:
            prefix, lo = s.get("prefixItems", []), s.get("minItems", 0)
            if all(ok(p) for p in prefix[:lo]) and (lo <= len(prefix) or ok(s.get("items", True))):
                return True
        return False

    changed = True
    while changed:
        changed = False
        for name, d in defs.items():
            if name not in good and ok(d):
                good.add(name)
                changed = True
    if not ok({k: v for k, v in schema.items() if k != "$defs"} if isinstance(schema, dict) else schema):
        raise ValueError("the JSON schema accepts no finite JSON value (a recursion with no way out, or a "
                         "required part that accepts nothing): it would generate forever")
