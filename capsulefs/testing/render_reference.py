"""Reference token counts of rendered bodies, independent of render's counters.

Rules:
  * Gemini: what Google's own offline counter counts (google-genai's
    ``LocalTokenizer.count_tokens``, its ``_TextsAccumulator``), applied to
    the REST body: every text part; a call's name, its arguments' keys and
    string values; a result's name, its response's keys and string values;
    each tool's name, description and schema (property names, descriptions,
    formats, enums, required names); the system instruction's texts. Each
    text is tokenized on its own with the Gemma vocabulary and the counts
    summed: no role markers, no JSON, no call ids, no thought signatures.
    Attachments (``inlineData``) count as the render's marker says.
  * The tests and bench/bench_render.py compare the fitter's counter with it:
    a window is never over the reference and fills most of it.
"""

from __future__ import annotations

from typing import Any

from capsulefs.core.render._count import text_counter


def gemini_reference(body: dict[str, Any]) -> int:
    """The tokens of a Gemini ``generateContent`` body as Google's local counter counts them."""
    tok = text_counter("gemma")
    assert tok is not None, "the tokenizer package is missing"
    texts: list[str] = []
    fixed = 0

    def any_value(v: Any) -> None:
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, dict):
            texts.extend(v)
            for x in v.values():
                any_value(x)
        elif isinstance(v, list):
            for x in v:
                any_value(x)

    def schema(s: dict[str, Any]) -> None:
        for key in ("format", "description"):
            if isinstance(s.get(key), str):
                texts.append(s[key])
        texts.extend(x for x in s.get("enum") or () if isinstance(x, str))
        texts.extend(x for x in s.get("required") or () if isinstance(x, str))
        if isinstance(s.get("items"), dict):
            schema(s["items"])
        for name, sub in (s.get("properties") or {}).items():
            texts.append(name)
            if isinstance(sub, dict):
                schema(sub)

    contents = list(body.get("contents") or ())
    if body.get("systemInstruction"):
        contents.append(body["systemInstruction"])
    for content in contents:
        for part in content.get("parts") or ():
            if "text" in part:
                texts.append(part["text"])
            if "functionCall" in part:
                texts.append(part["functionCall"]["name"])
                any_value(part["functionCall"].get("args") or {})
            if "functionResponse" in part:
                texts.append(part["functionResponse"]["name"])
                any_value(part["functionResponse"].get("response") or {})
            if "inlineData" in part:
                marker = part["inlineData"].get("data")
                fixed += getattr(marker, "tokens", 0)
    for tool in body.get("tools") or ():
        for decl in tool.get("functionDeclarations") or ():
            texts.append(decl["name"])
            if decl.get("description"):
                texts.append(decl["description"])
            params = decl.get("parametersJsonSchema") or decl.get("parameters")
            if isinstance(params, dict):
                schema(params)
    return sum(tok(t) for t in texts if t) + fixed
