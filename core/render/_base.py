"""What every provider module supplies, and the neutral tool description.

Rules:
  * A provider turns plan items (see :mod:`._plan`) into the exact JSON body
    its HTTP API takes, parses that API's response body back into journal
    events, and checks a body against its own pairing rules.
  * Reasoning items reach a provider only if their ``provider`` and ``model``
    equal the target's and their ``payload_format`` is one the provider
    replays; the provider then emits ``data`` verbatim, where it stood.
  * Bodies are plain dicts of JSON values; nothing is shared with the events
    (mutating a body never changes the journal).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError
from ..journal.events import Event, Reasoning
from ..capsule.format import load_json
from ._count import CLAUDE_4_7_ON
from ._plan import ATTACH, Item, Unit


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A tool the model may call, in neutral form."""

    name: str  # function name (letters, digits, _ and -)
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FormatError("tool name must be a non-empty string")
        if not isinstance(self.parameters, Mapping):
            raise FormatError(f"tool {self.name}: parameters must be a JSON schema object")


@dataclass(frozen=True, slots=True)
class BlobData:
    """Where an attachment's bytes go in a body, until the body is final:
    counted as ``tokens`` (the provider's own estimate, not its base64), then
    replaced by ``prefix`` + the base64 of the blob (:func:`resolve`)."""

    blob: str
    tokens: int
    prefix: str = ""  # "data:<media type>;base64," where the API takes a data URL


#: Upper bounds of what one attachment costs in tokens (docs/render.md):
#: an image is resized by every provider to at most about 1.2 megapixels
#: (Anthropic: 1,600 tokens at most; gpt-4o: 1,445; Gemini: 258 per tile);
#: a PDF page is its text and its picture (Anthropic documents 1,500-3,000).
IMAGE_TOKENS = 1600
PDF_PAGE_TOKENS = 3000

#: OpenAI counts an image by model (its vision guide). The full-size models
#: stay under IMAGE_TOKENS (tiles: 85 + 170 x 8 = 1,445; gpt-4.1's 32-px
#: patches: 1,536 at most). The small ones multiply: gpt-4.1-mini 1,536 x
#: 1.62, o4-mini x 1.72, gpt-4.1-nano x 2.46 (3,779), and gpt-4o-mini counts
#: 2,833 + 5,667 a tile (8 tiles at most: 48,169). A model not named here
#: is taken for a small one: the largest patch bound, never less.
OPENAI_FULL_SIZE = ("gpt-4o", "chatgpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "o1", "o3")
OPENAI_SMALL_IMAGE_TOKENS = 3779  # ceil(1536 x 2.46)
GPT_4O_MINI_IMAGE_TOKENS = 2833 + 8 * 5667


def openai_image_tokens(model: str) -> int:
    """An upper bound of what one image costs ``model`` (see above)."""
    name = model.lower().rsplit("/", 1)[-1]
    if name.startswith("gpt-4o-mini"):
        return GPT_4O_MINI_IMAGE_TOKENS
    if "mini" in name or "nano" in name or not name.startswith(OPENAI_FULL_SIZE):
        return OPENAI_SMALL_IMAGE_TOKENS
    return IMAGE_TOKENS


#: Anthropic counts an image as its pixels / 750, resized to about 1.15
#: megapixels (IMAGE_TOKENS at most), but Claude Opus 4.7 takes images up to
#: 3.75 megapixels: 5,000 tokens; taken for every model of 4.7 and later.
ANTHROPIC_HIGH_RES = re.compile(CLAUDE_4_7_ON)
ANTHROPIC_HIGH_RES_IMAGE_TOKENS = 5000


def anthropic_image_tokens(model: str) -> int:
    """An upper bound of what one image costs ``model`` (see above)."""
    return ANTHROPIC_HIGH_RES_IMAGE_TOKENS if ANTHROPIC_HIGH_RES.search(model) else IMAGE_TOKENS


def attachment_tokens(media_type: str, size: int, pages: int | None, *, image: int = IMAGE_TOKENS) -> int:
    """An upper bound of an attachment's tokens: ``image`` for an image (the
    provider's bound for the model), PDF_PAGE_TOKENS a page for a PDF."""
    if media_type.startswith("image/"):
        return image
    if media_type == "application/pdf":
        return PDF_PAGE_TOKENS * max(1, pages or 1) if pages is not None else max(PDF_PAGE_TOKENS, size)
    return size  # text: never more tokens than bytes


def attachment_note(ev: Any, why: str) -> str:
    name = f" {ev.name}" if ev.name else ""
    return f"[attachment{name} ({ev.media_type}, {ev.size} bytes) not sent: {why}]"


def resolve(obj: Any, read_blob: Any) -> Any:
    """``obj`` with every :class:`BlobData` replaced by its prefix and the
    base64 of its blob (read with ``read_blob(sha256) -> bytes``)."""
    import base64

    if isinstance(obj, BlobData):
        if read_blob is None:
            from ._plan import RenderError

            raise RenderError(f"the request holds attachment {obj.blob}: rendering it needs the capsule's blobs")
        return obj.prefix + base64.b64encode(read_blob(obj.blob)).decode("ascii")
    if isinstance(obj, dict):
        return {k: resolve(v, read_blob) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v, read_blob) for v in obj]
    return obj


MB = 1024 * 1024
IMAGES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def sniff_media_type(head: bytes) -> str | None:
    """The media type of an image or PDF by its first bytes (its magic
    number, never its file name), or None if it is neither."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"%PDF-"):
        return "application/pdf"
    return None


#: A decimal megabyte, as the providers state their request limits.
MB10 = 1000 * 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLimits:
    """What one request may carry in attachments, as the provider documents it
    (docs/render.md); None: no limit of that kind."""

    images: int  # images in one request
    pdf_pages: int  # pages of all PDFs in one request
    image_bytes: int | None = None  # bytes of all images (OpenAI)
    pdf_bytes: int | None = None  # bytes of all PDFs (OpenAI)
    #: base64 of all attachments: the request's size limit, less a tenth for the rest of the body
    encoded_bytes: int | None = None


def encoded_size(size: int) -> int:
    """Bytes of ``size`` bytes in base64."""
    return 4 * ((size + 2) // 3)


class Provider:
    """Base of the provider modules' singletons. Subclasses fill every method."""

    id: str = ""
    replays: frozenset[str] = frozenset()  # reasoning payload formats it sends back
    #: media types it takes as attachments -> largest size in bytes
    accepts: dict[str, int] = {}
    limits: RequestLimits = RequestLimits(images=0, pdf_pages=0)

    def refuses(self, ev: Any) -> str | None:
        """Why this provider cannot take the attachment ``ev``, or None."""
        limit = self.accepts.get(ev.media_type)
        if limit is None:
            return f"{self.id} takes no {ev.media_type} attachments"
        if ev.size > limit:
            return f"{self.id} takes attachments of at most {limit} bytes"
        return None

    def why_not(self, item: Item) -> str | None:
        """Why the attachment of plan item ``item`` is not sent, or None:
        a request limit (:meth:`limit_attachments`) or :meth:`refuses`."""
        return item[3] if len(item) > 3 else self.refuses(item[1])

    def limit_attachments(self, units: list[Unit], pages: Callable[[str], int | None] | None = None) -> None:
        """Mark the attachments one request cannot carry, the oldest first:
        walking from the newest, one that would pass a limit of
        :attr:`limits` is not sent (its item gets the reason, and becomes a
        note), so the newest are what the model sees. Decided over the whole
        journal, which keeps the same newest ones as deciding over the
        window, and before fitting, so that the budget counts notes for them.
        ``pages(sha256)`` counts a PDF's pages (its item takes the count, for
        its tokens); it is asked only while the page limit is not reached,
        so a long journal's old PDFs are never read."""
        lim = self.limits
        images = used_pages = image_bytes = pdf_bytes = encoded = 0
        for unit in reversed(units):
            items = unit.items
            for i in range(len(items) - 1, -1, -1):
                item = items[i]
                if item[0] != ATTACH or self.refuses(item[1]) is not None:
                    continue
                ev = item[1]
                image = ev.media_type.startswith("image/")
                pdf = ev.media_type == "application/pdf"
                if pdf and item[2] is None and used_pages < lim.pdf_pages and pages is not None:
                    item = items[i] = (ATTACH, ev, pages(ev.blob))
                n_images = images + image
                n_pages = used_pages + (max(1, item[2] or 1) if pdf else 0)
                n_image_bytes = image_bytes + (ev.size if image else 0)
                n_pdf_bytes = pdf_bytes + (ev.size if pdf else 0)
                n_encoded = encoded + encoded_size(ev.size)
                why = None
                if n_images > lim.images:
                    why = f"{self.id} takes at most {lim.images} images in a request"
                elif n_pages > lim.pdf_pages:
                    why = f"{self.id} takes at most {lim.pdf_pages} PDF pages in a request"
                elif lim.image_bytes is not None and n_image_bytes > lim.image_bytes:
                    why = f"{self.id} takes at most {lim.image_bytes} bytes of images in a request"
                elif lim.pdf_bytes is not None and n_pdf_bytes > lim.pdf_bytes:
                    why = f"{self.id} takes at most {lim.pdf_bytes} bytes of PDFs in a request"
                elif lim.encoded_bytes is not None and n_encoded > lim.encoded_bytes:
                    why = f"{self.id} takes requests of at most {lim.encoded_bytes * 10 // 9} bytes"
                if why is not None:
                    items[i] = (ATTACH, ev, item[2], why + "; newer attachments are sent")
                    continue
                images, used_pages, image_bytes, pdf_bytes, encoded = n_images, n_pages, n_image_bytes, n_pdf_bytes, n_encoded

    def keeps(self, item: Reasoning, model: str) -> bool:
        """True if this reasoning goes back to the target ``model`` of this provider."""
        return item.provider == self.id and item.model == model and item.payload_format in self.replays

    def body(
        self,
        items: list[Item],
        *,
        model: str,
        system: str | None,
        tools: Sequence[ToolSpec],
        max_output: int | None,
    ) -> dict[str, Any]:
        raise NotImplementedError

    def fragment(self, items: list[Item], *, model: str) -> Any:
        """The JSON these items add to a body; the fitter counts it to estimate."""
        raise NotImplementedError

    def parse(self, response: Mapping[str, Any], *, model: str, new_id: Any = None) -> list[Event]:
        raise NotImplementedError

    def check(self, body: Mapping[str, Any]) -> list[str]:
        """Every way ``body`` breaks this provider's pairing rules; empty if none."""
        raise NotImplementedError


def error_text(content: str, is_error: bool) -> str:
    """A tool result as plain text for APIs with no error flag."""
    return f"[error] {content}" if is_error else content


def args_json(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def args_from_json(raw: Any) -> dict[str, Any]:
    """Tool arguments as the model sent them; unparsable text is kept under one key."""
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = load_json(raw, "tool arguments") if isinstance(raw, str) and raw.strip() else {}
    except FormatError:  # not JSON, or JSON this reader refuses (a key twice, too deep, a huge number)
        return {"_unparsed_arguments": raw}
    return value if isinstance(value, dict) else {"_unparsed_arguments": raw}


def verbatim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A provider object without the ``None`` fields SDK dumps add."""
    return {k: v for k, v in obj.items() if v is not None}
