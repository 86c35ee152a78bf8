"""Images (and video frames) through every API, end to end: `python -m nanoserve.server` serving m3-tiny-vl (m3-tiny
with a tiny random vision tower) as a process of its own, driven by the openai and anthropic SDKs.

A data-URL image and a question get a 200 with text and the image's placeholder tokens in the usage; the same image
again is served from the prefix cache; the image URL rules (--allowed-media-domains, --allowed-local-media-path,
--max-media-bytes) and --limit-mm-per-prompt hold; corrupt, oversized and refused images get a 400 naming the field,
and the server stays healthy through them."""

from __future__ import annotations

import functools
import http.server
import threading

import anthropic
import httpx
import openai
import pytest

from tests.helpers.images import data_url, huge_header_png, image_tokens, jpeg, png, video_url
from tests.helpers.server_utils import SERVED_MODEL, ServerProcess

MAX_MEDIA_BYTES = 200_000


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "local").mkdir()
    (root / "local" / "cat.png").write_bytes(png(7))
    (root / "web").mkdir()
    (root / "web" / "dog.png").write_bytes(png(8))
    (root / "web" / "big.png").write_bytes(png(9, 400, 400))  # ~480 kB: over --max-media-bytes
    return root


@pytest.fixture(scope="module")
def web(media_dir):
    """A plain HTTP server on 127.0.0.1 serving media_dir/web."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir / "web"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.log_message = lambda *a, **k: None
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tiny_vl_dir, media_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vision") / "server.log"
    flags = ("--limit-mm-per-prompt", '{"image": 2, "video": 1}', "--allowed-media-domains", "127.0.0.1",
             "--allowed-local-media-path", str(media_dir / "local"), "--max-media-bytes", str(MAX_MEDIA_BYTES))
    with ServerProcess(tiny_vl_dir, log, *flags, name=SERVED_MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, *parts, text: str = "What is in this picture?", **kw):
    content = [{"type": "text", "text": text}, *parts]
    return client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=4, temperature=0, **kw)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def refused(call) -> dict:
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as info:
        call()
    return info.value.body.get("error", info.value.body)


def test_an_image_and_a_question_get_text_and_count_the_image_tokens(client):
    plain = client.chat.completions.create(model=SERVED_MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "What is in this picture?"}])
    answer = ask(client, image_part(data_url(png(1))))
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    # the image's run in the prompt: ]<]start of image[>[ + its placeholders + ]<]end of image[>[
    tokens = image_tokens(64, 80)
    assert answer.usage.prompt_tokens_details.image_tokens == tokens
    assert answer.usage.prompt_tokens == plain.usage.prompt_tokens + 1 + tokens + 1
    # the same image again: its blocks come from the prefix cache, and greedy decoding gives the same answer
    again = ask(client, image_part(data_url(png(1))))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == answer.choices[0].message.content


def test_image_urls_follow_the_servers_rules(client, web, media_dir):
    assert ask(client, image_part(f"{web}/dog.png")).choices[0].message.content  # an allowed host
    assert ask(client, image_part((media_dir / "local" / "cat.png").as_uri())).choices[0].message.content
    for url, why in ((f"{web.replace('127.0.0.1', 'localhost')}/dog.png", "not in --allowed-media-domains"),
                     (f"{web}/big.png", f"larger than the limit of {MAX_MEDIA_BYTES:,} bytes"),
                     (f"{web}/missing.png", "HTTP 404"),
                     ((media_dir / "web" / "dog.png").as_uri(), "under --allowed-local-media-path"),
                     ("ftp://example.com/a.png", "data:, http(s): or file:")):
        error = refused(lambda: ask(client, image_part(url)))
        assert why in error["message"] and "messages[0].content[1].image_url" in error["message"], error
        assert error["param"] == "messages"


@pytest.mark.parametrize("url, why", [
    (data_url(b"not an image at all"), "cannot be read"),
    (data_url(png(2)[:200]), "corrupt"),
    ("data:image/png;base64,!!!!", "not valid base64"),
    (data_url(huge_header_png()), "over the limit"),
    (data_url(png(3, 1, 300)), "aspect ratio"),
    (data_url(png(4), "text/plain"), "is no image"),
], ids=["garbage", "truncated", "base64", "bomb", "aspect", "type"])
def test_bad_images_get_a_400_naming_the_field(client, server, url, why):
    error = refused(lambda: ask(client, image_part(url)))
    assert why in error["message"] and error["message"].startswith("messages[0].content[1].image_url"), error
    assert server.healthy()


def test_limit_mm_per_prompt(client):
    three = [image_part(data_url(png(i))) for i in range(3)]
    error = refused(lambda: ask(client, *three))
    assert "At most 2 image(s)" in error["message"]
    assert ask(client, *three[:2]).usage.prompt_tokens_details.image_tokens == 2 * image_tokens(64, 80)


def test_video_frames(client):
    frames = [jpeg(i) for i in range(3)]  # 3 frames -> padded to 4 -> 2 temporal patches of 2 x 2 tokens
    answer = ask(client, {"type": "video_url", "video_url": {"url": video_url(frames)}}, text="What happens?")
    assert answer.choices[0].message.content
    error = refused(lambda: ask(client, {"type": "video_url", "video_url": {"url": data_url(b"x", "video/mp4")}}))
    assert "video/mp4 cannot be decoded" in error["message"]


def test_anthropic_image_blocks(server):
    import base64

    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120).messages

    def image(data: bytes) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(data).decode()}}

    reply = messages.create(model=SERVED_MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [image(png(5)), {"type": "text", "text": "What is this?"}]}])
    assert reply.content[0].type == "text" and reply.content[0].text
    count = messages.count_tokens(model=SERVED_MODEL, messages=[
        {"role": "user", "content": [image(png(5)), {"type": "text", "text": "What is this?"}]}])
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens  # the image counted
    error = refused(lambda: messages.create(model=SERVED_MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [image(b"GIF89a broken")]}]))
    assert "cannot be read" in error["message"]


def test_responses_input_image(client):
    response = client.responses.create(model=SERVED_MODEL, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": data_url(png(6))}]}])
    assert response.output_text and response.usage.input_tokens > image_tokens(64, 80)


def test_metrics_count_the_encoder(client, server):
    ask(client, image_part(data_url(png(11))))
    ask(client, image_part(data_url(png(11))), text="And now?")  # the features again, from the encoder cache
    text = httpx.get(f"{server.url}/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("nanoserve:encoder")}
    assert values["nanoserve:encoder_items_total"] >= 1 and values["nanoserve:encoder_seconds_total"] > 0
    assert values["nanoserve:encoder_cache_hits_total"] >= 1
    assert values["nanoserve:encoder_tokens_total"] >= image_tokens(64, 80)
