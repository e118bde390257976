"""The reference agent's calls to model providers, through their official
SDKs; the run's secrets (named in ``$CAPSULE_SECRETS``) are for them only.
"""

from __future__ import annotations


import logging
import os
from typing import Any

from capsulefs.core.errors import CapsuleError

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)



def _dump(obj: Any) -> dict[str, Any]:
    return obj.model_dump(mode="json", exclude_none=True) if hasattr(obj, "model_dump") else dict(obj)


class ProviderClients:
    """The official SDK clients, made once per process.

    Keys and endpoints come from the SDKs' own environment variables
    (ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL, OPENAI_API_KEY / OPENAI_BASE_URL),
    and GEMINI_API_KEY / GEMINI_BASE_URL for google-genai.
    """

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}

    def _client(self, name: str) -> Any:
        if name not in self._clients:
            if name == "anthropic":
                import anthropic

                self._clients[name] = anthropic.Anthropic(max_retries=2)
            elif name == "openai":
                import openai

                self._clients[name] = openai.OpenAI(max_retries=2)
            else:
                from google import genai
                from google.genai import types as gt

                base = os.environ.get("GEMINI_BASE_URL")
                opts = gt.HttpOptions(base_url=base, api_version="v1beta") if base else None
                self._clients[name] = genai.Client(api_key=os.environ.get("GEMINI_API_KEY"), http_options=opts)
        return self._clients[name]

    def __call__(self, provider: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """Send one rendered body; return the reply as the provider's JSON."""
        if provider == "anthropic":
            return _dump(self._client("anthropic").messages.create(**body))
        if provider == "openai-chat":
            return _dump(self._client("openai").chat.completions.create(**body))
        if provider == "openai-responses":
            return _dump(self._client("openai").responses.create(**body))
        if provider == "gemini":
            return self._gemini(model, body)
        raise CapsuleError(f"the reference agent cannot call provider {provider!r}")

    def _gemini(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        import json as _json

        from google.genai import types as gt

        def typed(cls: Any, obj: Any) -> Any:  # REST JSON -> the SDK's typed objects
            return cls.model_validate_json(_json.dumps(obj))

        config = gt.GenerateContentConfig(
            system_instruction=typed(gt.Content, body["systemInstruction"]) if "systemInstruction" in body else None,
            tools=[typed(gt.Tool, t) for t in body.get("tools", ())] or None,
            max_output_tokens=body.get("generationConfig", {}).get("maxOutputTokens"),
            automatic_function_calling=gt.AutomaticFunctionCallingConfig(disable=True),
        )
        reply = self._client("gemini").models.generate_content(
            model=model, contents=[typed(gt.Content, c) for c in body["contents"]], config=config)
        return reply.model_dump(mode="json", exclude_none=True, by_alias=True)
