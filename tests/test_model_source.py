"""One way to name a model (tarq_deploy.model_source) and one way to hash (tarq_deploy.hashing).

(a) ``resolve_source`` tells every kind of source apart, and the commands that refuse a source still refuse it with
their own words; (b) the package's source, read with ``ast``, tests no source marker (a file's magic, a folder's
marker files, config.json's model_type, the ``packaged:`` prefix) and computes no sha256 anywhere else: a new copy of
either fails here, naming the file, the function and the line.
"""
from __future__ import annotations

import ast
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

import tarq_deploy
from tarq_deploy.errors import UserError
from tarq_deploy.hashing import chunks_sha256, file_sha256, files_sha256, json_fingerprint, sha256_hex
from tarq_deploy.model_source import ModelSource, SourceKind, resolve_source
from helpers import tiny_gguf  # a GGUF written by gguf-py: an architecture key and nothing else

PACKAGE_ROOT = Path(tarq_deploy.__file__).parent


# ------------------------------------------------------------------------------------------------ sources on disk
def whisper_cpp_file(path: Path) -> Path:
    path.write_bytes(b"lmgg" + bytes(64))
    return path


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def gguf_architecture_last(path: Path, arch: str) -> Path:
    """A GGUF whose general.architecture comes after a string array and a scalar (GGUFWriter always writes it first):
    the header reader has to step over both."""
    tokens = struct.pack("<IQ", 8, 3) + b"".join(gguf_string(t) for t in ("a", "bc", "def"))
    kv = [gguf_string("tokenizer.ggml.tokens") + struct.pack("<I", 9) + tokens,
          gguf_string("general.alignment") + struct.pack("<II", 4, 32),
          gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string(arch)]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))
    return path


def transformers_dir(path: Path, config: dict | str, weights: bool = True) -> Path:
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def ct2_dir(path: Path) -> Path:
    path.mkdir()
    spec = b"WhisperSpec\0"
    (path / "model.bin").write_bytes(struct.pack("<IH", 6, len(spec)) + spec)
    (path / "config.json").write_text(json.dumps({"suppress_ids": [1, 2]}))
    return path


def checkpoint_dir(path: Path, model_type: str) -> Path:
    (path / "model").mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    (path / "lattice.safetensors").write_bytes(b"")
    (path / "model" / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def test_each_kind_of_source(tmp_path: Path) -> None:
    bin_file = whisper_cpp_file(tmp_path / "tiny-q4_0.bin")
    gguf_path = tiny_gguf(tmp_path / "m.gguf", "qwen3asr")
    hf = transformers_dir(tmp_path / "hf", {"model_type": "whisper"})
    ct2 = ct2_dir(tmp_path / "ct2")
    ckpt = checkpoint_dir(tmp_path / "ckpt", "qwen3_asr")
    expected = [
        (str(bin_file), SourceKind.WHISPER_CPP), (str(gguf_path), SourceKind.GGUF), (str(hf), SourceKind.TRANSFORMERS),
        (str(ct2), SourceKind.CT2), (str(ckpt), SourceKind.CHECKPOINT), ("packaged:tiny.en", SourceKind.PACKAGED),
        ("openai/whisper-base", SourceKind.HUB), (str(tmp_path / "no" / "such"), SourceKind.MISSING),
        ("./no/such/model", SourceKind.MISSING), ("~/no-such-model-here", SourceKind.MISSING),
    ]
    for text, kind in expected:
        found = resolve_source(text)
        assert (found.kind, found.text) == (kind, text), text
        assert found.on_disk == (kind not in (SourceKind.PACKAGED, SourceKind.HUB, SourceKind.MISSING)), text
    assert resolve_source(gguf_path).architecture == "qwen3asr"
    assert resolve_source(hf).model_type == "whisper" and resolve_source(hf).has_weights
    assert resolve_source(ckpt).model_type == "qwen3_asr"  # what its saved config says
    assert resolve_source(ct2).model_type is None and resolve_source(ct2).assumed_model_type == "whisper"
    assert resolve_source("packaged:tiny.en").packaged_name == "tiny.en"
    assert resolve_source("openai/whisper-base").path is None
    assert resolve_source("~/no-such-model-here").path == Path.home() / "no-such-model-here"


def test_a_resolved_source_is_handed_on_as_it_is(tmp_path: Path) -> None:
    found = resolve_source(str(whisper_cpp_file(tmp_path / "m.bin")))
    assert resolve_source(found) is found


def test_what_is_none_of_the_kinds(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "short.bin").write_bytes(b"lm")
    for name in ("notes.txt", "empty", "short.bin"):
        assert resolve_source(tmp_path / name).kind is SourceKind.OTHER, name
    assert resolve_source("x" * 5000).kind is SourceKind.HUB  # too long a name to look up: not on this disk


def test_the_gguf_architecture_is_read_wherever_the_key_stands(tmp_path: Path) -> None:
    assert resolve_source(gguf_architecture_last(tmp_path / "late.gguf", "qwen3-asr")).architecture == "qwen3-asr"
    data = (tmp_path / "late.gguf").read_bytes()
    for cut in (4, 10, 30, len(data) - 3):  # a damaged header says nothing; the kind is still GGUF (its magic)
        broken = tmp_path / f"cut{cut}.gguf"
        broken.write_bytes(data[:cut])
        assert (resolve_source(broken).kind, resolve_source(broken).architecture) == (SourceKind.GGUF, None)
    huge = bytearray(data)
    struct.pack_into("<Q", huge, 16, (1 << 64) - 1)  # a key/value count no file holds
    (tmp_path / "huge.gguf").write_bytes(bytes(huge))
    assert resolve_source(tmp_path / "huge.gguf").architecture == "qwen3-asr"  # found before the count runs out


def test_model_types_and_the_runtimes_that_claim_them(tmp_path: Path) -> None:
    from tarq_deploy.formats.backbones import is_whisper_source, model_type
    from tarq_deploy.runtimes.registry import infer_runtime

    voxtral = transformers_dir(tmp_path / "vox", {"model_type": "voxtral"})
    qwen = transformers_dir(tmp_path / "qwen", {"model_type": "qwen3_asr"})
    untyped = transformers_dir(tmp_path / "untyped", {}, weights=False)
    assert [model_type(str(p)) for p in (voxtral, qwen, untyped)] == ["voxtral", "qwen3_asr", "whisper"]
    assert model_type("mistralai/Voxtral-Mini-3B-2507") == "voxtral" and model_type("packaged:base") == "whisper"
    assert is_whisper_source("packaged:tiny.en") and not is_whisper_source(str(voxtral))
    assert infer_runtime(str(whisper_cpp_file(tmp_path / "m.bin"))) == "whisper.cpp"
    assert infer_runtime(str(qwen)) == infer_runtime(str(checkpoint_dir(tmp_path / "ck", "qwen3_asr"))) \
        == "qwen3-asr-torch"
    assert infer_runtime(str(checkpoint_dir(tmp_path / "wck", "whisper"))) == "torch"


def test_a_config_that_is_not_json_fails_as_before(tmp_path: Path, capsys) -> None:
    from tarq_deploy.commands.quantize import check_model_source
    from tarq_deploy.formats.model_loader import load_whisper
    from tarq_deploy.formats.backbones import is_whisper_source, model_type

    broken = transformers_dir(tmp_path / "broken", "{not json")
    config = broken / "config.json"
    assert resolve_source(broken).config_error == f"{config}: not valid JSON"
    with pytest.raises(ValueError, match=f"^{config}: not valid JSON$"):
        model_type(str(broken))
    assert not is_whisper_source(str(broken))
    with pytest.raises(UserError, match=f"^--model {config}: not valid JSON$"):
        check_model_source(str(broken))
    with pytest.raises(ValueError, match="neither a CTranslate2 Whisper directory"):
        load_whisper(str(broken))


def test_bad_sources_are_refused_in_the_commands_words(tmp_path: Path) -> None:
    from tarq_deploy.commands.eval import _not_here, default_label
    from tarq_deploy.commands.quantize import check_model_source
    from tarq_deploy.formats.model_loader import load_whisper

    with pytest.raises(UserError, match="unknown packaged model; available: packaged:tiny.en"):
        check_model_source("packaged:tiny.nl")
    with pytest.raises(UserError, match="^--model ./no/such/model: no such file or directory$"):
        check_model_source("./no/such/model")
    bert = transformers_dir(tmp_path / "bert", {"model_type": "bert"})
    with pytest.raises(UserError, match="model type 'bert' is not supported"):
        check_model_source(str(bert))
    assert check_model_source("openai/whisper-base").kind is SourceKind.HUB  # looked up when loaded
    with pytest.raises(FileNotFoundError, match="no/such/model: no such file or directory"):
        load_whisper("./no/such/model")
    # eval runs models from this disk: a missing name with a '/' or a .bin ending is a mistyped path
    assert [_not_here(resolve_source(t)) for t in ("results/ckpt", "tiny.bin", "./gone", "whisper-x")] == \
        [True, True, True, False]
    assert default_label("packaged:tiny.en") == "tiny.en" and default_label("out/tiny-q4_0.bin") == "tiny-q4_0"


# --------------------------------------------------------------------------------------------------- digests
def reference_files_hash(paths: list[Path]) -> str:
    """sweep/plan.files_hash as it was written before tarq_deploy.hashing: the sweep keys on disk are this."""
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(file.name.encode() + b"\0")
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def test_digests_are_the_bytes_they_always_were(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.bin").write_bytes(bytes(range(256)) * 5000)  # over one read
    (tmp_path / "d" / "sub" / "a.txt").write_text("ä")
    single = tmp_path / "one.json"
    single.write_text('{"x": 1}')
    paths = [tmp_path / "d", single]
    assert files_sha256(paths) == reference_files_hash(paths)
    data = (tmp_path / "d" / "b.bin").read_bytes()
    assert file_sha256(tmp_path / "d" / "b.bin") == hashlib.sha256(data).hexdigest() == sha256_hex(data)
    assert chunks_sha256([data[:7], data[7:]]) == sha256_hex(data)
    value = {"b": ["ü", 2], "a": {"z": None, "y": 1.5}}
    assert json_fingerprint(value) == hashlib.sha256(
        json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()  # the sweep's keys
    assert json_fingerprint(value, ensure_ascii=True, separators=(",", ":")) == hashlib.sha256(
        json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()  # a checkpoint manifest's
    assert json_fingerprint([value, Path("p")], ensure_ascii=True, default=str) == hashlib.sha256(
        json.dumps([value, Path("p")], sort_keys=True, default=str).encode()).hexdigest()  # calibration work folders
    assert json_fingerprint({"hub": "openai/whisper-base"}) == hashlib.sha256(
        b'{"hub": "openai/whisper-base"}').hexdigest()


# ------------------------------------------------------------------------------------ the package's own source
MAGICS = {b"lmgg", b"GGUF", 0x67676D6C, 0x46554747}  # the whisper.cpp and GGUF magics, as bytes and as uint32
MAGIC_NAMES = {"GGML_MAGIC", "GGUF_MAGIC", "MAGIC_BYTES", "FILE_MAGIC"}
MARKER_FILES = {"manifest.json", "lattice.safetensors", "config.json", "model.bin"}
MARKER_NAMES = {"MANIFEST", "LATTICE_FILE", "CHECKPOINT_MANIFEST", "CHECKPOINT_LATTICE", "CHECKPOINT_MARKERS",
                "CONFIG_JSON", "CONFIG_JSON_NAME", "CONFIG_FILE", "TRANSFORMERS_CONFIG_NAME", "MODEL_BIN_NAME",
                "CT2_MODEL_BIN"}
FILE_TESTS = {"is_file", "exists", "is_dir", "read_text", "read_bytes", "open", "stat"}
PREFIX_TESTS = {"startswith", "removeprefix"}
HASH_CALLS = {"sha256_hex", "chunks_sha256"}
SOURCE_MODULE = "model_source.py"
HASHING_MODULE = "hashing.py"

# (module, function, rule) -> why it may stay. Each entry must still be needed (a stale one fails the test too).
ALLOWED = {
    ("checkpoint.py", "read_manifest", "marker file"):
        "the checkpoint reader opens the manifest it was asked to load; it decides no kind",
    ("checkpoint.py", "_check_replaceable", "marker file"):
        "the writer replaces only its own earlier output (a manifest), as checks.check_output_dir does for quantize",
    ("models/packaged.py", "_is_complete", "marker file"):
        "the packaged cache checks the model.bin it assembled itself is whole (its size), not what a source is",
    ("formats/ggml_file.py", "<module>", "magic"): "the strict .bin parser and writer: the format's own magic",
    ("formats/ggml_file.py", "read_whisper_cpp", "magic"): "the strict .bin parser checks the magic it parses",
    ("formats/gguf_file.py", "read_gguf", "magic"): "the strict GGUF parser checks the magic it parses",
    ("formats/whisper_cpp.py", "checkpoint_source", "model_type"):
        "the exporter refuses a loaded checkpoint (bytes in memory) of another model with the format's own message",
    ("formats/qwen3_asr_gguf.py", "Qwen3ASRSource.hparams", "model_type"):
        "the exporter refuses a loaded checkpoint (bytes in memory) of another model with the format's own message",
}


@dataclass(frozen=True)
class Finding:
    module: str
    function: str
    rule: str
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} ({self.function}): {self.rule}"


def _name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_marker(node: ast.AST, marker_vars: set[str]) -> bool:
    """A marker file's name, or a path built with one (``x / "config.json"``), or a name bound to such a path."""
    if isinstance(node, ast.Constant):
        return node.value in MARKER_FILES
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _is_marker(node.right, marker_vars) or _is_marker(node.left, marker_vars)
    name = _name_of(node)
    return name is not None and (name in MARKER_NAMES or name in marker_vars)


class _Reader(ast.NodeVisitor):
    """Every place a module tests a source marker or hashes by itself, with the function it stands in."""

    def __init__(self, module: str) -> None:
        self.module, self.scope, self.found = module, ["<module>"], []
        self.marker_vars: list[set[str]] = [set()]

    def flag(self, node: ast.AST, rule: str) -> None:
        self.found.append(Finding(self.module, ".".join(self.scope[1:]) or "<module>", rule, node.lineno))

    def _enter(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        self.marker_vars.append(set())
        self.generic_visit(node)
        self.scope.pop()
        self.marker_vars.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Import(self, node: ast.Import) -> None:
        if any(alias.name == "hashlib" for alias in node.names):
            self.flag(node, "hashlib")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "hashlib":
            self.flag(node, "hashlib")

    def visit_Constant(self, node: ast.Constant) -> None:
        if type(node.value) in (bytes, int) and node.value in MAGICS:
            self.flag(node, "magic")

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(_name_of(side) in MAGIC_NAMES for side in (node.left, *node.comparators)):
            self.flag(node, "magic")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if _is_marker(node.value, self.marker_vars[-1]) and not isinstance(node.value, ast.Constant):
            self.marker_vars[-1].update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def _comprehension(self, node: ast.AST) -> None:
        for loop in node.generators:  # before the element that uses the loop's name
            if _name_of(loop.iter) in MARKER_NAMES and isinstance(loop.target, ast.Name):
                self.marker_vars[-1].add(loop.target.id)
        self.generic_visit(node)

    visit_GeneratorExp = visit_ListComp = visit_SetComp = visit_DictComp = _comprehension

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = _name_of(func)
        if name == "file_magic":
            self.flag(node, "magic")
        if isinstance(func, ast.Attribute) and name in FILE_TESTS and _is_marker(func.value, self.marker_vars[-1]):
            self.flag(node, "marker file")
        if name in PREFIX_TESTS and any(_packaged_prefix(arg) for arg in node.args):
            self.flag(node, "packaged prefix")
        if name == "get" and node.args and isinstance(node.args[0], ast.Constant) and \
                node.args[0].value == "model_type":
            self.flag(node, "model_type")
        if name in HASH_CALLS and any(_name_of(n.func) == "dumps" for n in ast.walk(node) if isinstance(n, ast.Call)):
            self.flag(node, "JSON fingerprint (use hashing.json_fingerprint)")
        self.generic_visit(node)


def _packaged_prefix(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith("packaged")
    return _name_of(node) == "PACKAGED_PREFIX"


def findings_in(source: str, module: str) -> list[Finding]:
    reader = _Reader(module)
    reader.visit(ast.parse(source))
    exempt = {SOURCE_MODULE: {"magic", "marker file", "packaged prefix", "model_type"}, HASHING_MODULE: {"hashlib"}}
    return [f for f in reader.found if f.rule not in exempt.get(module, set())]


def package_findings() -> list[Finding]:
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        found += findings_in(path.read_text(), path.relative_to(PACKAGE_ROOT).as_posix())
    return found


def test_no_module_but_model_source_tests_source_markers_or_hashes() -> None:
    found = package_findings()
    unexpected = [str(f) for f in found if (f.module, f.function, f.rule) not in ALLOWED]
    assert not unexpected, ("a source marker tested or a digest computed outside tarq_deploy/model_source.py and "
                            "tarq_deploy/hashing.py; ask resolve_source / the hashing helpers instead:\n"
                            + "\n".join(unexpected))
    stale = sorted(set(ALLOWED) - {(f.module, f.function, f.rule) for f in found})
    assert not stale, f"allow-list entries no longer needed (remove them): {stale}"


@pytest.mark.parametrize("code, rule", [
    ("import hashlib\n", "hashlib"),
    ("from hashlib import sha256\n", "hashlib"),
    ("def f(p):\n    return open(p, 'rb').read(4) == b'lmgg'\n", "magic"),
    ("def f(p):\n    return head(p) == GGUF_MAGIC\n", "magic"),
    ("def f(p):\n    return file_magic(p) == x\n", "magic"),
    ("def f(p):\n    return (Path(p) / 'config.json').is_file()\n", "marker file"),
    ("def f(p):\n    config = Path(p).expanduser() / CONFIG_JSON\n    return config.exists()\n", "marker file"),
    ("def f(p):\n    return all((p / m).is_file() for m in CHECKPOINT_MARKERS)\n", "marker file"),
    ("def f(p):\n    return json.loads((p / 'model' / 'config.json').read_text())\n", "marker file"),
    ("def f(s):\n    return s.startswith('packaged:')\n", "packaged prefix"),
    ("def f(s):\n    return s.startswith(PACKAGED_PREFIX)\n", "packaged prefix"),
    ("def f(c):\n    return c.get('model_type')\n", "model_type"),
    ("def f(o):\n    return sha256_hex(json.dumps(o).encode())\n", "JSON fingerprint (use hashing.json_fingerprint)"),
])
def test_the_reader_finds_a_planted_copy(code: str, rule: str) -> None:
    assert [f.rule for f in findings_in(code, "commands/new.py")] == [rule]


def test_the_two_modules_themselves_are_exempt_only_from_their_own_rule() -> None:
    assert findings_in("import hashlib\n", HASHING_MODULE) == []
    assert findings_in("X = b'GGUF'\n", SOURCE_MODULE) == []
    assert [f.rule for f in findings_in("import hashlib\n", SOURCE_MODULE)] == ["hashlib"]
    assert [f.rule for f in findings_in("X = b'GGUF'\n", HASHING_MODULE)] == ["magic"]


def test_model_source_imports_nothing_heavy() -> None:
    """Stdlib only (and errors, itself stdlib): claims and argument checks must not pay for torch."""
    import subprocess
    import sys

    code = ("import sys, tarq_deploy.model_source, tarq_deploy.hashing; "
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'gguf') if m in sys.modules]; "
            "sys.exit(1 if heavy else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_model_source_is_a_frozen_record() -> None:
    found = ModelSource(SourceKind.HUB, "openai/whisper-base")
    with pytest.raises(AttributeError):
        found.kind = SourceKind.PACKAGED  # type: ignore[misc]
