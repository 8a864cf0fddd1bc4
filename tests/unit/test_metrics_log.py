"""metrics.jsonl as the trainer can leave it: a kill mid-write tears the last line; a resume
cuts it away and appends whole lines, and every reader skips a torn line."""

from __future__ import annotations

import json
from pathlib import Path

from compiletune.metrics import MetricsLog, parse_metrics, read_metrics

WHOLE = "".join(json.dumps({"step": s, "loss": 3.0 - 0.1 * s}) + "\n" for s in (1, 2, 3))
TORN = '{"step": 4, "loss": 2.6, "lr": 0.001, "note": "unterminat'


def _strict_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line whole


def test_resume_after_a_torn_last_line_appends_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(WHOLE + TORN)
    log = MetricsLog(path, resume_step=3)
    log.write({"step": 4, "loss": 2.5})
    log.close()
    assert [r["step"] for r in _strict_lines(path)] == [1, 2, 3, 4]
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_resume_from_an_earlier_step_drops_later_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(WHOLE + TORN)
    MetricsLog(path, resume_step=2).close()
    assert [r["step"] for r in _strict_lines(path)] == [1, 2]


def test_a_torn_line_followed_by_resumed_steps_is_skipped_with_its_number(tmp_path):
    """What a run resumed by an older version left: the torn piece joined to the next line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(WHOLE + TORN + json.dumps({"step": 4, "loss": 2.5}) + "\n" + '{"step": 5}\n')
    records, torn = parse_metrics(path.read_bytes())
    assert [r["step"] for r in records] == [1, 2, 3, 5] and torn == [4]
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 5]
    MetricsLog(path, resume_step=5).close()
    assert [r["step"] for r in _strict_lines(path)] == [1, 2, 3, 5]
