"""Declared properties in any order, for the objects small enough to list every order.

Both compilers write an object's declared properties in the order the schema lists them: a valid
instance with its keys in another order (JSON Schema gives keys no order) is refused. A grammar
that takes each key at most once in any order must remember which keys it has seen, so its size
grows with the number of orders; namazu writes it out only where that stays small: an object with
at most `MAX_ANY_ORDER` declared properties becomes an `anyOf` of the same object with its
`properties` listed in every order. Each branch is the object as the schema states it (the same
keywords, only `properties` reordered), so the rewrite accepts exactly what the schema accepts: it
widens nothing but the key order. Larger objects keep the schema's order (over-constraint, never
a wrong output). The bound is llguidance's: its parser keeps every branch alive at once and gives up
past 2,000 items a position ("ParserTooComplex"), which an anyOf of two 4-property objects in every
order (48 branches) already passes on WashingtonPost's schemas; 3 properties (6 orders) stay well
inside it.

A property value that holds more than a leaf (an object, an array, a combinator) is moved into
`$defs` and referenced from every branch, so nested objects are not copied once per order; the
orders written over the whole schema are bounded by `MAX_ORDER_BRANCHES`, and those the branches of
one anyOf write together (llguidance follows all of them at once) by `MAX_ALTERNATIVE_ORDERS`.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

MAX_ANY_ORDER = 3             # declared properties of an object whose orders are all written (3! = 6)
MAX_ORDER_BRANCHES = 256      # orders written over the whole schema (later objects keep the schema's order)
MAX_ALTERNATIVE_ORDERS = 12   # orders the branches of one anyOf may write together (all live at one position)
_LEAF_KEYS = {"type", "enum", "const", "pattern", "format", "minLength", "maxLength", "minimum", "maximum",
              "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_SCHEMA_MAPS = {"properties", "patternProperties"}
_SCHEMA_LISTS = {"anyOf", "prefixItems"}
_SCHEMA_KEYS = {"items", "additionalProperties", "propertyNames"}


def _is_leaf(s: Any) -> bool:
    return isinstance(s, bool) or (isinstance(s, dict) and set(s) <= _LEAF_KEYS
                                   and all(not isinstance(v, (dict, list)) for k, v in s.items() if k != "enum"
                                           and not (k == "type" and isinstance(v, list))))


def _is_object(s: dict) -> bool:
    t = s.get("type")
    return (t == "object" or (isinstance(t, list) and "object" in t) or t is None) and \
        isinstance(s.get("properties"), dict)


def _orders_of(s: Any, defs: dict[str, Any]) -> int:
    """How many orders the rewrite would write for `s` itself (through one local $ref)."""
    if isinstance(s, dict) and set(s) == {"$ref"} and isinstance(s["$ref"], str):
        s = defs.get(s["$ref"].rsplit("/", 1)[-1])
    if not isinstance(s, dict) or not _is_object(s):
        return 1
    n = len(s["properties"])
    return math.factorial(n) if 2 <= n <= MAX_ANY_ORDER else 1


def _crowded(root: Any, defs: dict[str, Any]) -> tuple[set[int], set[str]]:
    """The anyOf branches (by node id, and $defs names) that keep the schema's order because together
    they would put more than MAX_ALTERNATIVE_ORDERS orders at one position of llguidance's parser."""
    nodes: set[int] = set()
    names: set[str] = set()
    stack = [root, *defs.values()]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        for key, value in s.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SCHEMA_LISTS or key in _SCHEMA_KEYS:
                stack.append(value)
        branches = s.get("anyOf")
        if isinstance(branches, list) and sum(_orders_of(b, defs) for b in branches) > MAX_ALTERNATIVE_ORDERS:
            for b in branches:
                if isinstance(b, dict) and set(b) == {"$ref"} and isinstance(b["$ref"], str):
                    names.add(b["$ref"].rsplit("/", 1)[-1])
                else:
                    nodes.add(id(b))
    return nodes, names


class _Orders:
    def __init__(self, defs: dict[str, Any], crowded: tuple[set[int], set[str]]):
        self.defs = defs
        self.crowded_nodes, self.crowded_defs = crowded
        self.branches = 0
        self.hoisted = 0

    def walk(self, s: Any, keep_order: bool = False) -> Any:
        """The schema `s` rewritten, its sub-schemas first (a normalized schema: its keywords are known)."""
        if not isinstance(s, dict):
            return s
        keep_order = keep_order or id(s) in self.crowded_nodes
        out = dict(s)
        for key, value in s.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: self.walk(sub) for name, sub in value.items()}
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [self.walk(sub) for sub in value]
            elif key in _SCHEMA_KEYS:
                out[key] = self.walk(value)
        if keep_order or not _is_object(out):
            return out
        props = out["properties"]
        n = len(props)
        if n < 2 or n > MAX_ANY_ORDER or self.branches + math.factorial(n) > MAX_ORDER_BRANCHES:
            return out
        self.branches += math.factorial(n)
        shared = {name: self.hoist(sub) for name, sub in props.items()}
        return {"anyOf": [{**out, "properties": {name: shared[name] for name in order}}
                          for order in itertools.permutations(props)]}

    def hoist(self, sub: Any) -> Any:
        """`sub` itself if it is a leaf, else a reference to it in $defs (shared by every order)."""
        if _is_leaf(sub) or (isinstance(sub, dict) and set(sub) == {"$ref"}):
            return sub
        name = f"o{self.hoisted}"
        while name in self.defs:
            self.hoisted += 1
            name = f"o{self.hoisted}"
        self.hoisted += 1
        self.defs[name] = sub
        return {"$ref": f"#/$defs/{name}"}


def any_order(schema: Any) -> tuple[Any, int]:
    """(the normalized schema with small objects' properties in any order, how many orders were
    written); the schema is returned unchanged when no object qualifies."""
    if not isinstance(schema, dict):
        return schema, 0
    defs = dict(schema.get("$defs", {}))
    body = {k: v for k, v in schema.items() if k != "$defs"}
    orders = _Orders(defs, _crowded(body, defs))
    body = orders.walk(body)
    for name in list(defs):
        if name in schema.get("$defs", {}):
            defs[name] = orders.walk(defs[name], keep_order=name in orders.crowded_defs)
    if not orders.branches:
        return schema, 0
    out = dict(body)
    if defs:
        out["$defs"] = defs
    return out, orders.branches
