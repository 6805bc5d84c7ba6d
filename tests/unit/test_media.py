"""Which prompts name media by reference (their tokens are bounded by the model's context, not by
the request's bytes: gateway/pipeline/admit.py), in each API's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from neuralgrid.gateway.pipeline.admit import media_by_reference

URL = "https://example.com/clip"
INLINE = "data:image/png;base64,iVBORw0KGgo="


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": list(parts)}],
    }


@pytest.mark.parametrize(
    ("body", "by_reference"),
    [
        (chat({"type": "image_url", "image_url": {"url": URL}}), True),
        (chat({"type": "image_url", "image_url": {"url": INLINE}}), False),
        (chat({"type": "video_url", "video_url": {"url": URL}}), True),  # vLLM
        (chat({"type": "audio_url", "audio_url": {"url": URL}}), True),  # vLLM
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": URL}]}],
            },
            True,
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_url": URL}]}]},
            True,
        ),
        # A URL in the text is text: its bytes are its tokens' bound.
        (chat({"type": "text", "text": f"what is at {URL}? and image_url too"}), False),
        ({"model": "m", "messages": [{"role": "user", "content": "image_url"}]}, False),
        ({"model": "m", "prompt": "image_url"}, False),
    ],
)
def test_media_by_reference(body: dict[str, Any], by_reference: bool) -> None:
    assert media_by_reference(json.dumps(body).encode(), body) is by_reference
