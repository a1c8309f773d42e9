"""Media a chat message names are loaded only where the caller allows (issue 44): remote URLs (a local HTTP server on
127.0.0.1 here), local paths (an allow-list of directories; ``..`` and symbolic links resolved), a byte budget on
every read and a pixel budget checked on the header before decoding. Data URLs and in-memory images stay accepted."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from transformers import AutoProcessor

from transformers_k3 import KimiK3ImageProcessor, KimiK3Processor, KimiK3VideoProcessor
from transformers_k3.media_kimi_k3 import KimiK3MediaError, MediaPolicy

Image = pytest.importorskip("PIL.Image")


def png_bytes(width=40, height=30, seed=0) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png_bytes()


def reference_pixels(processor, data: bytes = PNG):
    """What the image processor makes of the same picture handed over in memory."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return processor.image_processor(image)["pixel_values"]


class _Server:
    """A bounded HTTP server on 127.0.0.1: /a.png serves the PNG, /to?u=... redirects to u; it counts requests."""

    def __init__(self):
        outer = self
        self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                if self.path.startswith("/to?u="):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/to?u="):])
                    self.end_headers()
                    return
                if self.path == "/slow":  # a body that trickles in, one byte at a time
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    for _ in range(40):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.05)
                    return
                body = PNG if self.path == "/a.png" else b"x" * 5000
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.timeout = 5
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path="/a.png"):
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    served = _Server()
    yield served
    served.close()


def make(tokenizer, **options):
    return KimiK3Processor(KimiK3ImageProcessor(), KimiK3VideoProcessor(), tokenizer, **options)


def chat(part):
    return [{"role": "user", "content": [part, {"type": "text", "text": "what is this?"}]}]


def run_chat(processor, part):
    return processor.apply_chat_template(chat(part), add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


# ------------------------------------------------------------------------------------------------- remote URLs
@pytest.mark.parametrize("form", ["url", "image_url"])
def test_remote_url_refused_by_default_and_loopback_refused_even_when_remote_is_on(tokenizer, server, form):
    part = ({"type": "image", "url": server.url()} if form == "url"
            else {"type": "image_url", "image_url": {"url": server.url()}})
    with pytest.raises(KimiK3MediaError, match="remote media is off by default.*allow_remote_media=True"):
        run_chat(make(tokenizer), part)
    with pytest.raises(KimiK3MediaError, match="resolves to 127.0.0.1, a loopback.*allow_private_network_media"):
        run_chat(make(tokenizer, allow_remote_media=True), part)
    assert server.requests == []  # refused before any connection
    processor = make(tokenizer, allow_remote_media=True, allow_private_network_media=True)
    out = run_chat(processor, part)
    assert server.requests == ["/a.png"]
    assert out["pixel_values"].equal(reference_pixels(processor))
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_private_network_allow_list_and_redirects_to_a_disallowed_address(tokenizer, server):
    processor = make(tokenizer, allow_remote_media=True, allow_private_network_media=["127.0.0.1/32"])
    assert run_chat(processor, {"type": "image", "url": server.url()})["pixel_values"].equal(
        reference_pixels(processor))
    # the first hop is allowed; the address it redirects to is checked again and refused before connecting
    redirect = server.url(f"/to?u=http://127.0.0.2:{server.port}/a.png")
    with pytest.raises(KimiK3MediaError, match="resolves to 127.0.0.2"):
        run_chat(processor, {"type": "image", "url": redirect})
    with pytest.raises(KimiK3MediaError, match="not an http"):
        run_chat(processor, {"type": "image", "url": server.url("/to?u=file:///etc/passwd")})
    # a redirect to an allowed address is followed
    assert run_chat(processor, {"type": "image", "url": server.url(f"/to?u={server.url()}")})["pixel_values"].equal(
        reference_pixels(processor))


def test_download_byte_budget(tokenizer, server):
    processor = make(tokenizer, allow_remote_media=True, allow_private_network_media=True, max_media_bytes=1000)
    with pytest.raises(KimiK3MediaError, match="5000 bytes, above max_media_bytes=1000"):
        run_chat(processor, {"type": "image", "url": server.url("/big")})


def test_a_trickling_download_stops_at_media_timeout(tokenizer, server):
    processor = make(tokenizer, allow_remote_media=True, allow_private_network_media=True, media_timeout=0.5)
    with pytest.raises(KimiK3MediaError, match="took longer than media_timeout"):
        run_chat(processor, {"type": "image", "url": server.url("/slow")})


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.1", "172.16.3.4", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fe80::1", "fc00::1",
                                     "::ffff:127.0.0.1", "::ffff:10.0.0.1"])
def test_every_non_public_address_is_refused(address):
    with pytest.raises(KimiK3MediaError, match="refused"):
        MediaPolicy.create(allow_remote_media=True).check_host(address, 80)
    assert MediaPolicy.create(allow_remote_media=True, allow_private_network_media=True).check_host(address, 80)


def test_public_addresses_pass_the_address_check():
    policy = MediaPolicy.create(allow_remote_media=True)
    assert policy.check_host("8.8.8.8", 443) == ["8.8.8.8"]
    assert policy.check_host("2606:4700:4700::1111", 443) == ["2606:4700:4700::1111"]


# ------------------------------------------------------------------------------------------------- local files
@pytest.fixture
def files(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (outside / "b.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "b.png")
    (allowed / "linkdir").symlink_to(outside)
    return allowed, outside


def test_local_path_refused_by_default_and_loaded_under_an_allowed_directory(tokenizer, files):
    allowed, _ = files
    path = str(allowed / "a.png")
    with pytest.raises(KimiK3MediaError, match="reading local files is off by default.*allowed_local_media_path"):
        run_chat(make(tokenizer), {"type": "image", "path": path})
    with pytest.raises(KimiK3MediaError, match="reading local files is off by default"):
        make(tokenizer)(text="<|media_pad|>", images=[path])  # a string image handed to the processor directly
    with pytest.raises(KimiK3MediaError, match="reading local files is off by default"):
        make(tokenizer)(text="<|media_pad|>", images=[str(allowed / "missing.png")])  # no existence oracle
    processor = make(tokenizer, allowed_local_media_path=str(allowed))
    for part in ({"type": "image", "path": path}, {"type": "image", "image": path}, {"type": "image", "url": path}):
        assert run_chat(processor, part)["pixel_values"].equal(reference_pixels(processor))
    assert processor(text="<|media_pad|>", images=[path])["pixel_values"].equal(reference_pixels(processor))
    with pytest.raises(KimiK3MediaError, match=f"{len(PNG)} bytes, above max_media_bytes=100"):
        run_chat(make(tokenizer, allowed_local_media_path=str(allowed), max_media_bytes=100),
                 {"type": "image", "path": path})


@pytest.mark.parametrize("escape", ["../secret/b.png", "link.png", "linkdir/b.png", "./../secret/b.png"])
def test_dot_dot_and_symlink_escapes_are_refused(tokenizer, files, escape):
    allowed, _ = files
    processor = make(tokenizer, allowed_local_media_path=[str(allowed)])
    with pytest.raises(KimiK3MediaError, match="outside allowed_local_media_path"):
        run_chat(processor, {"type": "image", "path": os.path.join(str(allowed), escape)})


def test_other_schemes_refused_and_data_urls_accepted(tokenizer):
    processor = make(tokenizer)
    for url in ("file:///etc/passwd", "ftp://example.com/a.png", "gopher://127.0.0.1/"):
        with pytest.raises(KimiK3MediaError, match="scheme"):
            run_chat(processor, {"type": "image", "url": url})
    encoded = base64.b64encode(PNG).decode()
    for part in ({"type": "image", "url": f"data:image/png;base64,{encoded}"}, {"type": "image", "base64": encoded},
                 {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}}):
        assert run_chat(processor, part)["pixel_values"].equal(reference_pixels(processor))
    with pytest.raises(KimiK3MediaError, match="above max_media_bytes=100"):
        run_chat(make(tokenizer, max_media_bytes=100), {"type": "image", "base64": encoded})


def test_media_options_are_not_saved_and_a_config_cannot_widen_them(tokenizer, tmp_path, files):
    allowed, _ = files
    processor = make(tokenizer, allowed_local_media_path=str(allowed), allow_remote_media=True)
    processor.save_pretrained(tmp_path / "saved")
    written = json.loads((tmp_path / "saved" / "processor_config.json").read_text())
    assert not {"allowed_local_media_path", "allow_remote_media", "media_policy"} & set(written)
    written.update(allowed_local_media_path=str(allowed), allow_remote_media=True)
    (tmp_path / "saved" / "processor_config.json").write_text(json.dumps(written))
    reloaded = KimiK3Processor.from_pretrained(tmp_path / "saved")
    assert reloaded.media_policy == MediaPolicy()
    with pytest.raises(KimiK3MediaError, match="reading local files is off"):
        run_chat(reloaded, {"type": "image", "path": str(allowed / "a.png")})
    operator = KimiK3Processor.from_pretrained(tmp_path / "saved", allowed_local_media_path=str(allowed))
    assert run_chat(operator, {"type": "image", "path": str(allowed / "a.png")})["pixel_values"].equal(
        reference_pixels(operator))
    (tmp_path / "saved" / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    operator = AutoProcessor.from_pretrained(tmp_path / "saved", allowed_local_media_path=str(allowed),
                                             max_image_pixels=1000)
    with pytest.raises(KimiK3MediaError, match="40x30 = 1200 pixels, above the budget max_image_pixels=1000"):
        run_chat(operator, {"type": "image", "path": str(allowed / "a.png")})
    operator.save_pretrained(tmp_path / "again")
    assert "max_image_pixels" not in json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())
    tokenizer_config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert "allow_remote_media" not in tokenizer_config


# ------------------------------------------------------------------------------------------------- sizes, bad files
def _png_header_only(width, height) -> bytes:
    """A PNG whose header states ``width x height`` but whose pixel data is a few bytes (decoding it would fail)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_pixel_budget_is_checked_on_the_header_before_decoding(tokenizer, tmp_path):
    (tmp_path / "big.png").write_bytes(_png_header_only(20000, 20000))
    processor = make(tokenizer, allowed_local_media_path=str(tmp_path))
    # the refusal names the header's size: decoding this file would fail with a truncation error instead
    with pytest.raises(KimiK3MediaError, match=r"400000000 pixels, above the budget max_image_pixels=64000000.*"
                                                r"\(checked before decoding\)"):
        run_chat(processor, {"type": "image", "path": str(tmp_path / "big.png")})
    (tmp_path / "wide.png").write_bytes(_png_header_only(9000, 8000))  # below Pillow's own limits
    with pytest.raises(KimiK3MediaError, match=r"9000x8000 = 72000000 pixels, above the budget "
                                                r"max_image_pixels=64000000 \(checked before decoding\)"):
        run_chat(processor, {"type": "image", "path": str(tmp_path / "wide.png")})
    processor.image_processor.max_image_pixels = 1000
    with pytest.raises(KimiK3MediaError, match="40x30 = 1200 pixels, above the budget max_image_pixels=1000"):
        run_chat(processor, {"type": "image", "base64": base64.b64encode(PNG).decode()})


def test_in_memory_images_above_the_budget_are_refused_before_any_copy(tokenizer):
    processor = make(tokenizer)
    processor.image_processor.max_image_pixels = 50 * 40 - 1
    with pytest.raises(KimiK3MediaError, match="50x40 = 2000 pixels"):
        processor.image_processor(Image.new("RGB", (50, 40)))
    with pytest.raises(KimiK3MediaError, match="50x40 = 2000 pixels"):
        processor.image_processor(np.zeros((40, 50, 3), dtype=np.uint8))
    with pytest.raises(KimiK3MediaError, match="50x40 = 2000 pixels"):
        processor.image_processor(np.zeros((3, 40, 50), dtype=np.uint8))
    processor.image_processor.max_image_pixels = 2000
    assert processor.image_processor(np.zeros((40, 50, 3), dtype=np.uint8))["image_grid_thw"].tolist() == [[1, 4, 4]]


_RSS_SCRIPT = r"""
import resource, struct, sys, zlib
from PIL import Image
from transformers_k3 import KimiK3ImageProcessor
width = height = 12000
raw = zlib.compressobj(1)
row = b"\0" + b"\x80" * width  # filter byte + one gray row
data = b"".join(raw.compress(row) for _ in range(height)) + raw.flush()
def chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
       + chunk(b"IDAT", data) + chunk(b"IEND", b""))
open(sys.argv[1], "wb").write(png)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
image = Image.open(sys.argv[1])  # lazily opened: header read, pixels not decoded
try:
    KimiK3ImageProcessor()(image)
    print("processed")
except Exception as error:
    print(type(error).__name__, str(error)[:80])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_decompression_bomb_is_refused_without_taking_its_memory(tmp_path):
    """A real 12000 x 12000 PNG of 144 M pixels (a few hundred KB on disk, below PIL's own bomb error): decoding
    takes hundreds of MB; the budget refuses it from the header, so peak memory stays near where it was."""
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "bomb.png")], capture_output=True,
                         text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stderr[-2000:]
    assert lines[0].startswith("KimiK3MediaError the image is 12000x12000 = 144000000 pixels"), lines
    assert int(lines[1]) < 64, f"peak RSS grew by {lines[1]} MB"


def test_unreadable_image_files_give_a_named_error(tokenizer, tmp_path):
    (tmp_path / "text.png").write_bytes(b"this is not an image at all")
    (tmp_path / "cut.png").write_bytes(png_bytes(200, 200)[:300])
    (tmp_path / "folder.png").mkdir()
    processor = make(tokenizer, allowed_local_media_path=str(tmp_path))
    with pytest.raises(KimiK3MediaError, match="not an image PIL can read"):
        processor(text="<|media_pad|>", images=[str(tmp_path / "text.png")])
    with pytest.raises(KimiK3MediaError, match="could not be decoded.*truncated or corrupt"):
        run_chat(processor, {"type": "image", "path": str(tmp_path / "cut.png")})
    with pytest.raises(KimiK3MediaError, match="not a regular file"):
        run_chat(processor, {"type": "image", "path": str(tmp_path / "folder.png")})
    with pytest.raises(KimiK3MediaError, match="could not read the local media"):
        run_chat(processor, {"type": "image", "path": str(tmp_path / "missing.png")})
    # a truncated file the caller opened lazily fails at the decode with the processor's named error
    from transformers_k3.image_processing_kimi_k3 import KimiK3ImageInputError

    with pytest.raises(KimiK3ImageInputError, match="truncated or corrupt"):
        processor.image_processor(Image.open(tmp_path / "cut.png"))


def test_video_paths_and_urls_follow_the_same_policy(tokenizer, server, files):
    allowed, _ = files
    processor = make(tokenizer)
    with pytest.raises(KimiK3MediaError, match="remote media is off"):
        run_chat(processor, {"type": "video", "url": server.url("/v.mp4")})
    with pytest.raises(KimiK3MediaError, match="reading local files is off"):
        run_chat(processor, {"type": "video", "path": str(allowed / "v.mp4")})
    with pytest.raises(KimiK3MediaError, match="outside allowed_local_media_path"):
        run_chat(make(tokenizer, allowed_local_media_path=str(allowed)),
                 {"type": "video", "path": str(allowed / "../secret/v.mp4")})
    with pytest.raises(KimiK3MediaError, match="reading local files is off"):
        processor.video_processor.to_frames(str(allowed / "v.mp4"))
    assert server.requests == []
