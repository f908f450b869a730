"""The mistral format, for Mistral's tokenizers (those with a `[TOOL_CALLS]` token): the content, then `[TOOL_CALLS]`
and a JSON list of {"name", "arguments"} objects, or (the newer tokenizers') `[TOOL_CALLS]NAME[ARGS]{...}` for each
call, `NAME[CALL_ID]ID[ARGS]{...}` where the model gives the call's id. Mistral's templates refuse a tool call id
that is not 9 letters and digits, so under the request's id_style "mistral" every call gets such an id (the model's
own where it is one). The markers are special tokens: the server keeps them in the text for this parser. Streamed,
the calls come when the output ends."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from picovllm.entrypoints.openai.tool_parsers.base import (UNPARSED, ToolCall, ToolParser, partial_tag,
                                                          without_markers)

if TYPE_CHECKING:
    from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy

MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# Mistral's chat templates refuse a tool call id that is not 9 letters and digits (the next turn's): its calls get such
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


class MistralParser(ToolParser):
    name = "mistral"
    special_markers = True

    def parse(self, policy: ToolPolicy, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content before [TOOL_CALLS]; after it a JSON list of calls, or NAME[ARGS]{...} (NAME[CALL_ID]ID[ARGS]
        {...}: the model's id kept where it is Mistral's 9 letters and digits, with id_style "mistral") for each
        call (each after a [TOOL_CALLS] of its own, or one after the other). Anything that does not parse: all
        content, the markers out (they are special tokens, kept in the text for this parser only)."""
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return text, []
        rest, calls = text[start + len(MISTRAL_CALLS):], []
        if rest.lstrip().startswith("["):
            try:
                items = json.loads(rest)
            except UNPARSED:
                return without_markers(text, (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)), []
            calls = [policy.call_of(item) for item in items] if isinstance(items, list) and items else [None]
        else:
            decoder = json.JSONDecoder()
            for piece in rest.split(MISTRAL_CALLS):
                while piece.strip():
                    name, sep, args = piece.partition(MISTRAL_ARGS)
                    name, _, given_id = name.partition(MISTRAL_CALL_ID)
                    try:
                        obj, end = decoder.raw_decode(args.lstrip()) if sep else (None, 0)
                    except UNPARSED:
                        obj = None
                    calls.append(policy.call_of({"name": name.strip(), "arguments": obj}) if sep else None)
                    if calls[-1] is None:
                        break
                    if policy.id_style == "mistral" and MISTRAL_ID.fullmatch(given_id.strip()):
                        calls[-1].id = given_id.strip()
                    piece = args.lstrip()[end:]
        if not calls or any(c is None for c in calls):
            return without_markers(text, (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)), []
        content = text[:start].rstrip()
        return content or None, calls if policy.parallel else calls[:1]

    def held_content_end(self, text: str) -> int:
        """Up to [TOOL_CALLS], or where it may be starting, trailing whitespace held back."""
        tag = text.find(MISTRAL_CALLS)
        end = tag if tag >= 0 else len(text) - partial_tag(text, MISTRAL_CALLS)
        return len(text[:end].rstrip())
