"""A fixed set of JSON schemas for structured-output acceptance and benchmarks.

Eighteen written by hand for the shapes API customers send (Japanese business documents, nested
objects, bounded arrays, $ref, formats), then deterministic compositions of field types until the set
reaches the requested size. Every keyword used is one namazu enforces (`namazu/structured/json_schema.py`).
"""
from __future__ import annotations

import random
from typing import Any

HANDWRITTEN: list[dict[str, Any]] = [
    {"type": "object", "properties": {"会社名": {"type": "string", "maxLength": 30},
                                      "従業員数": {"type": "integer", "minimum": 1, "maximum": 100000},
                                      "業種": {"enum": ["製造", "小売", "金融", "情報通信"]}},
     "required": ["会社名", "従業員数", "業種"], "additionalProperties": False},
    {"type": "object", "properties": {"件名": {"type": "string", "maxLength": 40},
                                      "宛先": {"type": "array", "items": {"type": "string", "format": "email"},
                                               "minItems": 1, "maxItems": 3},
                                      "優先度": {"enum": ["高", "中", "低"]}},
     "required": ["件名", "宛先"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                      "amount_yen": {"type": "integer", "minimum": 0, "maximum": 10000000},
                                      "approved": {"type": "boolean"}},
     "required": ["date", "amount_yen", "approved"], "additionalProperties": False},
    {"$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                          "role": {"enum": ["部長", "課長", "担当"]}},
                          "required": ["name", "role"], "additionalProperties": False}},
     "type": "object", "properties": {"owner": {"$ref": "#/$defs/person"},
                                      "members": {"type": "array", "items": {"$ref": "#/$defs/person"},
                                                  "maxItems": 2}},
     "required": ["owner"], "additionalProperties": False},
    {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                                      "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                                "items": {"type": "object",
                                                          "properties": {"sku": {"type": "string", "maxLength": 8},
                                                                         "qty": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
                                                          "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["order_id", "items"], "additionalProperties": False},
    {"type": "object", "properties": {"meeting": {"type": "object", "properties": {
        "start": {"type": "string", "format": "date-time"},
        "room": {"type": "string", "maxLength": 10}}, "required": ["start"], "additionalProperties": False}},
     "required": ["meeting"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["id", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                           {"type": "string", "maxLength": 5}]}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"住所": {"type": "object", "properties": {
        "都道府県": {"enum": ["東京都", "大阪府", "北海道"]},
        "郵便番号": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["都道府県", "郵便番号"], "additionalProperties": False}},
     "required": ["住所"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["urgent", "billing", "bug"]},
                                               "maxItems": 3},
                                      "note": {"type": "string", "maxLength": 50}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"const": True}, "code": {"type": "integer", "multipleOf": 100,
                                                                      "minimum": 100, "maximum": 500}},
     "required": ["ok", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "array", "prefixItems": [{"type": "number"},
                                                                               {"type": "number"}],
                                                "items": False, "minItems": 2}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"url": {"type": "string", "format": "uri"}}, "required": ["url"],
     "additionalProperties": False},
    {"type": "object", "properties": {"nullable_note": {"anyOf": [{"type": "string", "maxLength": 10},
                                                                  {"type": "null"}]}},
     "required": ["nullable_note"], "additionalProperties": False},
    {"type": "object", "properties": {"返信": {"type": "string", "minLength": 1, "maxLength": 60},
                                      "感情": {"enum": ["肯定", "否定", "中立"]},
                                      "確信度": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
     "required": ["返信", "感情"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^v[0-9]+\\.[0-9]+$"},
                                      "stable": {"type": "boolean"}},
     "required": ["version"], "additionalProperties": False},
]

_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("name", {"type": "string", "maxLength": 16}),
    ("氏名", {"type": "string", "minLength": 1, "maxLength": 12}),
    ("age", {"type": "integer", "minimum": 0, "maximum": 120}),
    ("price", {"type": "number", "minimum": 0, "maximum": 1000}),
    ("status", {"enum": ["open", "closed", "pending"]}),
    ("部署", {"enum": ["営業部", "開発部", "総務部"]}),
    ("active", {"type": "boolean"}),
    ("code", {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}),
    ("due", {"type": "string", "format": "date"}),
    ("ids", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 3}),
    ("labels", {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2}),
    ("ratio", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    ("count", {"type": "integer", "exclusiveMinimum": 0, "maximum": 50}),
    ("memo", {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}),
]


def json_schemas(n: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    """The hand-written schemas, then seeded compositions (flat and nested) up to n."""
    out = [dict(s) for s in HANDWRITTEN[:n]]
    rng = random.Random(seed)
    while len(out) < n:
        fields = rng.sample(_FIELDS, rng.randint(2, 4))
        props = {name: schema for name, schema in fields}
        required = [name for name, _ in fields if rng.random() < 0.7] or [fields[0][0]]
        obj = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        if rng.random() < 0.3:
            obj = {"type": "object", "properties": {"data": obj, "ok": {"type": "boolean"}},
                   "required": ["data"], "additionalProperties": False}
        out.append(obj)
    return out
