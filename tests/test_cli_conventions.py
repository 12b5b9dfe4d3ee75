"""One CLI convention for every subcommand: -o/--out, --checkpoint, an example at the end of --help, `types`, and the
exit statuses (0 done, 1 a failed check, 2 bad input, 3 our bug with its traceback's file named). The 1s are pinned
where the checks live: verify's mismatch (test_whisper_cpp_export.py), bench's failed rows (test_bench.py) and the
sweep's failed cells (test_sweep.py)."""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from helpers import assert_user_error, run_cli

from tarq_deploy import cli
from tarq_deploy.commands.options import EXIT_BUG, EXIT_USER_ERROR, merge_spellings
from tarq_deploy.quant.choices import GGML_TYPES

REPO = Path(__file__).resolve().parents[1]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found = {flag for action in parser._actions for flag in action.option_strings}
    for action in parser._actions:  # corpus real / corpus synth
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found |= option_strings(child)
    return found


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_takes_o_and_ends_its_help_with_an_example(command, capsys):
    parser = subparsers()[command]
    assert {"-o", "--out"} <= option_strings(parser), command
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    example = text.split("\nexample:\n", 1)[1]
    assert f"tarq-deploy {command}" in example.split("\n\n")[0], example
    assert "exit status: 0 done; 1 a check failed" in text


def test_the_older_spellings_still_parse_to_the_same_options(tmp_path):
    parse = cli.build_parser().parse_args
    new = parse(["export", "--checkpoint", "ck", "-o", "a.bin"])
    old = parse(["export", "ck", "--output", "a.bin"])
    for args in (new, old):
        merge_spellings(args)
        assert (args.checkpoint, args.output) == ("ck", "a.bin")
    verify = parse(["verify", "m.bin", "--against", "ck"])
    assert verify.checkpoint == "ck"
    publish = parse(["publish", "stage", "--repo-id", "a/b"])
    merge_spellings(publish)
    assert publish.out == "stage"
    assert parse(["export", "--model", "m", "--baseline", "ggml", "-o", "x"]).baseline == \
        parse(["export", "--model", "m", "--baseline", "rtn", "-o", "x"]).baseline  # one meaning, two spellings


def test_a_checkpoint_given_two_different_ways_is_refused_by_name(capsys):
    assert cli.main(["inspect", "one", "--checkpoint", "two"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--checkpoint" in err and "'one'" in err and "'two'" in err


def test_types_lists_every_type_with_its_bits_per_weight(tmp_path, capsys):
    out = tmp_path / "types.json"
    assert cli.main(["types", "--json", "-o", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text())["types"] == rows
    by_name = {row["type"]: row for row in rows}
    assert set(by_name) == {"f16", *GGML_TYPES}
    for name, row in by_name.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
        assert row["bits_per_weight"] == pytest.approx(8 * size / block)
        assert "whisper.cpp" in row["targets"]
    assert by_name["q4_k"]["bits_per_weight"] == 4.5 and by_name["q3_k"]["bits_per_weight"] == pytest.approx(3.4375)
    assert "gptq" in by_name["q4_0"]["targets"] and "gptq" not in by_name["q4_k"]["targets"]
    assert [r["bits_per_weight"] for r in rows] == sorted(r["bits_per_weight"] for r in rows)


# One bad input per command: the file or option it names, exit 2, one line.
BAD_INPUTS = {
    "quantize": (["--model", "{missing}", "--calib", "{missing}", "-o", "{tmp}/q"], "{missing}"),
    "export": (["--checkpoint", "{missing}", "-o", "{tmp}/x.bin"], "{missing}"),
    "verify": (["{missing}", "--checkpoint", "{missing}"], "{missing}"),
    "bench": (["--model", "{missing}", "--audio", "{missing}", "-o", "{tmp}/b"], "{missing}"),
    "eval": (["--data", "{missing}", "--model", "packaged:tiny.en", "-o", "{tmp}/e"], "{missing}"),
    "corpus": (["synth", "--n", "0", "-o", "{tmp}/c"], "--n"),
    "inspect": (["--checkpoint", "{missing}"], "{missing}"),
    "publish": (["-o", "{tmp}/s", "--repo-id", "a/b", "--file", "{missing}", "--dry-run"], "{missing}"),
    "demo": (["-o", "{file}"], "{file}"),  # a file where its folder should go
    "sweep": (["{missing}", "-o", "{tmp}/w"], "{missing}"),
    "types": (["-o", "{tmp}"], "{tmp}"),  # a folder where the JSON file should go
}


def inputs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "a-file").write_text("not a folder")
    return {"missing": str(tmp_path / "no-such-file"), "tmp": str(tmp_path), "file": str(tmp_path / "a-file")}


def test_a_bad_option_value_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--threads", "zero"])
    assert stop.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--threads" in err and "'zero'" in err, err


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_bad_input_exits_2_with_one_line_naming_it(command, tmp_path, capsys):
    argv, named = BAD_INPUTS[command]
    fill = inputs(tmp_path)
    status = cli.main([command, *(a.format(**fill) for a in argv)])
    err = capsys.readouterr().err.strip()
    assert status == EXIT_USER_ERROR, err
    assert len(err.splitlines()) == 1 and named.format(**fill) in err, err


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_our_bug_exits_3_and_names_the_file_holding_its_traceback(command, tmp_path, capsys, monkeypatch):
    module = importlib.import_module(f"tarq_deploy.commands.{cli.COMMANDS[command]}")

    def bug(args: argparse.Namespace) -> int:
        return {}["a key no table has"]

    monkeypatch.setattr(module, "run", bug)
    argv, _ = BAD_INPUTS[command]
    fill = inputs(tmp_path)
    assert cli.main([command, *(a.format(**fill) for a in argv)]) == EXIT_BUG
    err = capsys.readouterr().err
    saved = Path(err.strip().rsplit("traceback in ", 1)[1])
    assert "KeyError: 'a key no table has'" in saved.read_text() and command in saved.name
    saved.unlink()


def test_export_into_a_folder_names_the_file_llama_cpp_style(tmp_path, monkeypatch):
    from tarq_deploy.commands import export

    written = []
    monkeypatch.setattr(export.export_whispercpp, "run_export", lambda args, crispasr=False: written.append(args.output)
                        or 0)
    folder = tmp_path / "files"
    folder.mkdir()
    assert cli.main(["export", "--model", "packaged:base", "--baseline", "ggml", "--type", "q5_0", "-o",
                     str(folder)]) == 0
    assert cli.main(["export", "--model", "packaged:tiny.en", "-o", str(folder)]) == 0
    assert written == [str(folder / "base-ggml-q5_0.bin"), str(folder / "tiny.en-f16.bin")]


def test_export_replaces_its_own_earlier_output_and_nothing_else(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert cli.main(["export", "--model", "packaged:tiny.en", "-o", str(notes), "--quiet"]) == EXIT_USER_ERROR
    assert notes.read_text() == "mine" and "is not a model file" in capsys.readouterr().err
    model = tmp_path / "tiny.en-f16.bin"
    for _ in range(2):  # the second run replaces the first one's file
        assert cli.main(["export", "--model", "packaged:tiny.en", "-o", str(model), "--quiet"]) == 0


def test_a_gpu_export_replaces_an_earlier_export_folder_only(tmp_path):
    from tarq_deploy.commands.export import _check_output
    from tarq_deploy.errors import UserError

    def args(out: Path) -> argparse.Namespace:
        return argparse.Namespace(target="gptq", output=str(out), checkpoint=None, model=None, overwrite=False)

    earlier, foreign = tmp_path / "earlier", tmp_path / "foreign"
    earlier.mkdir(), foreign.mkdir()
    (earlier / "config.json").write_text(json.dumps({"quantization_config": {"bits": 4}}))
    (foreign / "config.json").write_text(json.dumps({"model_type": "whisper"}))  # a float model: not ours to replace
    replaced = args(earlier)
    _check_output(replaced)
    assert replaced.overwrite
    with pytest.raises(UserError, match="is not an earlier export"):
        _check_output(args(foreign))
    _check_output(args(tmp_path / "new"))  # a new path is fine


# ---------------------------------------------------------------------------------------- the CLI's error policy
def test_our_own_bugs_get_a_traceback_and_a_request_to_report(capsys, monkeypatch):
    import tarq_deploy.commands.inspect_checkpoint as inspect_command

    def bug(args):
        raise KeyError("an internal table lost its key")

    monkeypatch.setattr(inspect_command, "run", bug)
    assert cli.main(["inspect", "anything"]) == 3  # 3: ours, not the input's (2) nor a failed check (1)
    err = capsys.readouterr().err
    assert "Traceback" in err and "please report it" in err
    saved = Path(err.strip().rsplit("traceback in ", 1)[1])  # the file the message names holds the whole traceback
    assert "KeyError: 'an internal table lost its key'" in saved.read_text()
    saved.unlink()


def test_missing_optional_package_is_a_user_error(capsys, monkeypatch):
    import tarq_deploy.commands.inspect_checkpoint as inspect_command

    def needs(args):
        raise ModuleNotFoundError("No module named 'pywhispercpp'", name="pywhispercpp")

    monkeypatch.setattr(inspect_command, "run", needs)
    status, _, err = run_cli(capsys, "inspect", "anything")
    assert_user_error(status, err, "'pywhispercpp'", "not installed")


def test_help_imports_nothing_heavy_and_shows_every_default():
    code = ("import sys, time; t = time.perf_counter(); from tarq_deploy.cli import build_parser; build_parser(); "
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    seconds, torch_loaded, transformers_loaded = done.stdout.split()
    assert (torch_loaded, transformers_loaded) == ("False", "False"), done.stdout

    import argparse

    def check(name: str, parser: argparse.ArgumentParser) -> None:
        assert parser.formatter_class is cli.HelpFormatter, name
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for child_name, child in action.choices.items():
                    check(f"{name} {child_name}", child)
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            if action.default not in (None, False, [], ()) and action.nargs != 0:
                shown = cli.HelpFormatter("tarq-deploy")._get_help_string(action)
                assert "default" in shown.lower(), f"{name} {action.option_strings}: default not shown"

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        check(name, sub)


def test_export_help_names_agree_with_the_converters():
    from tarq_deploy.formats.whisper_cpp import BASELINES, TARGET_TYPES

    from tarq_deploy.commands import export_whispercpp

    assert set(export_whispercpp.WEIGHT_TYPES) == set(TARGET_TYPES)
    assert tuple(export_whispercpp.BASELINES) == tuple(BASELINES)
