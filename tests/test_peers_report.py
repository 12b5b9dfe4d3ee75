"""bench.peers' report from an eval run: decoded and teacher-forced figures merged per method, and the
--teacher-forced-only form (no decoded rows) still gives every method its KLD and every pair its difference."""
from __future__ import annotations

from pathlib import Path

from tarq_deploy.bench.peers import (Calibration, _our_stage_seconds, _peer_stage_seconds, differences, over_rounds,
                                     render, summary)


def _figure(value: float, significant: bool | None = None) -> dict:
    out = {"value": value, "low": value - 0.01, "high": value + 0.01}
    return out if significant is None else {**out, "significant": significant}


def _teacher_forced() -> dict:
    return {"models": [{"label": m, "kld_rare": _figure(k), "kld_common": _figure(k / 2)}
                       for m, k in (("gptq", 0.16), ("tarq", 0.17), ("llmcompressor-gptq", 0.25))],
            "differences": [{"model": "gptq", "versus": "llmcompressor-gptq", "kld_rare": _figure(-0.09, True),
                             "kld_common": _figure(-0.06, True)},
                            {"model": "tarq", "versus": "FP32", "kld_rare": _figure(0.17, True)}]}


RUNS = [Calibration("gptq", Path("g"), 80.0, 1500, stage_seconds=61.4), Calibration("tarq", Path("t"), 85.0, 1600),
        Calibration("llmcompressor-gptq", Path("l"), 90.0, 1900, stage_seconds=70.0)]


def test_teacher_forced_only_report_has_klds_and_method_pairs():
    report = {"datasets": [{"name": "test", "teacher_forced": _teacher_forced()}]}
    rows = summary(RUNS, report)
    assert [r["method"] for r in rows] == ["gptq", "tarq", "llmcompressor-gptq"]
    assert all("kld_rare" in r and "wer" not in r for r in rows)
    pairs = differences(report)
    assert [(d["model"], d["versus"]) for d in pairs] == [("gptq", "llmcompressor-gptq")]  # not against the float
    assert pairs[0]["kld_rare"]["significant"] and "rare_wer" not in pairs[0]
    table = render({"model": "packaged:base", "command": "x", "machine": {}, "n_calib": 128, "calib": "c", "seed": 0,
                    "rows": rows, "differences": pairs})
    assert "| test | gptq | 80 | 61 | 1500 | — | — | — | — | 16.0000" not in table  # KLD is printed unscaled
    assert "| test | gptq | 80 | 61 | 1500 | — | — | — | — | 0.1600 [0.1500, 0.1700] |" in table
    assert "| test | tarq | 85 | — | 1600 |" in table  # no stage clock recorded: a dash, not a zero


def test_decoded_differences_carry_their_teacher_forced_partner():
    decoded = [{"model": "gptq [torch]", "versus": "llmcompressor-gptq [torch]", "wer": _figure(-0.03, False),
                "rare_wer": _figure(-0.2, True)},
               {"model": "gptq [torch]", "versus": "FP32 [torch]", "wer": _figure(0.01, False)}]
    report = {"datasets": [{"name": "test", "models": [], "differences": decoded, "teacher_forced": _teacher_forced()}]}
    (pair,) = differences(report)
    assert (pair["model"], pair["versus"]) == ("gptq", "llmcompressor-gptq")
    assert pair["rare_wer"]["value"] == -0.2 and pair["kld_rare"]["value"] == -0.09


def test_stage_seconds_come_from_each_methods_own_clock(tmp_path: Path):
    """Ours: the windows plus the calibration from quantize's OUT.log.json; llm-compressor's: its one-shot seconds
    from info.json; None where the file is missing or unreadable (a failed run)."""
    out = tmp_path / "ours-tarq"
    (tmp_path / "ours-tarq.log.json").write_text('{"seconds": 50.04, "windows_seconds": 21.13}')
    assert _our_stage_seconds(out) == 71.2
    (tmp_path / "ours-gptq.log.json").write_text('{"seconds": 41.0}')  # a log written before windows_seconds
    assert _our_stage_seconds(tmp_path / "ours-gptq") == 41.0
    (tmp_path / "ours-broken.log.json").write_text("not json")
    assert _our_stage_seconds(tmp_path / "ours-broken") is None
    assert _our_stage_seconds(tmp_path / "ours-missing") is None
    raw = tmp_path / "raw"
    raw.mkdir()
    assert _peer_stage_seconds(raw) is None
    (raw / "info.json").write_text('{"oneshot_seconds": 53.7}')
    assert _peer_stage_seconds(raw) == 53.7


def test_rounds_give_medians_ranges_ratios_and_a_same_bytes_check(tmp_path: Path):
    """--repeats: the first round's output is scored, the clocks are the rounds' medians with their range, and a
    method whose rounds wrote different bytes is flagged."""
    def ours(round_: int, seconds: float, stage: float) -> Calibration:
        out = tmp_path / f"r{round_}" / "ours-tarq"
        out.mkdir(parents=True)
        (out / "lattice.safetensors").write_bytes(b"same lattice")
        return Calibration("tarq", out, seconds, 6000 + round_, stage_seconds=stage)

    def peer(round_: int, seconds: float, stage: float) -> Calibration:
        raw = tmp_path / f"r{round_}" / "llmcompressor-gptq" / "raw"
        raw.mkdir(parents=True)
        (raw / "dequantized.safetensors").write_bytes(f"weights of round {round_}".encode())
        return Calibration("llmcompressor-gptq", raw.parent / "model", seconds, 1700, stage_seconds=stage)

    rounds = [[ours(k, s, s - 6), peer(k, p, p - 8)] for k, s, p in ((1, 78.0, 66.0), (2, 85.0, 67.0), (3, 80.0, 63.0))]
    tarq, llmc = over_rounds(rounds)
    assert tarq.output == rounds[0][0].output and tarq.seconds == 80.0 and tarq.stage_seconds == 74.0
    assert tarq.peak_rss_mib == 6002 and [r["seconds"] for r in tarq.rounds] == [78.0, 85.0, 80.0]
    assert tarq.same_result is True and llmc.same_result is False and llmc.seconds == 66.0
    report = {"datasets": [{"name": "test", "teacher_forced": _teacher_forced()}]}
    table = render({"model": "packaged:base", "command": "x", "machine": {}, "n_calib": 128, "calib": "c", "seed": 0,
                    "rows": summary([tarq, llmc], report), "differences": []})
    assert "| test | tarq | 80 (78-85) | 74 (72-79) | 6002 |" in table
    assert "- tarq: the same bytes in every round; 1.21x llm-compressor's process time, 1.28x its calibration " \
           "proper." in table
    assert "- llmcompressor-gptq: **different bytes between rounds**." in table
    assert over_rounds(rounds[:1]) == rounds[0]  # one round: as it is
