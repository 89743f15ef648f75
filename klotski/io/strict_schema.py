"""OpenAI's strict structured outputs: the subset of JSON Schema a `"strict": true` schema must
keep to, checked so that a line asking for strict mode is refused where OpenAI would refuse it
(one line naming the rule and where it is broken) rather than run on rules OpenAI never applied.

The rules checked are the ones OpenAI states for strict mode: the root is an object (not
`anyOf`); every object sets `"additionalProperties": false` and lists every one of its
properties in `"required"` (an optional field is written as a union with null). Nested
schemas are reached through properties, items, anyOf, and `$defs`/`definitions`. Without
`strict`, a schema is not held to these rules: llguidance compiles what it can, as documented
in jobs/README.md.

This module only uses the standard library.
"""

from __future__ import annotations

import json

NESTED_ONE = ("items", "additionalItems", "not")  # keywords holding one subschema
NESTED_MANY = ("anyOf", "allOf", "oneOf", "prefixItems")  # keywords holding a list of them
NESTED_MAP = ("properties", "$defs", "definitions")  # keywords holding a map of them


def strict_refusal(schema, name: str) -> str | None:
    """Why OpenAI's strict mode would refuse `schema` (found at `name` in the job line), in
    one line, or None when it keeps to strict mode's rules."""
    if not isinstance(schema, dict) or "anyOf" in schema or not _is_object(schema):
        return (f'{name}: with "strict": true the root schema must be {{"type": "object", ...}} '
                f'(not anyOf or another type); wrap the answer in an object, or set "strict": false')
    return _first_refusal(schema, name)


def _first_refusal(schema, where: str) -> str | None:
    if not isinstance(schema, dict):
        return None
    if _is_object(schema):
        if schema.get("additionalProperties") is not False:
            return (f'{where}: with "strict": true every object needs "additionalProperties": false '
                    f'(found {_show(schema.get("additionalProperties"))}); add it, or set "strict": false')
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        missing = [key for key in properties if key not in required]
        if missing:
            return (f'{where}: with "strict": true every property must be listed in "required" (missing '
                    f'{", ".join(json.dumps(k) for k in missing)}); list it (an optional field is a union '
                    f'with null: "type": ["string", "null"]), or set "strict": false')
    for key in NESTED_ONE:
        found = _first_refusal(schema.get(key), f"{where}.{key}")
        if found:
            return found
    for key in NESTED_MANY:
        subs = schema.get(key)
        for i, sub in enumerate(subs if isinstance(subs, list) else []):
            found = _first_refusal(sub, f"{where}.{key}[{i}]")
            if found:
                return found
    for key in NESTED_MAP:
        subs = schema.get(key)
        for sub_name, sub in (subs.items() if isinstance(subs, dict) else ()):
            found = _first_refusal(sub, f"{where}.{key}.{sub_name}")
            if found:
                return found
    return None


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        (kind is None and "properties" in schema)


def _show(value) -> str:
    return "nothing" if value is None else json.dumps(value)[:40]
