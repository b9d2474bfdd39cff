"""The console shows a logged run's transcript images as thumbnails (server/console/thumbnails.py):
inline images and files in the log directory become small JPEG data URIs; what cannot be shown
(a path out of the directory, bytes that are not an image, a decompression bomb) is a note."""

from __future__ import annotations

import base64
import io
import json
import re
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image
from server_fake_engine import FakeServer
from test_console_http import KEY_A, _browser, keyed  # noqa: F401 - a fixture

from tinker_local.apps.connect import register_log_dir


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def _bomb() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", 9000, 9000, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


def test_transcript_images_are_thumbnails(
    keyed: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    log_dir = tmp_path / "vision-run"
    (log_dir / "images").mkdir(parents=True)
    (log_dir / "images" / "step1.png").write_bytes(_png(640, 480, (200, 30, 30)))
    (tmp_path / "secret.png").write_bytes(_png(8, 8, (0, 0, 0)))
    (log_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    inline = base64.b64encode(_png(300, 100, (20, 40, 220))).decode()
    turn = {
        "observation": "<|vision_start|><|image_pad|><|vision_end|>What is this?",
        "action": "a red square", "reward": 1.0,
        "images": [
            {"path": "images/step1.png"},
            {"format": "png", "data": inline},
            {"path": "../secret.png"},
            {"format": "png", "data": base64.b64encode(b"not an image").decode()},
            {"format": "png", "data": base64.b64encode(_bomb()).decode()},
        ],
    }
    (log_dir / "transcripts.jsonl").write_text(
        json.dumps({"step": 1, "kind": "train", "reward": 1.0, "turns": [turn]}) + "\n")
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    url = register_log_dir(log_dir, "rl", keyed.base_url)
    assert url is not None
    with _browser(keyed, KEY_A) as http:
        page = http.get(url[len(keyed.base_url):])
        assert page.status_code == 200
    sources = re.findall(r'<img class="thumb" src="data:image/jpeg;base64,([^"]+)" '
                         r'alt="([^"]*)"', page.text)
    assert [alt for _, alt in sources] == ["images/step1.png (640x480)", "png image (300x100)"]
    for (data, _), colour, size in zip(sources, ((200, 30, 30), (20, 40, 220)),
                                       ((160, 120), (160, 53)), strict=True):
        thumb = Image.open(io.BytesIO(base64.b64decode(data)))
        assert thumb.format == "JPEG" and thumb.size == size
        assert all(abs(a - b) < 12 for a, b in zip(thumb.getpixel((10, 10)), colour, strict=True))
    assert "image not shown: &#39;../secret.png&#39; is not a file in the log directory" in page.text
    assert "image not shown: the 12 bytes are not a PNG or JPEG image" in page.text
    assert "image not shown: the image declares 9000x9000" in page.text
