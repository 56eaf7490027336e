"""The 20 JSON schemas of the structured-output acceptance test (issue 12) and the prompts
that ask for them: nested objects, arrays with minItems / maxItems, enums, required and
optional fields, integer and number bounds, string patterns, anyOf, $ref. Strings carry a
maxLength and numbers bounds, so a complete answer fits the test's max_tokens."""

from __future__ import annotations

NAME = {"type": "string", "maxLength": 16}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99,
                                                "maximum": 99},
                                          "y": {"type": "integer", "minimum": -99,
                                                "maximum": 99}},
         "required": ["x", "y"]}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    ("a user account", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "pattern": "^[a-z]{3,8}@[a-z]{3,6}\\.com$"}},
            "required": ["id", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]}),
    ("a blog post's tags", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "minItems": 2, "maxItems": 3}}, "required": ["tags"]}),
    ("a T-shirt", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"]}),
    ("a book", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "subtitle": {"type": "string", "maxLength": 24},
        "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["title", "pages"]}),
    ("a product price", {"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "discount": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["price", "discount"]}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
        "city": NAME}, "required": ["celsius", "city"]}),
    ("a flight code", {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "gate": {"type": "string", "pattern": "^[A-F][1-9]$"}},
        "required": ["code", "gate"]}),
    ("an identifier", {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999},
                         {"type": "string", "maxLength": 8}]}}, "required": ["id"]}),
    ("a line segment", {"type": "object", "$defs": {"point": POINT}, "properties": {
        "start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]}),
    ("a shopping list", {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "name": {"type": "string", "maxLength": 12},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["name", "qty"]}}}, "required": ["items"]}),
    ("a status report", {"type": "object", "properties": {
        "ok": {"const": True}, "count": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["ok", "count"]}),
    ("a difficulty level", {"type": "object", "properties": {
        "level": {"enum": [1, 2, 3]}, "label": {"enum": ["easy", "medium", "hard"]}},
        "required": ["level", "label"]}),
    ("a 2x2 matrix of digits", {"type": "object", "properties": {
        "matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["matrix"]}),
    ("a geometric shape", {"type": "object", "properties": {
        "shape": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "radius": {"type": "integer", "minimum": 1,
                                                         "maximum": 10}},
             "required": ["kind", "radius"]},
            {"type": "object", "properties": {"kind": {"const": "square"},
                                              "side": {"type": "integer", "minimum": 1,
                                                       "maximum": 10}},
             "required": ["kind", "side"]}]}}, "required": ["shape"]}),
    ("a list of fruit names", {"type": "array", "items": {"type": "string", "maxLength": 10},
                               "minItems": 1, "maxItems": 3}),
    ("a calendar date", {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"},
        "weekday": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}},
        "required": ["date", "weekday"]}),
    ("a pet with an optional nickname", {"type": "object", "properties": {
        "species": {"enum": ["cat", "dog"]},
        "nickname": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}},
        "required": ["species", "nickname"]}),
    ("a deeply nested setting", {"type": "object", "properties": {
        "a": {"type": "object", "properties": {
            "b": {"type": "object", "properties": {
                "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}},
            "required": ["b"]}}, "required": ["a"]}),
    ("a meeting", {"type": "object", "$defs": {"person": {
        "type": "object", "properties": {"name": NAME,
                                         "role": {"enum": ["host", "guest"]}},
        "required": ["name", "role"]}}, "properties": {
        "topic": {"type": "string", "maxLength": 20},
        "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"},
                      "minItems": 1, "maxItems": 2}}, "required": ["topic", "attendees"]}),
]
assert len(SCHEMAS) == 20
