"""Media sizes from their headers (proxy/request/sizes.py), against files real encoders wrote:
Pillow's PNG, JPEG, GIF, WebP and BMP, epdctl's own stdlib PNG, Python's wave module."""

from __future__ import annotations

import base64
import io

import pytest

from epdctl.bench.workload import png
from epdctl.proxy.request.sizes import HEAD_CHARS, image_size, measured, wav_seconds
from epdctl.traces.format import MediaItem
from tests.media_samples import make_video, make_wav

Image = pytest.importorskip("PIL.Image")


def encoded(fmt: str, size: tuple[int, int], mode: str = "RGB", **options: object) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, (200, 10, 30, 128)[:len(mode)]).save(buf, fmt, **options)
    return buf.getvalue()


def url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize(("fmt", "mode", "options"), [
    ("PNG", "RGB", {}), ("PNG", "RGBA", {}), ("JPEG", "RGB", {}),
    ("JPEG", "L", {"progressive": True}), ("GIF", "RGB", {}), ("WEBP", "RGB", {}),
    ("WEBP", "RGB", {"lossless": True}), ("WEBP", "RGBA", {}), ("BMP", "RGB", {}),
])
def test_image_headers_of_real_files(fmt: str, mode: str, options: dict) -> None:
    for size in ((1, 1), (641, 479), (3000, 17)):
        data = encoded(fmt, size, mode, **options)
        assert image_size(data) == size, (fmt, size)
        assert measured("image", url(data, f"image/{fmt.lower()}")) == MediaItem("image", *size)


def test_stdlib_png_and_a_jpeg_whose_frame_header_is_behind_its_metadata() -> None:
    assert image_size(png(333, 222, seed=1)) == (333, 222)
    exif = b"Exif\x00\x00" + bytes(60000)  # an APP1 segment of ~60 KB before the frame header
    data = encoded("JPEG", (123, 45), exif=exif)
    assert data.find(b"\xff\xc0") > HEAD_CHARS  # past the first look
    assert measured("image", url(data, "image/jpeg")) == MediaItem("image", 123, 45)


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\n", b"GIF89a\x01", b"\xff\xd8\xff\xe0",
                                  b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"not an image at all",
                                  b"\xff\xd8" + bytes(100)])
def test_truncated_or_other_data_has_no_size(data: bytes) -> None:
    assert image_size(data) is None


def test_a_truncated_jpeg_has_no_size() -> None:
    data = encoded("JPEG", (64, 64))
    cut = data[:data.find(b"\xff\xc0") + 4]
    assert image_size(cut) is None


def test_wav_seconds() -> None:
    for seed in range(4):
        clip = make_wav(seed)
        seconds = 0.5 + (seed % 4) / 4  # make_wav's length
        assert wav_seconds(clip) == pytest.approx(seconds, abs=1e-3)
        assert measured("audio", url(clip, "audio/wav")) == MediaItem("audio", seconds=seconds)
        as_input = base64.b64encode(clip).decode()  # input_audio's data: bare base64
        assert measured("audio", as_input, is_base64=True) == MediaItem("audio",
                                                                        seconds=seconds)
    # A streaming writer's open data size: the clip's bytes stand for it.
    clip = make_wav(1)
    at = clip.find(b"data")
    open_size = clip[:at + 4] + b"\xff\xff\xff\xff" + clip[at + 8:]
    assert wav_seconds(open_size[:64], len(open_size)) == pytest.approx(0.75, abs=1e-3)
    assert wav_seconds(b"ID3\x03 an mp3") is None


def test_videos_frames_and_size_where_cheaply_known() -> None:
    frames = [base64.b64encode(encoded("JPEG", (96, 64))).decode() for _ in range(5)]
    jpeg_list = "data:video/jpeg;base64," + ",".join(frames)
    assert measured("video", jpeg_list) == MediaItem("video", 96, 64, 5)
    assert measured("video", url(make_video(1), "video/mp4")) == MediaItem("video")


def test_what_is_not_inline_has_its_type_only() -> None:
    assert measured("image", "http://img.example/a.png") == MediaItem("image")
    assert measured("image", "data:image/png,rawtext") == MediaItem("image")
    assert measured("image", "data:image/png;base64,!!!!") == MediaItem("image")
    assert measured("audio", "data:audio/mpeg;base64,SUQzAwAA") == MediaItem("audio")
