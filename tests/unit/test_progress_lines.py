"""No silent minutes: every phase that can take long says what it does before it starts, and
work of known size shows its progress (a bar on a terminal, lines in a log). Each test checks
the ORDER of what is printed against the phase's work (the work patched to leave a mark), never
a measured time."""

from __future__ import annotations

import io
import json
import sys
import threading
from pathlib import Path

import torch
from hub_server import HubServer, Repo, folder_files
from tiny_hf import save_tiny_llama
from tiny_run import tiny_run

from compiletune import evaluation
from compiletune.cli import main
from compiletune.compiler.backend import CompiletuneBackend
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.config import resolve
from compiletune.data import sources, token_cache
from compiletune.data.token_cache import cached_store
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError
from compiletune.estimate.fit import advice, ladder, printing
from compiletune.estimate.fit.capacity import RESERVE_BYTES, Capacity, fits
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_name, resolve_model_path
from compiletune.progress import Progress


def _text_file(path: Path, n: int) -> Path:
    path.write_text("\n".join(json.dumps({"text": f"word {i} " * (1 + i % 5)}) for i in range(n)))
    return path


def test_progress_in_a_log_is_a_line_per_tenth_or_per_doubling() -> None:
    lines: list[str] = []
    with Progress("work", 20, "items", lines.append) as bar:
        for _ in range(20):
            bar.update(1)
    assert len(lines) == 10 and lines[0] == "work: 2/20 items (10%)"
    assert lines[-1] == "work: 20/20 items (100%)"
    lines.clear()
    with Progress("stream", None, "documents", lines.append) as bar:
        for _ in range(100):
            bar.update(1)
    # 1, 2, 4, ..., 64: a long stream is never silent, a log never floods
    assert [int(line.split(": ")[1].split()[0]) for line in lines] == [1, 2, 4, 8, 16, 32, 64]


def test_tokenising_names_the_source_and_the_entry_before_it_reads(tmp_path, monkeypatch):
    events: list[str] = []
    real = token_cache.read_examples

    def reading(*args, **kwargs):
        events.append("<reading the source>")
        return real(*args, **kwargs)

    monkeypatch.setattr(token_cache, "read_examples", reading)
    source = _text_file(tmp_path / "corpus.jsonl", 1200)
    cache = tmp_path / "cache"
    store = cached_store(str(source), byte_tokenizer(), cache_dir=str(cache), say=events.append)
    first = events[0]
    assert first.startswith(f"tokenizing {source} into the token cache ({cache}/")
    assert store.folder.name in first  # the entry it writes
    assert events[1] == "<reading the source>"
    # progress over the documents as chunks are written (512 a chunk), then the summary
    progress = [e for e in events if e.startswith(f"tokenizing {source}: ")]
    assert progress == [f"tokenizing {source}: 1,024 documents so far"]
    assert events[-1].startswith(f"tokenized {source}: 1200 documents")
    events.clear()
    cached_store(str(source), byte_tokenizer(), cache_dir=str(cache), say=events.append)
    assert events == []  # a cache hit is quiet


def test_compile_says_it_compiles_before_the_first_step_and_how_long_after(
    tmp_path, monkeypatch, capsys
):
    real = CompiletuneBackend.__call__

    def compiling(self, *args, **kwargs):
        print("<the backend compiles>", flush=True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CompiletuneBackend, "__call__", compiling)
    corpus = tmp_path / "c.txt"
    corpus.write_text("compiled training on a tiny corpus. " * 200)
    dump = tmp_path / "dump"
    tiny_run(
        tmp_path,
        str(corpus),
        max_steps=2,
        loss="plain",
        compile=True,
        compile_backend="aot_eager",
        dump_graphs=str(dump),
    )
    out = capsys.readouterr().out.splitlines()
    before = next(i for i, line in enumerate(out) if line.startswith("--compile: compiling"))
    work = out.index("<the backend compiles>")
    after = next(i for i, line in enumerate(out) if line.startswith("--compile: compiled in"))
    assert before < work < after
    assert "1 block kind + head (block, head); the first step takes longer" in out[before]
    # no backend call after the line that says compiling is done: it was the whole of it
    assert "<the backend compiles>" not in out[after:]
    said = [line for line in out if line.startswith("--dump-graphs:")]
    assert said == [
        f"--dump-graphs: the graphs go to {dump} after the first step ({dump / 'index.json'} "
        "says which file is which region and stage)"
    ]
    assert (dump / "index.json").is_file()


def test_the_graph_dump_has_an_index_of_every_file(tmp_path):
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = 2, 64, 160, 4, 2
    args.vocab_size = 300
    model = build_model(args, seed=0)
    head = LossHead(model.output)
    regions = compile_regions(model, head, CompileOptions(backend="aot_eager", dump=True))
    tokens = torch.randint(0, 300, (2, 24))
    head(model.hidden_states(tokens), torch.randint(0, 300, (2, 24))).backward()
    regions.write_dump(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    listed = {e["file"] for e in index}
    on_disk = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert listed == on_disk - {"index.json"}
    by_file = {e["file"]: e for e in index}
    assert by_file["block/00_dynamo.txt"]["region"] == "block"
    assert by_file["block/00_dynamo.txt"]["stage"] == "dynamo"
    assert "partitioned forward" in by_file["block/02_forward.txt"]["what"]
    # the fused head's pre-grad pass, by name
    fused = [e for e in index if e["region"] == "head" and e["stage"].startswith("pre_grad.")]
    assert fused and all(e["stage"].split(".", 1)[1] in e["what"] for e in fused)


def test_eval_says_what_it_evaluates_at_once_and_counts_its_batches(tmp_path, monkeypatch, capsys):
    model = save_tiny_llama(tmp_path / "model", vocab_size=320, hidden_size=64)
    data = tmp_path / "held.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"held-out note {i} " * 8}) + "\n" for i in range(12))
    )
    real_load, real_evaluate = evaluation.from_hf, evaluation.evaluate

    def loading(*args, **kwargs):
        print("<loading the model>", file=sys.stderr)
        return real_load(*args, **kwargs)

    def evaluating(*args, **kwargs):
        print("<evaluating>", file=sys.stderr)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluation, "from_hf", loading)
    monkeypatch.setattr(evaluation, "evaluate", evaluating)
    argv = ["eval", str(model), "--data", str(data), "--seq-len", "32", "--batch-size", "1"]
    assert main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0
    # (other libraries warn on stderr too: only our lines and the marks)
    err = [e for e in capsys.readouterr().err.splitlines() if e.startswith(("eval", "<"))]
    assert err[0] == (
        f"eval: {model} on {data} (fp32 on cpu): loading the model and reading the data"
    )
    assert err[1] == "<loading the model>"
    sizes = err.index("<evaluating>") - 1
    rows = int(err[sizes].split(" rows of ")[0].split(" in ")[-1])
    batches = rows
    assert err[sizes] == f"eval: 12 examples in {rows} rows of 32 tokens, {batches} batches of 1"
    progress = [line for line in err[sizes:] if line.startswith("eval: ") and "/" in line]
    tenth = -(-batches // 10)
    assert len(progress) == len(range(tenth, batches + 1, tenth)) + (batches % tenth > 0) > 3
    assert progress[-1] == f"eval: {batches}/{batches} batches (100%)"


def _hub_env(monkeypatch, tmp_path, url: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # conftest makes every test offline; huggingface_hub read that when it was imported
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    # its own bars on even without a terminal: what it would show a user is what is checked
    monkeypatch.setenv("TQDM_POSITION", "-1")


def test_a_hub_download_is_one_line_and_no_per_file_bars(tmp_path, monkeypatch, capsys):
    server = HubServer()
    model = save_tiny_llama(tmp_path / "model")
    files = folder_files(model)
    server.add("model", "org/tiny", Repo(files))
    _hub_env(monkeypatch, tmp_path, server.url)
    try:
        folder = resolve_model_path("org/tiny")
    finally:
        server.close()
    assert (folder / "model.safetensors").is_file()
    err = [e for e in capsys.readouterr().err.splitlines() if e.strip()]
    ours = [e for e in err if e.startswith("--model-dir org/tiny")]
    assert ours[0].startswith(f"--model-dir org/tiny: asking {server.url} for its files")
    weights = len(files["model.safetensors"])
    small = sum(len(v) for k, v in files.items() if k != "model.safetensors")
    assert ours[1] == (
        f"--model-dir org/tiny: fetching {len(files) - 1} files, {small / 1000:.1f} kB (commit "
        f"{folder.name[:12]}) into {tmp_path / 'hf' / 'hub'}"
    )
    assert ours[2].startswith(f"--model-dir org/tiny@{folder.name}: fetching 1 file, ")
    assert f"{weights / 1000:.1f} kB" in ours[2]
    # huggingface_hub's "Fetching N files" / "Download complete" bars are gone
    assert not [e for e in err if "Fetching" in e or "Download complete" in e], err


def test_a_hub_that_never_answers_ends_in_one_line(tmp_path, monkeypatch):
    """A server that accepts the connection and never answers: the line saying what is asked
    comes before the wait, and the timeout (0.5 s here) ends in one line naming the endpoint
    and the way out."""
    server = HubServer()
    server.silent = True
    _hub_env(monkeypatch, tmp_path, server.url)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "0.5")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "0.5")
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)  # retry waits
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    said_when_asked: list[str] = []

    def watch() -> None:  # what stderr held when the server got the request
        if server.silent_requests.wait(60):
            said_when_asked.append(stream.getvalue())

    errors: dict[str, BaseException] = {}

    def ask() -> None:  # in a thread: a regression hangs, and the test says so instead
        for flag, call in (("--model-dir", resolve_model_path), ("--data", sources.source_files)):
            try:
                call("org/tiny" if flag == "--model-dir" else "org/set")
            except BaseException as e:
                errors[flag] = e

    watcher, asker = threading.Thread(target=watch), threading.Thread(target=ask, daemon=True)
    watcher.start()
    asker.start()
    asker.join(300)  # a guard against a hang, not a measurement: 0.5 s timeouts end it at once
    hung = asker.is_alive()
    server.close()
    watcher.join()
    assert not hung, "a request to a server that never answers hung"
    assert said_when_asked and (
        f"--model-dir org/tiny: asking {server.url} for its files (timeout 0.5s"
        in said_when_asked[0]
    )
    for flag, spec in (("--model-dir", "org/tiny"), ("--data", "org/set")):
        assert isinstance(errors.get(flag), UserError), errors
        text, flag = str(errors[flag]), f"{flag} {spec}"
        assert text.startswith(f"{flag}: {server.url} did not answer within 0.5s"), text
        assert "HF_HUB_OFFLINE=1" in text and "local folder" in text
    assert f"--data org/set: asking {server.url} for the dataset's file list" in stream.getvalue()


def _counted_estimates(monkeypatch, marks: list[str]) -> None:
    """Each estimate the searches run leaves a mark in `marks`, in order with their lines."""
    real = ladder.estimate_memory

    def counted(*args, **kwargs):
        marks.append("<estimate>")
        return real(*args, **kwargs)

    monkeypatch.setattr(ladder, "estimate_memory", counted)


def _small(**values):
    base = {"model": "debug", "n_layers": 2, "dtype": "fp32", "batch_size": 2, "seq_len": 64}
    return resolve({}, {**base, **values})


def test_the_length_search_stops_at_its_bound_and_says_so(monkeypatch, capsys):
    """issue 67: `--max-seq-len` ran estimate after estimate (each slower, the longer the row):
    a search runs at most SEARCH_ESTIMATES, and an answer the bound cut says so."""
    marks: list[str] = []
    _counted_estimates(monkeypatch, marks)
    bound = ladder.Bound(2)
    capacity = Capacity(RESERVE_BYTES + 2**30)
    longest, est = ladder.longest_seq_len(
        _small(), 1, capacity, marks.append, ladder.MEMORY_LIMIT, None, bound
    )
    assert marks.count("<estimate>") == 2 and bound.cut
    assert est is not None and fits(est, capacity) and longest == est.setup["seq_len"]
    # each estimate's line follows it: the search is never silent between two
    assert marks[0] == "<estimate>" and marks[1].startswith("  --seq-len ")
    monkeypatch.setattr(ladder, "SEARCH_ESTIMATES", 2)
    argv = ["estimate-memory", "--model", "debug", "--n-layers", "2", "--dtype", "fp32"]
    assert main([*argv, "--device-memory", "3", "--max-seq-len"]) == 0
    got = capsys.readouterr()
    assert got.err.startswith("searching the longest --seq-len that fits 3 GiB (at most 2 ")
    assert got.out.splitlines()[-1] == (
        "the search stopped at its bound of 2 estimates: a longer --seq-len may fit"
    )


def test_the_length_ladder_has_one_bound_for_all_its_searches(monkeypatch, capsys):
    marks: list[str] = []
    _counted_estimates(monkeypatch, marks)
    monkeypatch.setattr(ladder, "LADDER_ESTIMATES", 7)
    capacity = Capacity(RESERVE_BYTES + 2**30)
    rows = ladder.length_ladder(_small(), 1, capacity, marks.append)
    assert marks.count("<estimate>") <= 7
    # the line before the first estimate, and one before each rung's
    assert marks[0] == "  estimating as configured..." and marks[1] == "<estimate>"
    skipped = [r for r in rows if r.why.startswith("not estimated (the bound of 7 estimates)")]
    assert skipped and rows[-1] in skipped
    assert marks[-1].startswith("  the search stopped at its bound of 7 estimates")
    table = printing.format_length_ladder(rows, 1024)
    assert "not estimated (the bound of 7 estimates)" in table


def test_the_advice_has_a_bound_on_its_estimates(monkeypatch):
    marks: list[str] = []
    _counted_estimates(monkeypatch, marks)
    monkeypatch.setattr(advice, "ADVICE_ESTIMATES", 3)
    tiny = Capacity(RESERVE_BYTES + 2**20, host_bytes=2**20)  # nothing fits
    text = advice.advice(_small(batch_size=8), 1, tiny, marks.append)
    assert marks.count("<estimate>") == 3
    assert text.startswith("no technique flag found to fit within the search's bound of 3 ")
    # each candidate estimated is a line, right after its estimate
    assert all(marks[i + 1] != "<estimate>" for i, m in enumerate(marks[:-1]) if m == "<estimate>")
