"""The run folder's duties: what `OUTPUT_DIR` holds, when it is written, and how a run stops.

    OUTPUT_DIR/config.yaml      the resolved config (written once the run is built)
    OUTPUT_DIR/metrics.jsonl    one JSON object per step (metrics.py)
    OUTPUT_DIR/step_N/          checkpoints every --save-every steps and at the end
    OUTPUT_DIR/merged/          --merge: the LoRA adapters folded into the base
    OUTPUT_DIR/summary.json     the run summary, also printed as the closing line
    OUTPUT_DIR/plot.png, .html  metrics.jsonl's charts, at the end (with matplotlib; plot.py)
    OUTPUT_DIR/eval/            --eval-tasks: lm-eval's results per checkpoint (harness.py)

Everything a user can get wrong about the folder is checked (`contents.check_output_dir`)
before the run is built, and nothing is written until the build succeeded, so a bad flag never
leaves a half-written run behind.

One room per duty, each read and changed on its own:

lock.py      one run per folder: `OutputLock` (flock on .compiletune.lock, a dead run's taken over)
contents.py  what a folder may hold before a run (checks, --overwrite), config.yaml, checkpoint cadence
resume.py    judging a --resume: options that change the result, a changed length
disk.py      a full disk: the warning before, the one line after a failed checkpoint or merge
signals.py   SIGINT/SIGTERM: finish the step and checkpoint, or answer once the summary is written
hub_pin.py   Hub repositories pinned to their commit in config.yaml, and kept so on --resume
closing.py   summary.json and the one line a run ends with
"""
