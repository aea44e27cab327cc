import io
import json

from disttrain.config import LogConfig
from disttrain.metrics import Metrics, ProgressBar


def test_jsonl_lines_are_strict_json_and_tensorboard_gets_scalars(tmp_path):
    metrics = Metrics(tmp_path, LogConfig(progress=False, tensorboard=True), total_steps=2)
    metrics.log(1, {"loss": 2.5, "lr": 0.1})
    metrics.log(2, {"loss": float("nan"), "lr": 0.1})
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 2.5, "lr": 0.1}, {"step": 2, "loss": "nan", "lr": 0.1}]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")][0] == (1, 2.5)


def test_progress_on_a_pipe_prints_about_twenty_lines():
    stream = io.StringIO()
    bar = ProgressBar(total=100, stream=stream)
    for step in range(1, 101):
        bar.update(step, {"loss": 1.0, "tokens_per_s": 2000.0})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 20 and lines[-1].startswith("[" + "#" * 30 + "] 100/100 | loss 1.0000 | 2.0k tok/s")


def test_progress_on_a_pipe_keeps_its_pace_when_only_every_tenth_step_is_logged():
    stream = io.StringIO()
    bar = ProgressBar(total=250, stream=stream)  # a line every 12 steps; the logged steps are multiples of 10
    for step in [*range(10, 250, 10), 250]:
        bar.update(step, {"loss": 1.0})
    steps = [int(line.split("] ")[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == [*range(20, 250, 20), 250]  # (multiples of 12 alone: 60, 120, 180, 240 and 250)
