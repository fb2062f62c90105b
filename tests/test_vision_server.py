"""`mlcc serve` with a vision-language model (the tiny Gemma 3 of test_vision.py) through the official openai client:
image_url parts, the media domains, the limits on images, and images that are not images, each a 400 naming the
problem."""

import base64
import io
import struct
import zlib

import openai
import pytest
from server_support import mlcc_serve
from vision_support import make_gemma3_vision, png_data_url, random_image


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mlcc.compiler.build import compile_model

    hf_dir = make_gemma3_vision(tmp_path_factory.mktemp("hf-gemma3-vision"))
    art = tmp_path_factory.mktemp("art-gemma3-vision") / "model"
    compile_model(hf_dir, "llvm", "q0f32", art)
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with mlcc_serve(art, log, "--allowed-media-domains", "example.com", "--max-images-per-request", "2",
                    "--max-image-bytes", "60000", "--max-image-pixels", "1000000", "--served-model-name", "m") as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _user(urls, text="What is this?"):
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}


def _chat(client, urls, text="What is this?", history=(), **kw):
    return client.chat.completions.create(model="m", messages=[*history, _user(urls, text)], max_tokens=4,
                                          temperature=0, **kw)


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _claiming(png: bytes, width: int, height: int) -> bytes:
    """A PNG whose header says width x height (CRC fixed) over the pixel data of a small one."""
    ihdr = struct.pack(">II", width, height) + png[24:29]
    return png[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + png[33:]


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_images_are_answered_and_their_content_keys_the_prefix_cache(client):
    a, b = png_data_url(random_image(1)), png_data_url(random_image(2))
    first = _chat(client, [a])
    answer = first.choices[0].message.content
    assert answer and first.usage.prompt_tokens > 4
    # "<start_of_turn>user\n\n\n<start_of_image>": the image's 4 tokens are prompt tokens 23..26 here
    follow = _chat(client, [], "And?", history=[_user([a]), {"role": "assistant", "content": answer}])
    assert follow.usage.prompt_tokens_details.cached_tokens >= 28   # through the image: the same content
    swapped = _chat(client, [], "And?", history=[_user([b]), {"role": "assistant", "content": answer}])
    assert swapped.usage.prompt_tokens_details.cached_tokens <= 23   # another image there: not its KV
    two = _chat(client, [a, b], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in two if c.choices)


@pytest.mark.parametrize("url, needle", [
    ("https://other.org/cat.png", "--allowed-media-domains other.org"),
    ("http://example.com/cat.png", "https://"),
    ("https://example.com/cat.png", "fetching https://example.com/cat.png failed"),   # allowed; no network here
    ("data:image/png,abc", "base64"),
    ("data:image/png;base64,@@@", "base64"),
])
def test_urls_outside_the_rules_get_400(client, url, needle):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [url])
    assert needle in e.value.message and "messages[0].content[0].image_url" in str(e.value.body)


@pytest.mark.parametrize("data, needle", [
    (_png(400, 300)[: len(_png(400, 300)) // 2], "truncated or corrupt"),
    (_png(1, 1), "at least 2x2"),
    (_claiming(_png(8, 8), 20000, 20000), "larger than max_image_pixels (1000000): Image size (400000000 pixels)"),
    (_claiming(_png(8, 8), 2000, 2000), "2000x2000, more than max_image_pixels (1000000)"),
    (b"GIF89a not really", "not an image"),
    (b"\x89PNG" + bytes(70000), "max_image_bytes (60000 bytes)"),
])
def test_bad_images_get_400_before_their_pixels_are_decoded(client, data, needle):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [_data_url(data)])
    assert needle in e.value.message


def test_too_many_images_get_400_naming_the_limit(client):
    url = png_data_url(random_image(3))
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [url, url, url])
    assert "max_images_per_request (2)" in e.value.message and "--max-images-per-request" in e.value.message
