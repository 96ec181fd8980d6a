"""50 JSON schemas of varied features for the structured-output tests: flat objects of every type,
nested objects, arrays with min/max items, enums and consts, patterns, formats, anyOf/oneOf,
$ref/$defs, and required/optional mixes."""

from __future__ import annotations

S = {"type": "string", "maxLength": 24}


def obj(props: dict, required: list[str] | None = None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


def schemas() -> list[dict]:
    out: list[dict] = []
    # flat objects, one type each and mixes (10)
    out += [
        obj({"name": S}),
        obj({"age": {"type": "integer", "minimum": 0, "maximum": 130}}),
        obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
        obj({"ok": {"type": "boolean"}}),
        obj({"nothing": {"type": "null"}}),
        obj({"name": S, "age": {"type": "integer"}, "ok": {"type": "boolean"}}),
        obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
        obj({"x": {"type": "number"}, "y": {"type": "number"}}),
        obj({"count": {"type": "integer", "exclusiveMinimum": 0, "multipleOf": 5}}),
        obj({"code": {"type": "string", "minLength": 2, "maxLength": 4}}),
    ]
    # nested objects (8)
    point = obj({"x": {"type": "integer"}, "y": {"type": "integer"}})
    out += [
        obj({"person": obj({"first": S, "last": S})}),
        obj({"a": obj({"b": obj({"c": {"type": "integer"}})})}),
        obj({"start": point, "end": point}),
        obj({"user": obj({"id": {"type": "integer"}, "profile": obj({"bio": S})}), "active": {"type": "boolean"}}),
        obj({"meta": obj({"version": {"type": "integer", "minimum": 1, "maximum": 9}}), "name": S}),
        obj({"box": obj({"w": {"type": "number", "minimum": 0}, "h": {"type": "number", "minimum": 0}})}),
        obj({"config": obj({"debug": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}})}),
        obj({"outer": obj({"inner": obj({"value": S}, required=[])})}),
    ]
    # arrays with min/max items (8)
    out += [
        obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
        obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                        "minItems": 2, "maxItems": 4}}),
        obj({"points": {"type": "array", "items": point, "minItems": 1, "maxItems": 2}}),
        obj({"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}),
        obj({"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 3,
                        "maxItems": 3}}),
        obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                   "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
        obj({"pair": {"type": "array", "prefixItems": [S, {"type": "integer"}], "items": False}}),
        {"type": "array", "items": obj({"k": S, "v": {"type": "integer"}}), "minItems": 1, "maxItems": 3},
    ]
    # enums and consts (5)
    out += [
        obj({"status": {"enum": ["active", "inactive", "banned"]}}),
        obj({"kind": {"const": "event"}, "n": {"type": "integer"}}),
        obj({"size": {"enum": ["S", "M", "L", "XL"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
        obj({"answer": {"enum": [1, 2, 3, True, None, "other"]}}),
        {"enum": ["yes", "no", "maybe"]},
    ]
    # patterns (4) and formats (5)
    out += [
        obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
        obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
        obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
        obj({"slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+){0,2}$"}}),
        obj({"day": {"type": "string", "format": "date"}}),
        obj({"email": {"type": "string", "format": "email"}}),
        obj({"id": {"type": "string", "format": "uuid"}}),
        obj({"ip": {"type": "string", "format": "ipv4"}}),
        obj({"ip6": {"type": "string", "format": "ipv6"}}),
    ]
    # anyOf / oneOf (5)
    out += [
        obj({"value": {"anyOf": [{"type": "integer"}, S]}}),
        obj({"id": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[a-z]{3}$"}]}}),
        obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}),
                                 obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}})]}}),
        obj({"maybe": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}),
        {"oneOf": [obj({"error": S}), {"type": "array", "items": {"type": "integer"}, "maxItems": 3}]},
    ]
    # $ref and $defs (3)
    out += [
        {"$defs": {"addr": obj({"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})},
         **obj({"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}})},
        {"$defs": {"item": obj({"name": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}})},
         **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}})},
        {"$defs": {"name": S, "tagged": obj({"name": {"$ref": "#/$defs/name"}, "tag": {"enum": ["x", "y"]}})},
         **obj({"first": {"$ref": "#/$defs/tagged"}, "second": {"$ref": "#/$defs/tagged"}}, required=["first"])},
    ]
    # required / optional mixes (2)
    out += [
        obj({"name": S, "nick": S, "age": {"type": "integer"}}, required=["name"]),
        obj({"a": {"type": "integer"}, "b": S, "c": {"type": "boolean"}}, required=["c"],
            ),
    ]
    assert len(out) == 50, len(out)
    return out
