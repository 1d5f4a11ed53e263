"""Image decoding limits, and http(s) image URLs: refused by default, fetched only from
allow-listed hosts (a real local HTTP server), never through a redirect."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from kdaserve.image_io import ImageError, ImageLimits, check_count, host_allowed, load_image


def png_bytes(w=30, h=20) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (255, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def http_images():
    body = png_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", "http://example.com/x.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_http_refused_by_default(http_images):
    with pytest.raises(ImageError, match="refused by this server"):
        load_image(http_images + "/a.png", ImageLimits())


def test_allow_list(http_images):
    allowed = ImageLimits(allow_remote=True, allowed_hosts=("127.0.0.1",))
    assert load_image({"url": http_images + "/a.png"}, allowed).size == (30, 20)
    other = ImageLimits(allow_remote=True, allowed_hosts=(".example.com",))
    with pytest.raises(ImageError, match="allow-list"):
        load_image(http_images + "/a.png", other)
    with pytest.raises(ImageError, match="redirect"):
        load_image(http_images + "/moved.png", allowed)
    small = ImageLimits(allow_remote=True, allowed_hosts=("127.0.0.1",), max_bytes=50)
    with pytest.raises(ImageError, match="50 bytes"):
        load_image(http_images + "/a.png", small)
    assert host_allowed("img.example.com", (".example.com",))
    assert not host_allowed("example.com.evil.org", (".example.com",))


def test_data_url_limits():
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    assert load_image(url, ImageLimits()).size == (30, 20)
    with pytest.raises(ImageError, match="max-image-bytes"):
        load_image(url, ImageLimits(max_bytes=40))
    with pytest.raises(ImageError, match="599 pixels"):
        load_image(url, ImageLimits(max_pixels=599))
    with pytest.raises(ImageError, match="must be base64"):
        load_image("data:image/png," + "abc", ImageLimits())
    with pytest.raises(ImageError, match="data URL"):
        load_image("file:///etc/passwd", ImageLimits())
    with pytest.raises(ImageError, match="at most 2"):
        check_count(3, ImageLimits(max_images=2))
