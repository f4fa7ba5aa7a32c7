"""Content-derived keys: same bytes, same key; remote URLs fetched once and inlined."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from epdctl.proxy import ProxyConfig
from epdctl.proxy.__main__ import upstream_client
from epdctl.proxy.errors import ProxyError
from epdctl.proxy.request.media import assign_uuids, content_key
from epdctl.proxy.request.parse import MediaItem
from epdctl.proxy.transport import wrap
from tests.proxy.sockets import Names

pytestmark = pytest.mark.anyio
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


def item(part_type: str, ref: str, uuid: str | None = None) -> MediaItem:
    modality = {"image_url": "image", "audio_url": "audio", "input_audio": "audio",
                "video_url": "video"}[part_type]
    return MediaItem(0, 0, part_type, modality, ref, uuid)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class Remote:
    """A fake web server for media URLs; counts fetches."""

    def __init__(self) -> None:
        self.fetches: list[str] = []
        self.content = {"/a.png": PNG, "/b.png": PNG + b"x"}
        self.client: Any = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.fetches.append(str(request.url))
        if request.url.host == "down.example":
            raise httpx.ConnectError("refused", request=request)
        data = self.content.get(request.url.path)
        if data is None:
            return httpx.Response(404)
        return httpx.Response(200, content=data, headers={"content-type": "image/png"})


@pytest.fixture
async def remote(names: Names, transport: str) -> AsyncIterator[Remote]:
    """The web on local sockets, fetched by the proxy's client of the kind `transport` names."""
    server = Remote()
    names.add(server.handle)
    config = ProxyConfig(models=("tiny",), prefill_decode=("http://pd0",), client=transport)
    async with upstream_client(config) as client:
        server.client = wrap(client)
        yield server


async def keys(items: list[MediaItem], remote: Remote) -> list[str | None]:
    await assign_uuids(items, remote.client, 5.0, 1 << 20)
    return [i.uuid for i in items]


async def test_same_bytes_same_key_across_encodings_and_types(remote):
    wrapped = base64.encodebytes(PNG).decode()  # base64 with newlines: same bytes
    items = [item("image_url", data_url(PNG)), item("image_url", data_url(PNG, "image/jpeg")),
             item("image_url", "data:image/png;base64," + wrapped),
             item("image_url", "http://img.example/a.png")]
    got = await keys(items, remote)
    assert got == [content_key("image", PNG)] * 4
    assert len(got[0]) == 64


async def test_different_bytes_or_modality_give_different_keys(remote):
    items = [item("image_url", data_url(PNG)), item("image_url", data_url(PNG + b"x")),
             item("audio_url", data_url(PNG, "audio/wav")),
             item("input_audio", base64.b64encode(PNG).decode()),
             item("video_url", data_url(PNG, "video/mp4")),
             item("image_url", "http://img.example/b.png")]
    got = await keys(items, remote)
    assert got[2] == got[3]  # audio_url and input_audio with the same bytes agree
    assert len({got[0], got[1], got[2], got[4]}) == 4
    assert got[5] == got[1]


async def test_remote_url_is_fetched_once_and_sent_on_as_the_hashed_bytes(remote):
    it = item("image_url", "http://img.example/a.png")
    await keys([it], remote)
    assert remote.fetches == ["http://img.example/a.png"]
    assert it.data_url == data_url(PNG)


async def test_client_uuid_is_respected_without_fetching(remote):
    items = [item("image_url", "http://img.example/a.png", "mine"),
             item("image_url", "data:image/png;base64,!!!", "mine2")]
    assert await keys(items, remote) == ["mine", "mine2"]
    assert remote.fetches == []


async def test_other_schemes_get_no_key(remote):
    assert await keys([item("image_url", "file:///tmp/x.png")], remote) == [None]


@pytest.mark.parametrize("ref", [
    "data:image/png;base64,!!!notbase64", "data:image/png,rawtext", "data:image/png;base64,",
    "http://down.example/a.png", "http://img.example/missing.png",
])
async def test_bad_media_is_a_400(remote, ref):
    with pytest.raises(ProxyError) as info:
        await keys([item("image_url", ref)], remote)
    assert info.value.status == 400


async def test_invalid_input_audio_base64_is_a_400(remote):
    with pytest.raises(ProxyError) as info:
        await keys([item("input_audio", "%%%")], remote)
    assert info.value.status == 400 and "base64" in info.value.message


async def test_oversize_remote_media_is_a_400(remote):
    it = item("image_url", "http://img.example/a.png")
    with pytest.raises(ProxyError) as info:
        await assign_uuids([it], remote.client, 5.0, 100)
    assert info.value.status == 400 and "100 bytes" in info.value.message


@pytest.mark.parametrize("url", [
    data_url(PNG), data_url(PNG * 7, "video/mp4"),
    "data:audio/wav;base64," + base64.encodebytes(PNG * 5).decode(),  # wrapped lines
    "data:video/jpeg;base64," + ",".join(base64.b64encode(PNG + bytes([n])).decode()
                                          for n in range(3)),
])
@pytest.mark.parametrize("piece", [4, 8, 1 << 20])
def test_a_data_url_key_is_the_key_of_its_bytes_whatever_the_pieces(url, piece, monkeypatch):
    from epdctl.proxy.request import media

    monkeypatch.setattr(media, "B64_PIECE_CHARS", piece)
    assert media.data_url_key("video", url, "x") == content_key(
        "video", media.data_url_bytes(url, "x"))


@pytest.mark.parametrize("text", ["QQ==QUJD", "QUJDRA", "QUJD!", "", "   "])
@pytest.mark.parametrize("piece", [4, 1 << 20])
def test_base64_refused_whole_is_refused_in_pieces(text, piece, monkeypatch):
    """Padding before the end, a bad length, a stray character, nothing: each a 400, as the
    whole text decoded at once is."""
    from epdctl.proxy.request import media

    monkeypatch.setattr(media, "B64_PIECE_CHARS", piece)
    with pytest.raises(ProxyError) as info:
        media.b64_key("audio", text, "input_audio #0")
    assert info.value.status == 400


async def test_a_repeated_data_url_is_hashed_once(remote, monkeypatch):
    from epdctl.proxy.request import media

    calls = []
    real = media.data_url_key
    monkeypatch.setattr(media, "data_url_key", lambda *a: calls.append(a[1]) or real(*a))
    url = data_url(PNG)
    got = await keys([item("image_url", url), item("image_url", url),
                      item("video_url", url)], remote)
    assert got[0] == got[1] != got[2] and calls == [url, url]  # once per modality
