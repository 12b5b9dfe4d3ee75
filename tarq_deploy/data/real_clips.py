"""Real English speech clips with reference transcripts, found offline or fetched through pip's own indexes.

Sources (all public, none from a model hub):

* ``jfk.wav`` -- the whisper.cpp sample (11.0 s, 16 kHz mono), shipped inside the *pywhispercpp 1.5.1 sdist* as
  ``whisper.cpp/samples/jfk.wav``.  pywhispercpp's sdists 1.3.0-1.5.1 declare version 0.0.0 in their metadata,
  so ``pip download pywhispercpp==1.5.1 --no-binary :all:`` quietly falls back to 1.2.0 (which has no whisper.cpp
  inside).  We therefore look the sdist *file* up by name on the indexes pip is configured with (read at run time
  from ``pip config list`` and the ``PIP_*`` environment, plus pip's built-in default index), download it, check
  its sha256 when the index gives one, and extract that one member.
* Pocketsphinx test data -- five LibriVox clips of *Sense and Sensibility* (``librivox/*.wav`` with the Sphinx
  ``transcription`` file), five ``cards/*.wav`` clips (``cards/cards.transcription``) and ``goforward.raw``
  (headerless 16-bit 16 kHz mono; its words are the grammar's fixed sentence ``go forward ten meters`` from
  ``goforward.gram``).  Looked for in Debian's ``pocketsphinx-testdata`` package
  (``/usr/share/pocketsphinx/test/data``), else in the cache, else extracted from the pocketsphinx 5.1.1 sdist
  (byte-identical files) fetched the same way as pywhispercpp.

Everything fetched lands in ``clips_cache_dir()``: ``$TARQ_DEPLOY_CACHE/clips`` when that variable is set, else
``~/.cache/tarq-deploy/clips``.  Files are written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import contextlib
import fcntl
import html.parser
import io
import os
import re
import shlex
import ssl
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from ..fileio import atomic_file, write_bytes_atomic
from ..hashing import chunks_sha256

__all__ = ["Clip", "JFK_TEXT", "RealClipError", "all_real_clips", "cache_root", "download_distribution",
           "extract_member", "jfk_wav_path", "lecture_wav_path", "librivox_clips"]

SAMPLE_RATE = 16_000

JFK_TEXT = (
    "And so my fellow Americans, ask not what your country can do for you, "
    "ask what you can do for your country."
)
PYWHISPERCPP_SDIST = "pywhispercpp-1.5.1.tar.gz"
JFK_MEMBER = "pywhispercpp-1.5.1/whisper.cpp/samples/jfk.wav"
SILERO_SDIST = "silero_vad-6.2.3.tar.gz"
LECTURE_MEMBER = "silero_vad-6.2.3/tests/data/test.wav"  # a 60 s English lecture, 16 kHz mono, no transcript

POCKETSPHINX_SDIST = "pocketsphinx-5.1.1.tar.gz"
POCKETSPHINX_SDIST_DATA = "pocketsphinx-5.1.1/test/data"
DEBIAN_POCKETSPHINX_DATA = Path("/usr/share/pocketsphinx/test/data")
POCKETSPHINX_DATA_ENV = "TARQ_DEPLOY_POCKETSPHINX_DATA"
GOFORWARD_TEXT = "go forward ten meters"  # the fixed sentence of goforward.gram's public <move> rule

APT_HINT = "apt-get update && apt-get install -y pocketsphinx-testdata"
_MAX_MEMBER_BYTES = 64 << 20  # no member we extract is near this; guards against a hostile archive
_HTTP_TIMEOUT_S = 120


class RealClipError(RuntimeError):
    """A real clip (or the archive it comes from) could not be found or fetched."""


@dataclass(frozen=True)
class Clip:
    """One real recording: a 16 kHz mono 16-bit WAV file and its reference transcript."""

    id: str
    path: str
    text: str
    source: str = ""


# --------------------------------------------------------------------------------------------- cache location


def cache_root() -> Path:
    """tarq-deploy's cache root: ``$TARQ_DEPLOY_CACHE`` or ``~/.cache/tarq-deploy``."""
    override = os.environ.get("TARQ_DEPLOY_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "tarq-deploy"


def clips_cache_dir() -> Path:
    return cache_root() / "clips"


@contextlib.contextmanager
def fetching_lock() -> Iterator[None]:
    """Hold the clips cache's fetch lock (blocking flock on ``.fetch.lock``): processes that want the same clip at
    once (two test workers, two commands) fetch and extract it one after another; without it one unlinked the
    archive while another was about to read it."""
    directory = clips_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".fetch.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# ------------------------------------------------------------------------------------- pip index discovery


def _pip_config_items() -> dict[str, str]:
    """``pip config list`` as {key: value}; keys look like ``global.extra-index-url`` or ``:env:.index-url``."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True, timeout=60, check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    items: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            items[key.strip()] = " ".join(shlex.split(value.strip())) if value.strip() else ""
    return items


def _config_values(items: dict[str, str], option: str) -> list[str]:
    """Every whitespace-separated value given for ``option`` in any pip config section or the environment."""
    values: list[str] = []
    for key, value in items.items():
        if key.rsplit(".", 1)[-1] == option:
            values.extend(value.split())
    env_value = os.environ.get("PIP_" + option.upper().replace("-", "_"), "")
    values.extend(env_value.split())
    return list(dict.fromkeys(values))  # de-duplicate, keep order


def _pip_default_index() -> str | None:
    """The index pip uses when none is configured, asked of pip itself (so no host name lives in this repo)."""
    try:
        from pip._internal.models.index import PyPI  # type: ignore[import-not-found]

        return str(PyPI.simple_url)
    except Exception:  # pip internals moved: fall back to the default printed in pip's own help text
        help_text = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--help"], capture_output=True, text=True, check=False,
        ).stdout
        match = re.search(r"--index-url.*?default\s+(\S+?)\)", help_text, flags=re.S)
        return match.group(1) if match else None


@dataclass(frozen=True)
class PipSources:
    """Where pip looks for distributions: PEP 503 indexes (primary first) and find-links locations."""

    indexes: list[str]
    find_links: list[str]

    def describe(self) -> str:
        return ", ".join(self.indexes + self.find_links) or "none"


def pip_package_sources() -> PipSources:
    """The indexes and find-links locations pip is configured with, read at run time."""
    items = _pip_config_items()
    no_index = {v.lower() for v in _config_values(items, "no-index")} & {"1", "true", "yes", "on"}
    indexes: list[str] = []
    if not no_index:
        indexes = _config_values(items, "index-url") or [u for u in [_pip_default_index()] if u]
        indexes += _config_values(items, "extra-index-url")
    return PipSources(list(dict.fromkeys(indexes)), _config_values(items, "find-links"))


def _ssl_context(items: dict[str, str]) -> ssl.SSLContext:
    """Honour pip's ``cert`` setting so private indexes behind a custom CA work as they do for pip."""
    certs = _config_values(items, "cert")
    return ssl.create_default_context(cafile=certs[0] if certs and Path(certs[0]).is_file() else None)


class _AnchorParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(value for name, value in attrs if name == "href" and value)


def _open_url(url: str) -> Any:
    """urlopen that honours pip's ``cert`` and ``proxy`` settings for network URLs (file:// needs neither)."""
    if not url.startswith(("http:", "https:")):
        return urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S)
    items = _pip_config_items()
    handlers: list[urllib.request.BaseHandler] = [urllib.request.HTTPSHandler(context=_ssl_context(items))]
    proxies = _config_values(items, "proxy")
    if proxies:
        handlers.append(urllib.request.ProxyHandler({"http": proxies[0], "https": proxies[0]}))
    return urllib.request.build_opener(*handlers).open(url, timeout=_HTTP_TIMEOUT_S)


def _read_url(url: str) -> bytes:
    with _open_url(url) as response:
        return response.read()


def _page_links(page_url: str) -> list[str]:
    """Absolute links of an HTML page (a PEP 503 simple page or a find-links page)."""
    parser = _AnchorParser()
    parser.feed(_read_url(page_url).decode("utf-8", errors="replace"))
    return [urllib.parse.urljoin(page_url, href) for href in parser.hrefs]


def _filename_of(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


def _project_page_urls(index: str, project: str) -> list[str]:
    """Where a PEP 503 index keeps a project's page; a file:// index is a directory tree with index.html files."""
    base = index.rstrip("/") + "/" + re.sub(r"[-_.]+", "-", project).lower() + "/"
    return [base + "index.html", base] if base.startswith("file:") else [base]


def _local_dir(location: str) -> Path | None:
    if location.startswith("file:"):
        return Path(urllib.request.url2pathname(urllib.parse.urlsplit(location).path))
    return Path(location) if "://" not in location else None


def _links_on(page_url: str) -> list[str]:
    try:
        return _page_links(page_url)
    except (OSError, ValueError):  # page absent on this index: the caller tries the next one
        return []


def find_distribution_link(project: str, filename: str, sources: PipSources | None = None) -> str | None:
    """URL (with its ``#sha256=`` fragment when the index gives one) of ``filename`` on pip's sources, or None."""
    sources = pip_package_sources() if sources is None else sources
    pages: list[str] = []
    for location in sources.find_links:
        local = _local_dir(location)
        if local is not None:
            if (local / filename).is_file():
                return (local / filename).as_uri()
        else:
            pages.append(location)
    for index in sources.indexes:
        pages.extend(_project_page_urls(index, project))
    for page in pages:
        for link in _links_on(page):
            if _filename_of(link) == filename:
                return link
    return None


def download_distribution(project: str, filename: str, dest_dir: Path, sources: PipSources | None = None) -> Path:
    """Fetch one exact distribution file through pip's configured indexes into ``dest_dir`` (sha256-checked)."""
    target = dest_dir / filename
    if target.is_file():
        return target
    sources = pip_package_sources() if sources is None else sources
    link = find_distribution_link(project, filename, sources)
    if link is None:
        raise RealClipError(
            f"{filename} was not found on any index pip is configured with ({sources.describe()}). "
            f"Put the file into {dest_dir} by hand, or configure a pip index that carries {project}."
        )
    url, _, fragment = link.partition("#")
    expected = dict(p.split("=", 1) for p in fragment.split("&") if "=" in p).get("sha256")
    dest_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(target) as out:  # an error inside removes the partial file
        try:
            with _open_url(url) as response:
                sha256 = chunks_sha256(_written(response, out))  # hashed as it is written: one pass
        except OSError as error:
            raise RealClipError(f"could not download {filename} from {url}: {error}") from error
        if expected and sha256 != expected.lower():
            raise RealClipError(f"sha256 mismatch for {url}: got {sha256}, index says {expected}")
    return target


def _written(response: Any, out: BinaryIO) -> Iterator[bytes]:
    for chunk in iter(lambda: response.read(1 << 20), b""):
        out.write(chunk)
        yield chunk


# ------------------------------------------------------------------------------------- safe archive extraction


def _read_regular_member(archive: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    # Only plain files are read; links or devices could point anywhere on disk.
    if not member.isfile() or member.size > _MAX_MEMBER_BYTES:
        raise RealClipError(f"archive member {member.name} is not a plain file of sane size")
    handle = archive.extractfile(member)
    assert handle is not None
    return handle.read()


def extract_member(archive_path: Path, member_name: str, target: Path) -> Path:
    """Copy one named member of a tar archive to ``target`` (never a path taken from the archive)."""
    with tarfile.open(archive_path, "r:*") as archive:
        try:
            member = archive.getmember(member_name)
        except KeyError as error:
            raise RealClipError(f"{archive_path.name} has no member {member_name}") from error
        write_bytes_atomic(target, _read_regular_member(archive, member))
    return target


def extract_tree(archive_path: Path, prefix: str, wanted: Iterable[str], dest_dir: Path) -> Path:
    """Extract members ``prefix/<rel>`` for each relative path in ``wanted`` into ``dest_dir/<rel>``."""
    wanted_set = set(wanted)
    with tarfile.open(archive_path, "r:*") as archive:
        for member in archive.getmembers():
            rel = member.name[len(prefix) + 1:] if member.name.startswith(prefix + "/") else None
            if rel is None or not any(rel == w or rel.startswith(w + "/") for w in wanted_set):
                continue
            if member.isdir():
                continue
            parts = Path(rel).parts
            if Path(rel).is_absolute() or ".." in parts:  # would escape dest_dir
                raise RealClipError(f"refusing suspicious archive member {member.name}")
            write_bytes_atomic(dest_dir / rel, _read_regular_member(archive, member))
    return dest_dir


# ----------------------------------------------------------------------------------------------- JFK sample


def _check_wav(path: Path, what: str) -> None:
    try:
        with wave.open(str(path), "rb") as wav:
            ok = wav.getframerate() == SAMPLE_RATE and wav.getnchannels() == 1 and wav.getnframes() > 0
    except (wave.Error, EOFError, OSError) as error:
        raise RealClipError(f"{what} at {path} is not a readable WAV file: {error}") from error
    if not ok:
        raise RealClipError(f"{what} at {path} is not 16 kHz mono audio")


def jfk_wav_path(download: bool = True) -> Path:
    """Path of ``jfk.wav`` in the clips cache, extracting it from the pywhispercpp 1.5.1 sdist if needed."""
    target = clips_cache_dir() / "jfk.wav"
    if not target.is_file():
        with fetching_lock():
            if not target.is_file():  # another process may have fetched it while this one waited
                _fetch_jfk(target, download)
    _check_wav(target, "jfk.wav")
    return target


def _fetch_jfk(target: Path, download: bool) -> None:
    sdist = clips_cache_dir() / PYWHISPERCPP_SDIST
    if not sdist.is_file() and not download:
        raise RealClipError(
            f"{target} is missing and downloading is disabled; place {PYWHISPERCPP_SDIST} "
            f"(member {JFK_MEMBER}) into {clips_cache_dir()}"
        )
    sdist = download_distribution("pywhispercpp", PYWHISPERCPP_SDIST, clips_cache_dir())
    extract_member(sdist, JFK_MEMBER, target)
    sdist.unlink()  # 10 MB archive; only the 350 kB sample is kept


def jfk_clip(download: bool = True) -> Clip:
    return Clip("jfk", str(jfk_wav_path(download)), JFK_TEXT, "pywhispercpp-1.5.1 sdist: whisper.cpp/samples")


# ---------------------------------------------------------------------------------- 30 s lecture (benchmarks)


def lecture_wav_path(seconds: int = 30, download: bool = True) -> Path:
    """The first ``seconds`` of the silero-vad 6.2.3 sdist's lecture recording as a 16 kHz mono 16-bit WAV in the
    clips cache: real continuous speech of a full Whisper window, for latency benchmarks (it has no transcript)."""
    target = clips_cache_dir() / f"lecture-{seconds}s.wav"
    if not target.is_file():
        full = clips_cache_dir() / "lecture.wav"
        if not full.is_file():
            if not download:
                raise RealClipError(f"{target} is missing and downloading is disabled; place {SILERO_SDIST} "
                                    f"(member {LECTURE_MEMBER}) into {clips_cache_dir()}")
            with fetching_lock():
                if not full.is_file():
                    sdist = download_distribution("silero-vad", SILERO_SDIST, clips_cache_dir())
                    extract_member(sdist, LECTURE_MEMBER, full)
                    sdist.unlink()
        _check_wav(full, "the silero-vad lecture recording")
        with wave.open(str(full), "rb") as wav:
            if wav.getsampwidth() != 2 or wav.getnframes() < seconds * SAMPLE_RATE:
                raise RealClipError(f"{full} is not 16-bit audio of at least {seconds} s")
            frames = wav.readframes(seconds * SAMPLE_RATE)
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(SAMPLE_RATE)
            out.writeframes(frames)
        write_bytes_atomic(target, buffer.getvalue())
    _check_wav(target, f"lecture-{seconds}s.wav")
    return target


# ------------------------------------------------------------------------------------ pocketsphinx test data

_POCKETSPHINX_WANTED = ("librivox", "cards", "goforward.raw", "goforward.gram")


def _has_pocketsphinx_data(root: Path) -> bool:
    return (root / "librivox" / "transcription").is_file() and (root / "cards" / "cards.transcription").is_file()


def pocketsphinx_data_dir(download: bool = True) -> Path:
    """Directory holding pocketsphinx's test data (``librivox/``, ``cards/``, ``goforward.raw``).

    Looked for in ``$TARQ_DEPLOY_POCKETSPHINX_DATA``, Debian's ``pocketsphinx-testdata`` install, then the cache;
    as a last resort the pocketsphinx 5.1.1 sdist is fetched through pip's indexes and the needed files extracted.
    """
    cached = clips_cache_dir() / "pocketsphinx"
    candidates = [Path(p) for p in [os.environ.get(POCKETSPHINX_DATA_ENV)] if p] + [DEBIAN_POCKETSPHINX_DATA, cached]
    for root in candidates:
        if _has_pocketsphinx_data(root):
            return root
    if not download:
        raise RealClipError(
            "pocketsphinx test data (LibriVox/cards clips and transcripts) not found in "
            f"{', '.join(map(str, candidates))}. Install it with: {APT_HINT}"
        )
    with fetching_lock():
        if _has_pocketsphinx_data(cached):
            return cached
        try:
            sdist = download_distribution("pocketsphinx", POCKETSPHINX_SDIST, clips_cache_dir())
        except RealClipError as error:
            raise RealClipError(f"{error}\npocketsphinx test data is missing; install it with: {APT_HINT}") from error
        extract_tree(sdist, POCKETSPHINX_SDIST_DATA, _POCKETSPHINX_WANTED, cached)
        sdist.unlink()  # 34 MB archive; only ~1 MB of it is kept
    return cached


_SPHINX_LINE = re.compile(r"^\s*(?:<s>)?(?P<text>.*?)(?:</s>)?\s*\((?P<id>[^()\s]+)\)\s*$")


def parse_sphinx_transcription(content: str) -> dict[str, str]:
    """Parse Sphinx ``<s> words </s> (utterance_id)`` lines into {utterance_id: words}."""
    transcripts: dict[str, str] = {}
    for line in content.splitlines():
        match = _SPHINX_LINE.match(line)
        if match:
            transcripts[match["id"]] = " ".join(match["text"].split())
    return transcripts


def _clips_from_transcription(folder: Path, transcription: str, id_prefix: str, source: str) -> list[Clip]:
    transcripts = parse_sphinx_transcription((folder / transcription).read_text(encoding="utf-8"))
    clips = []
    for utterance_id, text in sorted(transcripts.items()):
        wav_path = folder / f"{utterance_id}.wav"
        if not wav_path.is_file():
            raise RealClipError(f"{wav_path} is listed in {folder / transcription} but missing")
        clips.append(Clip(f"{id_prefix}{utterance_id}", str(wav_path), text, source))
    return clips


def librivox_clips(download: bool = True) -> list[Clip]:
    """The five LibriVox *Sense and Sensibility* clips (3-7 s) with their lowercase, unpunctuated transcripts."""
    root = pocketsphinx_data_dir(download)
    return _clips_from_transcription(root / "librivox", "transcription", "librivox-", "pocketsphinx test data")


def cards_clips(download: bool = True) -> list[Clip]:
    """The five short ``cards`` clips (playing-card names, e.g. "ten of clubs")."""
    root = pocketsphinx_data_dir(download)
    return _clips_from_transcription(root / "cards", "cards.transcription", "cards-", "pocketsphinx test data")


def raw_pcm16_to_wav(raw_path: Path, wav_path: Path, sample_rate: int = SAMPLE_RATE) -> Path:
    """Wrap headerless little-endian 16-bit mono PCM in a WAV header (so every clip is a plain WAV file)."""
    payload = raw_path.read_bytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(payload[: len(payload) // 2 * 2])
    write_bytes_atomic(wav_path, buffer.getvalue())
    return wav_path


def goforward_clip(download: bool = True) -> Clip:
    """``goforward.raw`` converted to WAV in the cache; text = the fixed sentence of ``goforward.gram``."""
    raw = pocketsphinx_data_dir(download) / "goforward.raw"
    wav_path = clips_cache_dir() / "goforward.wav"
    if not wav_path.is_file():
        raw_pcm16_to_wav(raw, wav_path)
    return Clip("goforward", str(wav_path), GOFORWARD_TEXT, "pocketsphinx test data (goforward.raw)")


def pocketsphinx_clips(download: bool = True) -> list[Clip]:
    return librivox_clips(download) + cards_clips(download) + [goforward_clip(download)]


def all_real_clips(download: bool = True) -> list[Clip]:
    """Every real clip: jfk, 5 LibriVox, 5 cards, goforward (12 clips, all 16 kHz mono WAV)."""
    return [jfk_clip(download)] + pocketsphinx_clips(download)


def wav_duration_s(path: str | Path) -> float:
    with wave.open(str(path), "rb") as wav:
        return wav.getnframes() / wav.getframerate()


def iter_clip_summaries(clips: Iterable[Clip]) -> Iterator[str]:
    for clip in clips:
        yield f"{clip.id}\t{wav_duration_s(clip.path):.2f}s\t{clip.text}"


if __name__ == "__main__":  # `python -m tarq_deploy.data.real_clips` fetches everything and lists it
    for summary in iter_clip_summaries(all_real_clips()):
        print(summary)
