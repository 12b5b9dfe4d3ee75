"""Real clips exist with transcripts and plausible durations; the sdist fetch path works against a file:// index."""
from __future__ import annotations

import hashlib
import io
import tarfile
import wave
from pathlib import Path

import pytest

from tarq_deploy.data import real_clips as rc


def test_jfk_is_the_11_second_sample(jfk_wav: str) -> None:
    assert Path(jfk_wav).is_file()
    assert rc.wav_duration_s(jfk_wav) == pytest.approx(11.0, abs=0.05)
    with wave.open(jfk_wav, "rb") as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (16_000, 1, 2)


def test_librivox_clips_have_transcripts_and_plausible_durations(librivox_clips: list[tuple[str, str]]) -> None:
    assert len(librivox_clips) == 5
    for path, text in librivox_clips:
        assert text and text == text.lower() and "<s>" not in text
        seconds = rc.wav_duration_s(path)
        assert 2.0 < seconds < 8.0
        # speech is ~2-4 words per second; a transcript far off that is attached to the wrong file
        assert 1.0 < len(text.split()) / seconds < 5.0


def test_all_real_clips(real_clips: list[rc.Clip]) -> None:
    ids = [clip.id for clip in real_clips]
    assert len(ids) == len(set(ids)) == 12
    assert {"jfk", "goforward", "cards-001"} <= set(ids)
    for clip in real_clips:
        assert clip.text.strip()
        assert 0.8 < rc.wav_duration_s(clip.path) < 12.0


def test_parse_sphinx_transcription() -> None:
    content = "<s> ten of clubs  </s> (001)\n\n<s> he was not </s> (abc-0880)\nnot a transcript line\n"
    assert rc.parse_sphinx_transcription(content) == {"001": "ten of clubs", "abc-0880": "he was not"}


def _tiny_sdist(path: Path, members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
        link = tarfile.TarInfo("pkg-1.0/evil-link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def test_fetch_exact_sdist_from_file_index_and_extract_one_member(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    payload = _tiny_sdist(files / "pkg-1.0.tar.gz", {"pkg-1.0/samples/a.wav": b"RIFFdata"})
    digest = hashlib.sha256(payload).hexdigest()
    project_page = tmp_path / "simple" / "pkg"
    project_page.mkdir(parents=True)
    (project_page / "index.html").write_text(
        '<html><body><a href="../../files/pkg-0.9.tar.gz">pkg-0.9.tar.gz</a>'
        f'<a href="../../files/pkg-1.0.tar.gz#sha256={digest}">pkg-1.0.tar.gz</a></body></html>'
    )
    sources = rc.PipSources(indexes=[(tmp_path / "simple").as_uri()], find_links=[])
    link = rc.find_distribution_link("pkg", "pkg-1.0.tar.gz", sources)
    assert link is not None and link.endswith(f"files/pkg-1.0.tar.gz#sha256={digest}")

    cache = tmp_path / "cache"
    archive = rc.download_distribution("pkg", "pkg-1.0.tar.gz", cache, sources)
    assert archive.read_bytes() == payload
    out = rc.extract_member(archive, "pkg-1.0/samples/a.wav", cache / "a.wav")
    assert out.read_bytes() == b"RIFFdata"
    with pytest.raises(rc.RealClipError, match="not a plain file"):
        rc.extract_member(archive, "pkg-1.0/evil-link", cache / "b")
    with pytest.raises(rc.RealClipError, match="no member"):
        rc.extract_member(archive, "pkg-1.0/missing.wav", cache / "c")


def test_sha256_mismatch_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pkg-1.0.tar.gz").write_bytes(b"tampered")
    page = tmp_path / "simple" / "pkg"
    page.mkdir(parents=True)
    (page / "index.html").write_text(f'<a href="../../pkg-1.0.tar.gz#sha256={"0" * 64}">pkg-1.0.tar.gz</a>')
    sources = rc.PipSources(indexes=[(tmp_path / "simple").as_uri()], find_links=[])
    with pytest.raises(rc.RealClipError, match="sha256 mismatch"):
        rc.download_distribution("pkg", "pkg-1.0.tar.gz", tmp_path / "cache", sources)
    assert not (tmp_path / "cache" / "pkg-1.0.tar.gz").exists()


def test_find_links_directory_is_searched_first(tmp_path: Path) -> None:
    (tmp_path / "pkg-1.0.tar.gz").write_bytes(b"x")
    sources = rc.PipSources(indexes=[], find_links=[str(tmp_path)])
    assert rc.find_distribution_link("pkg", "pkg-1.0.tar.gz", sources) == (tmp_path / "pkg-1.0.tar.gz").as_uri()
    assert rc.find_distribution_link("pkg", "pkg-2.0.tar.gz", sources) is None


def test_missing_pocketsphinx_data_names_the_apt_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TARQ_DEPLOY_CACHE", str(tmp_path))
    monkeypatch.delenv(rc.POCKETSPHINX_DATA_ENV, raising=False)
    monkeypatch.setattr(rc, "DEBIAN_POCKETSPHINX_DATA", tmp_path / "nowhere")
    with pytest.raises(rc.RealClipError, match="apt-get install -y pocketsphinx-testdata"):
        rc.librivox_clips(download=False)


def test_processes_fetching_jfk_at_once_all_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two test workers on a fresh machine asked for jfk.wav together: one unlinked the sdist the other was about to
    open (`No such file or directory`). The cache's fetch lock makes them take turns."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("TARQ_DEPLOY_CACHE", str(tmp_path))
    monkeypatch.setattr(rc, "pip_package_sources", lambda: rc.PipSources(indexes=[], find_links=[]))  # no network
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(b"\0\1" * 1600)
    clips = tmp_path / "clips"
    clips.mkdir()
    _tiny_sdist(clips / rc.PYWHISPERCPP_SDIST, {rc.JFK_MEMBER: buffer.getvalue()})
    start = threading.Barrier(8)

    def fetch(_: int) -> Path:
        start.wait()
        return rc.jfk_wav_path()

    with ThreadPoolExecutor(8) as pool:  # flock excludes open files, so threads exclude each other as processes do
        paths = list(pool.map(fetch, range(8)))
    assert set(paths) == {clips / "jfk.wav"}
    assert (clips / "jfk.wav").read_bytes() == buffer.getvalue()
    assert not (clips / rc.PYWHISPERCPP_SDIST).exists()
